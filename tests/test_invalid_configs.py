"""Every invalid set-up a user can trigger: a clear error naming the fix, or a documented
fallback (docs/invalid-configurations.md holds the same table). Never a wrong answer."""

from __future__ import annotations

import logging

import pytest
import torch

from trtllm_mla_plugin.ops import DecodeBatch, DecodeSpec, MLADecoder, Platform, choose_route
from trtllm_mla_plugin.ops.routes import flashinfer_mla, flashmla, trtllm_gen

H200 = Platform("cuda", (9, 0), "NVIDIA H200")
B200 = Platform("cuda", (10, 0), "NVIDIA B200")
A100 = Platform("cuda", (8, 0), "NVIDIA A100")
CPU = Platform("cpu", None, "cpu")


def packages_installed(monkeypatch, installed: bool) -> None:
    """Pretend FlashInfer and vLLM's FlashMLA are (or are not) importable."""
    for module in (flashinfer_mla, flashmla, trtllm_gen):
        monkeypatch.setattr(module, "module_available", lambda name: installed)


def spec(**over) -> DecodeSpec:
    base = dict(num_heads=16, kv_lora_rank=512, rope_dim=64, block_size=64,
                q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, softmax_scale=0.07)
    base.update(over)
    return DecodeSpec(**base)


# ---- attention features no route implements (vLLM glue, refused at engine start) --------

FEATURE_ROWS = [
    ("sliding window", dict(sliding_window=4096), "sliding window"),
    ("attention sinks", dict(has_sink=True), "attention sinks"),
    ("sparse MLA (V3.2 indexer)", dict(use_sparse=True), "sparse MLA"),
    ("logits soft cap", dict(logits_soft_cap=30.0), "soft cap"),
    ("ALiBi", dict(alibi_slopes=[0.5]), "ALiBi"),
    ("encoder attention", dict(attn_type="encoder_only"), "decoder self-attention only"),
    ("cross attention", dict(attn_type="encoder_decoder"), "decoder self-attention only"),
    ("decode context parallel", dict(dcp_world_size=2), "--decode-context-parallel-size 1"),
    ("KV sharing", dict(kv_sharing_target_layer_name="layers.0"), "KV sharing"),
    ("FP8 e5m2 KV cache", dict(kv_cache_dtype="fp8_e5m2"), "--kv-cache-dtype fp8"),
    ("int8 KV cache", dict(kv_cache_dtype="int8_per_token_head"), "not supported"),
]


@pytest.mark.parametrize(("what", "features", "message"), FEATURE_ROWS,
                         ids=[r[0] for r in FEATURE_ROWS])
def test_unsupported_feature_is_refused_with_reason(what, features, message):
    pytest.importorskip("vllm")
    from trtllm_mla_plugin.vllm_backend.capabilities import feature_reasons, raise_if_any

    reasons = feature_reasons(**features)
    assert len(reasons) == 1 and message in reasons[0]
    with pytest.raises(ValueError, match="TRTLLM_MLA cannot serve this model"):
        raise_if_any(reasons)


def test_supported_features_give_no_reason():
    pytest.importorskip("vllm")
    from trtllm_mla_plugin.vllm_backend.capabilities import feature_reasons

    assert feature_reasons() == []


@pytest.mark.parametrize(
    ("what", "kwargs", "reason_part"),
    [
        ("sinks", dict(has_sink=True), "attention sinks not supported"),
        ("sparse", dict(use_sparse=True), "sparse not supported"),
        ("sliding window", dict(has_sliding_window=True), "sliding window not supported"),
        ("encoder", dict(attn_type="encoder_only"), "not supported"),
        ("non-MLA model", dict(use_mla=False), "non-MLA not supported"),
        ("int8 KV cache", dict(kv_cache_dtype="int8_per_token_head"), "kv_cache_dtype"),
        ("adaptive verification", dict(use_adaptive_verification=True),
         "set enable_adaptive_verification to false in --speculative-config"),
    ],
)
def test_vllm_validate_configuration_reports_reason(what, kwargs, reason_part):
    """What vLLM's CUDA platform turns into its startup error for a selected backend."""
    pytest.importorskip("vllm")
    from vllm.platforms.interface import DeviceCapability

    from trtllm_mla_plugin.vllm_backend.backend import TrtllmMLABackend

    args = dict(head_size=576, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=64,
                use_mla=True, has_sink=False, use_sparse=False, use_mm_prefix=False,
                use_per_head_quant_scales=False, device_capability=DeviceCapability(9, 0),
                attn_type="decoder")
    args.update(kwargs)
    reasons = TrtllmMLABackend.validate_configuration(**args)
    assert any(reason_part in r for r in reasons), reasons


