"""Registration through vLLM's own plugin loader and the installed entry point."""

from __future__ import annotations

import importlib.metadata
import logging
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm")

from trtllm_mla_plugin.registration import BACKEND_NAME, BACKEND_PATH


def _env_without_selection() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "VLLM_ATTENTION_BACKEND"}


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (fresh vLLM registry and plugin state)."""
    full_env = _env_without_selection()
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                          capture_output=True, text=True, timeout=300)


def test_entry_point_is_installed():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.name == "trtllm_mla"]
    assert len(ours) == 1
    assert ours[0].value == "trtllm_mla_plugin.registration:register"


def test_vllm_plugin_loader_registers_backend_idempotently():
    proc = run_python("""
        from vllm.plugins import load_general_plugins
        from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
        load_general_plugins()
        load_general_plugins()
        from trtllm_mla_plugin.registration import register
        register(); register()   # vLLM may load plugins twice in a process
        print("PATH", E["TRTLLM_MLA"].get_path())
        print("CLASS", E["TRTLLM_MLA"].get_class().get_name())
        print("COUNT", list(E.__members__).count("TRTLLM_MLA"))
        from vllm.platforms import current_platform
        hook = type(current_platform).check_and_update_config
        print("CPU_SETTINGS", getattr(hook, "_trtllm_mla_cpu_settings", False),
              getattr(hook.__wrapped__, "_trtllm_mla_cpu_settings", False))
    """)
    assert proc.returncode == 0, proc.stderr
    assert f"PATH {BACKEND_PATH}" in proc.stdout
    assert f"CLASS {BACKEND_NAME}" in proc.stdout
    assert "COUNT 1" in proc.stdout
    # The CPU platform's config hook is wrapped once, however often register() runs.
    assert "CPU_SETTINGS True False" in proc.stdout


def test_selected_backend_unpickles_in_a_process_without_plugins():
    """vLLM's worker processes unpickle their config (naming the selected backend) before
    they load plugins: ``--attention-backend TRTLLM_MLA`` with tensor parallelism failed
    with "... is not a valid AttentionBackendEnum" until the member pickled through
    ``backend_member``."""
    import pickle

    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    load_general_plugins()
    data = pickle.dumps(AttentionBackendEnum[BACKEND_NAME])
    code = ("import pickle, sys; m = pickle.loads(sys.stdin.buffer.read()); "
            "print(m.name, m.get_path())")
    proc = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True,
                          env={**_env_without_selection(), "VLLM_PLUGINS": ""}, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert proc.stdout.decode().split() == [BACKEND_NAME, BACKEND_PATH]


def test_register_is_cheap_no_cuda_no_flashinfer_no_backend_import():
    proc = run_python("""
        import sys, torch
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        heavy = [m for m in sys.modules if m.startswith(("flashinfer",
                 "trtllm_mla_plugin.ops", "trtllm_mla_plugin.vllm_backend"))]
        print("HEAVY", heavy)
        print("CUDA_INIT", torch.cuda.is_initialized())
    """)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout
    assert "CUDA_INIT False" in proc.stdout


def test_unselected_cpu_mla_names_resolve_to_vllms_own_classes():
    proc = run_python("""
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
        from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
        print("SAME", E.CPU_MLA.get_class() is CPUMLABackend,
              E.AMX_MLA.get_class() is AMXMLABackend)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "SAME True True" in proc.stdout


def test_env_selected_cpu_mla_name_resolves_to_trtllm_mla():
    proc = run_python("""
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
        print("NAME", E.CPU_MLA.get_class().get_name(), E.AMX_MLA.get_class().get_name())
    """, VLLM_ATTENTION_BACKEND="TRTLLM_MLA")
    assert proc.returncode == 0, proc.stderr
    assert "NAME TRTLLM_MLA TRTLLM_MLA" in proc.stdout


