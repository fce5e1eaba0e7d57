"""Each kernel's decode time as a fixed cost plus bytes over a bandwidth, fitted by least
squares over bench_decode.py CSVs (random sets): where the time of typical shapes goes.

Usage::

    python benchmarks/fit_fixed_cost.py docs/bench-2026-11-30/run23-random-*.csv [--kv bf16]

Prints, per kernel and for all shapes / shapes of at most 32 query rows per request
(heads x q_len): the fixed cost (us), the bandwidth (TB/s) of the slope, and at the
median shape's bytes the fitted time against the time at the copy ceiling of the CSVs'
``ceilings.csv`` when given (``--copy-gbps``).
"""

from __future__ import annotations

import argparse
import csv
import statistics
from collections import defaultdict

import numpy as np


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(fixed us, TB/s) of ``us = fixed + MB / (TB/s)``; MB/us is TB/s."""
    mb = np.array([p[0] for p in points])
    us = np.array([p[1] for p in points])
    (fixed, us_per_mb), *_ = np.linalg.lstsq(np.vstack([np.ones_like(mb), mb]).T, us,
                                             rcond=None)
    return float(fixed), float(1.0 / us_per_mb)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csvs", nargs="+")
    ap.add_argument("--kv", default="bf16")
    ap.add_argument("--copy-gbps", type=float, default=None)
    args = ap.parse_args()
    by: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    for path in args.csvs:
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                kernel = r["kernel"]
                if (r["status"] == "ok" and r["kv"] == args.kv
                        and kernel.startswith(("peer:", "route:", "splitk["))):
                    rows = int(r["heads"]) * int(r["q_len"])
                    by[kernel].append((int(r["bytes"]) / 1e6, float(r["us"]), rows))
    print(f"| kernel | shapes | n | fixed us | TB/s | median MB | fitted us at median |"
          f"{' us at copy ceiling |' if args.copy_gbps else ''}")
    print("|---|---|---|---|---|---|---|" + ("---|" if args.copy_gbps else ""))
    for kernel, pts in sorted(by.items()):
        for label, sel in (("all", pts), ("<= 32 rows", [p for p in pts if p[2] <= 32])):
            fixed, tbps = fit([(p[0], p[1]) for p in sel])
            med = statistics.median(p[0] for p in sel)
            line = (f"| {kernel} | {label} | {len(sel)} | {fixed:.1f} | {tbps:.2f} | "
                    f"{med:.0f} | {fixed + med / tbps:.1f} |")
            if args.copy_gbps:
                line += f" {med * 1e6 / (args.copy_gbps * 1e9) * 1e6:.1f} |"
            print(line)


if __name__ == "__main__":
    main()
