"""Shared fixtures: the tiny local MLA model and a runner for the real vLLM engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ENGINE_TIMEOUT_S = 600

#: ``attention_classes`` entries (``trtllm_mla_plugin.testing.run_engine``): the backend and
#: impl classes an engine's MLA layers resolved.
_VLLM_MLA = "vllm.v1.attention.backends.mla"
CPU_MLA_CLASSES = f"{_VLLM_MLA}.cpu_mla.CPUMLABackend/{_VLLM_MLA}.cpu_mla.CPUMLAImpl"
AMX_MLA_CLASSES = f"{_VLLM_MLA}.amx_mla.AMXMLABackend/{_VLLM_MLA}.amx_mla.AMXMLAImpl"
TRTLLM_MLA_CLASSES = ("trtllm_mla_plugin.vllm_backend.backend.TrtllmMLABackend/"
                      "trtllm_mla_plugin.vllm_backend.impl.TrtllmMLAImpl")

#: Forces the decoder's short-prefill route (``vllm_backend.decode_spec``) in an engine.
SHORT_PREFILLS_ON_REFERENCE = {"TRTLLM_MLA_SHORT_PREFILL_ROUTE": "torch-reference"}


def short_prefills_ran(log: str) -> bool:
    """Whether the plugin's log shows a real step on the short-prefill path: one with more
    than two query tokens in some request (longer than the warm-up batch vLLM may run on
    the GPU; the builder logs each step that is the widest so far)."""
    import re

    found = re.findall(r"TRTLLM_MLA short prefills on decode route \S+: \d+ requests, \d+ "
                       r"query tokens, up to (\d+) per request", log)
    return any(int(n) > 2 for n in found)


def vllm_default_cpu_mla_classes() -> str:
    """What vLLM's CPU platform runs for an MLA model when no backend is selected: AMX_MLA
    on x86 CPUs with AMX tiles (bfloat16 weights only), else CPU_MLA (the condition of
    ``vllm/platforms/cpu.py`` ``get_attn_backend_cls``)."""
    import torch
    from vllm.platforms.cpu import CpuArchEnum, CpuPlatform

    amx = (CpuPlatform.get_cpu_architecture() == CpuArchEnum.X86
           and torch.cpu._is_amx_tile_supported())
    return AMX_MLA_CLASSES if amx else CPU_MLA_CLASSES


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    from trtllm_mla_plugin.testing.tiny_model import build_tiny_deepseek_v3

    return build_tiny_deepseek_v3(tmp_path_factory.mktemp("tiny-deepseek-v3"))


@dataclass
class EngineRun:
    returncode: int
    log: str
    result: dict | None


def run_engine(model: Path, tmp_path: Path, *args: str, env: dict[str, str] | None = None
               ) -> EngineRun:
    """Run ``trtllm_mla_plugin.testing.run_engine`` in a fresh process (vLLM on CPU)."""
    pytest.importorskip("vllm")
    out = tmp_path / f"result-{len(list(tmp_path.iterdir()))}.json"
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("VLLM_ATTENTION_BACKEND", "TRTLLM_MLA_DECODE_ROUTE")}
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-m", "trtllm_mla_plugin.testing.run_engine",
         "--model", str(model), "--out", str(out), *args],
        env=full_env, capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S,
    )
    result = json.loads(out.read_text()) if proc.returncode == 0 else None
    return EngineRun(proc.returncode, proc.stdout + proc.stderr, result)


@pytest.fixture
def engine(tiny_model, tmp_path):
    """``engine(*cli_args, env={...}) -> EngineRun`` on the tiny model."""

    def _run(*args: str, env: dict[str, str] | None = None) -> EngineRun:
        return run_engine(tiny_model, tmp_path, *args, env=env)

    return _run
