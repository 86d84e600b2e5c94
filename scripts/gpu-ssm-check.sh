#!/usr/bin/env bash
# scripts/gpu-ssm-check.sh: the Mamba-2 prefill scan round in ONE command on a machine with an NVIDIA
# GPU (the H200 machine): the scan's GPU test (every kernel against an fp64 reference and against
# the old sequential kernel), compute-sanitizer memcheck + racecheck on it, the scan benchmark
# (bench/gpu_ssm.c: the seq vs the tiled kernel (cuda_ssm_scan_kernel) at T = 1, 512, 2048, 8192 for
# the Nemotron-3-Nano-30B-A3B shape), and the end-to-end split by layer kind (fp4moe bench
# --synthetic nemotron-3-nano-30b-a3b --profile) at 512 and 2048 tokens with the old and the new
# scan. Logs go to $OUT (default gpu-ssm-out/); a short table is printed last.
#
# Usage:
#   scripts/gpu-ssm-check.sh [BIN]        run; BIN holds the package (--package: ssm.tar.xz),
#                                         default BIN=build-ssd/ssm-bin when present, else build here
#   scripts/gpu-ssm-check.sh --package BIN
#                                         on the build machine (nvcc, no GPU needed): build build-ssd
#                                         and pack test_ssm_gpu, gpu_ssm, fp4moe and the shared
#                                         libraries they need beyond glibc/CUDA into BIN/ssm.tar.xz
#                                         (run's carry: ["build-ssd/ssm-bin"]).
# Environment: SSM_QUICK=1: benchmark at 512 tokens only, no sanitizer, no end-to-end runs;
#   GP_BUILD: the build directory (default build-ssd);
#   SSM_VARIANTS="name=FILE.xz ..": gpu_ssm builds of bench/build-variants.sh, run after the package's;
#   SSM_FAULTS="name=FILE.xz ..": test_ssm_gpu fault builds (-DFP4MOE_INJECT_FAULT_*), which must FAIL;
#   SSM_MODES="default serial ..": the end-to-end runs, FP4MOE_CUDA_SSM unset (default) or set to the mode.
set -u
cd "$(dirname "$0")/.."
GP_NAME=ssm
GP_BUILD=${GP_BUILD:-build-ssd}
GP_PROGS="test_ssm_gpu gpu_ssm fp4moe"
GP_TARGETS="test_ssm_gpu gpu_ssm fp4moe_cli"
. scripts/gpu-pack.sh
CFG=nemotron-3-nano-30b-a3b

[ "${1:-}" = "--package" ] || { OUT=${OUT:-gpu-ssm-out}; mkdir -p "$OUT"; }
gp_main "$@"
BIN=$GP_BIN
export PATH="$PATH:/usr/local/cuda/bin"
QUICK=${SSM_QUICK:-0}

declare -a ROWS
row() { ROWS+=("$(printf '%-34s %-10s %5ss  %s' "$1" "$2" "$3" "${4:-}")"); }
status() { [ "$1" = 0 ] && echo PASS || echo "FAIL($1)"; }

# 0. the machine
{
    date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem \
        --format=csv; for p in $GP_PROGS; do ldd "$BIN/$p"; done; git rev-parse --short HEAD 2>/dev/null
    git status --short 2>/dev/null | head -30
} >"$OUT/env.log" 2>&1

# 1. the GPU test
t0=$SECONDS
timeout 300 "$BIN/test_ssm_gpu" >"$OUT/test_ssm_gpu.log" 2>&1
rc=$?
row "test_ssm_gpu" "$(status $rc)" $((SECONDS - t0)) \
    "$(grep -c '^\[       OK' "$OUT/test_ssm_gpu.log") ok, $(grep -c '^\[  FAILED  \] [a-z]' "$OUT/test_ssm_gpu.log") failed"