@pytest.mark.parametrize(
    ("value", "selected"),
    [("TRTLLM_MLA", True), ("trtllm_mla", True), ("", False), ("FLASHINFER_MLA", False),
     ("TRITON_MLA", False), ("FLASH_ATTN", False)],
)
def test_env_selection_leaves_vllms_values_alone(monkeypatch, value, selected):
    from trtllm_mla_plugin.registration.selection import env_selection

    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", value)
    assert env_selection() is selected


@pytest.mark.parametrize("typo", ["TRTLLM_MAL", "TRTLM_MLA", "TRTLLMMLA", "TRTLLM-MLA"])
def test_env_near_miss_names_the_valid_spelling(monkeypatch, typo):
    from trtllm_mla_plugin.registration.selection import env_selection

    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", typo)
    with pytest.raises(ValueError, match="did you mean VLLM_ATTENTION_BACKEND=TRTLLM_MLA"):
        env_selection()


def test_env_selection_on_gpu_platforms_fills_only_unset_mla_selection():
    """The CUDA-platform hook: 'no backend' becomes TRTLLM_MLA for MLA layers only."""
    from types import SimpleNamespace

    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from trtllm_mla_plugin.registration import plugin

    plugin.register()  # the name must exist
    calls = []

    class FakePlatform:
        @classmethod
        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            calls.append(selected_backend)
            return "path"

    plugin.install_env_selection(FakePlatform)
    plugin.install_env_selection(FakePlatform)  # idempotent: wraps once
    mla = SimpleNamespace(use_mla=True)
    dense = SimpleNamespace(use_mla=False)
    FakePlatform.get_attn_backend_cls(None, attn_selector_config=mla)
    FakePlatform.get_attn_backend_cls(None, dense)
    FakePlatform.get_attn_backend_cls(AttentionBackendEnum.TRITON_MLA, mla)
    assert calls == [AttentionBackendEnum["TRTLLM_MLA"], None, AttentionBackendEnum.TRITON_MLA]


# ---- CPU engine settings for TRTLLM_MLA (registration/cpu_settings.py) -------------------

def _cpu_config(*, backend=None, use_mla=True, model_type="deepseek_v3", block_size=128,
                user_block_size=False, chunked=True, prefix=True, budget=4096):
    """The parts of a VllmConfig that vLLM's CPU platform hook leaves for AMX_MLA."""
    from types import SimpleNamespace

    return SimpleNamespace(
        model_config=SimpleNamespace(use_mla=use_mla, max_model_len=1024,
                                     hf_config=SimpleNamespace(model_type=model_type)),
        cache_config=SimpleNamespace(block_size=block_size, enable_prefix_caching=prefix,
                                     user_specified_block_size=user_block_size),
        scheduler_config=SimpleNamespace(enable_chunked_prefill=chunked,
                                         max_num_batched_tokens=budget,
                                         DEFAULT_MAX_NUM_BATCHED_TOKENS=2048),
        attention_config=SimpleNamespace(
            backend=None if backend is None else SimpleNamespace(name=backend),
            backend_per_kind={}),
    )


def _settings(config) -> tuple:
    return (config.cache_config.block_size, config.scheduler_config.enable_chunked_prefill,
            config.cache_config.enable_prefix_caching,
            config.scheduler_config.max_num_batched_tokens)


