"""Ask a running engine which routes its MLA layers use.

``RouteReport`` is a vLLM worker extension: pass
``worker_extension_cls="trtllm_mla_plugin.vllm_backend.introspect.RouteReport"`` to
``vllm.LLM`` and call ``llm.collective_rpc("trtllm_mla_routes")``.
"""

from __future__ import annotations


class RouteReport:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    def trtllm_mla_routes(self) -> str:
        """One line: attention backend, decode route and prefill backend of the first MLA
        layer of this worker's model."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention

        layers = get_layers_from_vllm_config(self.vllm_config, MLAAttention)
        if not layers:
            return "no MLA layers"
        layer = next(iter(layers.values()))
        backend = layer.attn_backend.get_name()
        prefill = layer.prefill_backend.get_name() if layer.prefill_backend else "none"
        decoders = [
            builder.decoder
            for groups in self.model_runner.attn_groups
            for group in groups
            for builder in group.metadata_builders
            if hasattr(builder, "decoder")
        ]
        decode = (
            f"{decoders[0].route_name} ({decoders[0].choice.kernel})"
            if decoders
            else f"{backend}'s own kernel"
        )
        return f"attention backend {backend}; decode {decode}; prefill {prefill}"
