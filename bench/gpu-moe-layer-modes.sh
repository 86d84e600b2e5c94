#!/usr/bin/env bash
# bench/gpu-moe-layer-modes.sh: on the GPU machine, ONE call that prices a decode MoE layer's projections in
# bench/gpu_moe_decode's modes, then what the shared expert's side stream gives end to end:
#   1. gpu_moe_decode 8 6 MODE for MODE 0 (the routed pair, 6 rows), 3 (the shared expert's dense pair: the dense
#      decode linears' 16-warp qmv), 6 (both, one after the other: four launches, as the model issues them without
#      its side stream) and 7 (the routed pair of 8 rows: the shared expert as two more experts of the routed shape,
#      the same bytes as 6 in two launches) - us a layer in graph replay against the bytes' floor;
#   2. fp4moe bench 512 + 128 with FP4MOE_CUDA_SIDE_STREAM=1 (the default: the shared expert on a second queue beside
#      the routing and the routed experts) and =0, alternated, two rounds: how much of the shared expert the side
#      stream already hides (mode 7 can only gain what it does not).
# Measured in session 52 (docs/PERFORMANCE.md): mode 7 beats mode 6 but loses to the side stream - not built.
# Build here first (build-gpum configured): the batch package in G/main (bench/gpu-decode-variants.sh), then
#   cmake --build build-gpum --target gpu_moe_decode && strip -o /tmp/md build-gpum/gpu_moe_decode && xz -9c /tmp/md >G/md.xz
# Usage (device): OUT=$OUT bash bench/gpu-moe-layer-modes.sh G
set -u
cd "$(dirname "$0")/.." || exit 1
G=${1:-gpu-bin}
OUT=${OUT:-gpu-moe-layer-out}
. scripts/gpu-pack.sh
gp_bench_device "$G/main" # the package unpacked into B, LD_LIBRARY_PATH set, OUT made, the GPU named
xz -dc "$G/md.xz" >$B/md && chmod +x $B/md
for m in 0 3 6 7; do
    timeout 60 $B/md 8 6 $m 2>&1 | grep -v '^|---\|^| weights'
done
A="--synthetic nemotron-3-nano-30b-a3b --device cuda --prompt-tokens 512 --gen-tokens 128 --repeats 2 --json"
for r in 1 2; do
    for s in 1 0; do
        FP4MOE_CUDA_SIDE_STREAM=$s timeout 90 $B/fp4moe bench $A >"$OUT/side$s-$r.json" 2>"$OUT/side$s-$r.log"
        python3 - "$OUT/side$s-$r.json" $s $r <<'PY'
import json, sys
try:
    j = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"side stream {sys.argv[2]} round {sys.argv[3]}: no result ({e})")
    sys.exit(0)
d = j.get("decode_tok_s_median", j.get("decode_tok_s_aggregate", 0))
print(f"side stream {sys.argv[2]} round {sys.argv[3]}: decode {d:.1f} tok/s, hash",
      j.get("gen_ids_fnv1a_all") or j.get("gen_ids_fnv1a"))
PY
    done
done