@pytest.mark.parametrize("by_env", [False, True])
def test_selected_trtllm_mla_gets_cpu_mlas_engine_settings(monkeypatch, caplog, by_env):
    """What vLLM leaves for AMX_MLA (block 128, chunked prefill and prefix caching on)
    becomes what it gives CPU_MLA (block 16, both off, budget max(max_model_len, 2048))."""
    from trtllm_mla_plugin.registration.cpu_settings import apply_cpu_mla_settings

    monkeypatch.delenv("VLLM_ATTENTION_BACKEND", raising=False)
    if by_env:
        monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "TRTLLM_MLA")
    config = _cpu_config(backend=None if by_env else "TRTLLM_MLA")
    # vLLM's logging setup may stop records at the "vllm" logger: listen on ours directly.
    plugin_logger = logging.getLogger("vllm.plugins")
    monkeypatch.setattr(plugin_logger, "propagate", False)
    plugin_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="vllm.plugins"):
            changed = apply_cpu_mla_settings(config)
            assert _settings(config) == (16, False, False, 2048)
            assert len(changed) == 4
            assert ("TRTLLM_MLA on CPU: block size 128 -> 16, chunked prefill off, prefix "
                    "caching off, max_num_batched_tokens 4096 -> 2048" in caplog.text)
            # Where vLLM already applied them (CPUs without AMX): no change, no log line.
            caplog.clear()
            assert apply_cpu_mla_settings(config) == []
            assert caplog.text == ""
    finally:
        plugin_logger.removeHandler(caplog.handler)


@pytest.mark.parametrize(
    "config",
    [_cpu_config(), _cpu_config(backend="CPU_MLA"), _cpu_config(backend="AMX_MLA"),
     _cpu_config(backend="TRTLLM_MLA", use_mla=False),
     _cpu_config(backend="TRTLLM_MLA", model_type="deepseek_v4")],
    ids=["nothing selected", "CPU_MLA", "AMX_MLA", "not MLA", "DeepSeek-V4"],
)
def test_cpu_settings_leave_other_engines_alone(monkeypatch, config):
    from trtllm_mla_plugin.registration.cpu_settings import apply_cpu_mla_settings

    monkeypatch.delenv("VLLM_ATTENTION_BACKEND", raising=False)
    before = _settings(config)
    assert apply_cpu_mla_settings(config) == []
    assert _settings(config) == before


def test_cpu_settings_hook_runs_after_vllms_and_wraps_once(monkeypatch):
    from trtllm_mla_plugin.registration.cpu_settings import install_cpu_mla_settings

    monkeypatch.delenv("VLLM_ATTENTION_BACKEND", raising=False)
    calls = []

    class FakeCpuPlatform:
        @classmethod
        def check_and_update_config(cls, vllm_config):
            calls.append(_settings(vllm_config))  # vLLM's hook sees the config first

    install_cpu_mla_settings(FakeCpuPlatform)
    install_cpu_mla_settings(FakeCpuPlatform)
    config = _cpu_config(backend="TRTLLM_MLA")
    FakeCpuPlatform().check_and_update_config(config)
    assert calls == [(128, True, True, 4096)]
    assert _settings(config) == (16, False, False, 2048)


def test_cpu_settings_name_a_requested_block_size_they_override(monkeypatch):
    from trtllm_mla_plugin.registration import cpu_settings

    monkeypatch.delenv("VLLM_ATTENTION_BACKEND", raising=False)
    warnings = []
    monkeypatch.setattr(cpu_settings.logger, "warning",
                        lambda msg, *args: warnings.append(msg % args))
    config = _cpu_config(backend="TRTLLM_MLA", block_size=64, user_block_size=True)
    cpu_settings.apply_cpu_mla_settings(config)
    assert config.cache_config.block_size == 16
    assert warnings == ["TRTLLM_MLA on CPU uses block size 16 (as vLLM's CPU_MLA backend); "
                        "overriding the requested block size 64."]


def test_doctor_reports_the_cpu_engine_and_its_routes():
    """``python -m trtllm_mla_plugin`` in this environment: vLLM seen with its entry point,
    the CPU decode route, exit 0; no split-KV kernel line off SM90."""
    proc = subprocess.run([sys.executable, "-m", "trtllm_mla_plugin"], capture_output=True,
                          text=True, timeout=300, env=_env_without_selection())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "entry point: vllm.general_plugins:trtllm_mla seen by vLLM" in out
    assert "torch-reference" in out and "status: OK" in out
    assert "split-KV kernel" not in out
    assert "short prefills" not in out  # a GPU line
