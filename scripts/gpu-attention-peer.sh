#!/usr/bin/env bash
# fp4moe's CUDA attention (bench/gpu_attention) against torch's scaled_dot_product_attention
# (scripts/attention_peer.py) on the same shapes, in one run on the GPU machine (issue 11): prefill
# T = 512 .. 32,768 (causal, one sequence), decode at contexts 512 .. 131,072 (1 row) and up to
# 32,768 (64 rows). One attention layer; ratio = fp4moe ms / torch ms (<= 1: fp4moe no slower).
# The kernels' correctness test (test_attention_gpu, against fp64) runs first; with OLD (the package
# of an earlier commit) its gpu_attention runs in the same run too (column "before"); or, with
# BEFORE_ENV (e.g. FP4MOE_CUDA_ATTENTION=mma), this build's with that setting.
# Usage: scripts/gpu-attention-peer.sh [BIN [OLD]]  (BIN holds the programs, e.g. from --package)
#        scripts/gpu-attention-peer.sh --package BIN
set -u
cd "$(dirname "$0")/.."
GP_NAME=attpeer
GP_BUILD=build-gpum
GP_PROGS="gpu_attention test_attention_gpu"
GP_TARGETS="gpu_attention test_attention_gpu"
. scripts/gpu-pack.sh
[ "${1:-}" = --package ] && gp_main "$@"      # packs and exits
gp_main "${1:-}"
OUT=${OUT:-gpu-attpeer-out}
mkdir -p "$OUT"
if [ "${PEER_TEST:-1}" != 0 ]; then # PEER_TEST=0: the test ran elsewhere in the same call
    timeout 300 "$GP_BIN/test_attention_gpu" > "$OUT/test.txt" 2>&1
    echo "test_attention_gpu: $([ $? = 0 ] && echo PASS || echo FAIL) ($(grep -h 'worst' "$OUT/test.txt" | tr '\n' ' '))"
fi
"$GP_BIN/gpu_attention" > "$OUT/fp4moe.txt" 2>&1 || { cat "$OUT/fp4moe.txt"; exit 1; }
: > "$OUT/before.txt"
if [ -n "${BEFORE_ENV:-}" ]; then # this build with a setting, e.g. BEFORE_ENV=FP4MOE_CUDA_ATTENTION=mma
    # shellcheck disable=SC2086
    env $BEFORE_ENV "$GP_BIN/gpu_attention" > "$OUT/before.txt" 2>&1 || echo "gpu_attention ($BEFORE_ENV) failed"
elif [ -n "${2:-}" ]; then
    OLD_BIN=$(gp_unpack "$2") && "$OLD_BIN/gpu_attention" > "$OUT/before.txt" 2>&1 || echo "old gpu_attention failed"
fi
python3 scripts/attention_peer.py > "$OUT/torch.txt" 2>&1 || { cat "$OUT/torch.txt"; exit 1; }
head -1 "$OUT/fp4moe.txt"; head -1 "$OUT/torch.txt"
python3 - "$OUT/fp4moe.txt" "$OUT/torch.txt" "$OUT/before.txt" <<'PY'
import sys
def load(p):
    d = {}
    for l in open(p):
        f = l.split()
        if not f or f[0].startswith("#"): continue
        if f[0] == "prefill": d[("prefill", int(f[1]), 1)] = (float(f[2]), f[3] if len(f) > 3 else "")
        else: d[("decode", int(f[1]), int(f[2]))] = (float(f[3]), f[4] if len(f) > 4 else "")
    return d
a, b, old = load(sys.argv[1]), load(sys.argv[2]), load(sys.argv[3])
print("| case | tokens / context | rows | fp4moe ms | torch SDPA ms (backend) | fp4moe / torch | before ms |")
print("|---|---:|---:|---:|---:|---:|---:|")
for key in sorted(a, key=lambda k: (k[0] != "prefill", k[2], k[1])):
    if key in b:
        before = "%.4f" % old[key][0] if key in old else "-"
        print("| %s | %d | %d | %.4f | %.4f (%s) | %.2f | %s |" % (key[0], key[1], key[2], a[key][0], b[key][0], b[key][1], a[key][0] / b[key][0], before))
PY
