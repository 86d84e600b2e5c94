#!/usr/bin/env bash
# bench/gpu-argmax-check.sh: on the GPU machine, ONE call that checks and prices the greedy argmax's split form
# (src/kernels/cuda/ops_elementwise.cu, argmax_split_kernel: a decode row's 131,072 logits read by 64 blocks):
#   1. test_ops_gpu's test_argmax_rows of the batch package (both forms, the split form twice on one scratch),
#      then compute-sanitizer memcheck and racecheck of it;
#   2. the fault build G/amx/0/test_ops_gpu.xz (FP4MOE_INJECT_FAULT_ARGMAX_RESET: the counter not set back), which
#      must fail;
#   3. fp4moe bench 512 + 128 of OLD and NEW alternated, three rounds (decode tok/s; the hashes must be equal).
# Build here first (build-gpum configured): the batch package in G/main (see bench/gpu-decode-variants.sh), then
#   TARGET=test_ops_gpu PROG=test_ops_gpu bench/build-variants.sh G/amx src/kernels/cuda/ops_elementwise.cu \
#       -DFP4MOE_INJECT_FAULT_ARGMAX_RESET=1
# Usage (device): OUT=$OUT bash bench/gpu-argmax-check.sh G OLD.xz NEW.xz
set -u
cd "$(dirname "$0")/.." || exit 1
G=${1:-gpu-bin}
OLD=$2 NEW=$3
OUT=${OUT:-gpu-argmax-out}
. scripts/gpu-pack.sh
gp_bench_device "$G/main" # the package unpacked into B, LD_LIBRARY_PATH set, OUT made, the GPU named
CS=/usr/local/cuda/bin/compute-sanitizer
export FP4MOE_TEST_FILTER=test_argmax_rows
timeout 120 $B/test_ops_gpu >"$OUT/t.log" 2>&1
echo "test_argmax_rows: exit $? ($(grep -c 'OK \]' "$OUT/t.log") OK, $(grep -c 'FAILED \]' "$OUT/t.log") FAILED)"
for tool in memcheck racecheck; do
    timeout 200 $CS --tool $tool --error-exitcode 9 $B/test_ops_gpu >"$OUT/t-$tool.log" 2>&1
    echo "$tool: exit $? $(grep -m1 'ERROR SUMMARY\|RACECHECK SUMMARY' "$OUT/t-$tool.log")"
done
if [ -f "$G/amx/0/test_ops_gpu.xz" ]; then
    xz -dc "$G/amx/0/test_ops_gpu.xz" >$B/tx && chmod +x $B/tx
    timeout 120 $B/tx >"$OUT/tx.log" 2>&1
    rc=$?
    echo "fault ARGMAX_RESET: exit $rc - $([ $rc != 0 ] && echo CAUGHT || echo MISSED); $(grep -m1 'split' "$OUT/tx.log")"
fi
unset FP4MOE_TEST_FILTER
A="--synthetic nemotron-3-nano-30b-a3b --device cuda --prompt-tokens 512 --gen-tokens 128 --repeats 2"
OUT=$OUT/dec timeout 300 bash bench/gpu-compare.sh $B 3 "$A" old="$OLD" new="$NEW" >"$OUT/dec.txt" 2>&1
echo "== 512 + 128"
grep '^| [a-z]' "$OUT/dec.txt" | grep -v '^| build'