# ---- block size on Blackwell: adopted with one warning, or an error naming the fix ------

def test_blackwell_block_size_16_is_replaced_by_64_with_a_warning(monkeypatch, caplog):
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.platforms.interface import DeviceCapability

    from trtllm_mla_plugin.vllm_backend import backend

    config = SimpleNamespace(cache_config=SimpleNamespace(block_size=16))
    monkeypatch.setattr(backend, "_is_blackwell", lambda: True)
    monkeypatch.setattr(backend, "get_current_vllm_config_or_none", lambda: config)
    args = dict(head_size=576, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16,
                use_mla=True, has_sink=False, use_sparse=False, use_mm_prefix=False,
                use_per_head_quant_scales=False, device_capability=DeviceCapability(10, 0),
                attn_type="decoder")
    with caplog.at_level(logging.WARNING):
        assert backend.TrtllmMLABackend.validate_configuration(**args) == []
    assert config.cache_config.block_size == 64
    assert "using block size 64 instead" in caplog.text
    # A second layer validates the same (already adopted) config silently.
    caplog.clear()
    assert backend.TrtllmMLABackend.validate_configuration(**args) == []
    assert "using block size" not in caplog.text

    monkeypatch.setattr(backend, "get_current_vllm_config_or_none", lambda: None)
    reasons = backend.TrtllmMLABackend.validate_configuration(**args)
    assert any("--block-size 64" in r for r in reasons), reasons


# ---- decode routes: eligibility reasons, fallbacks, and run-time input errors ------------

ROUTE_ROWS = [
    # (what, spec overrides, platform, forced route, expected reason fragment)
    ("TRTLLM-gen on Hopper", {}, H200, "trtllm-gen", "SM100/SM103"),
    ("TRTLLM-gen block size 16", dict(block_size=16), B200, "trtllm-gen", "--block-size 64"),
    ("TRTLLM-gen fp16 model", dict(q_dtype=torch.float16, kv_dtype=torch.float16), B200,
     "trtllm-gen", "--dtype bfloat16"),
    ("TRTLLM-gen head dims (512, 0)", dict(rope_dim=0), B200, "trtllm-gen", "sparse-MLA-only"),
    ("TRTLLM-gen head dims 128+32", dict(kv_lora_rank=128, rope_dim=32), B200, "trtllm-gen",
     "not a dense"),
    ("TRTLLM-gen 96 heads", dict(num_heads=96), B200, "trtllm-gen", "head"),
    ("FlashMLA block size 32", dict(block_size=32), H200, "flashmla", "--block-size 64"),
    ("FlashMLA FP8 KV", dict(kv_dtype=torch.float8_e4m3fn), H200, "flashmla", "FP8"),
    ("FA3 on Ampere", {}, A100, "flashinfer-fa3", "SM90"),
    ("FA2 FP8 KV on Ampere", dict(kv_dtype=torch.float8_e4m3fn), A100, "flashinfer-fa2",
     "FP8"),
    ("FA3 odd latent width", dict(kv_lora_rank=320), H200, "flashinfer-fa3", "kv_lora_rank"),
    ("GPU route on CPU", {}, CPU, "flashinfer-fa3", "CUDA GPU"),
]


@pytest.mark.parametrize(("what", "over", "platform", "route", "fragment"), ROUTE_ROWS,
                         ids=[r[0] for r in ROUTE_ROWS])
def test_forced_route_that_cannot_serve_is_refused(what, over, platform, route, fragment,
                                                    monkeypatch):
    packages_installed(monkeypatch, True)
    with pytest.raises(ValueError, match="cannot serve this configuration") as err:
        choose_route(spec(**over), platform, forced=route)
    assert fragment in str(err.value)


def test_unknown_route_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown decode route 'fa9'.*torch-reference"):
        choose_route(spec(), H200, forced="fa9")


