#!/usr/bin/env bash
# scripts/gpu-batch-check.sh: the batched runtime (issue 9) in ONE command on a machine with an
# NVIDIA GPU (the H200 machine):
#   1. the GPU model tests (GPU vs CPU on every golden model and the default model; batched vs solo
#      greedy ids for 1/3/17 sequences with mixed prefill+decode steps and snapshots; graph vs
#      eager; KV growth), the Mamba-2 scan, gather_qmm and fused-op (test_ops_gpu) tests;
#   2. compute-sanitizer memcheck over a small batched run of the default model (paged KV,
#      batched decode kernels, snapshots are not in it);
#   3. the synthetic Nemotron-3-Nano-30B-A3B shape: one sequence (prefill 512 + decode 128) with
#      the expert-batched route on and FP4MOE_GATHER_EXPERT_BATCHED=0 (hashes must be equal), then
#      fp4moe bench --batch N for N = 1, 8, 32, 64, 128 (aggregate decode tok/s), and N = 64 with
#      the route off (every sequence's hash must be equal to the route-on run).
# Logs go to $OUT (default gpu-batch-out/); a short table is printed last.
#
# Usage:
#   scripts/gpu-batch-check.sh [BIN]          run (BIN: prebuilt programs from --package)
#   scripts/gpu-batch-check.sh --package BIN  on the build machine: build build-gpum and pack the
#                                             programs into BIN/batch.tar.xz (carry BIN)
# Environment: BATCH_PROMPT (default 256), BATCH_GEN (default 64) for the --batch runs.
set -u
cd "$(dirname "$0")/.."
GP_NAME=batch
GP_BUILD=build-gpum
# GP_PROGS / GP_TARGETS: the batch package's defaults (scripts/gpu-pack.sh)
. scripts/gpu-pack.sh
CFG=nemotron-3-nano-30b-a3b

[ "${1:-}" = "--package" ] || { OUT=${OUT:-gpu-batch-out}; mkdir -p "$OUT"; }
gp_main "$@"
BIN=$GP_BIN
FP="$BIN/fp4moe"
P=${BATCH_PROMPT:-256}
G=${BATCH_GEN:-64}

declare -a ROWS
row() { ROWS+=("$(printf '%-34s %-10s %5ss  %s' "$1" "$2" "$3" "${4:-}")"); }

{ date -u; nvidia-smi -L; git rev-parse --short HEAD 2>/dev/null; } >"$OUT/env.log" 2>&1

t0=$SECONDS
timeout 300 "$BIN/test_model_gpu" >"$OUT/tests.log" 2>&1
rc=$?
row "GPU model tests" "$([ $rc = 0 ] && echo PASS || echo "FAIL($rc)")" $((SECONDS - t0)) \
    "$(grep -c '^\[       OK' "$OUT/tests.log") ok, $(grep -c '^\[  FAILED  \] [a-z]' "$OUT/tests.log") failed"
t0=$SECONDS
timeout 120 "$BIN/test_ssm_gpu" >"$OUT/ssm.log" 2>&1
rc=$?
row "GPU SSM scan tests" "$([ $rc = 0 ] && echo PASS || echo "FAIL($rc)")" $((SECONDS - t0))
t0=$SECONDS
timeout 200 "$BIN/test_gather_qmm_gpu" >"$OUT/gather.log" 2>&1
rc=$?
row "GPU gather_qmm tests" "$([ $rc = 0 ] && echo PASS || echo "FAIL($rc)")" $((SECONDS - t0))
t0=$SECONDS
timeout 200 "$BIN/test_ops_gpu" >"$OUT/ops.log" 2>&1
rc=$?
row "GPU fused ops tests" "$([ $rc = 0 ] && echo PASS || echo "FAIL($rc)")" $((SECONDS - t0))
t0=$SECONDS
timeout 200 "$BIN/test_ep_gpu" >"$OUT/ep.log" 2>&1
rc=$?
row "GPU expert-parallel tests" "$([ $rc = 0 ] && echo PASS || echo "FAIL($rc)")" $((SECONDS - t0)) "$(grep -c '^\[       OK' "$OUT/ep.log") ok"

CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
if [ -n "$CS" ]; then
    t0=$SECONDS
    timeout 240 "$CS" --tool memcheck --error-exitcode 9 "$FP" bench -m models/nemotron-h-tiny-moe --device cuda \
        --batch 5 --prompt-tokens 70 --gen-tokens 6 --repeats 1 --warmup 0 >"$OUT/memcheck.log" 2>&1
    rc=$?
    row "memcheck (batch 5, default model)" "$([ $rc = 0 ] && echo CLEAN || echo "FAIL($rc)")" $((SECONDS - t0)) \
        "$(grep -m1 'ERROR SUMMARY' "$OUT/memcheck.log")"
