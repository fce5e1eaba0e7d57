"""TRTLLM_MLA in the real CUDA engine (vLLM 0.33), against vLLM's own MLA backends.

Every case runs the same greedy workloads through TRTLLM_MLA and through a vLLM backend
(FLASHMLA, or TRITON_MLA where FLASHMLA cannot serve the configuration) on the same
engine settings, and compares them tie-aware (``generation_compare``): tokens equal step by
step, a divergence accepted only where the reference's two best tokens are within
``NEAR_TIE`` (after it the sequences are not compared), logprobs of the reference's token
within ``LOGPROB_ATOL`` up to there, and at least ``MIN_COMPARED`` of all steps compared.

Tolerances. The model is bfloat16: two correct bf16 MLA decoders differ in rounding, and a
random model's logprobs move with it over the steps of a generation. Measured on the H200
(2026-11-30, run 16; docs/gpu-validation-history.md): on the "mix" and "prefix" workloads vLLM's
own TRITON_MLA (block 32) and FLASHMLA (block 64) differ by up to 0.062 in logprob, and
every engine, vLLM's and the plugin's, lies within 0.036-0.053 of the same model run in
float32 on vLLM's CPU engine (benchmarks/engine_vs_float32.py).
So near-ties and logprob differences up to 0.1 are tolerated (BF16_TOL): above the floor of
two correct bf16 engines, far below what a wrong attention output gives (a dropped or
misplaced key changes logprobs by whole units). FP8 (e4m3) caches and queries add ~2e-2
relative error to attention (measured on the H200), so FP8 comparisons tolerate 0.15.

Engines (one per configuration, each serving several checks, each started at most once per
session; ``ENGINES`` lists them): the model is bf16 with DeepSeek-V3's per-rank geometry
(16 heads, kv_lora_rank 512, rope 64), 3 layers; the speculative cases use a 1-layer model
with one MTP layer that imitates the target (``tiny_model._add_mtp_layers``). The two
default engines use vLLM's default compilation (torch.compile, FULL_AND_PIECEWISE CUDA
graphs); the others skip torch.compile and capture full CUDA graphs for decode only
(``FAST_GRAPHS``), which is the part the plugin runs inside graphs.

Run (H200 with the vLLM kit, from the repository root)::

    export PYTHONPATH=/tmp/kit/plugin:/tmp/kit/vllm:/tmp/kit/site VLLM_USE_FLASHINFER_SAMPLER=0
    export TRTLLM_MLA_TEST_OUT=$OUT TRTLLM_MLA_ENGINE_CACHE=/tmp/trtllm-mla-engines
    python3 -m pytest -q -rs tests/gpu/test_engine_gpu.py -m "not slow"

That starts 15 engines and one server (two with torch.compile). ``-m slow`` selects the
optional cases (MTP with 1 and 2 draft tokens, n-gram, FLASHMLA with MTP: 4 more engines);
``-k tensor_parallel`` needs two GPUs (2 engines). ``TRTLLM_MLA_TEST_OUT`` keeps every
engine's log, config and result, and ``summary.json`` (engine times, agreement per
comparison). With ``TRTLLM_MLA_ENGINE_CACHE`` an engine's result is kept on the machine and
reused by a later pytest run for the same configuration and plugin sources, so the cases
can be split over several calls (e.g. ``-k "env_var or graphs or prefix or eager or fp8"``,
then ``-k "block_size or mtp or server"``) without starting an engine twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from generation_compare import agreement, compare_generations

REPO = Path(__file__).resolve().parents[2]


def _skip_reason() -> str | None:
    """Why these tests cannot run here (``None`` where a CUDA vLLM imports)."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    try:
        from vllm.platforms import current_platform
    except Exception as error:  # any import failure means: no usable CUDA vLLM
        return f"vLLM does not import: {error!r}"
    if not current_platform.is_cuda():
        return f"vLLM's platform is {current_platform.device_name}, not CUDA"
    return None


SKIP_REASON = _skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(SKIP_REASON is not None,
                                                   reason=SKIP_REASON or "")]

BF16_TOL = 0.1
FP8_TOL = 0.15
#: A comparison must reach at least this share of all generated steps before divergences
#: at near-ties end it (else it proves little).
MIN_COMPARED = 0.5
ENGINE_TIMEOUT_S = 900
SERVER_START_TIMEOUT_S = 600

IN_USE = re.compile(r"TRTLLM_MLA backend in use: decode route (\S+)")
MULTI_TOKEN = re.compile(
    r"TRTLLM_MLA decode step with several query tokens per request: (\d+) requests, "
    r"(\d+) query tokens, up to (\d+) per request"
)

