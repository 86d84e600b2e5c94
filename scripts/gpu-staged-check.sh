#!/usr/bin/env bash
# scripts/gpu-staged-check.sh: the two options staged off by default until measured on the H200
# (issue 12), in ONE command on the GPU machine:
#   FP4MOE_CUDA_SIDE_STREAM=1    the shared expert of decode steps on a second stream (be_ops side_begin)
#   FP4MOE_CUDA_WEIGHT_LAYOUT=tiled  the NVFP4 linears re-laid at load for the kernels' loads
#                                (bench/gpu_qmv_tiled measured the decode qmv 0.89-0.92x on it)
#   1. the GPU tests: test_model_gpu with each option off and on (its side_stream and tiled_layout
#      cases compare bits against the default), test_ops_gpu (tiled_layout: every route, bitwise),
#      test_gather_qmm_gpu, test_ep_gpu with the tiled layout (expert views);
#   2. the deliberate faults, each must FAIL: FP4MOE_INJECT_FAULT_SIDE_JOIN (test_model_gpu),
#      FP4MOE_INJECT_FAULT_TILED_SCALE (test_ops_gpu and test_model_gpu);
#   3. compute-sanitizer memcheck of a solo decode of the default model with both options on;
#   4. end to end on the synthetic Nemotron-3-Nano-30B-A3B shape, one binary, the settings
#      alternated (bench/gpu-compare.sh): 512 + 128 (4 rounds), 64 sequences and 2,048 + 32 (2
#      rounds each); greedy hashes must be equal across settings. A decode rate that falls to the
#      eager one means the graph capture refused the side stream's fork.
# A short table is printed last; logs in $OUT (default gpu-staged-out/).
# Usage: scripts/gpu-staged-check.sh BIN              on the GPU machine (BIN from --package)
#        scripts/gpu-staged-check.sh --package BIN    here: build build-gpum, pack the programs and the
#                                                     fault builds into BIN (carry BIN)
set -u
cd "$(dirname "$0")/.."
GP_NAME=batch
GP_BUILD=build-gpum
# GP_PROGS / GP_TARGETS: the batch package's defaults (scripts/gpu-pack.sh)
. scripts/gpu-pack.sh
if [ "${1:-}" = "--package" ]; then
    BINP=${2:?usage: --package BIN}
    TARGET=test_model_gpu PROG=test_model_gpu bench/build-variants.sh "$BINP/f_side" src/backend/cuda/backend_cuda.c \
        -DFP4MOE_INJECT_FAULT_SIDE_JOIN=1 || exit 1
    TARGET=test_ops_gpu PROG=test_ops_gpu bench/build-variants.sh "$BINP/f_tiled_ops" src/kernels/cuda/gather_qmv.cu \
        -DFP4MOE_INJECT_FAULT_TILED_SCALE=1 || exit 1
    TARGET=test_model_gpu PROG=test_model_gpu bench/build-variants.sh "$BINP/f_tiled_model" src/kernels/cuda/gather_qmv.cu \
        -DFP4MOE_INJECT_FAULT_TILED_SCALE=1 || exit 1
    gp_main --package "$BINP"
fi
OUT=${OUT:-gpu-staged-out}
mkdir -p "$OUT"
PKG=$1
gp_main "$PKG"
BIN=$GP_BIN
declare -a ROWS
row() { ROWS+=("$(printf '%-44s %-10s %5ss  %s' "$1" "$2" "$3" "${4:-}")"); }
verdict() { [ "$1" = 0 ] && echo PASS || echo "FAIL($1)"; }
fault_verdict() { [ "$1" = 77 ] && echo "SKIP(77)" || { [ "$1" != 0 ] && echo CAUGHT || echo MISSED; }; }

