"""Plot ``engine.csv`` of bench_engine.py: output tokens/s per batch size, one line per
(backend, KV dtype), one panel per head count. Usage:
``python benchmarks/plot_engine.py engine.csv out.png``."""

from __future__ import annotations

import csv
import sys
from collections import defaultdict
from statistics import median


def main(src: str, dst: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(src, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["status"] == "ok"]
    heads = sorted({int(r["heads"]) for r in rows})
    fig, axes = plt.subplots(1, len(heads), figsize=(6 * len(heads), 4.5), squeeze=False)
    for ax, h in zip(axes[0], heads, strict=True):
        series: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for r in rows:
            if int(r["heads"]) == h:
                kv = "bf16" if r["kv"] == "auto" else r["kv"]
                rate = r.get("decode_tokens_per_s") or r["tokens_per_s"]
                series[f"{r['backend']} {kv}"].append((int(r["batch"]), float(rate)))
        for name, points in sorted(series.items()):
            by_batch: dict[int, list[float]] = defaultdict(list)
            for x, y in points:  # several rounds: plot the median
                by_batch[x].append(y)
            xs = sorted(by_batch)
            ys = [median(by_batch[x]) for x in xs]
            ax.plot(xs, ys, marker="o", label=name,
                    linestyle="--" if "fp8" in name else "-",
                    linewidth=2.5 if name.startswith("TRTLLM") else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (requests decoding together)")
        ax.set_ylabel("decode tokens/s" if rows and rows[0].get("decode_tokens_per_s")
                      else "output tokens/s")
        ax.set_title(f"{h} heads per rank")
        ax.legend(fontsize=8)
    fig.suptitle("vLLM 0.33 decode throughput on NVIDIA H200 (bench_engine.py)")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