MAX_MODEL_LEN = 4096
BASE_LLM: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "dtype": "bfloat16",
    "max_model_len": MAX_MODEL_LEN,
    "max_num_seqs": 64,
    # Prompts longer than this are prefilled in chunks (chunked prefill).
    "max_num_batched_tokens": 2048,
    "enable_prefix_caching": True,
    "gpu_memory_utilization": 0.8,
    "seed": 0,
}
#: No torch.compile, full CUDA graphs for uniform decode batches only (vLLM 0.33:
#: CompilationConfig.mode NONE and cudagraph_mode FULL_DECODE_ONLY), few capture sizes.
FAST_GRAPHS: dict[str, Any] = {"mode": "NONE", "cudagraph_mode": "FULL_DECODE_ONLY",
                               "max_cudagraph_capture_size": 64}
#: ``FAST_GRAPHS`` with decode graphs up to the wide workload's 128 requests.
WIDE_GRAPHS: dict[str, Any] = {**FAST_GRAPHS, "max_cudagraph_capture_size": 128}
MTP = {"method": "mtp"}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}


def prompt_ids(length: int, salt: int) -> list[int]:
    """A deterministic prompt (the CPU tests' generator: ids 1..499, below the vocab)."""
    from trtllm_mla_plugin.testing.run_engine import prompt_ids as ids

    return ids(length, salt)


# Workloads: one LLM.generate per call, identical for every backend.
#: Lengths around 32/64-token blocks up to a few thousand tokens (3000 > the batch-token
#: budget: chunked prefill), with generation lengths that make requests finish at
#: different steps while the others keep decoding.
MIX_LENS = [1, 31, 32, 33, 63, 64, 65, 127, 128, 129, 500, 1000, 2047, 2048, 2049, 3000]
MIX_TOKENS = [24, 3, 17, 24, 1, 9, 24, 12, 5, 24, 20, 7, 24, 2, 16, 24]
#: A 1100-token prefix cached by a first call, then shared by 8 prompts of a second call.
PREFIX = prompt_ids(1100, salt=1000)
PREFIX_SUFFIX_LENS = [1, 5, 17, 33, 64, 65, 130, 200]
SPEC_LENS = [1, 17, 64, 65, 130, 200, 1000, 2049]
SPEC_TOKENS = 48
#: The server's 32 concurrent clients (also run offline by the FLASHMLA engine).
CLIENT_LENS = [(97 * i) % 1500 + 1 for i in range(32)]
CLIENT_TOKENS = [8 + 4 * (i % 5) for i in range(32)]
CLIENT_PROMPTS = [prompt_ids(n, 4000 + i) for i, n in enumerate(CLIENT_LENS)]
#: 128 requests decoding together: under CUDA graphs the SM90 policy gives batches of
#: 33-1024 requests with 8-16 query rows each to the plugin's own split-KV kernel (rule 2b).
#: Lengths 60-2959 across 64-token pages.
WIDE_LENS = [(211 * i) % 2900 + 60 for i in range(128)]
#: Requests finish in six waves, so the decode batch runs 128, 107, 85, 64, 43 and 21 wide:
#: `cuda-splitk` under CUDA graphs from 33 requests on, vLLM's FA3 kernel below (on an H100,
#: whose band bound is 49, the 43-request wave runs FA3 too, at 16 heads and at 8).
WIDE_TOKENS = [8 * (1 + i % 6) for i in range(len(WIDE_LENS))]
#: 100 requests of near-equal length (1000-1015 tokens, 16-17 KV tiles of 64) decoding
#: together at 16 heads, captured at 104: FA3's own formula cuts every request in two
#: (about 200 work tiles on 132 SMs, past the band), where the ``vllm-fa3-mla`` route
#: runs them unsplit in one wave (``fa3_splits.one_wave_past_band``).
EVEN_LENS = [1000 + i % 16 for i in range(100)]
EVEN_TOKENS = 16


def workload(name: str) -> dict[str, Any]:
    """The named workload in ``run_engine_suite``'s format."""
    if name == "mix":
        return {"name": name, "calls": [{
            "prompts": [prompt_ids(n, i) for i, n in enumerate(MIX_LENS)],
            "max_tokens": MIX_TOKENS}]}
    if name == "prefix":
        return {"name": name, "calls": [
            {"prompts": [[*PREFIX, 7, 8, 9]], "max_tokens": [2]},
            {"prompts": [PREFIX + prompt_ids(n, 2000 + i)
                         for i, n in enumerate(PREFIX_SUFFIX_LENS)],
             "max_tokens": [16] * len(PREFIX_SUFFIX_LENS)},
        ]}
    if name == "clients":
        return {"name": name, "calls": [{"prompts": CLIENT_PROMPTS,
                                          "max_tokens": CLIENT_TOKENS}]}
    if name == "spec":
        return {"name": name, "calls": [{
            "prompts": [prompt_ids(n, 3000 + i) for i, n in enumerate(SPEC_LENS)],
            "max_tokens": [SPEC_TOKENS] * len(SPEC_LENS)}]}
    if name == "even":
        return {"name": name, "calls": [{
            "prompts": [prompt_ids(n, 6000 + i) for i, n in enumerate(EVEN_LENS)],
            "max_tokens": [EVEN_TOKENS] * len(EVEN_LENS)}]}
    if name == "wide":
        return {"name": name, "calls": [{
            "prompts": [prompt_ids(n, 5000 + i) for i, n in enumerate(WIDE_LENS)],
            "max_tokens": WIDE_TOKENS}]}
    raise KeyError(name)


