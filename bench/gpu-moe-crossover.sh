#!/usr/bin/env bash
# bench/gpu-moe-crossover.sh: on the GPU machine, ONE call that places the MoE layer's crossover between the big
# tiles (gq_launch_moe_big) and dequant_gemm (GQ_BIG_DEQUANT_ROWS_PER_EXPERT, session 47): the route checks, then
# prefill + 4 of the synthetic 30B-A3B at sizes around the threshold, main against two variants of the threshold
# (bench/build-variants.sh of src/kernels/cuda/gather_qmm_cuda.cu: VAR_DQ (e.g. 512: dequant_gemm from there) and
# VAR_BIG (e.g. 4096: the big tiles up to there)), alternated rounds; then the greedy hash with
# FP4MOE_GATHER_EXPERT_BATCHED=0 at SIZES' first (must equal main's: the switch only replaces batched by qmv).
# Usage: [SIZES="20480 24576"] [VAR_DQ=.xz] [VAR_BIG=.xz] bench/gpu-moe-crossover.sh PKG   (OUT: logs)
set -u
cd "$(dirname "$0")/.." || exit 1
PKG=$1
OUT=${OUT:-gpu-moe-crossover-out}
. scripts/gpu-pack.sh
gp_bench_device "$PKG" # the package unpacked into B, LD_LIBRARY_PATH set, OUT made, the GPU named
t0=$SECONDS
FP4MOE_TEST_QUICK=1 timeout 120 $B/test_gather_qmm_gpu >"$OUT/tg.log" 2>&1
echo "test_gather_qmm_gpu (quick): exit $? $((SECONDS - t0)) s, $(grep -c '^\[       OK' "$OUT/tg.log") ok $(grep -m2 'FAILED  \] [a-z]' "$OUT/tg.log" | tr '\n' ' ')"
FP4MOE_TEST_FILTER=test_moe timeout 150 $B/test_ops_gpu >"$OUT/moe_tests.log" 2>&1
echo "test_ops_gpu test_moe*: exit $? $(grep -c '^\[       OK' "$OUT/moe_tests.log") ok"
for f in f_route f_bigr; do
    [ -f "$PKG/$f/0/"*.xz ] || continue
    p=$(ls "$PKG/$f/0/"*.xz)
    xz -dc "$p" >$B/$f && chmod +x $B/$f
    case $f in f_route) timeout 60 $B/$f >"$OUT/$f.log" 2>&1 ;; *) FP4MOE_TEST_FILTER=test_moe_big timeout 60 $B/$f >"$OUT/$f.log" 2>&1 ;; esac
    echo "fault $f: exit $? (nonzero: CAUGHT)"
done
A="--synthetic nemotron-3-nano-30b-a3b --device cuda"
first=
for P in ${SIZES:-20480 24576}; do
    first=${first:-$P}
    OUT=$OUT/p$P timeout 240 bash bench/gpu-compare.sh $B 2 "$A --prompt-tokens $P --gen-tokens 4 --repeats 1" \
        main=$B/fp4moe ${VAR_DQ:+dq=$VAR_DQ} ${VAR_BIG:+big=$VAR_BIG} >"$OUT/p$P.txt" 2>&1
    echo "== prefill $P + 4 ($((P * 6 / 128)) rows an expert)"; grep '^| [a-z]' "$OUT/p$P.txt" | grep -v '^| build'
done
FP4MOE_GATHER_EXPERT_BATCHED=0 timeout 100 $B/fp4moe bench $A --prompt-tokens 16384 --gen-tokens 4 --repeats 1 --json \
    >"$OUT/hash-off.json" 2>&1
timeout 100 $B/fp4moe bench $A --prompt-tokens 16384 --gen-tokens 4 --repeats 1 --json >"$OUT/hash-on.json" 2>&1
echo "prefill 16384 + 4 hashes: main $(grep -o '"gen_ids_fnv1a"[^,]*' "$OUT/hash-on.json"), FP4MOE_GATHER_EXPERT_BATCHED=0 $(grep -o '"gen_ids_fnv1a"[^,]*' "$OUT/hash-off.json")"
