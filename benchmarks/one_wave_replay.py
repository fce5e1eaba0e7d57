"""The one-wave plans past the band (``fa3_splits.one_wave_past_band``), scored without a GPU.

``python benchmarks/one_wave_replay.py [--shapes] [--as-run] --run SHAPES.jsonl FILE.csv
[FILE.csv ...] [--run ...]`` reads bench_decode.py output timed with ``--extra-routes
vllm-fa3-mla:balanced`` (the route's plan forced on every step FA3's formula spills past one
wave) and keeps the bf16 shapes the CUDA-graph decoder runs on ``vllm-fa3-mla`` whose FA3
plan spills past the band while the forced plan runs in one wave (the kind
``one_wave_shapes.py`` draws). For each, FA3's own plan over the forced one
(``vllm-fa3-mla-own`` / ``route:vllm-fa3-mla:balanced``: > 1, the one wave faster), the
spread (longest over mean KV tiles), the longest request's KV tiles and whether this
checkout's rule takes it; then per spread band, the shapes the rule takes and those it
declines: count, geometric mean, worst and how many under 1.0; and the CUDA-graph decoder
against the faster of vLLM's two calls (``peer:`` rows) as timed, beside FA3's own plan in
its place. ``--shapes`` also prints every shape. Lengths come from each run's
``shapes.jsonl`` (bench_decode.py writes it).

``--as-run``, for runs made on this checkout's rule: the shapes it takes are scored on the
route's own row (``vllm-fa3-mla``, the rule's plan as the route ran it), which also covers
those whose forced plan, the best of any wave count, is not the one-wave plan the rule
makes past the band.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from bench_decode import parse_shape_name
from evaluate_policy import decoder_row, read_shapes_log, timed_rows, vllm_peer_times
from one_wave_shapes import one_wave_plan
from spill_band_replay import VARIANT

from trtllm_mla_plugin.ops.policy import FA3_KV_TILE

OWN = "vllm-fa3-mla-own"
ROUTE = "vllm-fa3-mla"
#: Spread bands of the summary: longest over mean KV tiles.
SPREAD_BANDS = ((1.0, 1.25), (1.25, 1.5), (1.5, 1.75), (1.75, 2.0), (2.0, math.inf))


def one_wave_timings(shapes_path: Path, csv_paths: Sequence[Path],
                     as_run: bool = False) -> list[dict]:
    """The one-wave shapes of one run: ``shape``, ``ratio`` (FA3's own plan's time over the
    forced plan's, or with ``as_run`` over the route's where this checkout's rule takes the
    shape), ``spread``, ``longest`` (KV tiles), ``taken`` (by this checkout's rule), and
    where the file has the decoder's and vLLM's rows, ``decoder`` (the faster of vLLM's
    calls over the decoder as timed) and ``decoder_own`` (over FA3's own plan)."""
    lens = read_shapes_log(str(shapes_path))
    found = []
    for path in csv_paths:
        for shape, ks in timed_rows(str(path)).items():
            if OWN not in ks or VARIANT not in ks or shape not in lens:
                continue
            parsed = parse_shape_name(shape)
            taken, one_wave, spread = one_wave_plan(parsed, lens[shape])
            timed = ROUTE if as_run and taken else VARIANT
            # The forced row timed the one-wave plan only where the best plan is one wave.
            if (timed == VARIANT and not one_wave) or timed not in ks:
                continue
            vllm = min(vllm_peer_times(ks).values(), default=math.nan)
            row = decoder_row(ks)
            graph = float(ks[row]["us"]) if row is not None else math.nan
            found.append(dict(shape=shape, spread=spread,
                              longest=-(-max(lens[shape]) // FA3_KV_TILE),
                              taken=taken,
                              ratio=float(ks[OWN]["us"]) / float(ks[timed]["us"]),
                              decoder=vllm / graph, decoder_own=vllm / float(ks[OWN]["us"])))
    return found


def band_summary(timings: Sequence[dict]) -> list[tuple[str, float, float, int, float, float, int]]:
    """Per spread band and ``taken`` / ``declined``: (label, band low, band high, count,
    geometric mean of ``ratio``, worst ratio, count under 1.0), bands with no shape left
    out."""
    out = []
    for lo, hi in SPREAD_BANDS:
        for label, taken in (("taken", True), ("declined", False)):
            ratios = [t["ratio"] for t in timings
                      if t["taken"] == taken and lo <= t["spread"] < hi]
            if ratios:
                out.append((label, lo, hi, len(ratios), statistics.geometric_mean(ratios),
                            min(ratios), sum(r < 1.0 for r in ratios)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", nargs="+", action="append", required=True,
                    metavar="SHAPES.jsonl FILE.csv", help="one run's shapes.jsonl and CSVs")
    ap.add_argument("--shapes", action="store_true", help="print every shape")
    ap.add_argument("--as-run", action="store_true",
                    help="runs made on this checkout's rule: score taken shapes on the route")
    args = ap.parse_args()
    timings = []
    for shapes_path, *csvs in args.run:
        timings += one_wave_timings(Path(shapes_path), [Path(c) for c in csvs], args.as_run)
    if args.shapes:
        print("own/one  spread  longest  rule      shape")
        for t in sorted(timings, key=lambda t: t["ratio"]):
            print(f"{t['ratio']:7.3f}  {t['spread']:6.2f}  {t['longest']:7d}  "
                  f"{'takes' if t['taken'] else '-':8s}  {t['shape']}")
    print("rule      spread     shapes  own/one geomean  worst  under 1.0")
    for label, lo, hi, n, geomean, worst, under in band_summary(timings):
        print(f"{label:8s}  {lo:.2f}-{hi:.2f}  {n:6d}  {geomean:15.3f}  {worst:5.3f}  {under:9d}")
    taken = [t for t in timings if t["taken"]]
    print(f"{len(timings)} one-wave shapes, {len(taken)} taken by this checkout's rule")
    for label, group in (("taken", taken), ("declined", [t for t in timings if not t["taken"]])):
        mine = [t for t in group if not math.isnan(t["decoder"])]
        if mine:
            print(f"{label}: the decoder vs the faster of vLLM's calls, {len(mine)} shapes: "
                  f"FA3's own plan {geomean_worst([t['decoder_own'] for t in mine])}, "
                  f"as timed {geomean_worst([t['decoder'] for t in mine])}")


def geomean_worst(ratios: Sequence[float]) -> str:
    """``ratios``' geometric mean and minimum, as text."""
    return f"{statistics.geometric_mean(ratios):.3f} (worst {min(ratios):.3f})"


if __name__ == "__main__":
    main()