@dataclass(frozen=True)
class EngineSpec:
    """One engine: model ("main" or "mtp"), LLM keyword arguments (over ``BASE_LLM``),
    extra environment, workloads."""

    model: str
    llm: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    workloads: tuple[str, ...] = ("mix", "prefix")


def _trtllm(**llm: Any) -> dict[str, Any]:
    return {"attention_backend": "TRTLLM_MLA", **llm}


def _wide(model: str, backend: str, workloads: tuple[str, ...] = ("wide",)) -> EngineSpec:
    """The "wide" workload on ``backend``: 128 requests at once under CUDA graphs."""
    return EngineSpec(model, {"block_size": 64, "max_num_seqs": 128, "attention_backend": backend,
                              "compilation_config": WIDE_GRAPHS}, workloads=workloads)


def _spec(kind: dict[str, Any], backend: str, num: int | None = None) -> dict[str, Any]:
    config = dict(kind)
    if num is not None:
        config["num_speculative_tokens"] = num
    if config["method"] == "mtp":
        # vLLM picks the drafter's backend on its own unless told (llm_base_proposer).
        config["attention_backend"] = backend
    return config


ENGINES: dict[str, EngineSpec] = {
    # Selection by environment variable, vLLM's default compilation and CUDA graphs.
    "trtllm-env": EngineSpec("main", {"block_size": 64},
                             env={"VLLM_ATTENTION_BACKEND": "TRTLLM_MLA"}),
    "flashmla": EngineSpec("main", {"block_size": 64, "attention_backend": "FLASHMLA"},
                           workloads=("mix", "prefix", "clients")),
    # Selection by argument (what --attention-backend sets), no CUDA graphs.
    "trtllm-arg-eager": EngineSpec("main", _trtllm(block_size=64, enforce_eager=True)),
    "trtllm-fp8": EngineSpec("main", _trtllm(block_size=64, kv_cache_dtype="fp8",
                                             compilation_config=FAST_GRAPHS)),
    "flashmla-fp8": EngineSpec("main", {"block_size": 64, "kv_cache_dtype": "fp8",
                                        "attention_backend": "FLASHMLA",
                                        "compilation_config": FAST_GRAPHS}),
    # FlashMLA's bf16 kernel on the plugin's own schedule kernel for every decode batch.
    "trtllm-flashmla": EngineSpec("main", _trtllm(block_size=64,
                                                  compilation_config=FAST_GRAPHS),
                                  env={"TRTLLM_MLA_DECODE_ROUTE": "flashmla"}),
    "triton-fp8": EngineSpec("main", {"block_size": 64, "kv_cache_dtype": "fp8",
                                      "attention_backend": "TRITON_MLA",
                                      "compilation_config": FAST_GRAPHS}),
    # FLASHMLA pages 64 tokens only: block 32 is compared with TRITON_MLA.
    # 128 requests at once: the plugin's split-KV kernel under CUDA graphs.
    "trtllm-wide": _wide("main", "TRTLLM_MLA"),
    "flashmla-wide": _wide("main", "FLASHMLA", ("wide", "even")),
    # The same with 8 heads (8 query rows per request), against vLLM's bf16 default on Hopper.
    "trtllm-wide-h8": _wide("h8", "TRTLLM_MLA"),
    "fa3-wide-h8": _wide("h8", "FLASH_ATTN_MLA"),
    # vLLM's FA3 kernel forced for the same 128 requests: its batches of >= 33 launch the
    # requests longest first inside vLLM's captured graphs; and for the "even" batch, which
    # the route plans in one wave.
    "trtllm-wide-fa3": replace(_wide("main", "TRTLLM_MLA", ("wide", "even")),
                               env={"TRTLLM_MLA_DECODE_ROUTE": "vllm-fa3-mla"}),
    "trtllm-b32": EngineSpec("main", _trtllm(block_size=32, compilation_config=FAST_GRAPHS)),
    "triton-b32": EngineSpec("main", {"block_size": 32, "attention_backend": "TRITON_MLA",
                                      "compilation_config": FAST_GRAPHS}),
    # Speculative decoding on the MTP model: the reference decodes without speculation.
    "mtp-ref": EngineSpec("mtp", {"block_size": 64, "attention_backend": "FLASHMLA",
                                  "compilation_config": FAST_GRAPHS}, workloads=("spec",)),
    **{f"trtllm-mtp{k}": EngineSpec(
        "mtp", _trtllm(block_size=64, compilation_config=FAST_GRAPHS,
                       speculative_config=_spec(MTP, "TRTLLM_MLA", k)), workloads=("spec",))
       for k in (1, 2, 3)},
    "trtllm-ngram": EngineSpec("mtp", _trtllm(block_size=64, compilation_config=FAST_GRAPHS,
                                              speculative_config=_spec(NGRAM, "TRTLLM_MLA")),
                               workloads=("spec",)),
    "flashmla-mtp3": EngineSpec("mtp", {"block_size": 64, "attention_backend": "FLASHMLA",
                                        "compilation_config": FAST_GRAPHS,
                                        "speculative_config": _spec(MTP, "FLASHMLA", 3)},
                                workloads=("spec",)),
    "trtllm-tp2": EngineSpec("main", _trtllm(block_size=64, tensor_parallel_size=2,
                                             compilation_config=FAST_GRAPHS),
                             workloads=("mix",)),
    "flashmla-tp2": EngineSpec("main", {"block_size": 64, "attention_backend": "FLASHMLA",
                                        "tensor_parallel_size": 2,
                                        "compilation_config": FAST_GRAPHS},
                               workloads=("mix",)),
}


