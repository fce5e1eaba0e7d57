"""What the TRTLLM_MLA backend refuses, as reasons (not exceptions), checked at engine start.

Head dims, block size and dtypes are the decode routes' business (``ops``: the builder's
``MLADecoder`` refuses at engine start when no route serves them). Here: the attention
features no route implements. One list for both places vLLM gives us: the CUDA
platform's ``validate_configuration`` (reasons become vLLM's startup error) and the
impl's constructor (the CPU platform does not validate selected backends, so the impl
raises the same reasons there).
"""

from __future__ import annotations

#: KV-cache dtypes every layer of the plugin handles (vLLM's names). FP8 means e4m3.
SUPPORTED_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3")


def feature_reasons(
    *,
    alibi_slopes: object = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    attn_type: str = "decoder",
    has_sink: bool = False,
    use_sparse: bool = False,
    kv_sharing_target_layer_name: str | None = None,
    dcp_world_size: int = 1,
    kv_cache_dtype: str = "auto",
) -> list[str]:
    """Reasons the backend cannot serve a layer with these features (empty: it can)."""
    reasons = []
    if use_sparse:
        reasons.append(
            "sparse MLA (DeepSeek-V3.2 indexer) is not supported by TRTLLM_MLA; use a "
            "sparse MLA backend (e.g. --attention-backend FLASHMLA_SPARSE)"
        )
    if has_sink:
        reasons.append("attention sinks are not supported by TRTLLM_MLA")
    if sliding_window is not None:
        reasons.append(f"sliding window ({sliding_window}) is not supported by TRTLLM_MLA")
    if alibi_slopes is not None:
        reasons.append("ALiBi is not supported by TRTLLM_MLA")
    if logits_soft_cap:
        reasons.append(f"logits soft cap ({logits_soft_cap}) is not supported by TRTLLM_MLA")
    if attn_type != "decoder":
        reasons.append(
            f"attention type {attn_type!r} is not supported: TRTLLM_MLA serves decoder "
            "self-attention only (no encoder or cross attention)"
        )
    if kv_sharing_target_layer_name is not None:
        reasons.append("KV sharing across layers is not supported for MLA")
    if dcp_world_size > 1:
        reasons.append(
            "decode context parallelism is not supported by TRTLLM_MLA; set "
            "--decode-context-parallel-size 1"
        )
    if kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        reasons.append(
            f"KV-cache dtype {kv_cache_dtype!r} is not supported by TRTLLM_MLA (supported: "
            f"{', '.join(SUPPORTED_KV_CACHE_DTYPES)}); use --kv-cache-dtype fp8 or auto"
        )
    return reasons


def raise_if_any(reasons: list[str]) -> None:
    if reasons:
        raise ValueError("TRTLLM_MLA cannot serve this model: " + "; ".join(reasons))
