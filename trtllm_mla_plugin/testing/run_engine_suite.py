"""Start one vLLM engine and run several workloads through it; write the results as JSON.

One engine start serves many checks (engine starts dominate GPU test time):

    python -m trtllm_mla_plugin.testing.run_engine_suite --config suite.json --out result.json

``suite.json``::

    {"model": DIR,
     "llm": {...},              # vllm.LLM keyword arguments (attention_backend, block_size,
                                # kv_cache_dtype, enforce_eager, compilation_config,
                                # speculative_config, tensor_parallel_size, ...)
     "workloads": [{"name": NAME,
                    "calls": [{"prompts": [[token ids], ...],
                               "max_tokens": [n, ...], "logprobs": 2}, ...]}, ...]}

Each call is one ``LLM.generate`` (greedy, ``ignore_eos``); the calls of a workload run in
order, so a first call can fill the prefix cache for the next. The result holds, per call,
each prompt's generated token ids and top-``logprobs`` logprobs per step (the format of
``run_engine``, which ``tests/generation_compare.py`` compares) and the change of the
engine's counters during the call (prefix-cache queries and hits, preemptions,
speculative-decoding drafts and acceptances). The engine core runs in this process, so a
workload is batched identically by every backend.

The result file is written and flushed before the process ends with ``os._exit``: engine
teardown can hang after the results are out (seen with the CUDA engine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from .run_engine import completion_record, engine_counters


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """``after - before`` per counter (vectors element-wise)."""
    out: dict[str, Any] = {}
    for key, value in after.items():
        old = before.get(key)
        if isinstance(value, list):
            old = old or [0] * len(value)
            out[key] = [a - b for a, b in zip(value, old, strict=True)]
        else:
            out[key] = value - (old or 0)
    return out


def run_call(llm: Any, call: dict[str, Any]) -> dict[str, Any]:
    """One ``LLM.generate`` of a workload; its outputs and counter changes."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in call["prompts"]]
    max_tokens = call["max_tokens"]
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=m, logprobs=call.get("logprobs", 2),
                             ignore_eos=True) for m in max_tokens]
    before = engine_counters(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    result: dict[str, Any] = {"seconds": seconds, "prompts": [
        {**completion_record(out), "finish_reason": out.outputs[0].finish_reason}
        for out in outputs]}
    result["counters"] = delta(engine_counters(llm), before)
    return result


def run_suite(config: dict[str, Any]) -> dict[str, Any]:
    """Start the engine of ``config`` and run its workloads."""
    # In-process engine core: every request of a call is queued before the first step, so
    # two backends see identical batches (see run_engine).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm.plugins import load_general_plugins

    # LLM() parses attention_config and speculative_config.attention_backend before vLLM
    # loads plugins: load them first so the TRTLLM_MLA name exists.
    load_general_plugins()
    start = time.perf_counter()
    llm = LLM(model=config["model"], disable_log_stats=False, **config.get("llm", {}))
    result: dict[str, Any] = {"start_seconds": time.perf_counter() - start, "workloads": {}}
    for workload in config["workloads"]:
        result["workloads"][workload["name"]] = [run_call(llm, c) for c in workload["calls"]]
    result["counters"] = engine_counters(llm)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    config = json.loads(Path(args.config).read_text())
    code = 0
    try:
        result = run_suite(config)
        result["ok"] = True
    except BaseException:  # reported in the result file; the test shows it
        result = {"ok": False, "error": traceback.format_exc()}
        code = 1
    Path(args.out).write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