@dataclass
class EngineRun:
    name: str
    returncode: int
    log: str
    result: dict[str, Any]
    seconds: float

    def calls(self, workload_name: str) -> list[dict[str, Any]]:
        assert self.returncode == 0 and self.result.get("ok"), (
            f"engine {self.name} failed:\n{self.result.get('error', '')}\n{self.log[-4000:]}")
        return self.result["workloads"][workload_name]

    def route(self) -> str | None:
        match = IN_USE.search(self.log)
        return match.group(1) if match else None


def out_dir(tmp_root: Path) -> Path:
    """Where engine logs, configs and results go (``TRTLLM_MLA_TEST_OUT`` to keep them)."""
    base = os.environ.get("TRTLLM_MLA_TEST_OUT")
    path = Path(base) / "engine-gpu" if base else tmp_root
    path.mkdir(parents=True, exist_ok=True)
    return path


def _source_digest() -> str:
    """Digest of the plugin's Python sources (an engine result is reused only for them)."""
    digest = hashlib.sha256()
    for path in sorted((REPO / "trtllm_mla_plugin").rglob("*.py")):
        digest.update(str(path.relative_to(REPO)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _cached_folder(name: str, config: dict[str, Any], spec: EngineSpec) -> Path | None:
    """Where ``TRTLLM_MLA_ENGINE_CACHE`` keeps this engine's log and result, keyed by its
    configuration (model recipe, not path), environment and the plugin's sources: lets
    the tests be split over several pytest runs on one machine without starting the
    same engine twice. ``None`` when the variable is unset."""
    base = os.environ.get("TRTLLM_MLA_ENGINE_CACHE")
    if not base:
        return None
    keyed = {**config, "model": spec.model, "env": spec.env, "src": _source_digest()}
    key = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]
    return Path(base) / f"{name}-{key}"


def subprocess_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment of an engine process: this checkout first on the path, no inherited
    backend selection, FlashInfer's sampler off (it JIT-compiles for minutes on a fresh
    machine)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_ATTENTION_BACKEND", "TRTLLM_MLA_DECODE_ROUTE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from trtllm_mla_plugin.testing.tiny_model import build_tiny_deepseek_v3

    root = tmp_path_factory.mktemp("gpu-models")
    return {
        "main": build_tiny_deepseek_v3(root / "main", num_layers=3, num_heads=16,
                                       dtype="bfloat16"),
        "mtp": build_tiny_deepseek_v3(root / "mtp", num_layers=1, num_heads=16,
                                      mtp_layers=1, dtype="bfloat16"),
        # 8 heads per rank: Kimi-K2 at TP 8, DeepSeek-V3 at TP 16.
        "h8": build_tiny_deepseek_v3(root / "h8", num_layers=3, num_heads=8,
                                     dtype="bfloat16"),
    }


