#!/usr/bin/env bash
# scripts/gpu-e2e-check.sh: issue 6 in ONE command on a machine with an NVIDIA GPU (the H200 machine):
# the GPU model tests (GPU vs CPU runtime on the golden models, the default model and synthetic
# models), then the full Nemotron-3-Nano-30B-A3B shape with synthetic NVFP4 weights made in GPU
# memory (fp4moe bench --synthetic nemotron-3-nano-30b-a3b --device cuda):
#   - prefill 512 / decode 128 with the expert-batched route on, and with FP4MOE_GATHER_EXPERT_BATCHED=0
#     (both greedy-token hashes printed; they must be equal) and the prefill speedup,
#   - prefill 2048 and 8192,
#   - the device-time split by layer kind (--profile: CUDA events, a separate run so that they do
#     not perturb the timed ones),
# each speed next to its memory floor (weights once per prefill, active weights once per decoded
# token, at 4.2 TB/s) as a fraction. Logs go to $OUT (default gpu-e2e-out/); a short table is
# printed last.
#
# Usage:
#   scripts/gpu-e2e-check.sh [BIN]        run; BIN holds prebuilt programs (--package: e2e.tar.xz),
#                                         default BIN=build-gpum/e2e-bin when present, else build here
#   scripts/gpu-e2e-check.sh --package BIN
#                                         on the build machine (nvcc, no GPU needed): build
#                                         build-gpum and pack fp4moe, test_model_gpu and the shared
#                                         libraries they need beyond glibc/CUDA into BIN/e2e.tar.xz
#                                         (~20 MB), to carry (run's carry: ["build-gpum/e2e-bin"]).
# Environment: E2E_QUICK=1: fewer repeats, no 8192; E2E_TESTS=0: skip the tests.
set -u
cd "$(dirname "$0")/.."
GP_NAME=e2e
GP_BUILD=build-gpum
GP_PROGS="fp4moe test_model_gpu"
GP_TARGETS="fp4moe_cli test_model_gpu"
. scripts/gpu-pack.sh
CFG=nemotron-3-nano-30b-a3b

[ "${1:-}" = "--package" ] || { OUT=${OUT:-gpu-e2e-out}; mkdir -p "$OUT"; }
gp_main "$@"
BIN=$GP_BIN
QUICK=${E2E_QUICK:-0}
FP="$BIN/fp4moe"

declare -a ROWS
row() { ROWS+=("$(printf '%-30s %-10s %6ss  %s' "$1" "$2" "$3" "${4:-}")"); }

# 0. the machine
{
    date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem \
        --format=csv; ldd "$FP"; git rev-parse --short HEAD 2>/dev/null; git status --short 2>/dev/null | head -50
} >"$OUT/env.log" 2>&1
if ldd "$FP" | grep -q "not found"; then
    echo "gpu-e2e: missing shared libraries (see $OUT/env.log)" >&2
    grep "not found" "$OUT/env.log" >&2
fi

# 1. the GPU model tests
if [ "${E2E_TESTS:-1}" = 1 ]; then
    t0=$SECONDS
    timeout 180 "$BIN/test_model_gpu" >"$OUT/tests.log" 2>&1
    rc=$?
    row "GPU model tests" "$([ $rc = 0 ] && echo PASS || echo "FAIL($rc)")" $((SECONDS - t0)) \
        "$(grep -c '^\[       OK' "$OUT/tests.log") ok, $(grep -c '^\[  FAILED  \] [a-z]' "$OUT/tests.log") failed; $(grep -m1 'worst row error' "$OUT/tests.log")"
fi

