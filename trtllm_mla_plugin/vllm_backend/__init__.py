"""vLLM glue: backend, metadata builder and impl on vLLM's MLA common classes.

Thin by design: decode goes to ``trtllm_mla_plugin.ops``; prefill is vLLM's MLA prefill
path. Imported only when vLLM resolves the ``TRTLLM_MLA`` class path.
"""
