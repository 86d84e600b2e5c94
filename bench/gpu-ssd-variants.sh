#!/usr/bin/env bash
# bench/gpu-ssd-variants.sh: on the GPU machine, ONE call that checks and prices variants of the Mamba-2 SSD scan
# (src/kernels/cuda/ops_ssm.cu; bench/build-variants.sh builds, variant 0 = main's defaults):
#   1. bench/gpu_ssm --quick of each variant (G/ssdv/i): the check line prints a hash of the SSD's y and state bits at
#      T = 512 (a variant that keeps the arithmetic prints variant 0's), then the 512-token time, variants alternated,
#      three rounds;
#   2. test_ssm_gpu of each test build (G/ssdt/j: the variants' flags), then compute-sanitizer memcheck and racecheck
#      of its test_chunks (the SSD's shared-memory buffers and barriers); one full gpu_ssm run of each variant
#      (64 - 8,192 tokens);
#   3. fp4moe bench 512 + 64 and 2,048 + 32 (G/ssdf/i), alternated, two rounds each (hashes must be equal).
# Build here first (no GPU needed; build-gpum configured), for the variant flags V1:
#   TARGET=gpu_ssm PROG=gpu_ssm bench/build-variants.sh gpu-bin/ssdv src/kernels/cuda/ops_ssm.cu "" "$V1"
#   TARGET=test_ssm_gpu PROG=test_ssm_gpu bench/build-variants.sh gpu-bin/ssdt src/kernels/cuda/ops_ssm.cu "$V1"
#   (more variants: their flags after "$V1" in each of the three); fault builds of test_ssm_gpu, which must fail:
#   TARGET=test_ssm_gpu PROG=test_ssm_gpu bench/build-variants.sh gpu-bin/ssdx src/kernels/cuda/ops_ssm.cu \
#       -DFP4MOE_INJECT_FAULT_...=1
#   bench/build-variants.sh gpu-bin/ssdf src/kernels/cuda/ops_ssm.cu "" "$V1"
#   and the batch package in gpu-bin/main (its shared libraries; see bench/gpu-decode-variants.sh).
# Usage (device): OUT=$OUT bash bench/gpu-ssd-variants.sh gpu-bin
set -u
cd "$(dirname "$0")/.." || exit 1
G=${1:-gpu-bin}
OUT=${OUT:-gpu-ssd-variants-out}
. scripts/gpu-pack.sh
gp_bench_device "$G/main" # the package unpacked into B, LD_LIBRARY_PATH set, OUT made, the GPU named
CS=/usr/local/cuda/bin/compute-sanitizer
V=$(cd "$G/ssdv" && ls | sort -n | tr '\n' ' ')
for v in $V; do
    xz -dc "$G/ssdv/$v/gpu_ssm.xz" >$B/s$v && chmod +x $B/s$v
done
echo "== gpu_ssm --quick: the SSD's bits at T = 512, then ms a layer at 512 tokens"
for round in 1 2 3; do
    for v in $V; do
        timeout 60 $B/s$v --quick >"$OUT/s$v-q$round.log" 2>&1
        printf "round %s v%s: %s | %s\n" $round $v "$(grep -m1 'check T=512 ssd ' "$OUT/s$v-q$round.log" | sed 's/.*bits/bits/')" \
            "$(grep -E '^512 +ssd ' "$OUT/s$v-q$round.log" | awk '{print $2, $3}')"
    done
done
for t in $(cd "$G/ssdt" && ls | sort -n); do
    xz -dc "$G/ssdt/$t/test_ssm_gpu.xz" >$B/ts$t && chmod +x $B/ts$t
    timeout 200 $B/ts$t >"$OUT/ts$t.log" 2>&1
    echo "test build $t test_ssm_gpu: exit $? ($(grep -c 'OK \]' "$OUT/ts$t.log") OK, $(grep -c 'FAILED \]' "$OUT/ts$t.log") FAILED)"
    for tool in memcheck racecheck; do
        FP4MOE_TEST_FILTER=test_chunks timeout 200 $CS --tool $tool --error-exitcode 9 $B/ts$t >"$OUT/ts$t-$tool.log" 2>&1
        echo "test build $t $tool (test_chunks): exit $? $(grep -m1 'ERROR SUMMARY\|RACECHECK SUMMARY' "$OUT/ts$t-$tool.log")"
    done
done
for t in $( [ -d "$G/ssdx" ] && cd "$G/ssdx" && ls | sort -n); do # fault builds: must fail
    xz -dc "$G/ssdx/$t/test_ssm_gpu.xz" >$B/tx$t && chmod +x $B/tx$t
    timeout 200 $B/tx$t >"$OUT/tx$t.log" 2>&1
    rc=$?
    echo "fault build $t test_ssm_gpu: exit $rc - $([ $rc != 0 ] && echo CAUGHT || echo MISSED)"
done
echo "== gpu_ssm full, ms a layer (ssd)"
for v in $V; do
    timeout 150 $B/s$v >"$OUT/s$v-full.log" 2>&1
    printf "v%s: %s\n" $v "$(grep -E '^[0-9]+ +ssd ' "$OUT/s$v-full.log" | awk '{printf "T=%s %s  ", $1, $3}')"
done
A="--synthetic nemotron-3-nano-30b-a3b --device cuda"
P=$(for v in $V; do printf "v%s=%s " $v "$G/ssdf/$v/fp4moe.xz"; done)
# shellcheck disable=SC2086
OUT=$OUT/e512 timeout 200 bash bench/gpu-compare.sh $B 2 "$A --prompt-tokens 512 --gen-tokens 64 --repeats 2" $P \
    >"$OUT/e512.txt" 2>&1
echo "== 512 + 64"; grep '^| [a-z]' "$OUT/e512.txt" | grep -v '^| build'
# shellcheck disable=SC2086
OUT=$OUT/e2k timeout 200 bash bench/gpu-compare.sh $B 2 "$A --prompt-tokens 2048 --gen-tokens 32 --repeats 2" $P \
    >"$OUT/e2k.txt" 2>&1
echo "== 2,048 + 32"; grep '^| [a-z]' "$OUT/e2k.txt" | grep -v '^| build'
