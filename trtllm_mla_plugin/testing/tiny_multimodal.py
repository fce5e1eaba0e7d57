"""A tiny random-weight multimodal MLA model (Kimi-K2.5 architecture), built locally.

vLLM 0.32 serves ``KimiK25ForConditionalGeneration``: a MoonViT-3D vision tower, a
patch-merging projector and a DeepSeek-V3 (MLA) language model. Everything it needs is
written here without a download: ``config.json`` (transformers' own ``Kimi_K25Config``),
random weights under the checkpoint names vLLM loads, a word-level tokenizer (built with
``tokenizers``) that knows Kimi's media tokens, and the ``media_proc_cfg`` that vLLM's own
image processor for this model (``KimiK25FusedVisionProcessor``, numba) reads.

Why Kimi-K2.5 and not DeepSeek-VL2 or Kimi-VL: vLLM's DeepSeek-VL2 processor imports
torchvision and its vision tower is built with ``timm`` (which needs torchvision too; PyPI's
torchvision builds break imports next to torch 2.13+cpu), and that tower is hard-coded
to the 400M-parameter SigLIP-so400m; Kimi-VL's processor exists only as remote code on the
hub. Kimi-K2.5 needs neither: its processor is vLLM's own.

The language model is the one of ``tiny_model`` (DeepSeek-V3 attention geometry: latent
512, rope 64), with the same gains so greedy output depends on attention. The vision side
is small (2 layers, width 64) but scaled so image tokens reach the language model with
the magnitude of text embeddings times ``IMAGE_EMBED_GAIN``: different images change the
generated text.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .tiny_model import ATTENTION_GAIN, LM_HEAD_GAIN, random_deepseek_v3

DEFAULT_DIR = Path(__file__).resolve().parents[2] / ".cache" / "tiny-kimi-k25"

#: Token ids of the word-level tokenizer: ``w0`` .. ``w499`` are ordinary words (the ids
#: ``run_engine.prompt_ids`` draws from), then Kimi's media tokens.
NUM_WORDS = 500
UNK_TOKEN = "<unk>"
EOS_TOKEN = "<|im_end|>"
MEDIA_BEGIN = "<|media_begin|>"
MEDIA_CONTENT = "<|media_content|>"
MEDIA_PAD = "<|media_pad|>"
MEDIA_END = "<|media_end|>"
VIDEO_PLACEHOLDER = "<|kimi_k25_video_placeholder|>"
SPECIAL_TOKENS = (UNK_TOKEN, EOS_TOKEN, MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_PAD, MEDIA_END,
                  VIDEO_PLACEHOLDER)
VOCAB = [f"w{i}" for i in range(NUM_WORDS)] + list(SPECIAL_TOKENS) + ["image"]
TOKEN_IDS = {token: i for i, token in enumerate(VOCAB)}
#: The language model's vocabulary (a multiple of 64 above the tokenizer's).
VOCAB_SIZE = 512
#: What one image becomes in a token prompt (vLLM's placeholder for Kimi-K2.5, as ids):
#: the processor expands the single ``<|media_pad|>`` into one token per merged patch.
IMAGE_PLACEHOLDER_IDS = [TOKEN_IDS[t] for t in (MEDIA_BEGIN, "image", MEDIA_CONTENT,
                                                 MEDIA_PAD, MEDIA_END)]

#: Vision tower geometry.
PATCH_SIZE = 14
MERGE = 2
#: Image resize budget (vLLM's navit resize): at most this many 14x14 patches in all and
#: on one side, so an image yields at most (16 / 2)^2 = 64 image tokens.
IN_PATCH_LIMIT = 256
PATCH_LIMIT_ON_ONE_SIDE = 16
#: Image-token embeddings are scaled to about this many times a text embedding's norm.
IMAGE_EMBED_GAIN = 1.0


def image_token_count(width: int, height: int) -> int:
    """Image tokens one ``width`` x ``height`` image becomes (vLLM's navit resize)."""
    scale = min(1.0,
                math.sqrt(IN_PATCH_LIMIT / (max(1, width // PATCH_SIZE)
                                            * max(1, height // PATCH_SIZE))),
                PATCH_LIMIT_ON_ONE_SIDE * PATCH_SIZE / width,
                PATCH_LIMIT_ON_ONE_SIDE * PATCH_SIZE / height)
    side = PATCH_SIZE * MERGE
    new_w = min(max(1, int(width * scale)), PATCH_LIMIT_ON_ONE_SIDE * PATCH_SIZE)
    new_h = min(max(1, int(height * scale)), PATCH_LIMIT_ON_ONE_SIDE * PATCH_SIZE)
    return math.ceil(new_w / side) * math.ceil(new_h / side)


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=TOKEN_IDS, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=UNK_TOKEN,
        eos_token=EOS_TOKEN,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (UNK_TOKEN,
                                                                           EOS_TOKEN)],
        model_max_length=4096,
    )
    fast.save_pretrained(path)


def _media_proc_cfg() -> dict:
    return {
        "patch_size": PATCH_SIZE,
        "merge_kernel_size": MERGE,
        "in_patch_limit": IN_PATCH_LIMIT,
        "patch_limit_on_one_side": PATCH_LIMIT_ON_ONE_SIDE,
        "in_patch_limit_each_frame": IN_PATCH_LIMIT,
        "in_patch_limit_video": 4 * IN_PATCH_LIMIT,
        "fixed_output_tokens": None,
        "temporal_merge_kernel_size": 4,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }


def _vision_weights(
    *, hidden: int, layers: int, mlp: int, pos_emb: int, text_hidden: int, text_embed_rms: float,
    generator,
) -> dict:
    """Random weights for the vision tower and projector, under vLLM's checkpoint names."""
    import torch

    def linear(out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=generator) * (gain / math.sqrt(in_f))

    def small(*shape: int) -> torch.Tensor:
        return 0.02 * torch.randn(*shape, generator=generator)

    w: dict[str, torch.Tensor] = {}
    vt = "vision_tower."
    w[vt + "patch_embed.proj.weight"] = (torch.randn(hidden, 3, PATCH_SIZE, PATCH_SIZE,
                                                     generator=generator)
                                         / math.sqrt(3 * PATCH_SIZE * PATCH_SIZE))
    w[vt + "patch_embed.proj.bias"] = small(hidden)
    w[vt + "patch_embed.pos_emb.weight"] = 0.5 * torch.randn(pos_emb, pos_emb, hidden,
                                                             generator=generator)
    for i in range(layers):
        block = f"{vt}encoder.blocks.{i}."
        for norm in ("norm0", "norm1"):
            w[block + norm + ".weight"] = 1.0 + small(hidden)
            w[block + norm + ".bias"] = small(hidden)
        w[block + "wqkv.weight"] = linear(3 * hidden, hidden, gain=2.0)
        w[block + "wqkv.bias"] = small(3 * hidden)
        w[block + "wo.weight"] = linear(hidden, hidden)
        w[block + "wo.bias"] = small(hidden)
        w[block + "mlp.fc0.weight"] = linear(mlp, hidden)
        w[block + "mlp.fc0.bias"] = small(mlp)
        w[block + "mlp.fc1.weight"] = linear(hidden, mlp)
        w[block + "mlp.fc1.bias"] = small(hidden)
    w[vt + "encoder.final_layernorm.weight"] = 1.0 + small(hidden)
    w[vt + "encoder.final_layernorm.bias"] = small(hidden)
    merged = hidden * MERGE * MERGE
    w["mm_projector.pre_norm.weight"] = 1.0 + small(hidden)
    w["mm_projector.pre_norm.bias"] = small(hidden)
    w["mm_projector.proj.0.weight"] = linear(merged, merged)
    w["mm_projector.proj.0.bias"] = small(merged)
    # GELU of ~unit inputs has an RMS of ~0.6: scale the last layer so an image token's
    # embedding has about the RMS of a text token's.
    w["mm_projector.proj.2.weight"] = linear(text_hidden, merged,
                                             gain=IMAGE_EMBED_GAIN * text_embed_rms / 0.6)
    w["mm_projector.proj.2.bias"] = torch.zeros(text_hidden)
    return w


def build_tiny_kimi_k25(
    path: str | Path = DEFAULT_DIR,
    *,
    num_layers: int = 2,
    num_heads: int = 4,
    hidden_size: int = 256,
    vision_hidden: int = 64,
    vision_layers: int = 2,
    vision_heads: int = 4,
    seed: int = 0,
) -> Path:
    """Write a random-weight Kimi-K2.5-style multimodal MLA model to ``path``.

    Reused when ``path`` already holds one built from the same recipe.

    Returns:
        The model directory, loadable by ``vllm.LLM(model=path)`` (tokenizer, image
        processor config and weights included; no network).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import Kimi_K25Config

    path = Path(path)
    marker = path / "trtllm_mla_tiny.json"
    recipe = dict(arch="kimi_k25", num_layers=num_layers, num_heads=num_heads,
                  hidden_size=hidden_size, vision=[vision_hidden, vision_layers, vision_heads],
                  seed=seed, gains=[ATTENTION_GAIN, LM_HEAD_GAIN, IMAGE_EMBED_GAIN],
                  media=_media_proc_cfg(), vocab=len(VOCAB))
    if marker.exists() and json.loads(marker.read_text()) == recipe:
        return path
    path.mkdir(parents=True, exist_ok=True)

    language_model = random_deepseek_v3(num_layers=num_layers, num_heads=num_heads,
                                        hidden_size=hidden_size, vocab_size=VOCAB_SIZE,
                                        seed=seed)
    text_config = language_model.config.to_dict()
    for key in ("architectures", "transformers_version", "dtype", "torch_dtype"):
        text_config.pop(key, None)
    pos_emb = PATCH_LIMIT_ON_ONE_SIDE
    config = Kimi_K25Config(
        text_config=text_config,
        vision_config=dict(
            patch_size=PATCH_SIZE,
            pos_emb_height=pos_emb,
            pos_emb_width=pos_emb,
            pos_emb_time=4,
            num_attention_heads=vision_heads,
            num_hidden_layers=vision_layers,
            hidden_size=vision_hidden,
            intermediate_size=2 * vision_hidden,
            hidden_act="gelu_pytorch_tanh",
            merge_kernel_size=[MERGE, MERGE],
        ),
        projection_hidden_size=vision_hidden,
        image_token_id=TOKEN_IDS[MEDIA_PAD],
        video_token_id=TOKEN_IDS[VIDEO_PLACEHOLDER],
        vision_start_token_id=TOKEN_IDS[MEDIA_BEGIN],
        vision_end_token_id=TOKEN_IDS[MEDIA_END],
        tie_word_embeddings=False,
        pad_token_id=TOKEN_IDS[UNK_TOKEN],
        eos_token_id=TOKEN_IDS[EOS_TOKEN],
    )
    config.architectures = ["KimiK25ForConditionalGeneration"]
    config.dtype = "float32"
    config.save_pretrained(path)

    weights = {f"language_model.{name}": tensor.detach().contiguous()
               for name, tensor in language_model.state_dict().items()}
    embed = language_model.get_input_embeddings().weight
    generator = torch.Generator().manual_seed(seed + 1)
    weights.update(_vision_weights(
        hidden=vision_hidden, layers=vision_layers, mlp=2 * vision_hidden, pos_emb=pos_emb,
        text_hidden=hidden_size, text_embed_rms=float(embed.detach().pow(2).mean().sqrt()),
        generator=generator,
    ))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    (path / "preprocessor_config.json").write_text(
        json.dumps({"media_proc_cfg": _media_proc_cfg()}, indent=2))
    _write_tokenizer(path)
    marker.write_text(json.dumps(recipe))
    return path


#: Images as ``[width, height, seed]`` (``run_engine.random_image``): square ones that fill
#: the patch budget (64 tokens), a wide and a tall one (resized, position embeddings
#: interpolated), and small ones.
IMAGE_A = [224, 224, 1]
IMAGE_B = [224, 224, 2]
IMAGE_WIDE = [300, 150, 3]
IMAGE_WIDE_2 = [300, 150, 4]
IMAGE_TALL = [112, 196, 5]
IMAGE_SMALL = [56, 56, 6]
IMAGE_SMALL_2 = [56, 56, 7]


def _words(length: int, salt: int) -> list[int]:
    from .run_engine import prompt_ids

    return prompt_ids(length, salt) if length else []


def image_prompt_spec() -> dict:
    """The ``--prompts-json`` content of the multimodal engine test.

    Text before and after each image of lengths that put the image tokens across the CPU
    block size (16) in different places, pairs that differ only in the image (``pairs``,
    indices into ``prompts``), a prompt with two images and a text-only prompt in the same
    batch.
    """
    def prompt(before: int, images: list[list[int]], after: int, salt: int) -> dict:
        ids = _words(before, salt)
        for _ in images:
            ids += IMAGE_PLACEHOLDER_IDS + _words(after, salt + 1)
        return {"prompt_token_ids": ids, "images": images}

    prompts = [
        prompt(3, [IMAGE_A], 4, 0),
        prompt(3, [IMAGE_B], 4, 0),
        prompt(9, [IMAGE_WIDE], 2, 10),
        prompt(9, [IMAGE_WIDE_2], 2, 10),
        prompt(0, [IMAGE_SMALL], 1, 20),
        prompt(0, [IMAGE_SMALL_2], 1, 20),
        prompt(14, [IMAGE_TALL, IMAGE_A], 6, 30),
        prompt(17, [], 0, 40),
        prompt(40, [IMAGE_B], 11, 50),
    ]
    return {"modality": "vision_chunk", "prompts": prompts, "pairs": [[0, 1], [2, 3], [4, 5]]}


def expected_prompt_len(entry: dict) -> int:
    """Prompt length after vLLM expands each image's ``<|media_pad|>`` into its tokens."""
    images = entry["images"]
    return (len(entry["prompt_token_ids"]) - len(images)
            + sum(image_token_count(width, height) for width, height, _ in images))
