#!/usr/bin/env bash
# bench/gpu-decode-variants.sh: on the GPU machine, ONE call that checks and prices variants of a decode kernel's
# source (bench/build-variants.sh builds of one file, variant 0 = main's defaults):
#   1. the GPU tests of variant 1 (G/dvt/0/test_ops_gpu.xz test_linear_gather_x1, G/dvq/0/test_gather_qmm_gpu.xz all),
#      then compute-sanitizer memcheck of test_linear_gather_x1;
#   2. bench/gpu_moe_decode 8 6 0 (the decode MoE pair, graph replay, weights from DRAM; G/dvd/i) of each variant,
#      alternated, three rounds, and the up / down calls alone (modes 1 / 2) once each;
#   3. fp4moe bench 512 + 128 (decode tok/s; G/dv/i), the variants alternated, three rounds (hashes must be equal).
# Build here first (no GPU needed; build-gpum configured), e.g. for SRC with the variant flags V1, V2:
#   bench/build-variants.sh gpu-bin/dv SRC "" "$V1" "$V2"
#   TARGET=gpu_moe_decode PROG=gpu_moe_decode bench/build-variants.sh gpu-bin/dvd SRC "" "$V1" "$V2"
#   TARGET=test_ops_gpu PROG=test_ops_gpu bench/build-variants.sh gpu-bin/dvt SRC "$V1"
#   TARGET=test_gather_qmm_gpu PROG=test_gather_qmm_gpu bench/build-variants.sh gpu-bin/dvq SRC "$V1"
#   and a batch package in gpu-bin/main for the libraries:
#   (GP_NAME=batch GP_BUILD=build-gpum GP_PROGS="fp4moe test_ops_gpu" GP_TARGETS="fp4moe_cli test_ops_gpu"; \
#    . scripts/gpu-pack.sh; gp_package gpu-bin/main)
# Optional: G/dvt/1/test_ops_gpu.xz, a deliberate-fault build of the same test (must FAIL the filtered test), made
# by a second flag set in the dvt build above: ... bench/build-variants.sh gpu-bin/dvt SRC "$V1" "$V1 -DFP4MOE_INJECT_FAULT_<MACRO>=1";
# TV_FILTER (default test_linear_gather_x1): the test_ops_gpu tests of step 1 and of the memcheck;
# MD_MODES (default "1 2"): the gpu_moe_decode modes run once each after the pair (3: the shared expert's dense pair).
# Usage (device): OUT=$OUT bash bench/gpu-decode-variants.sh gpu-bin
set -u
cd "$(dirname "$0")/.." || exit 1
G=${1:-gpu-bin}
OUT=${OUT:-gpu-decode-variants-out}
. scripts/gpu-pack.sh
gp_bench_device "$G/main" # the package unpacked into B, LD_LIBRARY_PATH set, OUT made, the GPU named
xz -dc "$G/dvt/0/test_ops_gpu.xz" >$B/tv && chmod +x $B/tv
xz -dc "$G/dvq/0/test_gather_qmm_gpu.xz" >$B/tq && chmod +x $B/tq
TV_FILTER=${TV_FILTER:-test_linear_gather_x1}
FP4MOE_TEST_FILTER=$TV_FILTER timeout 120 $B/tv >"$OUT/tv.log" 2>&1
echo "variant 1 test_ops_gpu $TV_FILTER: exit $? ($(grep -c 'OK \]' "$OUT/tv.log") OK)"
if [ -f "$G/dvt/1/test_ops_gpu.xz" ]; then
    xz -dc "$G/dvt/1/test_ops_gpu.xz" >$B/tf && chmod +x $B/tf
    FP4MOE_TEST_FILTER=$TV_FILTER timeout 120 $B/tf >"$OUT/tf.log" 2>&1
    echo "fault build test_ops_gpu $TV_FILTER: exit $? (must not be 0; $(grep -c '^\[  FAILED  \] [a-z]' "$OUT/tf.log") FAILED)"
fi
timeout 300 $B/tq >"$OUT/tq.log" 2>&1
echo "variant 1 test_gather_qmm_gpu: exit $? ($(grep -c 'OK \]' "$OUT/tq.log") OK, $(grep -c '^\[  FAILED  \] [a-z]' "$OUT/tq.log") FAILED)"
FP4MOE_TEST_SANITIZE=1 FP4MOE_TEST_FILTER=$TV_FILTER timeout 200 /usr/local/cuda/bin/compute-sanitizer \
    --tool memcheck --error-exitcode 9 $B/tv >"$OUT/tv-mem.log" 2>&1
echo "variant 1 memcheck: exit $? $(grep -m1 'ERROR SUMMARY' "$OUT/tv-mem.log")"
V=$(cd "$G/dv" && ls | sort -n | tr '\n' ' ')
for v in $V; do
    xz -dc "$G/dvd/$v/gpu_moe_decode.xz" >$B/d$v && chmod +x $B/d$v
    xz -dc "$G/dv/$v/fp4moe.xz" >$B/v$v && chmod +x $B/v$v
done
echo "== decode MoE pair, 6 rows, us (graph | no graph | floor)"
for round in 1 2 3; do
    for v in $V; do
        printf "round %s v%s: " $round $v
        timeout 60 $B/d$v 8 6 0 2>&1 | grep -m1 "^| 8 layers" | cut -d'|' -f3-5
    done
done
for m in ${MD_MODES:-1 2}; do
    for v in $V; do
        printf "mode %s v%s: " $m $v
        timeout 60 $B/d$v 8 6 $m 2>&1 | grep -m1 "^| 8 layers" | cut -d'|' -f3-5
    done
done
A="--synthetic nemotron-3-nano-30b-a3b --device cuda"
OUT=$OUT/e2e timeout 300 bash bench/gpu-compare.sh $B 3 "$A --prompt-tokens 512 --gen-tokens 128 --repeats 2" \
    $(for v in $V; do printf "v%s=%s/v%s " $v $B $v; done) >"$OUT/e2e.txt" 2>&1
echo "== 512 + 128"; grep '^| [a-z]' "$OUT/e2e.txt" | grep -v '^| build'
