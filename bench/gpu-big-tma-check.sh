#!/usr/bin/env bash
# bench/gpu-big-tma-check.sh: on the GPU machine, ONE call that checks and prices bench/patches/big-tma.diff (the
# big-tile MoE kernel's x through TMA: GB_TMA=1 one CTA, GB_TMA=2 2-CTA clusters with multicast) against main, most
# important first, each step under a time limit (a hang - a wrong mbarrier phase - costs only its limit):
#   1. test_ops_gpu test_moe_big of each variant (bitwise against the 64-row kernel), then compute-sanitizer memcheck
#      on the small cases;
#   2. Nsight Compute: the first MoE layer's two gq_big(_tma)_kernel launches in a real prefill of 4,096 / 8,192
#      tokens (main's kernel time against the variants');
#   3. prefill 4,096 / 8,192 / 16,384 + 8, main and the variants alternated, two rounds (hashes must be equal).
# Build here first (no GPU needed; ~8 min):
#   git apply bench/patches/big-tma.diff
#   for v in 1 2; do TARGET=test_ops_gpu PROG=test_ops_gpu bench/build-variants.sh gpu-bin/tmat$v \
#       src/kernels/cuda/gather_batched.cu "-DGB_TMA=$v"; done
#   bench/build-variants.sh gpu-bin/tma src/kernels/cuda/gather_batched.cu "-DGB_TMA=1" "-DGB_TMA=2"
#   git checkout src/kernels/cuda/gather_big.cuh
#   (GP_NAME=batch GP_BUILD=build-gpum GP_PROGS="fp4moe test_ops_gpu" GP_TARGETS="fp4moe_cli test_ops_gpu"; \
#    . scripts/gpu-pack.sh; gp_package gpu-bin/main)
# Usage (device): OUT=$OUT bash bench/gpu-big-tma-check.sh gpu-bin
# Result (session 48, H100; docs/PERFORMANCE.md): both variants bitwise right, memcheck clean, and slower - the up
# projection 1,416 (GB_TMA=1) / 1,151 (GB_TMA=2) against 614 us at 4,096 tokens: per-row boxes bind the TMA unit.
set -u
cd "$(dirname "$0")/.." || exit 1
G=${1:-gpu-bin}
OUT=${OUT:-gpu-big-tma-out}
. scripts/gpu-pack.sh
gp_bench_device "$G/main" # the package unpacked into B, LD_LIBRARY_PATH set, OUT made, the GPU named
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu)
cp $B/fp4moe $B/main
for v in 1 2; do
    xz -dc "$G/tmat$v/0/test_ops_gpu.xz" >$B/t$v && chmod +x $B/t$v
    xz -dc "$G/tma/$((v - 1))/fp4moe.xz" >$B/tma$v && chmod +x $B/tma$v
    FP4MOE_TEST_FILTER=test_moe_big timeout 120 $B/t$v >"$OUT/t$v.log" 2>&1
    echo "GB_TMA=$v test_moe_big: exit $? $(grep -m1 'moe big\|OK \]' "$OUT/t$v.log" | cut -c1-220)"
    FP4MOE_TEST_SANITIZE=1 FP4MOE_TEST_FILTER=test_moe_big timeout 150 /usr/local/cuda/bin/compute-sanitizer \
        --tool memcheck --error-exitcode 9 $B/t$v >"$OUT/t$v-mem.log" 2>&1
    echo "GB_TMA=$v memcheck: exit $? $(grep -m1 'ERROR SUMMARY' "$OUT/t$v-mem.log")"
done
A="--synthetic nemotron-3-nano-30b-a3b --device cuda"
for P in 4096 8192; do
    for i in main tma1 tma2; do
        timeout 100 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv -k "regex:gq_big" \
            --launch-count 2 $B/$i bench $A --prompt-tokens $P --gen-tokens 1 --repeats 1 --warmup 0 \
            >"$OUT/$i-$P.csv" 2>/dev/null
        printf "ncu prefill %s, %s (us, up / down): " $P $i
        grep '"gq_big' "$OUT/$i-$P.csv" | awk -F'","' '{gsub(/"/,"",$NF); gsub(/,/,"",$NF); printf "%.1f ", $NF / 1000}'
        echo
    done
done
for P in 4096 8192 16384; do
    OUT=$OUT/p$P timeout 200 bash bench/gpu-compare.sh $B 2 "$A --prompt-tokens $P --gen-tokens 8 --repeats 2" \
        main=$B/main tma1=$B/tma1 tma2=$B/tma2 >"$OUT/p$P.txt" 2>&1
    echo "== prefill $P + 8"; grep '^| [a-z]' "$OUT/p$P.txt" | grep -v '^| build'
done
