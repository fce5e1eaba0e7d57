"""Plot ``decode.csv`` of bench_decode.py: fraction of the copy ceiling per shape, one line
per kernel (pass 1). Usage: ``python benchmarks/plot_decode.py decode.csv out.png``."""

from __future__ import annotations

import csv
import sys
from collections import defaultdict


def main(src: str, dst: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(src, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["pass_no"] == "1" and r["us"]]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    series: dict[str, dict[str, float]] = defaultdict(dict)
    for r in rows:
        name = "plugin" if r["kernel"].startswith("plugin") else r["kernel"]
        series[name][r["shape"]] = float(r["pct_copy"])
    fig, ax = plt.subplots(figsize=(14, 6))
    for name, values in sorted(series.items()):
        xs = [i for i, s in enumerate(shapes) if s in values]
        sparse = len(xs) < len(shapes) // 2  # few shapes: markers only, no joining lines
        ax.plot(xs, [values[shapes[i]] for i in xs], marker="o", label=name,
                linestyle="none" if sparse else "-", linewidth=2.5 if name == "plugin" else 1)
    ax.set_xticks(range(len(shapes)), shapes, rotation=75, fontsize=7)
    ax.set_ylabel("% of copy ceiling (KV once + q + out)")
    ax.axhline(90, color="gray", linestyle=":")
    ax.legend(fontsize=8)
    ax.set_title("MLA decode on NVIDIA H200 (bench_decode.py)")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
