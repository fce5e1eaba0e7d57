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
