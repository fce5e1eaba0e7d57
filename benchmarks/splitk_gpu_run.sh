#!/usr/bin/env bash
# The CUDA split-KV kernel (route cuda-splitk, issue 11) on the GPU machine, in phases that
# each fit one device call (10 min). Run from the project root; logs go to OUT.
#
#   bash benchmarks/splitk_gpu_run.sh check OUT   # correctness: ladder, memcheck, GPU tests
#   bash benchmarks/splitk_gpu_run.sh bf16 OUT    # speed against every peer, bf16 cache
#   bash benchmarks/splitk_gpu_run.sh fp8 OUT     # speed against FlashMLA FP8
#   bash benchmarks/splitk_gpu_run.sh profile OUT # where the time goes (variants, ncu)
#   bash benchmarks/splitk_gpu_run.sh fused OUT   # the fused-merge build against the default
#
# `check` needs only torch and nvcc (FlashInfer stays off the path: the reliability tests
# would prebuild its modules). The bench phases need .whl/ (../shared/device/fetch-wheels.sh)
# and .peers/ (../shared/device/fetch-peers.sh) carried to the machine.
set -u
phase="${1:?phase: check, bf16, fp8, profile or fused}"
out="${2:?output directory}"
mkdir -p "$out"
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
nvidia-smi -L > "$out/gpu.txt" 2>&1
case "$phase" in
  check)
    timeout 150 python3 benchmarks/splitk_ladder.py --all 2>&1 | tee "$out/ladder.log"
    timeout 200 compute-sanitizer --tool memcheck python3 benchmarks/splitk_ladder.py --quick \
      > "$out/memcheck.log" 2>&1
    echo "memcheck exit $?" >> "$out/memcheck.log"
    tail -3 "$out/memcheck.log"
    timeout 220 python3 -m pytest -q -rs -p no:cacheprovider -s tests/gpu/test_splitk_gpu.py \
      tests/gpu/test_decode_routes_gpu.py tests/gpu/test_cuda_graph_gpu.py -k splitk \
      > "$out/pytest.log" 2>&1
    grep -E "passed|failed|error" "$out/pytest.log" | tail -5
    ;;
  profile)
    timeout 300 python3 benchmarks/splitk_profile.py 2>&1 | tee "$out/profile.log"
    # stall reasons of one decode + combine (shape 3: h16 b128 8k ragged)
    timeout 100 ncu --clock-control none -k regex:splitk_mla --launch-skip 2 --launch-count 2 \
      --section SpeedOfLight --section Occupancy --section LaunchStats \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed" \
      python3 benchmarks/splitk_profile.py --eager 3 > "$out/ncu.txt" 2>&1
    ;;
  bf16 | fp8)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="$PWD/.peers:/tmp/site:$PYTHONPATH"
    if [ "$phase" = bf16 ]; then
      args=(--shapes 2,4,6,13,14,26 --random 1 --random-count 16 --kv bf16
            --splitk-configs "0,0,4;4,1,4;0,0,16")
    else
      args=(--shapes 28,29,30,36,41,42,43 --random 1 --random-count 16 --kv fp8
            --splitk-configs "0,0,4;8,1,4;0,0,16")
    fi
    timeout 560 python3 benchmarks/bench_decode.py --out "$out/$phase" --extra-routes cuda-splitk \
      "${args[@]}" > "$out/bench-$phase.log" 2>&1
    grep -A80 "route:cuda-splitk" "$out/bench-$phase.log" | tail -60
    ;;
  fused)
    # SplitKConfig(fuse_max_splits=K): GPU tests, then the variants table of the default and
    # fused builds side by side, then every peer on seeded shapes with <= 16 rows/request.
    timeout 150 python3 -m pytest -q -rs -p no:cacheprovider -s tests/gpu/test_splitk_gpu.py \
      -k fused > "$out/pytest-fused.log" 2>&1
    grep -E "passed|failed|error" "$out/pytest-fused.log" | tail -3
    timeout 150 python3 benchmarks/splitk_profile.py --shapes 0,1,2,3,4 \
      --configs "0,0,4;0,0,4,4;0,0,4,8;0,0,4,16" 2>&1 | tee "$out/profile-fused.log"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="$PWD/.peers:/tmp/site:$PYTHONPATH"
    timeout 280 python3 benchmarks/bench_decode.py --out "$out/fused" --no-prewarm \
      --shapes 1,2,4,44,45,46 --kv bf16 --random 4 --random-count 60 \
      --random-max-request-rows 16 --splitk-configs "0,0,4;0,0,4,8" \
      > "$out/bench-fused.log" 2>&1
    grep -A40 "splitk\[s0c0m4\]" "$out/bench-fused.log" | tail -60
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
