#!/usr/bin/env bash
# bench/gpu-attn-variants.sh: on the GPU machine, builds of the attention kernels that differ in
# compile-time macros (bench/build-variants.sh of src/kernels/cuda/ops_attention.cu into DIR/<i>/,
# each with gpu_attention.xz and test_attention_gpu.xz), timed and checked in ONE run: ROUNDS rounds
# of `gpu_attention --prefill` over the variants in turn (variant 0 also with FP4MOE_CUDA_ATTENTION=mma:
# the mma.sync kernel, "mma"), a table of the median ms per T, then each variant's test_attention_gpu
# prefill tests (against fp64; both kernels).
# Usage: bench/gpu-attn-variants.sh PKG DIR [ROUNDS]   (PKG: scripts/gpu-staged-check.sh --package PKG,
#        for the shared libraries). GA_ARGS: gpu_attention's arguments (default --prefill; empty: the
#        decode cases too, then each variant's whole test_attention_gpu runs, not only the test_prefill tests:
#        ~60-90 s a variant on the H200). GA_TESTS=0: the tests are left out (timing only; a variant
#        that is to become the default still needs its test run). The timing runs come first, so that
#        a run cut short by its time limit still has its table (session 13 lost one that way).
set -u
cd "$(dirname "$0")/.."
GP_NAME=batch
GP_BUILD=build-gpum
. scripts/gpu-pack.sh
OUT=${OUT:-gpu-attvar-out}
mkdir -p "$OUT"
gp_main "$1"
DIR=$2
ROUNDS=${3:-3}
names=""
for d in "$DIR"/*/; do
    i=$(basename "$d")
    for p in gpu_attention test_attention_gpu; do
        xz -dc "$d/$p.xz" >"$GP_BIN/$p-$i" && chmod +x "$GP_BIN/$p-$i"
    done
    names="$names $i"
done
for r in $(seq "$ROUNDS"); do
    # shellcheck disable=SC2086
    for i in $names; do timeout 120 "$GP_BIN/gpu_attention-$i" ${GA_ARGS---prefill} >"$OUT/time-$i-$r.txt" 2>&1; done
    set -- $names
    # shellcheck disable=SC2086
    FP4MOE_CUDA_ATTENTION=mma timeout 120 "$GP_BIN/gpu_attention-$1" ${GA_ARGS---prefill} >"$OUT/time-mma-$r.txt" 2>&1
done
python3 - "$OUT" $names mma <<'PY'
import glob, os, statistics, sys
out, names = sys.argv[1], sys.argv[2:]
ms = {}
for n in names:
    for f in glob.glob(os.path.join(out, "time-%s-*.txt" % n)):
        for l in open(f):
            x = l.split()
            if len(x) == 3 and x[0] == "prefill": ms.setdefault((n, int(x[1])), []).append(float(x[2]))
            if len(x) == 4 and x[0] == "decode": ms.setdefault((n, (int(x[1]), int(x[2]))), []).append(float(x[3]))
Ts = sorted({t for (_, t) in ms if isinstance(t, int)})
Ds = sorted({t for (_, t) in ms if isinstance(t, tuple)})
for n in names if Ds else []:
    print("decode %s: " % n + ", ".join("L=%d R=%d %.4f ms" % (L, R, statistics.median(ms[(n, (L, R))]))
                                      for (L, R) in Ds if (n, (L, R)) in ms))
print("| variant | " + " | ".join("T=%d ms (TFLOP/s)" % t for t in Ts) + " |")
print("|---|" + "---:|" * len(Ts))
for n in names:
    cells = []
    for t in Ts:
        v = ms.get((n, t))
        if not v: cells.append("-"); continue
        m = statistics.median(v)
        cells.append("%.4f (%.0f)" % (m, 4.0 * 32 * 128 * t * (t + 1) / 2 / (m * 1e-3) / 1e12))
    print("| %s | %s |" % (n, " | ".join(cells)))
PY
[ "${GA_TESTS:-1}" = 0 ] && exit 0
for i in $names; do
    filt=""; [ "${GA_ARGS---prefill}" = --prefill ] && filt=test_prefill
    FP4MOE_TEST_FILTER=$filt timeout 300 "$GP_BIN/test_attention_gpu-$i" >"$OUT/test-$i.log" 2>&1
    echo "variant $i: test ${filt:-all} $([ $? = 0 ] && echo PASS || echo FAIL): $(grep -h 'worst' "$OUT/test-$i.log" | tr '\n' ' ')"
done
