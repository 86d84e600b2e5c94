#!/usr/bin/env bash
# scripts/gpu-attention-check.sh: attention on the GPU (issue 11) in ONE command on the H200
# machine: the attention kernels against the fp64 reference (test_attention_gpu), the same test
# built with each deliberate attention fault (it must FAIL), compute-sanitizer memcheck of the test,
# then end to end on the synthetic Nemotron-3-Nano-30B-A3B shape: a 32,768-token prompt and decode
# at that context, with this build and (when given) an older fp4moe binary in the same run.
# (The 32k runs take bench's default warm-up run first: a cold first run pays the process's first-use
# costs - a cold 32k run read 13,385 tok/s where warm runs of nearby builds read 27,783-28,347,
# docs/PERFORMANCE.md; the profile run stays cold, for its split only.)
# Usage: scripts/gpu-attention-check.sh BIN [OLD_FP4MOE [FAULT_DIR]]
#   BIN        packed programs (scripts/gpu-batch-check.sh --package BIN)
#   OLD_FP4MOE an fp4moe binary of an earlier commit, for the same-run comparison (optional; "self":
#              this build's, run with OLD_ENV, e.g. OLD_ENV=FP4MOE_CUDA_ATTENTION=mma)
#   FAULT_DIR  test_attention_gpu-causal_mask / -kv_block binaries (FP4MOE_INJECT_FAULT builds; or
#              the same names with .xz)
# Environment: RACECHECK=0 skips the racecheck run. CANDIDATES: a folder of candidate-kernel programs (NAME or NAME.xz: a bench/ source built
# with each variant's macros, checking itself against the production kernel and timing both), each
# run in turn; its "check ... PASS" count goes to the table, its "|" lines to the end of the output.
# (2026-12-02: the two-row-tile prefill kernel, measured so, is now the production one.)
set -u
cd "$(dirname "$0")/.."
GP_NAME=batch
GP_BUILD=build-gpum
GP_PROGS="fp4moe test_model_gpu test_ssm_gpu test_gather_qmm_gpu test_attention_gpu"
GP_TARGETS="fp4moe_cli"
. scripts/gpu-pack.sh
OUT=${OUT:-gpu-attention-out}
mkdir -p "$OUT"
gp_main "$1"
BIN=$GP_BIN
OLD=${2:-}
[ "$OLD" = self ] && OLD=$BIN/fp4moe
FAULTS=${3:-}
CFG=nemotron-3-nano-30b-a3b
declare -a ROWS
row() { ROWS+=("$(printf '%-40s %-10s %5ss  %s' "$1" "$2" "$3" "${4:-}")"); }

t0=$SECONDS
timeout 200 "$BIN/test_attention_gpu" >"$OUT/attention.log" 2>&1
rc=$?
row "attention tests" "$([ $rc = 0 ] && echo PASS || echo "FAIL($rc)")" $((SECONDS - t0)) "$(grep -m1 'worst' "$OUT/attention.log")"
for f in causal_mask kv_block; do
    fb=$FAULTS/test_attention_gpu-$f
    if [ -n "$FAULTS" ] && [ -f "$fb.xz" ]; then
        xz -dc "$fb.xz" >"$BIN/test_attention_gpu-$f" && chmod +x "$BIN/test_attention_gpu-$f"
        fb=$BIN/test_attention_gpu-$f
    fi
    [ -n "$FAULTS" ] && [ -x "$fb" ] || continue
    t0=$SECONDS
    timeout 200 "$fb" >"$OUT/fault-$f.log" 2>&1
    rc=$?
    row "fault $f" "$([ $rc != 0 ] && echo "CAUGHT" || echo "MISSED")" $((SECONDS - t0)) "$(grep -m1 'error' "$OUT/fault-$f.log" | cut -c1-60)"
