"""Run the real vLLM engine once on the tiny model and write what it generated as JSON.

A separate process per engine keeps each test's environment (``VLLM_ATTENTION_BACKEND``)
and vLLM's global state apart.

    python -m trtllm_mla_plugin.testing.run_engine --model DIR --out result.json \
        [--attention-backend NAME] [--prompt-lens 1,16,17] [--max-tokens 12] ...

``--prompts-json FILE`` replaces the generated prompts with given ones, images included
(see ``load_prompts``): for a multimodal model, which then loads its tokenizer.

The JSON holds, per prompt, the generated token ids and the top-2 logprobs of each step,
the engine's batch schedule (which requests ran how many tokens in each step), the engine
core's decode intervals per step (``step_intervals``, see ``record_step_intervals``),
the engine settings that decide how prompts are scheduled and cached (``engine_config``:
block size, chunked prefill, prefix caching, token budget, dtype) and the attention backend
and impl classes the MLA layers resolved (``attention_classes``), so a test can check that
two runs it compares were configured alike and ran the backends it meant, and whether the
plugin was loaded at all (``plugin_loaded``: ``VLLM_PLUGINS=""`` runs vLLM without it).

The engine core always runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, also
with ``--tensor-parallel-size 2``, whose workers are processes either way). In its own
process the core starts stepping while requests are still arriving, so the batch mix, and
with it vLLM CPU's float32 numbers, change from run to run: at TP=2 vLLM's own CPU_MLA
moved by up to 0.14 in logprob between two such runs. Two backends are only comparable on
identical schedules, which the ``schedule`` field lets a test check.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

#: Prompts of these lengths cross the CPU block size (16) in every way: one token, one
#: block minus/plus one, exactly one and two blocks, several blocks.
DEFAULT_PROMPT_LENS = (1, 5, 15, 16, 17, 32, 33, 70)


def prompt_ids(length: int, salt: int = 0) -> list[int]:
    """A deterministic prompt of ``length`` token ids below 500."""
    return [(31 * i + 7 * length + salt) % 499 + 1 for i in range(length)]


def random_image(width: int, height: int, seed: int) -> Any:
    """A ``width`` x ``height`` RGB image of uniform noise, reproducible from ``seed``."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def load_prompts(path: str) -> tuple[list[Any], str | None, int]:
    """Prompts from a JSON file, with their images.

    The file holds ``{"modality": NAME, "prompts": [{"prompt_token_ids": [...],
    "images": [[width, height, seed], ...]}, ...]}``; each image is ``random_image``. For
    the ``vision_chunk`` modality (Kimi-K2.5) an image is passed the way vLLM's Kimi-K2.5
    processor takes it (``{"type": "image", "image": ..., "uuid": None}``).

    Returns:
        The ``TokensPrompt`` list, the modality (``None`` without images) and the most
        images any one prompt has.
    """
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(path).read_text())
    modality = spec.get("modality", "image")
    prompts, most = [], 0
    for entry in spec["prompts"]:
        images = [random_image(*image) for image in entry.get("images", [])]
        prompt = TokensPrompt(prompt_token_ids=list(entry["prompt_token_ids"]))
        if images:
            if modality == "vision_chunk":
                images = [{"type": "image", "image": image, "uuid": None} for image in images]
            prompt["multi_modal_data"] = {modality: images}
        most = max(most, len(images))
        prompts.append(prompt)
    return prompts, modality if most else None, most


def mla_attention_classes(worker: Any) -> list[str]:
    """``backend.Class/impl.Class`` qualified names of a worker's MLA layers (one per
    distinct pair); run on the worker by ``LLM.collective_rpc``."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    def qualname(cls: type) -> str:
        return f"{cls.__module__}.{cls.__qualname__}"

    layers = get_layers_from_vllm_config(worker.vllm_config, MLAAttention).values()
    return sorted({f"{qualname(layer.attn_backend)}/{qualname(type(layer.impl))}"
                   for layer in layers})


def engine_config(llm: Any) -> dict[str, Any]:
    """The settings vLLM's platform hook (and the plugin) decided for this engine."""
    config = llm.llm_engine.vllm_config
    return {
        "block_size": config.cache_config.block_size,
        "enable_chunked_prefill": config.scheduler_config.enable_chunked_prefill,
        "enable_prefix_caching": config.cache_config.enable_prefix_caching,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "dtype": str(config.model_config.dtype).removeprefix("torch."),
    }