@pytest.fixture(scope="module")
def engine(models, tmp_path_factory):
    """``engine(name) -> EngineRun``: start engine ``name`` of ``ENGINES`` once, run its
    workloads, keep the outcome for every test that asks again."""
    runs: dict[str, EngineRun] = {}
    root = out_dir(tmp_path_factory.mktemp("engine-gpu"))

    def _get(name: str) -> EngineRun:
        if name in runs:
            return runs[name]
        spec = ENGINES[name]
        gpus = spec.llm.get("tensor_parallel_size", 1)
        if gpus > 1 and gpus > torch.cuda.device_count():
            pytest.skip(f"{name} needs {gpus} GPUs")
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        config = {"model": str(models[spec.model]), "llm": {**BASE_LLM, **spec.llm},
                  "workloads": [workload(w) for w in spec.workloads]}
        (folder / "config.json").write_text(json.dumps(config))
        out = folder / "result.json"
        cached = _cached_folder(name, config, spec)
        if cached is not None and (cached / "result.json").exists():
            shutil.copy(cached / "log.txt", folder / "log.txt")
            shutil.copy(cached / "result.json", out)
            runs[name] = EngineRun(name, 0, (folder / "log.txt").read_text(errors="replace"),
                                   json.loads(out.read_text()), 0.0)
            _record(root, f"engine {name}", {"cached": str(cached)})
            return runs[name]
        start = time.perf_counter()
        with open(folder / "log.txt", "w") as log:
            try:
                proc = subprocess.run(
                    [sys.executable, "-m", "trtllm_mla_plugin.testing.run_engine_suite",
                     "--config", str(folder / "config.json"), "--out", str(out)],
                    cwd=REPO, env=subprocess_env(spec.env), stdout=log,
                    stderr=subprocess.STDOUT, timeout=ENGINE_TIMEOUT_S)
                code = proc.returncode
            except subprocess.TimeoutExpired:
                code = -1
        result = json.loads(out.read_text()) if out.exists() else {"ok": False}
        runs[name] = EngineRun(name, code, (folder / "log.txt").read_text(errors="replace"),
                               result, time.perf_counter() - start)
        if cached is not None and code == 0 and result.get("ok"):
            cached.mkdir(parents=True, exist_ok=True)
            shutil.copy(folder / "log.txt", cached / "log.txt")
            shutil.copy(out, cached / "result.json")
        _record(root, f"engine {name}", {"seconds": runs[name].seconds,
                                         "start_seconds": result.get("start_seconds"),
                                         "returncode": code, "route": runs[name].route()})
        return runs[name]

    _get.root = root  # type: ignore[attr-defined]
    return _get


def _record(root: Path, key: str, value: Any) -> None:
    """Add ``key: value`` to ``summary.json`` in the output folder."""
    path = root / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {}
    summary[key] = value
    path.write_text(json.dumps(summary, indent=1))


def assert_same_generations(engine, ours: EngineRun, ref: EngineRun, workload_name: str,
                            tol: float = BF16_TOL) -> None:
    """Every call of ``workload_name``: tie-aware equal, enough steps compared."""
    for i, (a, b) in enumerate(zip(ours.calls(workload_name), ref.calls(workload_name),
                                   strict=True)):
        stats = agreement(a, b)
        _record(engine.root, f"{ours.name} vs {ref.name}: {workload_name}[{i}]", stats)
        problems = compare_generations(a, b, logprob_atol=tol, near_tie=tol)
        assert problems == [], f"{ours.name} vs {ref.name} ({workload_name}[{i}]): {problems}"
        assert stats["compared_fraction"] >= MIN_COMPARED, stats
        assert [len(p["token_ids"]) for p in a["prompts"]] == [
            len(p["token_ids"]) for p in b["prompts"]]


def assert_plugin_served(run: EngineRun) -> None:
    """The plugin's log line, naming a GPU decode route (not the slow reference)."""
    assert run.returncode == 0, run.log[-4000:]
    route = run.route()
    assert route is not None, f"{run.name}: no 'TRTLLM_MLA backend in use' line"
    assert route != "torch-reference", f"{run.name} decoded on the pure-torch reference"


def assert_vllm_served(run: EngineRun, backend: str) -> None:
    """vLLM's own ``backend`` served (its selection log line), not the plugin."""
    assert run.returncode == 0, run.log[-4000:]
    assert run.route() is None, f"{run.name} used the plugin"
    # vllm/platforms/cuda.py: "Using AttentionBackendEnum.FLASHMLA backend."
    assert re.search(rf"Using \S*\b{backend} (?:attention )?backend", run.log), run.name


# --- in the order of priority -------------------------------------------------------------


def test_env_var_selects_trtllm_mla_with_cuda_graphs(engine):
    ours = engine("trtllm-env")
    assert_plugin_served(ours)
    prompts = ours.calls("mix")[0]["prompts"]
    # The model depends on attention: different prompts, different outputs.
    assert len({tuple(p["token_ids"]) for p in prompts if len(p["token_ids"]) > 8}) >= 8


