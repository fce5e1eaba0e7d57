"""trtllm_mla_plugin: a vLLM attention backend for Multi-head Latent Attention.

Layers: ``registration`` (vLLM entry point, cheap), ``ops`` (engine-agnostic decode routes)
and ``vllm_backend`` (vLLM glue). Importing the package imports none of them.
"""

__version__ = "0.1.0"
