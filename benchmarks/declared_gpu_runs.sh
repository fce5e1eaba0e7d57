#!/usr/bin/env bash
# The GPU runs declared in docs/bench-2026-12-05/run228-criteria.txt (addenda 9-20) and the
# engine cases left on today's code, one phase per device call (each under its 10-minute
# limit); which have run, and which are next, is in docs/gpu-validation.md. Run from the
# repository root on the GPU machine after the kit's calls (../shared/device/
# fetch-vllm-kit.sh: its header says how); logs go to OUT (the device's $OUT).
#
#   bash benchmarks/declared_gpu_runs.sh tests OUT  # split-KV tests and the FA3 GPU plan's
#   bash benchmarks/declared_gpu_runs.sh r259 OUT   # decoder on vLLM's query parts vs kernel
#   bash benchmarks/declared_gpu_runs.sh r260 OUT   # the FA3 route's GPU plan: host/GPU time
#   bash benchmarks/declared_gpu_runs.sh r257 OUT   # H200: one CTA per SM against two
#   bash benchmarks/declared_gpu_runs.sh engine-fa3 OUT  # the engine's FA3 cases, GPU plan
#   bash benchmarks/declared_gpu_runs.sh pair48 OUT # band engine pair, b48, 61 layers,
#                                                   # the FA3 route's plan on the GPU
#   bash benchmarks/declared_gpu_runs.sh pair80 OUT # the same at b80
#   bash benchmarks/declared_gpu_runs.sh pair64 OUT # H200 (addendum 20): the same at b64
#   bash benchmarks/declared_gpu_runs.sh pair48-h8 OUT  # addendum 23: the same at 8 heads,
#   bash benchmarks/declared_gpu_runs.sh pair64-h8 OUT  # b48 (either card) and b64 (H200)
#   bash benchmarks/declared_gpu_runs.sh band-kernel OUT  # 8-16-row shapes at 33-96
#                                                   # requests: the decoder and FA3 forced
#   bash benchmarks/declared_gpu_runs.sh pair40 OUT # H100 (addendum 14): the pair at b40
#   bash benchmarks/declared_gpu_runs.sh band-kernel-b49 OUT  # H100: 33-64 requests,
#                                                   # fresh seeds, bounds 0 and 49
#   bash benchmarks/declared_gpu_runs.sh band8-kernel OUT  # either card (addendum 23):
#                                                   # 8-row shapes of 33-64 requests, FA3
#                                                   # against the decoder, fresh seeds
#   bash benchmarks/declared_gpu_runs.sh b40-fa3 OUT  # H100 (addendum 15): the default
#   bash benchmarks/declared_gpu_runs.sh b48-fa3 OUT  # plugin against FLASH_ATTN_MLA, 61 layers
#   bash benchmarks/declared_gpu_runs.sh b32-fa3 OUT       # h16 b32 against FLASH_ATTN_MLA
#   bash benchmarks/declared_gpu_runs.sh b32-flashmla OUT  # the same against FLASHMLA
#   bash benchmarks/declared_gpu_runs.sh engine-rest OUT   # the engine cases runs 299-304
#                                                   # left; repeat the call until all report
#   bash benchmarks/declared_gpu_runs.sh engine-spec OUT  # the five engine cases run 331
#                                                   # did not reach (speculation, server)
#   bash benchmarks/declared_gpu_runs.sh engine-wide OUT  # H100 (addendum 25): the three
#                                                   # wide-batch engine cases
#   bash benchmarks/declared_gpu_runs.sh engine OUT  # all 20 one-GPU engine cases,
#                                                   # resumable as engine-rest
#   bash benchmarks/declared_gpu_runs.sh suite OUT  # the kernel suite's six files whole
#                                                   # and the graph-switch file (about 7 min
#                                                   # on an H100)
#   bash benchmarks/declared_gpu_runs.sh rows4096 OUT  # H100 (addendum 17): FA3 and
#                                                   # FlashMLA at 3073-4096 query rows,
#                                                   # then the GPU test of a rows bound
#   bash benchmarks/declared_gpu_runs.sh rows4096-engine OUT  # addenda 18 (H100) and 20
#                                                   # (H200): h128 b32 (4096 rows) in the
#                                                   # engine, the plugin against FlashMLA
#                                                   # forced and against FLASH_ATTN_MLA
#   bash benchmarks/declared_gpu_runs.sh memory OUT     # either card (addendum 19): h128
#                                                   # b32, each engine alone at 0.9: does
#                                                   # the plugin's fit where vLLM's do?
#
# Which phase decides what, and the readings fixed before any of them ran: the addenda.
# engine-fa3 and the pairs (addenda 13-14) turn the FA3 route's GPU plan on in every
# engine process they start (TRTLLM_MLA_FA3_DEVICE_PLAN=1). Addendum 13's phases are read
# on an H200, addendum 14's (pair40, band-kernel-b49), 15's (b40-fa3, b48-fa3) and 17's
# (rows4096) and 18's (rows4096-engine) on an H100; 19's (memory) on either; 20's (tests,
# pair64, rows4096-engine, engine) on an H200; 23's (band8-kernel, pair48-h8, and on an
# H200 pair64-h8) on either, each card for its own band entry.
# tests/test_declared_gpu_runs.py checks on the CPU that every test name a phase selects by
# (or leaves out) still names a GPU test.
set -u
phase="${1:?phase: tests, r259, r260, r257, engine-fa3, pair40, pair48, pair64, pair80, pair48-h8, pair64-h8, band-kernel, band-kernel-b49, band8-kernel, b40-fa3, b48-fa3, b32-fa3, b32-flashmla, engine-rest, engine-spec, engine-wide, engine, suite, rows4096, rows4096-engine, memory}"
out="${2:?output directory}"
mkdir -p "$out"
export PYTHONPATH="/tmp/kit/plugin:/tmp/kit/vllm:/tmp/kit/site:$PWD:${PYTHONPATH:-}"
export VLLM_USE_FLASHINFER_SAMPLER=0
gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
echo "$gpu" > "$out/gpu.txt"
decode_bench=(python3 benchmarks/bench_decode.py --graph-only --query-parts --kv bf16
              --no-grid --no-prewarm --random-count 400 --random-request-rows 8-16
              --random-batches 33-1024 --rounds 3)
