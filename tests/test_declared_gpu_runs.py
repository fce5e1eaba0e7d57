"""``benchmarks/declared_gpu_runs.sh`` picks GPU tests by name (``pytest -k``). A renamed
test would drop out of its phase without a word on the GPU machine, where a phase that
selects nothing costs device time and proves nothing; here, on the CPU, every name a phase
selects or leaves out must still name a collected test."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "declared_gpu_runs.sh"
#: A ``-k`` argument, quoted or one word, or the argument of the script's ``engine_cases``.
K_EXPRESSION = re.compile(r'(?:-k|engine_cases)\s+(?:"([^"$]+)"|([\w\[\]]+))')
K_OPERATORS = {"and", "or", "not"}


def _gpu_test_ids() -> list[str]:
    """Node ids of every test under ``tests/gpu`` (collected only; they skip without CUDA)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "tests/gpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    assert ids, done.stdout + done.stderr
    return ids


def test_every_name_a_phase_selects_by_still_names_a_gpu_test():
    expressions = [quoted or word for quoted, word in K_EXPRESSION.findall(SCRIPT.read_text())]
    names = {name for expression in expressions for name in expression.split()
             if name not in K_OPERATORS}
    # The phases of today's script: the kernel tests', the plans', the engine's.
    assert {"splitk", "own_band_bound", "rows_bound_replays", "fa3", "tensor_parallel",
            "without[2]", "ngram", "openai_server"} <= names
    ids = [node.lower() for node in _gpu_test_ids()]
    unmatched = sorted(name for name in names if not any(name.lower() in node for node in ids))
    assert not unmatched, f"declared_gpu_runs.sh selects by names no GPU test has: {unmatched}"