def test_cuda_graphs_long_and_staggered_prompts_match_flashmla(engine):
    """Default compilation and CUDA graphs; prompts up to 3000 tokens across 64-token
    blocks (one chunked), requests finishing at different steps."""
    ours, ref = engine("trtllm-env"), engine("flashmla")
    assert_vllm_served(ref, "FLASHMLA")
    assert_same_generations(engine, ours, ref, "mix")


def test_prefix_caching_matches_flashmla(engine):
    ours, ref = engine("trtllm-env"), engine("flashmla")
    assert_same_generations(engine, ours, ref, "prefix")
    # The second call found the first call's prefix blocks in the cache, for every prompt.
    cached_blocks_tokens = (len(PREFIX) // 64) * 64
    for run in (ours, ref):
        hits = run.calls("prefix")[1]["counters"].get("prefix_cache_hits", 0)
        assert hits >= len(PREFIX_SUFFIX_LENS) * cached_blocks_tokens, (run.name, hits)


def test_short_prefills_run_on_the_decode_kernel_on_hopper(engine):
    """On SM90 with a bf16 cache, requests with up to 512 new tokens (the mix's short
    prompts, the prefix workload's suffixes over a cached prefix, a long prompt's last
    chunk) run on vLLM's FA3 MLA decode kernel, as vLLM's FLASH_ATTN_MLA runs them; the
    tests above compare those generations with FLASHMLA's, which prefills them."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the short-prefill decode pathway is SM90 only")
    ours = engine("trtllm-env")
    assert_plugin_served(ours)
    from conftest import short_prefills_ran

    assert ("short prefills (up to 512 new tokens) on decode route vllm-fa3-mla"
            in ours.log), ours.log[-3000:]
    assert short_prefills_ran(ours.log), ours.log[-3000:]


def test_attention_backend_arg_and_eager_match_flashmla(engine):
    ours, ref = engine("trtllm-arg-eager"), engine("flashmla")
    assert_plugin_served(ours)
    assert_same_generations(engine, ours, ref, "mix")
    assert_same_generations(engine, ours, ref, "prefix")


def test_fp8_kv_cache_matches_flashmla_fp8(engine):
    ours, ref = engine("trtllm-fp8"), engine("flashmla-fp8")
    assert_plugin_served(ours)
    assert_vllm_served(ref, "FLASHMLA")
    assert_same_generations(engine, ours, ref, "mix", tol=FP8_TOL)
    assert_same_generations(engine, ours, ref, "prefix", tol=FP8_TOL)


def test_flashmla_route_on_the_plugins_schedule_matches_flashmla(engine):
    """The ``flashmla`` route forced for every decode batch under full CUDA graphs:
    FlashMLA's bf16 kernel on the plan of the plugin's schedule kernel
    (``ops/kernels/flashmla_schedule.py``), the padding slots of captured batches
    included. Its generations match FLASHMLA's, which runs FlashMLA's own scheduler."""
    ours, ref = engine("trtllm-flashmla"), engine("flashmla")
    assert_plugin_served(ours)
    assert ours.route() == "flashmla", ours.route()
    assert_same_generations(engine, ours, ref, "mix")
    assert_same_generations(engine, ours, ref, "prefix")


def test_fp8_kv_cache_matches_triton_mla_fp8(engine):
    ours, ref = engine("trtllm-fp8"), engine("triton-fp8")
    assert_vllm_served(ref, "TRITON_MLA")
    assert_same_generations(engine, ours, ref, "mix", tol=FP8_TOL)


def test_fp8_kv_cache_is_really_fp8(engine):
    """The FP8 run differs from the bf16 one by FP8 rounding only: not bit-equal (the
    cache really is FP8), but close on the first decode step."""
    fp8, bf16 = engine("trtllm-fp8"), engine("trtllm-env")
    moved = []
    for a, b in zip(fp8.calls("mix")[0]["prompts"], bf16.calls("mix")[0]["prompts"],
                    strict=True):
        if len(b["token_ids"]) < 2 or a["token_ids"][0] != b["token_ids"][0]:
            continue
        token = str(b["token_ids"][1])
        moved.append(abs(a["logprobs"][1].get(token, float("-inf"))
                         - b["logprobs"][1][token]))
    assert len(moved) >= 8
    assert 0 < max(moved) < 0.5, moved


WIDE_CASES = [("trtllm-wide", "flashmla-wide", "FLASHMLA"),
              ("trtllm-wide-h8", "fa3-wide-h8", "FLASH_ATTN_MLA")]


@pytest.mark.parametrize("ours_name,ref_name,ref_backend", WIDE_CASES,
                         ids=["h16", "h8"])
def test_wide_batch_on_split_kv_kernel_matches_vllm(engine, ours_name: str, ref_name: str,
                                                    ref_backend: str):
    """128 requests decoding together under CUDA graphs, finishing in waves (batches of
    128 down to 21): the plugin's decoder holds its own split-KV kernel (``cuda-splitk``,
    built with the machine's nvcc at engine start) for the batches of 33 or more and vLLM's
    FA3 kernel below (on a GPU with its own band bound, ``policy.band_bound``, the band's
    batches under it run FA3 planned on the GPU: an H100's 8-16-row batches of 33-48), and the
    generations match vLLM's own backend's. 16 heads (16 query rows per request) against
    FLASHMLA; 8 heads (8 rows) against FLASH_ATTN_MLA."""
    from trtllm_mla_plugin.ops.kernels.nvcc_build import cached_cubin, find_nvcc
    from trtllm_mla_plugin.ops.kernels.splitk_mla_decode import CAPABILITY, SOURCE

    if find_nvcc() is None and cached_cubin(SOURCE, CAPABILITY) is None:
        pytest.skip("no nvcc and no prebuilt split-KV kernel on this machine")
    ours, ref = engine(ours_name), engine(ref_name)
    assert_plugin_served(ours)
    assert ours.route().split("+") == ["vllm-fa3-mla", "cuda-splitk"], ours.route()
    assert_vllm_served(ref, ref_backend)
    assert_same_generations(engine, ours, ref, "wide")


def test_wide_batch_on_fa3_longest_first_matches_flashmla(engine):
    """vLLM's FA3 kernel forced (``TRTLLM_MLA_DECODE_ROUTE``) for 128 requests under CUDA
    graphs, finishing in waves: the batches of 33 or more (128 down to 43) launch FA3 on
    their requests longest first (``seqused_q`` and permuted ``cu_seqlens_q``, the tables
    reordered at plan time, inside vLLM's captured graphs), 21 in the caller's order, and the
    generations match FLASHMLA's."""
    ours, ref = engine("trtllm-wide-fa3"), engine("flashmla-wide")
    assert_plugin_served(ours)
    assert ours.route() == "vllm-fa3-mla", ours.route()
    assert_vllm_served(ref, "FLASHMLA")
    assert_same_generations(engine, ours, ref, "wide")


def _even_batch_plans() -> tuple[float, float, np.ndarray | None]:
    """For the "even" workload's first decode steps (every request decoding, in 104 graph
    slots): FA3's own plan in waves of the H200's SMs, the band's bound, and the route's
    splits (``None``: FA3's kept), as the ``vllm-fa3-mla`` route plans them under CUDA
    graphs (longest first)."""
    from trtllm_mla_plugin.ops import DecodeBatch, DecodeSpec, fa3_splits, policy
    from trtllm_mla_plugin.ops.routes.vllm_fa3_mla import graph_splits

    spec = DecodeSpec(16, 512, 64, 64, torch.bfloat16, torch.bfloat16, 0.1, 1)
    lens = np.array(sorted((n + 1 for n in EVEN_LENS), reverse=True) + [0] * 4, np.int64)
    host = torch.from_numpy(lens.astype(np.int32))
    batch = DecodeBatch(torch.zeros(len(lens), 1, dtype=torch.int32), host, int(lens.max()),
                        kv_tokens=int(lens.sum()), seq_lens_host=host)
    reserved, planned = graph_splits(spec, batch, policy.HOPPER_SMS)
    kv_tiles = -(-lens // policy.FA3_KV_TILE)
    own = fa3_splits.fa3_splits(np.maximum(kv_tiles, 1), 1, planned, policy.HOPPER_SMS)
    return (int(own.sum()) / policy.HOPPER_SMS, fa3_splits.spill_band(16, kv_tiles),
            fa3_splits.balanced_splits(kv_tiles, 1, reserved, policy.HOPPER_SMS, 16.0,
                                       planned))


def test_even_batch_on_fa3_in_one_wave_matches_flashmla(engine):
    """vLLM's FA3 kernel forced for 100 requests of near-equal length under CUDA graphs:
    FA3's formula would spill two pieces a request past the band, the route writes one
    piece a request (one wave) over FA3's scheduler metadata inside vLLM's captured graphs,
    and the generations match FLASHMLA's."""
    own_waves, band, splits = _even_batch_plans()
    assert own_waves > band, (own_waves, band)  # the workload reaches the case
    assert splits is not None and splits.max() == 1, splits
    ours, ref = engine("trtllm-wide-fa3"), engine("flashmla-wide")
    assert_plugin_served(ours)
    assert ours.route() == "vllm-fa3-mla", ours.route()
    assert_vllm_served(ref, "FLASHMLA")
    assert_same_generations(engine, ours, ref, "even")


def test_block_size_32_matches_triton_mla(engine):
    ours, ref = engine("trtllm-b32"), engine("triton-b32")
    assert_plugin_served(ours)
    assert_vllm_served(ref, "TRITON_MLA")
    assert_same_generations(engine, ours, ref, "mix")
    assert_same_generations(engine, ours, ref, "prefix")


def _check_speculation(run: EngineRun, num_spec: int) -> None:
    """Drafts were made and accepted at every position, and the plugin's decoder got
    several query tokens per request in a real step."""
    assert_plugin_served(run)
    counters = run.calls("spec")[0]["counters"]
    assert counters.get("spec_decode_num_drafts", 0) > 0, counters
    assert counters.get("spec_decode_num_accepted_tokens", 0) > 0, counters
    per_pos = counters.get("spec_decode_accepted_per_pos", [])
    assert len(per_pos) == num_spec and all(n > 0 for n in per_pos), counters
    seen = [tuple(map(int, m)) for m in MULTI_TOKEN.findall(run.log)]
    assert seen and all(2 <= up_to <= num_spec + 1 for _, _, up_to in seen), seen


@pytest.mark.parametrize("num_spec", [
    pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3])
def test_mtp_speculation_matches_decoding_without(engine, num_spec):
    ours, ref = engine(f"trtllm-mtp{num_spec}"), engine("mtp-ref")
    _check_speculation(ours, num_spec)
    assert_same_generations(engine, ours, ref, "spec")


@pytest.mark.slow
def test_ngram_speculation_matches_decoding_without(engine):
    ours, ref = engine("trtllm-ngram"), engine("mtp-ref")
    _check_speculation(ours, NGRAM["num_speculative_tokens"])
    assert_same_generations(engine, ours, ref, "spec")


@pytest.mark.slow
def test_mtp_speculation_matches_flashmla_mtp(engine):
    ours, ref = engine("trtllm-mtp3"), engine("flashmla-mtp3")
    assert_vllm_served(ref, "FLASHMLA")
    assert ref.calls("spec")[0]["counters"].get("spec_decode_num_accepted_tokens", 0) > 0
    assert_same_generations(engine, ours, ref, "spec")


def test_tensor_parallel_2_matches_flashmla(engine):
    ours, ref = engine("trtllm-tp2"), engine("flashmla-tp2")
    assert_plugin_served(ours)
    assert_same_generations(engine, ours, ref, "mix")


def test_openai_server_with_32_concurrent_clients(models, engine):
    """``python -m vllm.entrypoints.openai.api_server`` with the plugin selected by
    ``--attention-backend``; 32 clients (the official ``openai`` client) at once. Each
    greedy completion must follow FLASHMLA's offline run of the same prompts up to a
    near-tie of the reference (the batch mixes differ)."""
    from trtllm_mla_plugin.testing.server import Server, complete_concurrently

    folder = engine.root / "server"
    folder.mkdir(parents=True, exist_ok=True)
    args = ["--attention-backend", "TRTLLM_MLA", "--dtype", "bfloat16", "--block-size", "64",
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "64",
            "--gpu-memory-utilization", "0.8",
            "--compilation-config", json.dumps(FAST_GRAPHS)]
    start = time.perf_counter()
    with Server(models["main"], args, folder / "log.txt", env=subprocess_env({})) as server:
        server.wait_healthy(SERVER_START_TIMEOUT_S)
        started = time.perf_counter() - start
        responses = complete_concurrently(server.url, CLIENT_PROMPTS, CLIENT_TOKENS,
                                          clients=32)
        log = server.log()
    _record(engine.root, "server", {"start_seconds": started})
    match = IN_USE.search(log)
    assert match and match.group(1) != "torch-reference", log[-4000:]
    assert [r.get("error") for r in responses] == [None] * 32
    reference = engine("flashmla").calls("clients")[0]["prompts"]
    problems, compared = [], 0
    for i, (response, ref) in enumerate(zip(responses, reference, strict=True)):
        assert response["finish_reason"] == "length", response
        assert response["prompt_tokens"] == CLIENT_LENS[i], response
        assert response["completion_tokens"] == len(response["token_ids"]) == CLIENT_TOKENS[i]
        for step, (ours, theirs) in enumerate(zip(response["token_ids"], ref["token_ids"],
                                                  strict=True)):
            compared += 1
            if ours != theirs:
                best = sorted(ref["logprobs"][step].values(), reverse=True)[:2]
                if best[0] - best[1] > BF16_TOL:
                    problems.append(f"request {i} step {step}: {ours} vs {theirs} ({best})")
                break
    (folder / "responses.json").write_text(json.dumps(responses))
    _record(engine.root, "server vs flashmla offline",
            {"compared_steps": compared, "total_steps": sum(CLIENT_TOKENS),
             "problems": problems})
    assert problems == []
    assert compared >= MIN_COMPARED * sum(CLIENT_TOKENS)
