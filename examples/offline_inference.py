"""Offline generation through vLLM with the TRTLLM_MLA attention backend.

When to use: to try the backend on one machine without a server, or as the template for
batch jobs. Works with any MLA model path (DeepSeek-V2/V3/R1, Kimi-K2, ...); without
``--model`` it builds a tiny random-weight DeepSeek-V3-style model locally (no download)
and prompts it with token ids.

    VLLM_ATTENTION_BACKEND=TRTLLM_MLA python examples/offline_inference.py [--model PATH]

Prints the generated token ids (or text) and the routes that served decode and prefill.
"""

from __future__ import annotations

import argparse
import os

ROUTE_REPORT = "trtllm_mla_plugin.vllm_backend.introspect.RouteReport"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="MLA model path; default: tiny local model")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--dtype", default=None, help="model dtype (default: bfloat16 "
                        "on GPU, float32 on CPU)")
    args = parser.parse_args()

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from trtllm_mla_plugin.testing.engine import CPU_KV_CACHE_BYTES, tiny_engine_kwargs
    from trtllm_mla_plugin.testing.tiny_model import build_tiny_deepseek_v3

    tiny = args.model is None
    model = args.model or str(build_tiny_deepseek_v3())
    on_gpu = torch.cuda.is_available()
    dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    backend_kwargs = {}
    if os.environ.get("VLLM_ATTENTION_BACKEND", "").upper() != "TRTLLM_MLA":
        # Equivalent of `--attention-backend TRTLLM_MLA`.
        backend_kwargs["attention_backend"] = "TRTLLM_MLA"
    if tiny:
        backend_kwargs.update(tiny_engine_kwargs(on_gpu))
    elif not on_gpu:
        backend_kwargs.update(kv_cache_memory_bytes=CPU_KV_CACHE_BYTES)
    llm = LLM(model=model, dtype=dtype, worker_extension_cls=ROUTE_REPORT, **backend_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    if tiny:
        prompts = [TokensPrompt(prompt_token_ids=[(7 * i + 3) % 500 for i in range(n)])
                   for n in (1, 16, 40)]
    else:
        prompts = ["The capital of France is", "Multi-head latent attention is"]
    for output in llm.generate(prompts, params):
        completion = output.outputs[0]
        shown = completion.token_ids if tiny else repr(completion.text)
        print(f"prompt of {len(output.prompt_token_ids)} tokens -> {shown}")
    print(f"routes: {llm.collective_rpc('trtllm_mla_routes')[0]}")


if __name__ == "__main__":
    main()