# 2. the benchmarks (JSON per run; each run makes the 17.6 GB of weights again, in ~1 s)
bench() { # NAME ENV... -- ARGS...: one fp4moe bench run into $OUT/NAME.json (+ .log)
    local name=$1; shift
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    local t0=$SECONDS
    env ${envs[@]+"${envs[@]}"} timeout 60 "$FP" bench --synthetic "$CFG" --device cuda "$@" >"$OUT/$name.json" 2>"$OUT/$name.log"
    local rc=$?
    row "bench $name" "$([ $rc = 0 ] && echo DONE || echo "FAIL($rc)")" $((SECONDS - t0)) \
        "$(tail -1 "$OUT/$name.log" | cut -c1-80)"
}
R=$([ "$QUICK" = 1 ] && echo 3 || echo 5)
bench p512_on -- --prompt-tokens 512 --gen-tokens 128 --repeats "$R" --json
bench p512_off FP4MOE_GATHER_EXPERT_BATCHED=0 -- --prompt-tokens 512 --gen-tokens 128 --repeats "$R" --json
bench p2048 -- --prompt-tokens 2048 --gen-tokens 16 --repeats 3 --json
[ "$QUICK" = 1 ] || bench p8192 -- --prompt-tokens 8192 --gen-tokens 16 --repeats 3 --json
t0=$SECONDS
timeout 60 "$FP" bench --synthetic "$CFG" --device cuda --prompt-tokens 512 --gen-tokens 128 --repeats 3 \
    --profile >"$OUT/profile.txt" 2>"$OUT/profile.log"
rc=$?
row "bench profile (split)" "$([ $rc = 0 ] && echo DONE || echo "FAIL($rc)")" $((SECONDS - t0))
timeout 60 "$FP" bench --synthetic "$CFG" --device cuda --prompt-tokens 2048 --gen-tokens 16 --repeats 3 \
    --profile >"$OUT/profile2048.txt" 2>>"$OUT/profile.log"

# 3. the table
python3 - "$OUT" >"$OUT/table.txt" 2>&1 <<'EOF'
import json, os, sys
out = sys.argv[1]
def load(n):
    try:
        with open(os.path.join(out, n + ".json")) as f:
            return json.load(f)
    except Exception:
        return None
runs = [(n, load(n)) for n in ("p512_on", "p512_off", "p2048", "p8192")]
print("| run | prefill tok/s | floor | fraction | decode tok/s | floor | fraction | gen ids hash |")
print("|---|---|---|---|---|---|---|---|")
for n, j in runs:
    if not j:
        print(f"| {n} | (no result) | | | | | | |")
        continue
    print(f"| {n} ({j['prompt_tokens']}+{j['gen_tokens']}) | {j['prefill_tok_s_median']:.0f} | {j['prefill_floor_tok_s']:.0f} | "
          f"{j['prefill_floor_fraction']:.3f} | {j['decode_tok_s_median']:.1f} | {j['decode_floor_tok_s']:.0f} | "
          f"{j['decode_floor_fraction']:.3f} | {j['gen_ids_fnv1a']} |")
on, off = runs[0][1], runs[1][1]
if on and off:
    same = on["gen_ids_fnv1a"] == off["gen_ids_fnv1a"]
    print(f"\nroute on vs FP4MOE_GATHER_EXPERT_BATCHED=0: hashes {on['gen_ids_fnv1a']} / {off['gen_ids_fnv1a']}: "
          f"{'EQUAL' if same else 'DIFFERENT'}; prefill speedup {on['prefill_tok_s_median'] / off['prefill_tok_s_median']:.2f}x")
    if not same and "gen_ids" in on and "gen_ids" in off:
        d = next((i for i, (x, y) in enumerate(zip(on["gen_ids"], off["gen_ids"])) if x != y), None)
        print(f"  first different generated token: step {d} ({on['gen_ids'][d]} vs {off['gen_ids'][d]})")
    print(f"targets: prefill 512 >= 40000 tok/s: {'MET' if on['prefill_tok_s_median'] >= 40000 else 'MISSED'} "
          f"({on['prefill_tok_s_median']:.0f}); decode >= 400 tok/s: {'MET' if on['decode_tok_s_median'] >= 400 else 'MISSED'} "
          f"({on['decode_tok_s_median']:.1f})")
    print(f"weights read per prefill {on['weight_bytes_prefill'] / 1e9:.2f} GB, per decoded token "
          f"{on['weight_bytes_decode_token'] / 1e9:.3f} GB, floors at {on['floor_bw_bytes_s'] / 1e12:.1f} TB/s")
EOF
echo
cat "$OUT/table.txt"
echo
echo "device time by layer kind (ms; prefill 512 / decode per token):"
grep -A8 '^split' "$OUT/profile.txt"
echo "(prefill 2048:)"
grep -A8 '^split' "$OUT/profile2048.txt" | cut -c1-40
echo
printf '%s\n' "${ROWS[@]}" | tee "$OUT/summary.txt"
