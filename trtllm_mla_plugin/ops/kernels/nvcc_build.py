"""Compile a CUDA source to a cubin for one GPU generation with ``nvcc``, once, cached on disk.

Why a cubin and not a torch extension: the plugin's CUDA kernels include no headers and
are launched through the driver API (``cuda_driver``), so a build is one ``nvcc -cubin``
call of a few seconds, with no C++ toolchain, ninja or torch headers involved.

A cubin's name carries a digest of the source text and the flags, then one of
``nvcc --version``; a finished build is moved into place atomically, so processes that
start together (tensor parallel ranks) may compile the same cubin at once without reading a
partial file. A cubin of the same source and flags built by any nvcc serves too: one
prebuilt where nvcc is (``python -m trtllm_mla_plugin --build-kernels``, e.g. in an image's
build stage) serves a machine without the CUDA toolkit.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from ...log import get_logger

logger = get_logger(__name__)

#: Flags every build gets (fast exp2/log2/reciprocal: the kernels' softmax tolerates them;
#: line info costs no speed and lets compute-sanitizer and ncu name source lines).
BASE_FLAGS = ("-O3", "-use_fast_math", "-std=c++17", "-lineinfo")


def find_nvcc() -> str | None:
    """Path of ``nvcc``: ``$CUDA_HOME/bin``, ``$CUDA_PATH/bin``, ``PATH``, then
    ``/usr/local/cuda/bin``; ``None`` when there is none (cheap: no subprocess)."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = "/usr/local/cuda/bin/nvcc"
    return default if os.access(default, os.X_OK) else None


def target_flags(capability: tuple[int, int]) -> tuple[str, ...]:
    """``-gencode`` for ``capability``: the arch-specific target (``sm_90a``) on SM90, whose
    own instructions need it; plain ``sm_XY`` elsewhere."""
    sm = f"{capability[0]}{capability[1]}"
    suffix = "a" if capability == (9, 0) else ""
    return (f"-gencode=arch=compute_{sm}{suffix},code=sm_{sm}{suffix}",)


def cache_dir() -> Path:
    """``$TRTLLM_MLA_CACHE_DIR``, else ``$XDG_CACHE_HOME/trtllm_mla_plugin``, else
    ``~/.cache/trtllm_mla_plugin``."""
    explicit = os.environ.get("TRTLLM_MLA_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "trtllm_mla_plugin"


@cache
def _nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                          check=True).stdout


def _digest(data: bytes, length: int) -> str:
    return hashlib.sha256(data).hexdigest()[:length]


def _cubin_prefix(source: Path, capability: tuple[int, int], defines: tuple[str, ...]) -> str:
    """File-name prefix of every build of ``source`` with these flags, whichever nvcc."""
    flags = repr((target_flags(capability), BASE_FLAGS, defines)).encode()
    return (f"{source.stem}-sm{capability[0]}{capability[1]}-"
            f"{_digest(source.read_bytes() + flags, 16)}")


def _own_cubin(out_dir: Path, prefix: str, nvcc: str) -> Path:
    """Where ``nvcc`` puts (or put) its build of ``prefix``."""
    return out_dir / f"{prefix}-{_digest(_nvcc_version(nvcc).encode(), 8)}.cubin"


def _find_cubin(out_dir: Path, prefix: str, nvcc: str | None) -> Path | None:
    if nvcc is not None and (own := _own_cubin(out_dir, prefix, nvcc)).exists():
        return own
    if not out_dir.is_dir():
        return None
    built = sorted(out_dir.glob(f"{prefix}-*.cubin"), key=lambda p: p.stat().st_mtime)
    return built[-1] if built else None


def cached_cubin(source: Path, capability: tuple[int, int],
                 defines: tuple[str, ...] = ()) -> Path | None:
    """A finished build of ``source`` for ``capability`` in ``cache_dir()``: this machine's
    nvcc's where there is one, else the newest by any nvcc (a prebuilt kernel); ``None``
    when there is none. Cheap (no subprocess without nvcc; one directory listing)."""
    return _find_cubin(cache_dir() / "cubin", _cubin_prefix(source, capability, defines),
                       find_nvcc())


def compile_command(nvcc: str, source: Path, output: Path, capability: tuple[int, int],
                    defines: tuple[str, ...] = ()) -> list[str]:
    return [nvcc, *target_flags(capability), *BASE_FLAGS, *(f"-D{d}" for d in defines),
            "-cubin", "-o", str(output), str(source)]


def build_cubin(source: Path, capability: tuple[int, int],
                defines: tuple[str, ...] = ()) -> Path:
    """The cubin of ``source`` for ``capability`` (preprocessor ``defines``, e.g. a
    benchmark's diagnostic variant): ``cached_cubin``'s, else compiled now.

    Raises ``RuntimeError`` naming the fix when there is neither a cached build nor
    ``nvcc``, or the build fails.
    """
    out_dir = cache_dir() / "cubin"
    prefix = _cubin_prefix(source, capability, defines)
    nvcc = find_nvcc()
    found = _find_cubin(out_dir, prefix, nvcc)
    if found is not None:
        return found
    if nvcc is None:
        raise RuntimeError(
            f"{source.name} is compiled at first use and needs the CUDA toolkit's nvcc: "
            "install it (e.g. the CUDA toolkit matching your driver) and put it on PATH or "
            "set CUDA_HOME; or build it where nvcc is (python -m trtllm_mla_plugin "
            f"--build-kernels) and bring {cache_dir()} along (TRTLLM_MLA_CACHE_DIR)")
    target = _own_cubin(out_dir, prefix, nvcc)
    out_dir.mkdir(parents=True, exist_ok=True)
    logger.info("compiling %s for SM%d%d with %s (first use, a few seconds)", source.name,
                capability[0], capability[1], nvcc)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".cubin.tmp")
    os.close(fd)
    try:
        done = subprocess.run(compile_command(nvcc, source, Path(tmp), capability, defines),
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"nvcc failed to compile {source.name} for SM{capability[0]}"
                               f"{capability[1]}:\n{done.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
