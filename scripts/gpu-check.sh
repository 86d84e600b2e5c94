#!/usr/bin/env bash
# scripts/gpu-check.sh: the whole GPU round of issue 3 in ONE command, on a machine with an NVIDIA
# GPU (the H200 machine): the GPU tests, compute-sanitizer (memcheck + racecheck) on the small
# cases, the deliberate-fault check (each route's tests must FAIL in the global_scale and
# expert_offset fault builds) and the benchmark. Logs go to $OUT (default gpu-check-out/); a short
# table is printed last.
#
# Usage:
#   scripts/gpu-check.sh [BIN]        run; BIN holds prebuilt binaries (see --package), default:
#                                     build here with cmake (build-cuda, build-cuda-fault-*)
#   scripts/gpu-check.sh --package BIN
#                                     on the build machine (nvcc, no GPU needed): build the three
#                                     configurations and copy the programs (+ libcmocka, which the
#                                     GPU machine's image lacks) into BIN, ready to carry.
# Environment: GPU_CHECK_QUICK=1: quick test set and quick benchmark; GPU_CHECK_NCU=0: no ncu step;
#   GPU_CHECK_BUILD=DIR: build directory prefix (default build-cuda; DIR-fault-* for the fault builds);
#   GPU_CHECK_VARIANT="VAR=value ...": the environment of a kernel variant under test on a working
#   branch (production code keeps no variant switches; rounds 3-5 used FP4MOE_CUDA_BATCHED_V etc.,
#   docs/GPU-NOTES.md): the tests run with the default kernels (quick set) and with the variant
#   (full set); sanitizer and fault runs use the variant; the benchmark runs first.
set -u
cd "$(dirname "$0")/.."
FAULTS="global_scale expert_offset"
PROGS="test_gather_qmm_gpu gpu_bench"

build() { # build DIR [cmake args...]: configure + build the GPU programs
    local dir=$1; shift
    cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null &&
        cmake --build "$dir" -j "$(nproc)" --target $PROGS >/dev/null
}

build_all() { # BIN: three builds, programs copied into BIN
    local bin=$1 pre=${GPU_CHECK_BUILD:-build-cuda}
    mkdir -p "$bin"
    build $pre || return 1
    for p in $PROGS; do cp $pre/$p "$bin/"; done
    for f in $FAULTS; do
        build $pre-fault-$f -DFP4MOE_INJECT_FAULT=$f || return 1
        cp $pre-fault-$f/test_gather_qmm_gpu "$bin/test_gather_qmm_gpu.fault_$f"
    done
}

if [ "${1:-}" = "--package" ]; then
    bin=${2:?usage: scripts/gpu-check.sh --package BIN}
    build_all "$bin" || { echo "gpu-check: build failed" >&2; exit 1; }
    for lib in $(ldd "$bin/test_gather_qmm_gpu" | awk '/libcmocka/ {print $3}'); do cp -L "$lib" "$bin/"; done
    strip "$bin"/test_gather_qmm_gpu* "$bin"/gpu_bench
    ls -la "$bin"
    exit 0
fi

OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
BIN=${1:-}
if [ -z "$BIN" ]; then
    BIN=build-cuda/gpu-check-bin
    echo "gpu-check: building into build-cuda*" >&2
    build_all "$BIN" || { echo "gpu-check: build failed" >&2; exit 1; }
fi
QUICK=${GPU_CHECK_QUICK:-0}
export LD_LIBRARY_PATH="$(cd "$BIN" && pwd):/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
if ldd "$BIN/test_gather_qmm_gpu" | grep -q "libcublas.*not found"; then # cuBLAS from the pip wheel
    d=$(python3 -c 'import nvidia.cublas, os; print(os.path.dirname(nvidia.cublas.__file__) + "/lib")' 2>/dev/null)
    [ -n "$d" ] && export LD_LIBRARY_PATH="$d:$LD_LIBRARY_PATH"
fi
export PATH="$PATH:/usr/local/cuda/bin"

declare -a ROWS
row() { ROWS+=("$(printf '%-34s %-8s %6ss  %s' "$1" "$2" "$3" "${4:-}")"); }

# 0. the machine
{
    date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu \
        --format=csv; ldd "$BIN/test_gather_qmm_gpu"; git rev-parse --short HEAD 2>/dev/null
} >"$OUT/env.log" 2>&1