def _avoid_vllm_llvmlite_crash() -> None:
    """Work around a vLLM 0.32 (CPU) start-up crash once numba is imported in-process.

    At worker start, ``vllm/triton_utils/dispatcher.py`` ``_rebind_kernels`` (line 139)
    calls ``vars(value).get("kernel")`` on every attribute of every loaded module. Kimi-K2.5's
    image processor imports numba, hence llvmlite, whose ``llvmlite.binding.ffi.lib`` (a
    slotted ``_lib_wrapper`` with a ``__getattr__`` that wraps any name as a C function)
    answers ``vars()`` with a ``_lib_fn_wrapper``: "AttributeError: '_lib_fn_wrapper' object
    has no attribute 'get'". With the engine in its own process it does not happen (numba
    is not loaded there yet); in-process (this script) it always does. Giving the wrapper
    an empty ``__dict__`` entry in its function table makes that scan skip it; llvmlite
    never looks a C function up under that name.
    """
    try:
        import llvmlite.binding.ffi as ffi
    except ImportError:  # no numba, no llvmlite: nothing to work around
        return
    table = getattr(getattr(ffi, "lib", None), "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})


def record_schedule(llm: Any) -> list[list[list]] | None:
    """Start recording the in-process engine's schedule; returns the list it fills.

    One entry per engine step: ``[[request, tokens], ...]`` sorted by request, where
    ``request`` is the index ``LLM.generate`` gave the request (vLLM's id before any
    suffix). ``None`` when the scheduler is not in this process.
    """
    client = getattr(llm.llm_engine, "engine_core", None)
    scheduler = getattr(getattr(client, "engine_core", None), "scheduler", None)
    if scheduler is None:
        return None
    steps: list[list[list]] = []
    schedule = scheduler.schedule

    def recording_schedule(*args: Any, **kwargs: Any) -> Any:
        output = schedule(*args, **kwargs)
        if output.total_num_scheduled_tokens:
            steps.append(sorted([str(rid).split("-")[0], int(n)]
                                for rid, n in output.num_scheduled_tokens.items()))
        return output

    scheduler.schedule = recording_schedule
    return steps


def record_step_intervals(llm: Any) -> list[list[float]] | None:
    """Start recording the engine core's decode steps one by one; returns the list it fills.

    One entry per engine step that gave decode tokens: ``[median, total, count]`` of the
    intervals vLLM's output processor measured since each of those requests' previous token
    (``IterationStats.inter_token_latencies_iter``, by the engine core's timestamps; one per
    request, equal for requests that decoded in the step before). Over a request's life its
    intervals add up to ``last_token_ts - first_token_ts`` (``core_ts``). ``None`` when the
    engine logs no stats. ``LLM`` passes no custom stat loggers through to its engine, so
    this wraps the engine's ``StatLoggerManager.record``, which every step calls.
    """
    manager = getattr(getattr(llm, "llm_engine", None), "logger_manager", None)
    if manager is None:
        return None
    steps: list[list[float]] = []
    record = manager.record

    def recording_record(scheduler_stats: Any, iteration_stats: Any, *args: Any,
                         **kwargs: Any) -> Any:
        intervals = getattr(iteration_stats, "inter_token_latencies_iter", None)
        if intervals:
            steps.append([statistics.median(intervals), sum(intervals), len(intervals)])
        return record(scheduler_stats, iteration_stats, *args, **kwargs)

    manager.record = recording_record
    return steps


#: Engine counters ``engine_counters`` reports (summed over labels; the per-position
#: acceptance vector element-wise).
COUNTERS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def engine_counters(llm: Any) -> dict[str, Any]:
    """The engine's counters of interest from ``LLM.get_metrics()``, by short name (``vllm:``
    dropped; speculative decoding's accepted tokens per draft position as
    ``spec_decode_accepted_per_pos``). Counters the engine never created are absent."""
    out: dict[str, Any] = {}
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            key = metric.name.removeprefix("vllm:")
            out[key] = out.get(key, 0) + metric.value
        elif metric.name == ACCEPTED_PER_POS:
            values = list(metric.values)
            prev = out.get("spec_decode_accepted_per_pos", [0] * len(values))
            out["spec_decode_accepted_per_pos"] = [a + b for a, b in zip(prev, values,
                                                                         strict=True)]
    return out


def completion_record(output: Any) -> dict[str, Any]:
    """One ``RequestOutput`` as the JSON the comparisons read: prompt length, generated
    token ids and, per step, the top logprobs by token id; with the engine's stats on,
    ``core_ts``: the engine core's timestamps of the first and last token and the number of
    tokens (``RequestOutput.metrics``, which ``bench_engine.py --core-steps`` times steps
    by)."""
    completion = output.outputs[0]
    steps = [{str(tok): lp.logprob for tok, lp in step.items()} for step in completion.logprobs]
    record = {"prompt_len": len(output.prompt_token_ids),
              "token_ids": list(completion.token_ids), "logprobs": steps}
    metrics = getattr(output, "metrics", None)
    if metrics is not None and hasattr(metrics, "first_token_ts"):
        record["core_ts"] = [metrics.first_token_ts, metrics.last_token_ts,
                             metrics.num_generation_tokens]
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--attention-backend", default=None,
                        help="EngineArgs.attention_backend (what --attention-backend sets)")
    parser.add_argument("--attention-config-backend", default=None,
                        help='LLM(attention_config={"backend": NAME})')
    parser.add_argument("--dtype", default="float32", help="model dtype (vLLM's --dtype)")
    parser.add_argument("--prompt-lens", default=",".join(map(str, DEFAULT_PROMPT_LENS)))
    parser.add_argument("--max-tokens", default="12",
                        help="one value, or one per prompt (comma separated)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--kv-cache-bytes", type=int, default=None)
    parser.add_argument("--kv-cache-dtype", default=None)
    parser.add_argument("--prompts-json", default=None,
                        help="prompts (with images) from this file instead of --prompt-lens")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="on CPU, TP=2 also needs VLLM_CPU_OMP_THREADS_BIND (e.g. '0|1')")
    parser.add_argument("--speculative-config", default=None,
                        help='LLM(speculative_config=JSON), e.g. \'{"method": "ngram", ...}\'')
    args = parser.parse_args()

    # With the engine core in its own process it starts stepping while LLM.generate is
    # still adding requests, so batch mixes (and vLLM CPU's float32 numbers, which depend
    # on them at the 1e-2 level) vary between runs. In-process, every request is queued
    # before the first step: two runs of one backend are bit-identical. Forced, not
    # defaulted: an exported VLLM_ENABLE_V1_MULTIPROCESSING=1 made TP=2 comparisons flaky.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from .engine import tiny_engine_kwargs

    kwargs = tiny_engine_kwargs(on_gpu=False)
    if args.prompts_json:
        prompts, modality, most_images = load_prompts(args.prompts_json)
    else:
        lens = [int(x) for x in args.prompt_lens.split(",")]
        prompts = [TokensPrompt(prompt_token_ids=prompt_ids(n, i)) for i, n in enumerate(lens)]
        modality, most_images = None, 0
    if modality is not None:
        # A multimodal processor needs the model's tokenizer (it ships with the model).
        kwargs["skip_tokenizer_init"] = False
        kwargs["limit_mm_per_prompt"] = {modality: most_images}
        _avoid_vllm_llvmlite_crash()
    if args.attention_backend:
        kwargs["attention_backend"] = args.attention_backend
    if args.attention_config_backend:
        # LLM() parses attention_config before vLLM loads plugins; load them first so the
        # TRTLLM_MLA name exists (README: "Selecting the backend").
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        kwargs["attention_config"] = {"backend": args.attention_config_backend}
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.max_num_seqs:
        kwargs["max_num_seqs"] = args.max_num_seqs
    if args.kv_cache_dtype:
        kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    if args.kv_cache_bytes:
        kwargs["kv_cache_memory_bytes"] = args.kv_cache_bytes
    if args.tensor_parallel_size > 1:
        kwargs["tensor_parallel_size"] = args.tensor_parallel_size
    if args.speculative_config:
        kwargs["speculative_config"] = json.loads(args.speculative_config)
    llm = LLM(model=args.model, dtype=args.dtype, disable_log_stats=False, **kwargs)
    schedule = record_schedule(llm)
    step_intervals = record_step_intervals(llm)

    max_tokens = [int(x) for x in args.max_tokens.split(",")]
    if len(max_tokens) == 1:
        max_tokens *= len(prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=m, logprobs=2, ignore_eos=True)
              for m in max_tokens]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result = {"prompts": [completion_record(out) for out in outputs]}
    result["schedule"] = schedule
    result["step_intervals"] = step_intervals
    counts = engine_counters(llm)
    result["num_preemptions"] = counts.get("num_preemptions", 0)
    # Speculative decoding's counters (drafts, draft and accepted tokens, accepted per draft
    # position): empty without speculation.
    result["spec_decode"] = {key.removeprefix("spec_decode_"): value
                             for key, value in counts.items() if key.startswith("spec_decode_")}
    result["engine_config"] = engine_config(llm)
    result["attention_classes"] = llm.collective_rpc(mla_attention_classes)
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    result["plugin_loaded"] = "TRTLLM_MLA" in AttentionBackendEnum.__members__
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
