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
    mtp_layers: int = 0,
    dtype: str = "float32",
    max_position_embeddings: int = 4096,
) -> Path:
    """Write a random-weight DeepSeek-V3-style model to ``path`` (reused if present).

    Args:
        mtp_layers: DeepSeek multi-token-prediction layers to add after the main layers
            (``num_nextn_predict_layers``), for vLLM's ``speculative_config={"method":
            "mtp"}``; see ``_add_mtp_layers``. 0 (default) leaves the model exactly as
            without the option.
        dtype: dtype the weights are saved in (``"float32"`` or ``"bfloat16"``); the
            random draw is the same, so a bfloat16 model is the float32 one rounded.
        max_position_embeddings: longest context the model config allows (engine
            benchmarks with long prompts).

    Returns:
        The model directory, loadable by ``vllm.LLM(model=path, skip_tokenizer_init=True)``.
    """
    path = Path(path)
    marker = path / "trtllm_mla_tiny.json"
    recipe = dict(num_layers=num_layers, num_heads=num_heads, hidden_size=hidden_size,
                  vocab_size=vocab_size, seed=seed, gains=[ATTENTION_GAIN, LM_HEAD_GAIN])
    if mtp_layers or dtype != "float32":
        recipe.update(mtp_layers=mtp_layers, dtype=dtype)
    if max_position_embeddings != 4096:
        recipe.update(max_position_embeddings=max_position_embeddings)
    if marker.exists() and json.loads(marker.read_text()) == recipe:
        return path
    model = random_deepseek_v3(num_layers=num_layers, num_heads=num_heads,
                               hidden_size=hidden_size, vocab_size=vocab_size, seed=seed,
                               max_position_embeddings=max_position_embeddings)
    if dtype != "float32":
        import torch

        model = model.to(getattr(torch, dtype))
        model.config.dtype = dtype
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if mtp_layers:
        _add_mtp_layers(path, model, mtp_layers)
    marker.write_text(json.dumps(recipe))
    return path


def random_deepseek_v3(
    *,
    num_layers: int,
    num_heads: int,
    hidden_size: int,
    vocab_size: int,
    seed: int,
    max_position_embeddings: int = 4096,
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
        max_position_embeddings=max_position_embeddings,
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


def _add_mtp_layers(path: Path, model: DeepseekV3ForCausalLM, mtp_layers: int) -> None:
    """Append ``mtp_layers`` DeepSeek MTP layers to the checkpoint saved in ``path``.

    transformers' ``DeepseekV3ForCausalLM`` creates none, so they are added here under the
    names vLLM's DeepSeek MTP loader reads (``vllm/model_executor/models/deepseek_mtp.py``):
    layer ``n = num_hidden_layers + j`` holds a full decoder block
    (``model.layers.{n}.self_attn.*``, ``mlp.*``, the two layer norms: an MLA layer, so
    drafting runs the selected attention backend too) plus ``enorm``, ``hnorm``,
    ``eh_proj`` ([hidden, 2 * hidden]) and ``shared_head.{norm,head}``.

    Random MTP weights draft tokens the target never accepts, which leaves the rows after
    the first of each verification unused. So each MTP layer imitates the target instead:
    its block is a copy of main layer 0, ``eh_proj`` passes the (re-normalised) token
    embedding through and drops the target's hidden state, and the shared head is the
    final norm and LM head. With ``num_layers=1`` the draft is then the target's own
    prediction over the context the MTP layer has seen (it never sees the first token),
    so drafts are often, not always, accepted.
    """
    import torch
    from safetensors.torch import load_file, save_file

    config = model.config
    base, hidden = config.num_hidden_layers, config.hidden_size
    file = path / "model.safetensors"
    tensors = load_file(file)
    dtype = tensors["lm_head.weight"].dtype
    block = {k.removeprefix("model.layers.0."): v for k, v in tensors.items()
             if k.startswith("model.layers.0.")}
    embed_rms = float(tensors["model.embed_tokens.weight"].float().pow(2).mean().sqrt())
    eh_proj = torch.zeros(hidden, 2 * hidden)
    eh_proj[:, :hidden] = torch.eye(hidden)
    for j in range(mtp_layers):
        prefix = f"model.layers.{base + j}"
        tensors.update({f"{prefix}.{k}": v.clone() for k, v in block.items()})
        # enorm scales the normalised embedding back to the embedding's own size.
        tensors[f"{prefix}.enorm.weight"] = torch.full((hidden,), embed_rms, dtype=dtype)
        tensors[f"{prefix}.hnorm.weight"] = torch.ones(hidden, dtype=dtype)
        tensors[f"{prefix}.eh_proj.weight"] = eh_proj.to(dtype)
        tensors[f"{prefix}.shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
        tensors[f"{prefix}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, file, metadata={"format": "pt"})
    config.num_nextn_predict_layers = mtp_layers
    # vLLM builds the MTP block as a MoE layer unless it is below first_k_dense_replace.
    config.first_k_dense_replace = base + mtp_layers
    config.save_pretrained(path)
