#!/usr/bin/env bash
# scripts/gpu-side-check.sh: the shared expert on a second CUDA stream (FP4MOE_CUDA_SIDE_STREAM=1,
# be_ops side_begin, issue 12) in ONE command on the H200 machine:
#   1. test_model_gpu (its side_stream case: bits equal to one stream, graph and eager; and every
#      other case) with the option off (the default) and on;
#   2. the deliberate fault FP4MOE_INJECT_FAULT_SIDE_JOIN (no join: the next layer may read the
#      shared expert's output early): test_model_gpu built with it must FAIL;
#   3. compute-sanitizer memcheck of a solo decode of the default model with the option on;
#   4. end to end on the synthetic Nemotron-3-Nano-30B-A3B shape, the same binary with the option off
#      and on alternated (bench/gpu-compare.sh): 512 + 128 tokens (4 rounds), 8 and 64 sequences;
#      greedy hashes must be equal.
# A short table is printed last; logs in $OUT (default gpu-side-out/).
# Usage: scripts/gpu-side-check.sh BIN                on the GPU machine (BIN from --package)
#        scripts/gpu-side-check.sh --package BIN      here: build build-gpum, pack the programs and
#                                                     the fault build into BIN (carry BIN)
set -u
cd "$(dirname "$0")/.."
GP_NAME=batch
GP_BUILD=build-gpum
GP_PROGS="fp4moe test_model_gpu test_ssm_gpu test_gather_qmm_gpu test_attention_gpu test_ops_gpu test_ep_gpu"
GP_TARGETS="fp4moe_cli test_model_gpu test_ssm_gpu test_gather_qmm_gpu test_attention_gpu test_ops_gpu test_ep_gpu"
. scripts/gpu-pack.sh
if [ "${1:-}" = "--package" ]; then
    BINP=${2:?usage: --package BIN}
    TARGET=test_model_gpu PROG=test_model_gpu bench/build-variants.sh "$BINP/fault" src/backend/cuda/backend_cuda.c \
        -DFP4MOE_INJECT_FAULT_SIDE_JOIN=1 || exit 1
    gp_main --package "$BINP"
fi
OUT=${OUT:-gpu-side-out}
mkdir -p "$OUT"
PKG=$1
gp_main "$PKG"
BIN=$GP_BIN
declare -a ROWS
row() { ROWS+=("$(printf '%-40s %-10s %5ss  %s' "$1" "$2" "$3" "${4:-}")"); }

t0=$SECONDS
timeout 300 "$BIN/test_model_gpu" >"$OUT/tests_off.log" 2>&1
rc=$?
row "test_model_gpu (side off)" "$([ $rc = 0 ] && echo PASS || echo "FAIL($rc)")" $((SECONDS - t0)) "$(grep -c '^\[       OK' "$OUT/tests_off.log") ok"
t0=$SECONDS
FP4MOE_CUDA_SIDE_STREAM=1 timeout 300 "$BIN/test_model_gpu" >"$OUT/tests_on.log" 2>&1
rc=$?
row "test_model_gpu (side on everywhere)" "$([ $rc = 0 ] && echo PASS || echo "FAIL($rc)")" $((SECONDS - t0)) "$(grep -c '^\[       OK' "$OUT/tests_on.log") ok"
if [ -f "$PKG/fault/0/test_model_gpu.xz" ]; then
    xz -dc "$PKG/fault/0/test_model_gpu.xz" >"$BIN/test_model_gpu-side_join" && chmod +x "$BIN/test_model_gpu-side_join"
    t0=$SECONDS
    timeout 300 "$BIN/test_model_gpu-side_join" >"$OUT/fault.log" 2>&1
    rc=$?
    row "fault side_join" "$([ $rc = 77 ] && echo "SKIP(77)" || { [ $rc != 0 ] && echo CAUGHT || echo MISSED; })" $((SECONDS - t0)) "$(grep -m1 'FAILED  \] [a-z]' "$OUT/fault.log")"
fi
CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
if [ -n "$CS" ]; then
    t0=$SECONDS
    FP4MOE_CUDA_SIDE_STREAM=1 timeout 200 "$CS" --tool memcheck --error-exitcode 9 "$BIN/fp4moe" bench \
        -m models/nemotron-h-tiny-moe --device cuda --prompt-tokens 40 --gen-tokens 8 --repeats 1 --warmup 0 \
        >"$OUT/memcheck.log" 2>&1
    rc=$?
    row "memcheck solo decode (side on)" "$([ $rc = 0 ] && echo CLEAN || echo "FAIL($rc)")" $((SECONDS - t0)) "$(grep -m1 'ERROR SUMMARY' "$OUT/memcheck.log")"
fi
printf '#!/bin/sh\nexec env FP4MOE_CUDA_SIDE_STREAM=1 %s/fp4moe "$@"\n' "$BIN" >"$BIN/side_on" && chmod +x "$BIN/side_on"
A="--synthetic nemotron-3-nano-30b-a3b --device cuda"
LIB=$BIN
OUT=$OUT/cmp1 timeout 240 bench/gpu-compare.sh "$LIB" 4 "$A --prompt-tokens 512 --gen-tokens 128 --repeats 3" \
    side_off="$BIN/fp4moe" side_on="$BIN/side_on" >"$OUT/cmp1.txt" 2>&1
OUT=$OUT/cmp8 timeout 120 bench/gpu-compare.sh "$LIB" 2 "$A --batch 8 --prompt-tokens 256 --gen-tokens 64 --repeats 2" \
    side_off="$BIN/fp4moe" side_on="$BIN/side_on" >"$OUT/cmp8.txt" 2>&1
OUT=$OUT/cmp64 timeout 150 bench/gpu-compare.sh "$LIB" 2 "$A --batch 64 --prompt-tokens 256 --gen-tokens 64 --repeats 2" \
    side_off="$BIN/fp4moe" side_on="$BIN/side_on" >"$OUT/cmp64.txt" 2>&1
for f in cmp1 cmp8 cmp64; do echo "== $f"; cat "$OUT/$f.txt"; done
printf '%s\n' "${ROWS[@]}"
