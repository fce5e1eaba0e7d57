"""Paired engine rounds of bench_engine.py (``--paired``) as ratios with an interval.

``python benchmarks/summarize_engine.py [--core | --core-median | --core-fast]
[--over TRTLLM_MLA@ROUTE] [--plot out.png] engine.csv [more.csv ...]``
prints,
per (heads, KV dtype, batch) and per pair of backends, the decode tokens/s of TRTLLM_MLA over
the other backend's in every round, their geometric mean, and an estimate balanced over
creation order with its 95% interval (``--plot``: those estimates and intervals against 1,
one marker per round; needs matplotlib; ``--core``: the decode steps timed by vLLM's engine
core, ``bench_engine.py --core-steps``; ``--core-median``: the median of those steps one by
one; ``--core-fast``: each engine's fastest decile of steps, the lowest 10th percentile of
its repeats; ``--over``: of two forced routes of the plugin paired, the one whose decode
tokens/s is divided by the other's). ``bench_engine.py --paired`` prints the table at its
end, the first of its ``--backends`` over the other.

Why the fastest decile: one engine's repeats of the same decode loop shift as a whole, the
10th percentile with the median (run 98: p10 3.34 / 2.48 / 2.43 ms over three repeats,
medians 3.51 / 3.22 / 2.64), for both backends alike, and the per-round ratio of medians
scattered 0.78-1.27 where that of the fastest deciles stayed within 0.96-1.05.

Why balanced: in a paired round one process creates both engines, and the engine created
first decoded 2-3% faster than the one created second (runs 40-41, 14 FP8 rounds at b256),
whichever backend it was. ``bench_engine`` alternates the creation order per round; with an
odd number of rounds (or a round cut off) the plain geometric mean leans toward the backend
created first more often. The balanced estimate is the mean of the two orders' mean log
ratios, so the order effect cancels whatever the counts; its interval uses Student's t with
``n - 2`` degrees of freedom. Within a (file, round, batch) group the CSV lists the engines in
creation order (``bench_engine.worker``).
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
from dataclasses import dataclass

from bench_engine import split_backend  # this folder is on sys.path when a file of it runs

PLUGIN = "TRTLLM_MLA"
#: Student's t, two-sided 95% (0.975 quantile), by degrees of freedom; 1.96 beyond.
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131,
        16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 25: 2.060, 30: 2.042}


def t975(df: int) -> float:
    if df in T975:
        return T975[df]
    below = [d for d in T975 if d < df]
    return T975[max(below)] if df <= 30 else 1.96


@dataclass(frozen=True)
class PairedPoint:
    """One (heads, kv, batch, other backend): TRTLLM_MLA's decode tokens/s over the other's.

    Attributes:
        ratios: per round, in file order.
        plugin_first: per round, whether TRTLLM_MLA's engine was created first.
        geomean: plain geometric mean of ``ratios``.
        balanced: ``exp`` of the mean of the two creation orders' mean log ratios
            (``None`` unless both orders have a round).
        low, high: 95% interval of ``balanced`` (``None`` below two rounds per order).
        created_first: how much faster the engine created first decoded, as a factor
            (``None`` as ``balanced``).
    """

    heads: str
    kv: str
    batch: int
    other: str
    ratios: tuple[float, ...]
    plugin_first: tuple[bool, ...]
    geomean: float
    balanced: float | None
    low: float | None
    high: float | None
    created_first: float | None


def paired_points(files: list[list[dict]], column: str = "decode_tokens_per_s",
                  over: str | None = None) -> list[PairedPoint]:
    """``files``: the rows of each engine.csv (as ``csv.DictReader`` gives them);
    ``column``: the throughput compared (``core_decode_tokens_per_s``: by the engine
    core's timestamps); ``over``: the side compared where a round pairs two of the plugin's
    forced routes (``plugin_index``)."""
    groups: dict[tuple, list[dict]] = {}
    for i, rows in enumerate(files):
        for r in rows:
            if r.get("status", "ok") == "ok" and r.get(column):
                groups.setdefault((i, r["round"], r["heads"], r["kv"], int(r["batch"])),
                                  []).append(r)
    per_point: dict[tuple, list[tuple[float, bool]]] = {}
    for (_, _, heads, kv, batch), rows in groups.items():
        names = [r["backend"] for r in rows]
        mine = plugin_index(names, over) if len(rows) == 2 and names[0] != names[1] else None
        if mine is None:
            continue
        plugin, other = rows[mine], rows[1 - mine]
        against = other["backend"]
        if plugin["backend"] != PLUGIN:
            against += f" ({plugin['backend']} over it)"
        ratio = float(plugin[column]) / float(other[column])
        per_point.setdefault((heads, kv, batch, against), []).append((ratio, mine == 0))
    return [_point(key, values) for key, values in per_point.items()]


def plugin_index(names: list[str], over: str | None = None) -> int | None:
    """Which of a round's two backends is the plugin: ``TRTLLM_MLA`` or
    ``TRTLLM_MLA@ROUTE`` (a route forced); of two plugin engines, the one with a route
    forced (compared with the plugin's own choice), and of two forced routes the one named
    ``over`` (``bench_engine`` passes the first of its ``--backends``); ``None`` if neither
    or undecided."""
    mine = [i for i, n in enumerate(names) if split_backend(n)[0] == PLUGIN]
    if len(mine) == 2:
        forced = [i for i in mine if split_backend(names[i])[1]]
        mine = forced if len(forced) == 1 else [i for i in mine if names[i] == over]
    return mine[0] if len(mine) == 1 else None


def _point(key: tuple, values: list[tuple[float, bool]]) -> PairedPoint:
    logs = [math.log(r) for r, _ in values]
    first = [math.log(r) for r, f in values if f]
    second = [math.log(r) for r, f in values if not f]
    balanced = low = high = created_first = None
    if first and second:
        mid = (statistics.fmean(first) + statistics.fmean(second)) / 2
        balanced = math.exp(mid)
        created_first = math.exp((statistics.fmean(first) - statistics.fmean(second)) / 2)
        if len(first) > 1 and len(second) > 1:
            se = 0.5 * math.sqrt(statistics.variance(first) / len(first)
                                 + statistics.variance(second) / len(second))
            half = t975(len(values) - 2) * se
            low, high = math.exp(mid - half), math.exp(mid + half)
    return PairedPoint(*key, tuple(r for r, _ in values), tuple(f for _, f in values),
                       math.exp(statistics.fmean(logs)), balanced, low, high, created_first)


FAST_COLUMN = "core_fast_decode_tokens_per_s"


def with_fastest_decile(rows: list[dict]) -> list[dict]:
    """``rows`` with ``FAST_COLUMN``: decode tokens/s at the lowest 10th percentile of step
    time over the row's repeats (``core_step_quantiles_each_ms``, ``p10/p50/p90`` per repeat
    joined by ``;``); rows without that column are left without it."""
    out = []
    for r in rows:
        quantiles = r.get("core_step_quantiles_each_ms")
        if quantiles:
            fastest_ms = min(float(q.split("/")[0]) for q in quantiles.split(";"))
            r = {**r, FAST_COLUMN: f"{int(r['batch']) * 1e3 / fastest_ms:.0f}"}
        out.append(r)
    return out


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def print_table(points: list[PairedPoint]) -> None:
    """Markdown table of ``points`` (for docs/benchmarks.md)."""
    print("| heads | KV | batch | against | rounds | TRTLLM_MLA / other, per round | geomean "
          "| balanced (95%) | created first |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p in sorted(points, key=lambda p: (p.heads, p.kv, p.other, p.batch)):
        per_round = ", ".join(f"{r:.3f}{'*' if f else ''}"
                              for r, f in zip(p.ratios, p.plugin_first, strict=True))
        interval = f"{fmt(p.balanced)} ({fmt(p.low)}-{fmt(p.high)})"
        print(f"| {p.heads} | {p.kv} | {p.batch} | {p.other} | {len(p.ratios)} | {per_round} "
              f"| {p.geomean:.3f} | {interval} | {fmt(p.created_first)} |")
    print("\n(* TRTLLM_MLA's engine created first in that round)")


def plot(points: list[PairedPoint], dst: str) -> None:
    """One row per point: every round's ratio, the balanced estimate and its interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted(points, key=lambda p: (p.kv, p.other, p.batch))
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(points) + 1.8))
    for y, p in enumerate(points):
        ax.scatter(p.ratios, [y] * len(p.ratios), s=14, color="0.6", zorder=2)
        if p.balanced is not None:
            lo, hi = p.low or p.balanced, p.high or p.balanced
            ax.errorbar([p.balanced], [y], xerr=[[p.balanced - lo], [hi - p.balanced]],
                        fmt="D", color="C0", capsize=4, zorder=3)
    ax.axvline(1.0, color="k", linewidth=0.8)
    ax.set_yticks(range(len(points)))
    ax.set_yticklabels([f"h{p.heads} {'bf16' if p.kv == 'auto' else p.kv} b{p.batch} "
                        f"vs {p.other} ({len(p.ratios)} rounds)" for p in points])
    ax.set_xlabel("TRTLLM_MLA decode tokens/s / other backend's (> 1: plugin faster)")
    ax.set_title("Paired engine rounds: grey per round, blue balanced over creation order (95%)")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


def main(*argv: str) -> None:
    ap = argparse.ArgumentParser(description="Paired engine rounds as ratios (module doc).")
    ap.add_argument("files", nargs="+", metavar="engine.csv")
    for flag, name in (("--core", "core_decode_tokens_per_s"),
                       ("--core-median", "core_median_decode_tokens_per_s"),
                       ("--core-fast", FAST_COLUMN)):
        ap.add_argument(flag, dest="column", action="store_const", const=name)
    ap.add_argument("--over", metavar="TRTLLM_MLA@ROUTE")
    ap.add_argument("--plot", metavar="out.png")
    args = ap.parse_args(argv)
    column = args.column or "decode_tokens_per_s"
    files = []
    for path in args.files:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        files.append(with_fastest_decile(rows) if column == FAST_COLUMN else rows)
    points = paired_points(files, column, args.over)
    print_table(points)
    if args.plot is not None:
        plot(points, args.plot)


if __name__ == "__main__":
    main(*sys.argv[1:])