t() { # NAME LOG ENV... -- PROGRAM
    local name=$1 log=$2; shift 2
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    local t0=$SECONDS
    env ${envs[@]+"${envs[@]}"} timeout 300 "$@" >"$OUT/$log" 2>&1
    local rc=$?
    row "$name" "$(verdict $rc)" $((SECONDS - t0)) "$(grep -c '^\[       OK' "$OUT/$log") ok"
}
t "test_model_gpu" model.log -- "$BIN/test_model_gpu"
t "test_model_gpu, side stream on" model_side.log FP4MOE_CUDA_SIDE_STREAM=1 -- "$BIN/test_model_gpu"
t "test_model_gpu, tiled layout" model_tiled.log FP4MOE_CUDA_WEIGHT_LAYOUT=tiled -- "$BIN/test_model_gpu"
t "test_ops_gpu" ops.log -- "$BIN/test_ops_gpu"
t "test_gather_qmm_gpu" gather.log -- "$BIN/test_gather_qmm_gpu"
t "test_ep_gpu, tiled layout" ep_tiled.log FP4MOE_CUDA_WEIGHT_LAYOUT=tiled -- "$BIN/test_ep_gpu"
for f in f_side/0/test_model_gpu f_tiled_ops/0/test_ops_gpu f_tiled_model/0/test_model_gpu; do
    [ -f "$PKG/$f.xz" ] || continue
    n=$(echo "$f" | tr / _)
    xz -dc "$PKG/$f.xz" >"$BIN/$n" && chmod +x "$BIN/$n"
    t0=$SECONDS
    timeout 300 "$BIN/$n" >"$OUT/$n.log" 2>&1
    rc=$?
    row "fault ${f%%/*} ($(basename "$f"))" "$(fault_verdict $rc)" $((SECONDS - t0)) "$(grep -m1 'FAILED  \] [a-z]' "$OUT/$n.log")"
done
CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
if [ -n "$CS" ]; then
    t0=$SECONDS
    FP4MOE_CUDA_SIDE_STREAM=1 FP4MOE_CUDA_WEIGHT_LAYOUT=tiled timeout 200 "$CS" --tool memcheck --error-exitcode 9 \
        "$BIN/fp4moe" bench -m models/nemotron-h-tiny-moe --device cuda --prompt-tokens 40 --gen-tokens 8 --repeats 1 \
        --warmup 0 >"$OUT/memcheck.log" 2>&1
    rc=$?
    row "memcheck solo decode (both options on)" "$([ $rc = 0 ] && echo CLEAN || echo "FAIL($rc)")" $((SECONDS - t0)) \
        "$(grep -m1 'ERROR SUMMARY' "$OUT/memcheck.log")"
fi
wrap() { printf '#!/bin/sh\nexec env %s %s/fp4moe "$@"\n' "$2" "$BIN" >"$BIN/$1" && chmod +x "$BIN/$1"; }
wrap side FP4MOE_CUDA_SIDE_STREAM=1
wrap tiled FP4MOE_CUDA_WEIGHT_LAYOUT=tiled
wrap both "FP4MOE_CUDA_SIDE_STREAM=1 FP4MOE_CUDA_WEIGHT_LAYOUT=tiled"
A="--synthetic nemotron-3-nano-30b-a3b --device cuda"
B="base=$BIN/fp4moe side=$BIN/side tiled=$BIN/tiled both=$BIN/both"
# shellcheck disable=SC2086
OUT=$OUT/cmp1 timeout 300 bench/gpu-compare.sh "$BIN" 4 "$A --prompt-tokens 512 --gen-tokens 128 --repeats 3" $B >"$OUT/cmp1.txt" 2>&1
# shellcheck disable=SC2086
OUT=$OUT/cmp64 timeout 200 bench/gpu-compare.sh "$BIN" 2 "$A --batch 64 --prompt-tokens 256 --gen-tokens 64 --repeats 2" $B >"$OUT/cmp64.txt" 2>&1
# shellcheck disable=SC2086
OUT=$OUT/cmp2k timeout 120 bench/gpu-compare.sh "$BIN" 2 "$A --prompt-tokens 2048 --gen-tokens 32 --repeats 2" $B >"$OUT/cmp2k.txt" 2>&1
for f in cmp1 cmp64 cmp2k; do echo "== $f"; grep '^|' "$OUT/$f.txt"; grep -v '^|' "$OUT/$f.txt" | head -5; done
printf '%s\n' "${ROWS[@]}"
