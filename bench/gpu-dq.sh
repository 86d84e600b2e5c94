#!/usr/bin/env bash
# bench/gpu-dq.sh: the dequant_gemm route's variants in ONE device call (issue 12, session 39): its tests (the route
# alone, FP4MOE_TEST_ROUTE=dequant_gemm) and deliberate faults, the MoE layer's up + down at 2k-32k tokens against
# the batched route (bench/gpu_gather_wg, tiled layout), and end to end the prefill chunk / route choice at 8k-32k
# prompts. Usage (on the device): OUT=$OUT bench/gpu-dq.sh PKG DQ DQT
#   PKG: the batch package (scripts/gpu-staged-check.sh --package, FAULTS_ONLY=none); DQ: bench/build-variants.sh
#   builds of gpu_gather_wg (DQ/<name>/gpu_gather_wg.xz) from src/kernels/cuda/gather_dequant_gemm.cu, e.g. with
#   bench/patches/dq-side-streams.diff applied and its macros (GQ_DQ_GEMM, GQ_DQ_STREAMS, GQ_DQ_CHUNK) varied, and one
#   of the unpatched file; DQT: of test_gather_qmm_gpu (0: the candidate, the others its fault builds, e.g.
#   FP4MOE_INJECT_FAULT_DQ_JOIN / DQ_HALF of the patch). Environment: DQ_TOKENS (default 2048,4096,8192,16384,32768),
#   DQ_E2E (default 1). Session 39 measured the patch with it (docs/PERFORMANCE.md): dropped.
set -u
PKG=$1; DQ=$2; DQT=$3
OUT=${OUT:-gpu-dq-out}
mkdir -p "$OUT" /tmp/b /tmp/dq
tar -C /tmp/b -xJf "$PKG/batch.tar.xz"
export LD_LIBRARY_PATH=/tmp/b:/usr/local/cuda/lib64
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
sum="$OUT/summary.txt"; : >"$sum"
# 1. the route's tests, then its faults (each must fail)
for d in "$DQT"/*/; do
    n=$(basename "$d")
    xz -dc "$d/test_gather_qmm_gpu.xz" >/tmp/dq/t$n && chmod +x /tmp/dq/t$n
    s=$(date +%s)
    FP4MOE_TEST_ROUTE=dequant_gemm timeout 300 /tmp/dq/t$n >"$OUT/test-$n.log" 2>&1
    rc=$?
    echo "test $n: exit $rc ($(( $(date +%s) - s )) s) $(grep -c FAIL "$OUT/test-$n.log") FAIL lines" | tee -a "$sum"
done
# 2. the MoE layer at 2k-32k tokens, each variant of the route
for d in "$DQ"/*/; do
    n=$(basename "$d")
    xz -dc "$d/gpu_gather_wg.xz" >/tmp/dq/g$n && chmod +x /tmp/dq/g$n
    echo "== gpu_gather_wg variant $n" >>"$OUT/gather.txt"
    WK_CHECKS=none WK_TILED_ONLY=1 WK_TOKENS=${DQ_TOKENS:-2048,4096,8192,16384,32768} timeout 240 /tmp/dq/g$n \
        >>"$OUT/gather.txt" 2>&1 || echo "variant $n: exit $?" >>"$OUT/gather.txt"
done
# 3. end to end: prefill chunk and route at long prompts (this package's fp4moe)
if [ "${DQ_E2E:-1}" = 1 ]; then
    B="/tmp/b/fp4moe bench --synthetic nemotron-3-nano-30b-a3b --device cuda --gen-tokens 8 --repeats 2 --json"
    run() { # name env... -- args
        local name=$1; shift
        local envs=()
        while [ "$1" != -- ]; do envs+=("$1"); shift; done
        shift
        env "${envs[@]}" timeout 240 $B "$@" >"$OUT/e2e-$name.json" 2>"$OUT/e2e-$name.err"
        python3 -c "import json,sys; j=json.load(open(sys.argv[1])); print('%-28s prefill %9.1f tok/s  decode %7.1f  hash %s' % (sys.argv[2], j['prefill_tok_s_median'], j['decode_tok_s_median'], j['gen_ids_fnv1a']))" \
            "$OUT/e2e-$name.json" "$name" 2>/dev/null | tee -a "$sum" || echo "$name: failed (see e2e-$name.err)" | tee -a "$sum"
    }
    run p8k_auto X=1 -- --prompt-tokens 8192
    run p8k_dq FP4MOE_GATHER_ROUTE=dequant_gemm -- --prompt-tokens 8192
    run p16k_c8k X=1 -- --prompt-tokens 16384
    run p16k_c16k X=1 -- --prompt-tokens 16384 --chunk 16384
    run p16k_c16k_batched FP4MOE_GATHER_ROUTE=batched -- --prompt-tokens 16384 --chunk 16384
    run p32k_c8k X=1 -- --prompt-tokens 32768
    run p32k_c16k X=1 -- --prompt-tokens 32768 --chunk 16384
    run p32k_c32k X=1 -- --prompt-tokens 32768 --chunk 32768
fi
echo "== gather (up + down ms; dequant_gemm column per variant)"
grep -E "^== |^\| [0-9]" "$OUT/gather.txt" | awk -F'|' '/^==/{print; next} {printf "%s | %s | batched %s | dequant_gemm %s\n", $2, $3, $4, $6}'
echo "== summary"
cat "$sum"