# 2. compute-sanitizer (cp.async staging, shared-memory reuse between tiles)
if [ "$QUICK" != 1 ] && command -v compute-sanitizer >/dev/null; then
    for tool in memcheck racecheck; do
        t0=$SECONDS
        timeout 600 compute-sanitizer --tool $tool --error-exitcode 9 "$BIN/test_ssm_gpu" \
            >"$OUT/sanitizer_$tool.log" 2>&1
        rc=$?
        row "compute-sanitizer $tool" "$(status $rc)" $((SECONDS - t0)) \
            "$(grep -m1 -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log")"
    done
fi

# 2b. fault builds: each must fail
for fv in ${SSM_FAULTS:-}; do
    name=${fv%%=*}
    xz -dc "${fv#*=}" >"$BIN/test_ssm_gpu_$name" && chmod +x "$BIN/test_ssm_gpu_$name"
    t0=$SECONDS
    timeout 300 "$BIN/test_ssm_gpu_$name" >"$OUT/fault_$name.log" 2>&1
    rc=$?
    row "fault $name" "$([ $rc = 0 ] && echo NOT-CAUGHT || echo CAUGHT)" $((SECONDS - t0)) \
        "$(grep -c '^\[  FAILED  \] [a-z]' "$OUT/fault_$name.log") failed"
done

# 3. the scan benchmark
t0=$SECONDS
timeout 300 "$BIN/gpu_ssm" $([ "$QUICK" = 1 ] && echo --quick) >"$OUT/gpu_ssm.log" 2>&1
rc=$?
row "gpu_ssm (scan benchmark)" "$(status $rc)" $((SECONDS - t0))
for fv in ${SSM_VARIANTS:-}; do
    name=${fv%%=*}
    xz -dc "${fv#*=}" >"$BIN/gpu_ssm_$name" && chmod +x "$BIN/gpu_ssm_$name"
    t0=$SECONDS
    timeout 300 "$BIN/gpu_ssm_$name" $([ "$QUICK" = 1 ] && echo --quick) >"$OUT/gpu_ssm_$name.log" 2>&1
    rc=$?
    row "gpu_ssm variant $name" "$(status $rc)" $((SECONDS - t0))
done

# 4. end to end: the split by layer kind (the production scan: tiled for prefill, seq for decode)
if [ "$QUICK" != 1 ]; then
    for T in 512 2048; do
        for mode in ${SSM_MODES:-default}; do
            t0=$SECONDS
            if [ "$mode" = default ]; then unset FP4MOE_CUDA_SSM; else export FP4MOE_CUDA_SSM=$mode; fi
            timeout 120 "$BIN/fp4moe" bench --synthetic "$CFG" --device cuda \
                --prompt-tokens $T --gen-tokens 16 --repeats 3 --profile \
                >"$OUT/e2e_${T}_$mode.txt" 2>"$OUT/e2e_${T}_$mode.log"
            rc=$?
            row "e2e profile T=$T scan=$mode" "$(status $rc)" $((SECONDS - t0)) \
                "$(grep -i -m1 'mamba' "$OUT/e2e_${T}_$mode.txt" | tr -s ' ' | cut -c1-60)"
        done
    done
fi

# 5. the table
unset FP4MOE_CUDA_SSM
echo
cat "$OUT/gpu_ssm.log"
for fv in ${SSM_VARIANTS:-}; do
    echo; echo "variant ${fv%%=*}:"; grep -E '^[0-9]+ ' "$OUT/gpu_ssm_${fv%%=*}.log"
done
if [ "$QUICK" != 1 ]; then
    for T in 512 2048; do
        for mode in ${SSM_MODES:-default}; do
            echo
            echo "end to end, prefill $T, scan $mode:"
            grep -i -E 'prefill.*tok/s|tok/s.*prefill' "$OUT/e2e_${T}_$mode.txt" | head -2
            grep -A8 '^split' "$OUT/e2e_${T}_$mode.txt"
        done
    done
fi
echo
printf '%s\n' "${ROWS[@]}" | tee "$OUT/summary.txt"