@pytest.mark.parametrize(
    ("what", "over", "platform", "expected"),
    [
        ("96 heads on Blackwell -> CuTe DSL", dict(num_heads=96), B200, "flashinfer-cute-dsl"),
        ("fp16 on Blackwell -> FA2", dict(q_dtype=torch.float16, kv_dtype=torch.float16),
         B200, "flashinfer-fa2"),
        ("FP8 KV on Hopper -> FA3", dict(kv_dtype=torch.float8_e4m3fn), H200,
         "flashinfer-fa3"),
    ],
)
def test_documented_fallbacks(what, over, platform, expected, monkeypatch):
    packages_installed(monkeypatch, True)
    choice = choose_route(spec(**over), platform)
    assert choice.name == expected


def test_missing_flashinfer_on_a_gpu_falls_back_with_the_install_command(monkeypatch):
    packages_installed(monkeypatch, False)
    choice = choose_route(spec(), H200)
    assert choice.name == "torch-reference"
    assert "pip install flashinfer-python" in choice.explain()


def _decoder():
    s = spec(q_dtype=torch.float32, kv_dtype=torch.float32, block_size=4, kv_lora_rank=32,
             rope_dim=8)
    return MLADecoder(s, "cpu", max_batch_size=2)


def _batch(lens, width=2):
    return DecodeBatch(block_table=torch.zeros(len(lens), width, dtype=torch.int32),
                       seq_lens=torch.tensor(lens, dtype=torch.int32), max_seq_len=max(lens))


@pytest.mark.parametrize(
    ("what", "make", "fragment"),
    [
        ("lengths beyond the block table", lambda d: d.plan(_batch([9], width=2)),
         "block table's capacity"),
        ("batch larger than built for", lambda d: d.plan(_batch([1, 1, 1])),
         "max_batch_size"),
        ("int16 block table", lambda d: d.plan(DecodeBatch(
            block_table=torch.zeros(1, 2, dtype=torch.int16),
            seq_lens=torch.ones(1, dtype=torch.int32), max_seq_len=1)), "int32"),
        ("wrong query head dim", lambda d: (d.plan(_batch([3])), d.run(
            torch.zeros(1, 16, 39), torch.zeros(4, 4, 40))), "kv_lora_rank + rope_dim"),
        ("query dtype mismatch", lambda d: (d.plan(_batch([3])), d.run(
            torch.zeros(1, 16, 40, dtype=torch.float64), torch.zeros(4, 4, 40))),
         "dtype mismatch"),
        ("non-contiguous cache", lambda d: (d.plan(_batch([3])), d.run(
            torch.zeros(1, 16, 40), torch.zeros(4, 4, 80)[..., ::2])), ".contiguous()"),
        ("run before plan", lambda d: d.run(torch.zeros(1, 16, 40), torch.zeros(4, 4, 40)),
         "before plan"),
    ],
)
def test_bad_decode_inputs_raise_naming_the_fix(what, make, fragment):
    with pytest.raises((ValueError, RuntimeError)) as err:
        make(_decoder())
    assert fragment in str(err.value)


def test_unknown_backend_name_is_vllms_error():
    pytest.importorskip("vllm")
    from vllm.config import AttentionConfig

    from trtllm_mla_plugin.registration import register

    register()
    with pytest.raises(Exception, match="Unknown attention backend: 'TRTLLM_MLX'"):
        AttentionConfig(backend="TRTLLM_MLX")


# ---- benchmark switches read from the environment (vLLM glue) ----------------------------


@pytest.mark.parametrize(("value", "want"), [("", None), ("1", True), ("0", False), (" 1 ", True)])
def test_fa3_device_plan_switch_reads_one_or_zero(monkeypatch, value, want):
    from trtllm_mla_plugin.vllm_backend.decode_spec import FA3_DEVICE_PLAN_ENV_VAR, fa3_device_plan

    monkeypatch.setenv(FA3_DEVICE_PLAN_ENV_VAR, value)
    assert fa3_device_plan() is want


def test_fa3_device_plan_switch_refuses_other_values_naming_them(monkeypatch):
    from trtllm_mla_plugin.vllm_backend.decode_spec import FA3_DEVICE_PLAN_ENV_VAR, fa3_device_plan

    monkeypatch.setenv(FA3_DEVICE_PLAN_ENV_VAR, "yes")
    with pytest.raises(ValueError, match=r"TRTLLM_MLA_FA3_DEVICE_PLAN='yes': use 1 .* or 0"):
        fa3_device_plan()
