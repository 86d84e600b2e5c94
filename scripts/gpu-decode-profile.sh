#!/usr/bin/env bash
# scripts/gpu-decode-profile.sh: where the device time of one forward goes, kernel by kernel, on the
# H200 machine (issue 12): the synthetic Nemotron-3-Nano-30B-A3B shape, Nsight Compute's
# gpu__time_duration of every kernel of a short run (prefill P tokens, then D decode steps), split
# into forwards at the embedding kernel (the first kernel of every forward), summed by kernel name
# for the prefill and for the last decode step, next to the step's wall time from `fp4moe bench`
# (the difference is launch gaps and idle time between kernels). Also the layer-kind split of
# `bench --profile` (CUDA events).
#
# Usage: scripts/gpu-decode-profile.sh BIN [OLD]   BIN (and OLD): a directory with batch.tar.xz
#        (made by scripts/gpu-batch-check.sh --package BIN) or with an fp4moe program. With OLD,
#        `bench` runs old and new alternately (3 rounds each) and prints both, so that a change is
#        measured against its parent in the same run.
# Environment: PROMPT (default 512), OUT (default gpu-profile-out), NCU_CACHE (all: caches flushed
# before every kernel, the ncu default; none: warm, closer to a graph replay), GEN (decode steps of the
# profiled run, default 4), NCU_ONLY=1 (only the Nsight Compute run and its tables), BATCH (sequences of
# the profiled run through `bench --batch`, unset: one; e.g. BATCH=64 PROMPT=256 GEN=2 for the 64-sequence
# decode step; settings such as FP4MOE_GATHER_EXPERT_BATCHED=0 pass through the environment), NCU_DETAIL
# (a kernel-name regex: Nsight Compute's sections and stall reasons of a few of its launches, ncu_detail.txt;
# NCU_DETAIL_SKIP, NCU_DETAIL_COUNT).
set -u
cd "$(dirname "$0")/.."
BIN=${1:?usage: scripts/gpu-decode-profile.sh BIN [OLD]}
OLD=${2:-}
OUT=${OUT:-gpu-profile-out}
P=${PROMPT:-512}
mkdir -p "$OUT"
unpack() { # DIR -> directory of programs
    if [ -f "$1/batch.tar.xz" ]; then
        local d
        d=$(mktemp -d)
        tar -xJf "$1/batch.tar.xz" -C "$d"
        echo "$d"
    else
        echo "$1"
    fi
}
BIN=$(unpack "$BIN")
export LD_LIBRARY_PATH="$BIN:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
FP="$BIN/fp4moe"
CFG=nemotron-3-nano-30b-a3b
if [ -n "$OLD" ]; then
    OLD=$(unpack "$OLD")
    for round in 1 2 3; do
        for v in old new; do
            f=$([ $v = old ] && echo "$OLD/fp4moe" || echo "$FP")
            LD_LIBRARY_PATH="$(dirname "$f"):/usr/local/cuda/lib64" timeout 120 "$f" bench --synthetic $CFG \
                --device cuda --prompt-tokens "$P" --gen-tokens 64 --repeats 3 --json >"$OUT/cmp-$v-$round.json" \
                2>"$OUT/cmp-$v-$round.log"
        done
    done
    echo "== same run, old vs new (prefill $P tokens, decode 64; medians of 3 repeats per round)"
    python3 - "$OUT" <<'EOF2'
import json, sys, glob
for v in ("old", "new"):
    pf, dc, hs = [], [], set()
    for f in sorted(glob.glob(f"{sys.argv[1]}/cmp-{v}-*.json")):
        try:
            j = json.load(open(f))
        except Exception as e:
            print(v, f, "unreadable:", e); continue
        pf.append(j["prefill_tok_s_median"]); dc.append(j["decode_tok_s_median"]); hs.add(j.get("gen_ids_fnv1a", "?"))
    print(f"{v}: prefill tok/s {' '.join(f'{x:.0f}' for x in pf)}   decode tok/s {' '.join(f'{x:.1f}' for x in dc)}   hashes {sorted(hs)}")
EOF2
fi
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)

if [ -z "${NCU_ONLY:-}" ]; then
timeout 120 "$FP" bench --synthetic $CFG --device cuda --prompt-tokens "$P" --gen-tokens 64 --repeats 3 \
    --json >"$OUT/bench.json" 2>"$OUT/bench.log"
timeout 120 "$FP" bench --synthetic $CFG --device cuda --prompt-tokens "$P" --gen-tokens 64 --repeats 3 \
    --profile >"$OUT/profile.txt" 2>&1
fi
if [ -n "$NCU" ]; then
    timeout 400 "$NCU" --metrics gpu__time_duration.sum --csv --clock-control none --cache-control "${NCU_CACHE:-all}" \
        --kernel-name-base function \
        --kernel-name "regex:^(?!synth)" "$FP" bench --synthetic $CFG --device cuda --prompt-tokens "$P" \
        ${BATCH:+--batch "$BATCH"} --gen-tokens "${GEN:-4}" --repeats 1 --warmup 0 >"$OUT/ncu.csv" 2>"$OUT/ncu.log"
    echo "ncu rc=$?"
    if [ -n "${NCU_DETAIL:-}" ]; then
        # Nsight Compute's sections for NCU_DETAIL_COUNT launches (default 2) of the kernels matching the
        # regex NCU_DETAIL after NCU_DETAIL_SKIP (default 20) of them: speed of light, memory workload (L1 /
        # L2 hit rates and throughputs), warp states, scheduler, occupancy, and the stall reasons.
        st=
        for r in barrier branch_resolving dispatch_stall drain imc_miss lg_throttle long_scoreboard \
            math_pipe_throttle membar mio_throttle misc no_instruction not_selected selected short_scoreboard \
            sleeping tex_throttle wait; do
            st="$st${st:+,}smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"
        done
        ncu_detail() {
            timeout 300 "$NCU" -k "regex:$NCU_DETAIL" --launch-skip "${NCU_DETAIL_SKIP:-20}" \
                --launch-count "${NCU_DETAIL_COUNT:-2}" --clock-control none --cache-control "${NCU_CACHE:-all}" \
                --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
                --section SchedulerStats --section Occupancy --section LaunchStats "$@" \
                "$FP" bench --synthetic $CFG --device cuda --prompt-tokens "$P" ${BATCH:+--batch "$BATCH"} \
                --gen-tokens "${GEN:-4}" --repeats 1 --warmup 0 >"$OUT/ncu_detail.txt" 2>&1
        }
        ncu_detail --metrics "$st" || ncu_detail
        echo "ncu detail rc=$?"
    fi
fi
echo "== bench --profile (CUDA events, ms)"
cat "$OUT/profile.txt" | tail -25
echo "== bench"
python3 - "$OUT/bench.json" <<'EOF'
import json, sys
try:
    j = json.load(open(sys.argv[1]))
    print({k: j[k] for k in j if "tok" in k or "ms" in k})
except Exception as e:
    print("bench json:", e)
EOF
python3 scripts/ncu_kernels.py "$OUT/ncu.csv"         # per kernel name: prefill, last decode step
python3 scripts/ncu_kernels.py --by-grid "$OUT/ncu.csv" # the gather calls by shape (grid size)
if [ -f "$OUT/ncu_detail.txt" ]; then
    echo "== Nsight Compute detail ($NCU_DETAIL)"
    grep -v "^==PROF==\|^    ---\|^$" "$OUT/ncu_detail.txt" | cut -c1-140
fi
