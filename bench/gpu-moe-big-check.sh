#!/usr/bin/env bash
# bench/gpu-moe-big-check.sh: on the GPU machine, ONE call that checks and measures the MoE layer's 128 x 256-tile
# path (gq_launch_moe_big, FP4MOE_CUDA_MOE_BIG) - most important first, each step under a time limit and its result
# printed at once, so that a call cut short keeps what it had:
#   1. test_ops_gpu test_moe_pair / test_moe_big (bitwise against the 64-row kernel; awkward K, N, out-of-range rows);
#   2. prefill 2,048 + 16 tokens, synthetic 30B-A3B, big tiles on (default) against FP4MOE_CUDA_MOE_BIG=0, two
#      alternated rounds (bench/gpu-compare.sh; the greedy hashes must be equal);
#   3. compute-sanitizer memcheck and racecheck of test_moe_big (its small shapes: FP4MOE_TEST_SANITIZE=1);
#   4. the fault builds f_bigx / f_bigy (scripts/gpu-staged-check.sh's table) must fail test_moe_big;
#   5. the bench candidates of CAND (bench/build-bench-variants.sh of gpu_gather_wg, e.g. BG_XCO / BG_YNAT / BG_XPS)
#      at 1,024-8,192 tokens, timings only;
#   6. prefill 8,192 + 8, one round on / off; 7. test_ops_gpu, test_gather_qmm_gpu, test_model_gpu (FP4MOE_TEST_QUICK).
# Usage: bench/gpu-moe-big-check.sh PKG [CAND]   (PKG: FAULTS_ONLY="f_bigx f_bigy" scripts/gpu-staged-check.sh
#        --package PKG, here; OUT: where the logs go, default gpu-moe-big-out)
set -u
cd "$(dirname "$0")/.." || exit 1
PKG=$1 CAND=${2:-}
OUT=${OUT:-gpu-moe-big-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
B=/tmp/moebig-bin
mkdir -p $B
[ -x $B/fp4moe ] || tar -C $B -xJf "$PKG/batch.tar.xz"
export LD_LIBRARY_PATH=$B:/usr/local/cuda/lib64
T=$B/test_ops_gpu
t0=$SECONDS
FP4MOE_TEST_FILTER=test_moe timeout 120 $T >"$OUT/moe_tests.log" 2>&1
echo "test_ops_gpu test_moe*: exit $? $((SECONDS - t0)) s"
grep -h "OK \]\|FAILED\|moe big\|moe pair" "$OUT/moe_tests.log" | head -12
printf '#!/bin/sh\nexec env FP4MOE_CUDA_MOE_BIG=0 %s "$@"\n' "$B/fp4moe" >$B/big0
chmod +x $B/big0
A="--synthetic nemotron-3-nano-30b-a3b --device cuda"
OUT=$OUT/p2k timeout 150 bash bench/gpu-compare.sh $B 2 "$A --prompt-tokens 2048 --gen-tokens 16 --repeats 2" \
    new=$B/fp4moe big0=$B/big0 >"$OUT/p2k.txt" 2>&1
echo "== p2k"; grep '^|' "$OUT/p2k.txt"; grep -v '^|' "$OUT/p2k.txt" | head -3
CS=/usr/local/cuda/bin/compute-sanitizer
for t in memcheck racecheck; do
    t0=$SECONDS
    FP4MOE_TEST_SANITIZE=1 FP4MOE_TEST_FILTER=test_moe_big timeout 90 $CS --tool $t --error-exitcode 9 $T \
        >"$OUT/san-big-$t.log" 2>&1
    echo "$t test_moe_big: exit $? $((SECONDS - t0)) s $(grep -m1 'ERROR SUMMARY\|RACECHECK SUMMARY' "$OUT/san-big-$t.log")"
done
for f in f_bigx f_bigy; do
    [ -f "$PKG/$f/0/test_ops_gpu.xz" ] || continue
    xz -dc "$PKG/$f/0/test_ops_gpu.xz" >$B/$f && chmod +x $B/$f
    FP4MOE_TEST_FILTER=test_moe_big timeout 60 $B/$f >"$OUT/$f.log" 2>&1
    echo "fault $f: exit $? (nonzero: CAUGHT) $(grep -m1 'moe big' "$OUT/$f.log" | cut -c1-150)"
done
if [ -n "$CAND" ]; then
    OUT=$OUT/cand WK_CHECKS=none WK_TILED_ONLY=1 WK_TOKENS=1024,2048,4096,8192 timeout 100 \
        bash bench/gpu-run-candidates.sh "$PKG" "$CAND" 30 >"$OUT/cand.txt" 2>&1
    echo "--- candidates"; grep -h '^==\|^| [0-9]\|FAIL' "$OUT/cand.txt"
fi
OUT=$OUT/p8k timeout 100 bash bench/gpu-compare.sh $B 1 "$A --prompt-tokens 8192 --gen-tokens 8 --repeats 1" \
    new=$B/fp4moe big0=$B/big0 >"$OUT/p8k.txt" 2>&1
echo "== p8k"; grep '^|' "$OUT/p8k.txt"
for t in test_ops_gpu test_gather_qmm_gpu test_model_gpu; do
    t0=$SECONDS
    FP4MOE_TEST_QUICK=1 timeout 100 $B/$t >"$OUT/$t.log" 2>&1
    echo "$t: exit $? $((SECONDS - t0)) s, $(grep -c '^\[       OK' "$OUT/$t.log") ok; $(grep -m2 'FAILED  \] [a-z]' "$OUT/$t.log" | tr '\n' ' ')"
done
