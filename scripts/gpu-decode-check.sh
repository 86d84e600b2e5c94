#!/usr/bin/env bash
# scripts/gpu-decode-check.sh: issue 12's decode work in ONE command on the H200 machine: the GPU
# tests (fused ops, gather_qmm, model, SSM, attention), then the synthetic Nemotron-3-Nano-30B-A3B
# shape with a NEW and an OLD build in the same run (prefill 512 + decode 128 with the route on and
# FP4MOE_GATHER_EXPERT_BATCHED=0: equal hashes; prompts of 2048, 8192 and 32768 tokens + 32
# decoded; 64 concurrent sequences), the layer-kind split (--profile) of the new build, a short
# table last.
# Usage: scripts/gpu-decode-check.sh NEW_BIN [OLD_BIN]   (directories with batch.tar.xz from
#        scripts/gpu-batch-check.sh --package). Logs in $OUT (default gpu-decode-out).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-decode-out}
mkdir -p "$OUT"
unpack() { local d; d=$(mktemp -d); tar -xJf "$1/batch.tar.xz" -C "$d"; echo "$d"; }
N=$(unpack "$1")
O=${2:+$(unpack "$2")}
export LD_LIBRARY_PATH="$N:/usr/local/cuda/lib64"
for t in test_ops_gpu test_gather_qmm_gpu test_model_gpu test_ssm_gpu test_attention_gpu; do
    s=$SECONDS
    timeout 300 "$N/$t" >"$OUT/$t.log" 2>&1
    echo "$t rc=$? $((SECONDS - s))s $(grep -c '  OK ' "$OUT/$t.log") ok $(grep -m1 'worst row' "$OUT/$t.log")"
done
run() { # LABEL BIN ENV ARGS...: one bench line
    local label=$1 bin=$2 envs=$3; shift 3
    env $envs "$bin/fp4moe" bench --synthetic nemotron-3-nano-30b-a3b --device cuda "$@" --json 2>"$OUT/$label.log" |
        python3 -c "import json,sys; j=json.load(sys.stdin); print('%-18s %s prefill %8.0f tok/s  decode %7.1f tok/s' % ('$label', j.get('gen_ids_fnv1a', '-'), j.get('prefill_tok_s_median', j.get('prefill_tok_s_aggregate', 0)), j.get('decode_tok_s_median', j.get('decode_tok_s_aggregate', 0))))" 2>/dev/null ||
        echo "$label: failed (see $OUT/$label.log)"
}
for v in new old; do
    b=$([ $v = new ] && echo "$N" || echo "$O")
    [ -n "$b" ] || continue
    run "p512-$v" "$b" "X=1" --prompt-tokens 512 --gen-tokens 128 --repeats 5
    run "p512-$v-off" "$b" "FP4MOE_GATHER_EXPERT_BATCHED=0" --prompt-tokens 512 --gen-tokens 128 --repeats 3
    for p in 2048 8192 32768; do run "p$p-$v" "$b" "X=1" --prompt-tokens $p --gen-tokens 32 --repeats 1; done
    run "batch64-$v" "$b" "X=1" --batch 64 --prompt-tokens 256 --gen-tokens 64 --repeats 1
done
"$N/fp4moe" bench --synthetic nemotron-3-nano-30b-a3b --device cuda --prompt-tokens 512 --gen-tokens 128 --repeats 3 \
    --profile 2>&1 | tail -7