VARIANT=${GPU_CHECK_VARIANT:-}
# 1. the GPU tests (with a variant: the variant's full set first, then the default kernels' quick set)
t0=$SECONDS
if [ -n "$VARIANT" ]; then
    env $VARIANT FP4MOE_TEST_QUICK=$QUICK timeout 150 "$BIN/test_gather_qmm_gpu" >"$OUT/tests_variant.log" 2>&1
    rc=$?
    row "tests, variant: $VARIANT" "$([ $rc = 0 ] && echo PASS || echo "FAIL($rc)")" $((SECONDS - t0)) \
        "$(grep -c '^ok ' "$OUT/tests_variant.log") ok, $(grep -c '^FAIL' "$OUT/tests_variant.log") failed calls"
    t0=$SECONDS
    env FP4MOE_TEST_QUICK=1 timeout 100 "$BIN/test_gather_qmm_gpu" >"$OUT/tests.log" 2>&1
else
    env FP4MOE_TEST_QUICK=$QUICK timeout 240 "$BIN/test_gather_qmm_gpu" >"$OUT/tests.log" 2>&1
fi
rc=$?
row "tests (all routes/dtypes/shapes)" "$([ $rc = 0 ] && echo PASS || echo "FAIL($rc)")" $((SECONDS - t0)) \
    "$(grep -c '^ok ' "$OUT/tests.log") ok, $(grep -c '^FAIL' "$OUT/tests.log") failed calls"

# with a variant, the benchmark comes next (the sanitizer and fault runs after it)
if [ -n "$VARIANT" ]; then
    t0=$SECONDS
    timeout 100 "$BIN/gpu_bench" >"$OUT/bench.log" 2>&1
    rc=$?
    row "benchmark (variant)" "$([ $rc = 0 ] && echo DONE || echo "FAIL($rc)")" $((SECONDS - t0))
fi

# 2. compute-sanitizer on the small cases
: >"$OUT/sanitizer.log"
for tool in memcheck racecheck; do
    t0=$SECONDS
    echo "=== $tool" >>"$OUT/sanitizer.log"
    env $VARIANT FP4MOE_TEST_SANITIZE=1 timeout 60 compute-sanitizer --tool $tool --error-exitcode 99 \
        "$BIN/test_gather_qmm_gpu" >>"$OUT/sanitizer.log" 2>&1
    rc=$?
    row "compute-sanitizer $tool" "$([ $rc = 0 ] && echo CLEAN || echo "FAIL($rc)")" $((SECONDS - t0)) \
        "$(grep -m1 'ERROR SUMMARY\|RACECHECK SUMMARY' "$OUT/sanitizer.log" | tail -1)"
done

# 3. the deliberate faults: every route's tests must fail
: >"$OUT/fault.log"
for f in $FAULTS; do
    for route in qmv batched dequant_gemm; do
        t0=$SECONDS
        echo "=== fault $f, route $route" >>"$OUT/fault.log"
        env $VARIANT FP4MOE_TEST_ROUTE=$route FP4MOE_TEST_QUICK=1 timeout 40 "$BIN/test_gather_qmm_gpu.fault_$f" \
            >>"$OUT/fault.log" 2>&1
        rc=$?
        ok=$([ $rc != 0 ] && [ $rc != 77 ] && [ $rc != 124 ] && echo CAUGHT || echo "MISSED($rc)")
        row "fault $f / $route" "$ok" $((SECONDS - t0)) "$(grep -c '^FAIL' "$OUT/fault.log") FAIL lines so far"
    done
done

# 4. the benchmark (without a variant)
if [ -z "$VARIANT" ]; then
    t0=$SECONDS
    timeout 240 "$BIN/gpu_bench" $([ "$QUICK" = 1 ] && echo --quick) >"$OUT/bench.log" 2>&1
    rc=$?
    row "benchmark" "$([ $rc = 0 ] && echo DONE || echo "FAIL($rc)")" $((SECONDS - t0))
fi

# 5. Nsight Compute on one launch of the batched kernel (512 tokens, up) and of qmv (decode, up)
if [ "${GPU_CHECK_NCU:-1}" = 1 ] && command -v ncu >/dev/null; then
    t0=$SECONDS
    : >"$OUT/ncu.log"
    for ks in gq_batched_kernel:2 gq_qmv_kernel:20; do # batched: 512 tokens; qmv: a decode call
        k=${ks%:*}
        timeout 120 ncu --clock-control none --kernel-name regex:$k --launch-skip ${ks#*:} --launch-count 1 \
            --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
            --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis \
            --metrics smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio \
            "$BIN/gpu_bench" --quick >>"$OUT/ncu.log" 2>&1
    done
    row "ncu (batched, qmv)" "$(grep -c 'Duration' "$OUT/ncu.log") kern" $((SECONDS - t0))
fi

echo
grep '^|' "$OUT/bench.log"
grep -E '^(device|512 tokens|decode)' "$OUT/bench.log"
grep -h '^FAIL\|^\[  FAILED' "$OUT"/tests*.log 2>/dev/null | head -20
echo
printf '%s\n' "${ROWS[@]}" | tee "$OUT/summary.txt"
