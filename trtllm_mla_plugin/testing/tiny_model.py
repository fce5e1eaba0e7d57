"""A tiny random-weight DeepSeek-V3-style MLA model, built locally (no hub, no download).

DeepSeek-V3's attention geometry (kv_lora_rank 512, rope 64, nope 128, v 128) with a few
small dense layers. Attention projections and the LM head are scaled up so greedy output
depends on attention: with default init the model repeats one token and an off-by-one in
the context would go unnoticed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import DeepseekV3ForCausalLM

ATTENTION_GAIN = 3.0
LM_HEAD_GAIN = 8.0
DEFAULT_DIR = Path(__file__).resolve().parents[2] / ".cache" / "tiny-deepseek-v3"


def build_tiny_deepseek_v3(
    path: str | Path = DEFAULT_DIR,
    *,
    num_layers: int = 2,
    num_heads: int = 4,
    hidden_size: int = 256,
    vocab_size: int = 512,
    seed: int = 0,
) -> Path:
    """Write a random-weight DeepSeek-V3-style model to ``path`` (reused if present).

    Returns:
        The model directory, loadable by ``vllm.LLM(model=path, skip_tokenizer_init=True)``.
    """
    path = Path(path)
    marker = path / "trtllm_mla_tiny.json"
    recipe = dict(num_layers=num_layers, num_heads=num_heads, hidden_size=hidden_size,
                  vocab_size=vocab_size, seed=seed, gains=[ATTENTION_GAIN, LM_HEAD_GAIN])
    if marker.exists() and json.loads(marker.read_text()) == recipe:
        return path
    model = random_deepseek_v3(num_layers=num_layers, num_heads=num_heads,
                               hidden_size=hidden_size, vocab_size=vocab_size, seed=seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    marker.write_text(json.dumps(recipe))
    return path


def random_deepseek_v3(
    *,
    num_layers: int,
    num_heads: int,
    hidden_size: int,
    vocab_size: int,
    seed: int,
) -> DeepseekV3ForCausalLM:
    """The random-weight, attention-gained DeepSeek-V3 language model (not saved)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        moe_intermediate_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        first_k_dense_replace=num_layers,  # all dense: no MoE layers
        n_routed_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        rope_scaling=None,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".self_attn." in name and name.endswith("proj.weight"):
                param.mul_(ATTENTION_GAIN)
        model.lm_head.weight.mul_(LM_HEAD_GAIN)
    return model