done
CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
if [ -n "$CS" ]; then
    t0=$SECONDS
    timeout 300 "$CS" --tool memcheck --error-exitcode 9 "$BIN/test_attention_gpu" >"$OUT/memcheck.log" 2>&1
    rc=$?
    row "memcheck test_attention_gpu" "$([ $rc = 0 ] && echo CLEAN || echo "FAIL($rc)")" $((SECONDS - t0)) "$(grep -m1 'ERROR SUMMARY' "$OUT/memcheck.log")"
    [ "${RACECHECK:-1}" = 0 ] || { t0=$SECONDS
    timeout 400 "$CS" --tool racecheck --error-exitcode 9 "$BIN/test_attention_gpu" >"$OUT/racecheck.log" 2>&1
    rc=$?
    row "racecheck test_attention_gpu" "$([ $rc = 0 ] && echo CLEAN || echo "FAIL($rc)")" $((SECONDS - t0)) "$(grep -m1 'RACECHECK SUMMARY' "$OUT/racecheck.log")"; }
fi
WIDE_TABLES=""
for w in ${CANDIDATES:+"$CANDIDATES"/*}; do
    [ -e "$w" ] || continue
    n=$(basename "$w" .xz)
    case $w in *.xz) xz -dc "$w" >"$BIN/$n" && chmod +x "$BIN/$n" ;; *) cp "$w" "$BIN/$n" ;; esac
    t0=$SECONDS
    timeout 200 "$BIN/$n" >"$OUT/$n.log" 2>&1
    rc=$?
    row "$n" "$([ $rc = 0 ] && echo PASS || echo "FAIL($rc)")" $((SECONDS - t0)) "$(grep -c 'PASS$' "$OUT/$n.log") checks pass"
    WIDE_TABLES="$WIDE_TABLES $OUT/$n.log"
done
e2e() { # NAME BINARY ARGS...   (the OLD binary's runs with OLD_ENV)
    local name=$1 fp=$2; shift 2
    local t0=$SECONDS envs=FP4MOE_X=0
    case $name in *_old) envs=${OLD_ENV:-FP4MOE_X=0} ;; esac
    # shellcheck disable=SC2086
    env $envs timeout 200 "$fp" bench --synthetic "$CFG" --device cuda "$@" --json >"$OUT/$name.json" 2>"$OUT/$name.log"
    local rc=$?
    row "bench $name" "$([ $rc = 0 ] && echo DONE || echo "FAIL($rc)")" $((SECONDS - t0))
}
e2e ctx32k "$BIN/fp4moe" --prompt-tokens 32768 --gen-tokens 32 --repeats 2
e2e ctx32k_profile "$BIN/fp4moe" --prompt-tokens 32768 --gen-tokens 32 --repeats 1 --warmup 0 --profile
e2e short "$BIN/fp4moe" --prompt-tokens 512 --gen-tokens 128 --repeats 3
[ -n "$OLD" ] && e2e ctx32k_old "$OLD" --prompt-tokens 32768 --gen-tokens 32 --repeats 2
[ -n "$OLD" ] && e2e short_old "$OLD" --prompt-tokens 512 --gen-tokens 128 --repeats 3
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(n):
    try: return json.load(open(os.path.join(out, n + ".json")))
    except Exception: return None
print("| run | prefill tok/s | decode tok/s | hash |")
print("|---|---|---|---|")
for n in ("ctx32k", "ctx32k_old", "short", "short_old"):
    j = load(n)
    if j: print(f"| {n} ({j['prompt_tokens']}+{j['gen_tokens']}) | {j['prefill_tok_s_median']:.0f} | {j['decode_tok_s_median']:.1f} | {j['gen_ids_fnv1a']} |")
p = load("ctx32k_profile")
if p:
    print("32k split, prefill ms: " + ", ".join(f"{k} {v:.1f}" for k, v in p["prefill_split_ms"].items()))
    print("32k split, decode ms/token: " + ", ".join(f"{k} {v:.3f}" for k, v in p["decode_split_ms_per_token"].items()))
PY
for f in $WIDE_TABLES; do echo "== $(basename "$f" .log)"; grep '^|' "$f"; done
printf '%s\n' "${ROWS[@]}"
