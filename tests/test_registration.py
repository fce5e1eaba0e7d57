"""Registration through vLLM's own plugin loader and the installed entry point."""

from __future__ import annotations

import importlib.metadata
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
    """)
    assert proc.returncode == 0, proc.stderr
    assert f"PATH {BACKEND_PATH}" in proc.stdout
    assert f"CLASS {BACKEND_NAME}" in proc.stdout
    assert "COUNT 1" in proc.stdout


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


def test_unselected_cpu_mla_name_resolves_to_vllms_own_class():
    proc = run_python("""
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
        print("SAME", E.CPU_MLA.get_class() is CPUMLABackend)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "SAME True" in proc.stdout


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
