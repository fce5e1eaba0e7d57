"""The plugin's Triton kernels on a machine without a GPU, for the CPU tests: a script run
under Triton's CPU interpreter, and a kernel compiled for Hopper (front end, TTGIR, PTX and
ptxas; no GPU needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def interpreted(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python ARGS`` with ``TRITON_INTERPRET=1`` and the repository and tests/
    importable (the interpreter must be chosen before ``triton`` is imported, hence a
    process of its own)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def compile_for_hopper(kernel, signature: dict[str, str], constants: dict, **options):
    """``kernel`` (a ``triton.jit`` function) compiled for SM90 with ``signature`` (argument
    types; ``constants`` are added as constexprs) and compile ``options``; skips the test
    where this Triton build has no CUDA toolchain."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = dict(signature, **{name: "constexpr" for name in constants})
    try:
        return triton.compile(ASTSource(kernel, signature, constants),
                              target=GPUTarget("cuda", 90, 32), options=options)
    except RuntimeError as exc:  # no CUDA toolchain in this triton build
        if "ptxas" in str(exc) or "backend" in str(exc):
            pytest.skip(f"triton cannot target CUDA here: {exc}")
        raise