fi

run() { # NAME ENV... -- ARGS...
    local name=$1; shift
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    local t0=$SECONDS
    env ${envs[@]+"${envs[@]}"} timeout 120 "$FP" bench --synthetic "$CFG" --device cuda "$@" --json \
        >"$OUT/$name.json" 2>"$OUT/$name.log"
    local rc=$?
    row "bench $name" "$([ $rc = 0 ] && echo DONE || echo "FAIL($rc)")" $((SECONDS - t0)) "$(tail -1 "$OUT/$name.log" | cut -c1-70)"
}
run solo_on -- --prompt-tokens 512 --gen-tokens 128 --repeats 3
run solo_off FP4MOE_GATHER_EXPERT_BATCHED=0 -- --prompt-tokens 512 --gen-tokens 128 --repeats 3
for n in 1 8 32 64 128; do
    run batch$n -- --batch $n --prompt-tokens "$P" --gen-tokens "$G" --repeats 2
done
run batch64_profile -- --batch 64 --prompt-tokens "$P" --gen-tokens 32 --repeats 1 --profile
run batch64_off FP4MOE_GATHER_EXPERT_BATCHED=0 -- --batch 64 --prompt-tokens "$P" --gen-tokens "$G" --repeats 2

python3 - "$OUT" >"$OUT/table.txt" 2>&1 <<'PY'
import json, os, sys
out = sys.argv[1]
def load(n):
    try:
        return json.load(open(os.path.join(out, n + ".json")))
    except Exception:
        return None
on, off = load("solo_on"), load("solo_off")
if on and off:
    print(f"one sequence (512 + 128): prefill {on['prefill_tok_s_median']:.0f} tok/s, decode {on['decode_tok_s_median']:.1f} tok/s; "
          f"route off: decode {off['decode_tok_s_median']:.1f}; hashes {on['gen_ids_fnv1a']} / {off['gen_ids_fnv1a']}: "
          f"{'EQUAL' if on['gen_ids_fnv1a'] == off['gen_ids_fnv1a'] else 'DIFFERENT'}")
print("| N | prefill tok/s (aggregate) | decode tok/s (aggregate) | per sequence | hash of all sequences |")
print("|---|---|---|---|---|")
for n in (1, 8, 32, 64, 128):
    j = load(f"batch{n}")
    if not j:
        print(f"| {n} | (no result) | | | |")
        continue
    print(f"| {n} | {j['prefill_tok_s_aggregate']:.0f} | {j['decode_tok_s_aggregate']:.0f} | "
          f"{j['decode_tok_s_per_sequence']:.1f} | {j['gen_ids_fnv1a_all']} |")
b1, b64, b64o = load("batch1"), load("batch64"), load("batch64_off")
if b1 and on:
    print(f"batch 1 sequence 0 hash {b1['gen_ids_fnv1a']} (its prompt is the solo run's, {j['prompt_tokens']} tokens)")
if b64 and b64o:
    same = b64["gen_ids_fnv1a_per_sequence"] == b64o["gen_ids_fnv1a_per_sequence"]
    ndiff = sum(a != b for a, b in zip(b64["gen_ids_fnv1a_per_sequence"], b64o["gen_ids_fnv1a_per_sequence"]))
    print(f"N=64 route on vs FP4MOE_GATHER_EXPERT_BATCHED=0: {'EQUAL' if same else f'{ndiff} sequences DIFFERENT'}; "
          f"decode {b64['decode_tok_s_aggregate']:.0f} vs {b64o['decode_tok_s_aggregate']:.0f} tok/s")
    print(f"target N=64 >= 6000 aggregate decode tok/s: {'MET' if b64['decode_tok_s_aggregate'] >= 6000 else 'MISSED'}")
pr = load("batch64_profile")
if pr:
    print("N=64 device ms per decode step: " + ", ".join(f"{k} {v:.3f}" for k, v in pr["decode_split_ms_per_step"].items()))
    print("N=64 device ms, prefill of all prompts: " + ", ".join(f"{k} {v:.1f}" for k, v in pr["prefill_split_ms"].items()))
PY
echo
cat "$OUT/table.txt"
echo
grep -E "differ from solo|FAILED|ERROR" "$OUT/tests.log" | head -40
printf '%s\n' "${ROWS[@]}" | tee "$OUT/summary.txt"