engine_run=(python3 benchmarks/bench_engine.py --output-len 336 --short-len 16 --repeats 2
            --no-warmup-engine --kv auto)
engine_pair=("${engine_run[@]}" --heads 16 --paired --rounds 3)
# Engine results are kept on the machine (TRTLLM_MLA_ENGINE_CACHE), so a second call on the
# same warm machine goes on from where the first one's time limit cut it, without starting a
# finished engine again.
engine_cases() {
  TRTLLM_MLA_ENGINE_CACHE=/tmp/trtllm-mla-engines TRTLLM_MLA_TEST_OUT="$out/t" timeout 560 \
    python3 -m pytest -v -rfs -p no:cacheprovider tests/gpu/test_engine_gpu.py -k "$1" \
    > "$out/$phase.log" 2>&1
  grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" "$out/$phase.log" | tail -24
}
# The band phases' kernel timing: graph_routes_ab.py on fresh seeds ($1), the decoder and
# vllm-fa3-mla forced, three rounds, into $out/$4 and the phase's log.
band_timing() {
  timeout 400 python3 benchmarks/graph_routes_ab.py --out "$out/$4" --rounds 3 \
    --query-parts --seeds "$1" --count 1000 --request-rows "$2" \
    --batches "$3" --routes plugin,vllm-fa3-mla > "$out/$phase.log" 2>&1
}
# band-kernel's and band-kernel-b49's replay of band.csv at the bounds $1, the 8-row shapes
# and the 9-16-row ones apart, appended to the phase's log.
band_rows_replay() {
  for rows in 8-8 9-16; do
    echo "rows a request $rows:"
    python3 benchmarks/band16_bound_replay.py --bounds "$1" --with-8-rows --rows "$rows" \
      "$out/band.csv"
  done >> "$out/$phase.log" 2>&1
  tail -10 "$out/$phase.log"
}
case "$phase" in
  tests)  # addenda 10, 11 and 13
    timeout 330 python3 -m pytest -q -rfs -p no:cacheprovider tests/gpu/test_splitk_gpu.py \
      tests/gpu/test_decode_routes_gpu.py -k "splitk or one_row_group" \
      > "$out/pytest-splitk.log" 2>&1
    tail -8 "$out/pytest-splitk.log"
    timeout 240 python3 -m pytest -q -rfs -p no:cacheprovider tests/gpu/test_cuda_graph_gpu.py \
      tests/gpu/test_plan_host_gpu.py \
      -k "balanced or length_order or planner or plan_host or raised_splitk_bound or raised_for_this_gpu or own_band_bound or rows_bound_replays or batch_size_route" \
      > "$out/pytest-plan.log" 2>&1
    tail -8 "$out/pytest-plan.log"
    ;;
  r259)  # addendum 10: the card's default launch
    case "$gpu" in *H100*) launch="3,1,4" ;; *) launch="2,2,4" ;; esac
    timeout 560 "${decode_bench[@]}" --out "$out/d" --random 605 --splitk-configs "$launch" \
      > "$out/r259.log" 2>&1
    tail -30 "$out/r259.log"
    ;;
  r260)  # addendum 11
    timeout 400 python3 benchmarks/bench_plan_host.py --out "$out/p" \
      --batches 32,48,64,96,128 --routes vllm-fa3-mla,vllm-fa3-mla:gpu-plan,peer:vllm-fa3-mla \
      --reps 200 --rounds 4 > "$out/r260.log" 2>&1
    timeout 120 python3 tests/fa3_split_plan_cases.py --time 33,48,64,96,128,198 \
      >> "$out/r260.log" 2>&1
    tail -25 "$out/r260.log"
    ;;
  r257)  # addendum 9, on an H200
    timeout 560 "${decode_bench[@]}" --out "$out/d" --random 603,604 \
      --splitk-configs "2,2,4;3,1,4" --shape-list docs/bench-2026-12-05/run257-grid.txt \
      > "$out/r257.log" 2>&1
    tail -30 "$out/r257.log"
    ;;
  engine-fa3)  # addendum 13: run 235's FA3 cases with the FA3 route's plan on the GPU
    TRTLLM_MLA_FA3_DEVICE_PLAN=1 TRTLLM_MLA_TEST_OUT="$out/t" timeout 580 \
      python3 -m pytest -q -rfs -p no:cacheprovider tests/gpu/test_engine_gpu.py -k fa3 \
      > "$out/engine-fa3.log" 2>&1
    tail -8 "$out/engine-fa3.log"
    ;;
  pair40 | pair48 | pair64 | pair80 | pair48-h8 | pair64-h8)  # addenda 13, 14, 20, 23: runs
    # 247 and 251's command, the FA3 route's plan on the GPU; -h8: 8 heads (8 query rows a
    # request), the band's 8-row batches
    export TRTLLM_MLA_FA3_DEVICE_PLAN=1
    echo "TRTLLM_MLA_FA3_DEVICE_PLAN=1" > "$out/$phase.log"
    batch="${phase#pair}"
    heads=16
    if [[ "$batch" == *-h8 ]]; then batch="${batch%-h8}"; heads=8; fi
    # FA3 (planned on the GPU) over cuda-splitk, both forced: a card's band entry may already
    # give the plugin's own pick FA3 at the pair's batch (the H200's 65 at b48 and b64)
    timeout 580 "${engine_pair[@]}" --heads "$heads" --out "$out/e" --layers 61 --timeout 400 \
      --batches "$batch" --backends TRTLLM_MLA@vllm-fa3-mla,TRTLLM_MLA@cuda-splitk \
      >> "$out/$phase.log" 2>&1
    tail -20 "$out/$phase.log"
    ;;
  band-kernel)  # addendum 13: whether 8-row batches move with the 16-row band
    band_timing 612,613,614,615 8-16 33-96 band.csv
    band_rows_replay 0,65,97
    ;;
  band-kernel-b49)  # addendum 14, on an H100: the band's 8-row batches at bound 49
    band_timing 616,617,618,619 8-16 33-64 band.csv
    band_rows_replay 0,49
    ;;
  band8-kernel)  # addendum 23, either card: the 8-row batches a card's band bound would move
    # (33-48 requests on an H100, 33-64 on an H200), fresh seeds, the kernels alone
    band_timing 750,751,752,753,754,755 8-8 33-64 band8.csv
    for bound in 49 65; do  # the H100's span, then the H200's
      echo "8 rows a request, 33-$((bound - 1)) requests:"
      python3 benchmarks/band16_bound_replay.py --bounds "0,$bound" --with-8-rows --rows 8-8 \
        --batches "33-$((bound - 1))" "$out/band8.csv"
    done >> "$out/band8-kernel.log" 2>&1
    tail -10 "$out/band8-kernel.log"
    ;;
  b40-fa3 | b48-fa3)  # addendum 15: the H100's bound as shipped, no env var, over vLLM's default
    batch="${phase%-fa3}"
    timeout 580 "${engine_pair[@]}" --out "$out/e" --layers 61 --timeout 400 \
      --batches "${batch#b}" --backends TRTLLM_MLA,FLASH_ATTN_MLA > "$out/$phase.log" 2>&1
    tail -12 "$out/$phase.log"
    ;;
  b32-fa3 | b32-flashmla)  # gpu-validation's next order, item 3 (run 238's command)
    baseline=FLASH_ATTN_MLA
    [ "$phase" = b32-flashmla ] && baseline=FLASHMLA
    timeout 580 "${engine_pair[@]}" --out "$out/e" --layers 24 --timeout 240 --batches 32 \
      --backends "TRTLLM_MLA,$baseline" > "$out/$phase.log" 2>&1
    tail -12 "$out/$phase.log"
    ;;
  engine-rest)  # test_engine_gpu.py's cases not run on 1fbf7bb's bound (runs 299-304 ran the
    # wide batches, the two FA3 cases and MTP 1-2)
    engine_cases "not wide_batch and not fa3 and not tensor_parallel and not without[1] and not without[2]"
    ;;
  engine-spec)  # the cases last at the end of a cut call (run 331 on an H200 did not reach
    # them): MTP 2-3, n-gram, MTP against FLASHMLA's MTP, the server; a later `engine` call
    # on the same warm machine reuses their finished engines (the server starts again)
    engine_cases "without[2] or without[3] or ngram or flashmla_mtp or openai_server"
    ;;
  engine-wide)  # addendum 25, on an H100: the wide batches (128 requests finishing in
    # waves), whose 43-request wave at 8 heads BandBound(49) moves to FA3 planned on the GPU
    engine_cases "wide_batch"
    ;;
  engine)  # every one-GPU case of test_engine_gpu.py (all but tensor parallel)
    engine_cases "not tensor_parallel"
    ;;
  suite)  # the kernel suite whole (docs/benchmarks.md "Where things stand"), as last in run
    # 242; the phase tests runs only the parts the recent changes touched
    timeout 200 python3 -m pytest -q -rfs -p no:cacheprovider tests/gpu/test_decode_routes_gpu.py \
      tests/gpu/test_graph_switch_gpu.py > "$out/pytest-routes.log" 2>&1
    tail -4 "$out/pytest-routes.log"
    timeout 370 python3 -m pytest -q -rfs -p no:cacheprovider tests/gpu/test_cuda_graph_gpu.py \
      tests/gpu/test_reliability_gpu.py tests/gpu/test_flashmla_schedule_gpu.py \
      tests/gpu/test_splitk_gpu.py tests/gpu/test_plan_host_gpu.py > "$out/pytest-suite.log" 2>&1
    tail -4 "$out/pytest-suite.log"
    ;;
  rows4096-engine)  # addenda 18 (H100) and 20 (H200): the rows bound 4096 in the engine
    # Two plugin engines in one process ran out of memory at 0.45 each on an H100 (run 319:
    # vLLM's chunked-context prefill asked 4 GiB past the profiled budget); 0.35 ran (321).
    for pair in TRTLLM_MLA@flashmla:0.35 FLASH_ATTN_MLA:0.45; do
      baseline="${pair%:*}"
      timeout 280 "${engine_pair[@]}" --heads 128 --out "$out/e-${baseline#*@}" --layers 24 \
        --timeout 250 --batches 32 --gpu-memory "${pair#*:}" \
        --backends "TRTLLM_MLA,$baseline" >> "$out/$phase.log" 2>&1
    done
    grep -E "^\| 128" "$out/$phase.log"
    ;;
  memory)  # addendum 19, either card: each engine alone at vLLM's default utilization 0.9
    timeout 560 "${engine_run[@]}" --heads 128 --layers 24 --batches 32 --rounds 1 \
      --gpu-memory 0.9 --timeout 170 --backends TRTLLM_MLA,FLASH_ATTN_MLA,FLASHMLA \
      --out "$out/m" > "$out/$phase.log" 2>&1
    grep -E "round 0|GiB|^ +128" "$out/$phase.log"
    ;;
  rows4096)  # addendum 17, on an H100: batches of <= 32 requests at 3073-4096 query rows
    timeout 400 python3 benchmarks/graph_routes_ab.py --out "$out/rows4096.csv" --rounds 3 \
      --query-parts --seeds 728,729,730,731,732,733,734,735 --count 1000 \
      --request-rows 97-512 --batches 1-32 --rows 3073-4096 \
      --routes plugin,vllm-fa3-mla,flashmla > "$out/rows4096.log" 2>&1
    grep -E "^all shapes|query rows" "$out/rows4096.log"
    timeout 150 python3 -m pytest -q -rfs -p no:cacheprovider tests/gpu/test_cuda_graph_gpu.py \
      -k rows_bound > "$out/pytest-rows-bound.log" 2>&1
    tail -4 "$out/pytest-rows-bound.log"
    ;;
  *)
    echo "unknown phase $phase" >&2
    exit 2
    ;;
esac
