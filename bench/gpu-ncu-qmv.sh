#!/usr/bin/env bash
# bench/gpu-ncu-qmv.sh: Nsight Compute's view of the decode qmv launches (issue 12, the tensor-core
# gq_qmv_mma_kernel: plain linears and a token's routed experts), one row per launch: grid and block,
# duration, DRAM throughput, achieved occupancy, issue-slot use and the stall reasons per issued
# instruction (each by name: the regex form of the stall metrics was refused on the H200 image, see
# docs/GPU-NOTES.md session 15). The run is `fp4moe bench` with a ONE-token prompt on the synthetic
# Nemotron-3-Nano-30B-A3B shape, so every call of its prefill is a decode-shaped call (one row; the
# routed experts 6 rows of one x row), issued eagerly (no graph, no PDL: ncu serialises kernels anyway).
# The first N launches cover layer 0 (Mamba-2: in_proj, out_proj), layer 1 (MoE: the routed experts'
# up and down, the shared expert's up and down), ... - the grid tells which: blocks = 16-feature
# tiles x slots (e.g. in_proj 644, out_proj 168, expert up 116 x 6 = 696, expert down 168 x 6 = 1008).
# Usage (GPU machine): bench/gpu-ncu-qmv.sh PKG [N]   PKG: a batch package (scripts/gpu-staged-check.sh
#        --package); N launches (default 12). Output: a table on stdout; ncu's CSV in $OUT (default /tmp).
# Other kernels and prompts (the same table): KREGEX (default gq_qmv_mma_kernel), PROMPT (prompt tokens,
# default 1), e.g. KREGEX=gq_batched_kernel PROMPT=512 for the expert-batched gather of a 512-token
# prefill (its first launches: layer 1's up and down projections).
set -u
cd "$(dirname "$0")/.."
GP_NAME=batch
GP_BUILD=build-gpum
. scripts/gpu-pack.sh
gp_main "${1:?usage: bench/gpu-ncu-qmv.sh PKG [N]}"
N=${2:-12}
OUT=${OUT:-/tmp}
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
[ -n "$NCU" ] || { echo "no ncu"; exit 1; }
R="long_scoreboard short_scoreboard wait barrier mio_throttle lg_throttle math_pipe_throttle not_selected no_instruction branch_resolving dispatch_stall"
KREGEX=${KREGEX:-gq_qmv_mma_kernel}
PROMPT=${PROMPT:-1}
M=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,sm__inst_issued.avg.pct_of_peak_sustained_active,launch__grid_size,launch__block_size,launch__registers_per_thread
for r in $R; do M="$M,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"; done
timeout 300 "$NCU" --csv --print-units base --cache-control none -k "regex:$KREGEX" --launch-count "$N" --metrics "$M" \
    "$GP_BIN/fp4moe" bench --synthetic nemotron-3-nano-30b-a3b --device cuda --prompt-tokens "$PROMPT" --gen-tokens 1 \
    --repeats 1 --warmup 0 >"$OUT/ncu_qmv.csv" 2>"$OUT/ncu_qmv.log" || { echo "ncu failed:"; tail -5 "$OUT/ncu_qmv.log"; }
python3 - "$OUT/ncu_qmv.csv" "$R" <<'EOF'
import csv, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
if not rows:
    sys.exit("no ncu rows")
h = rows[0]
ci = {n: i for i, n in enumerate(h)}
per = {}  # (launch id) -> {metric: value}
for r in rows[1:]:
    if len(r) != len(h):
        continue
    k = r[ci["ID"]]
    per.setdefault(k, {"name": r[ci["Kernel Name"]][:24]})[r[ci["Metric Name"]]] = r[ci["Metric Value"]]
stalls = sys.argv[2].split()
short = {"long_scoreboard": "lsb", "short_scoreboard": "ssb", "wait": "wait", "barrier": "bar", "mio_throttle": "mio",
         "lg_throttle": "lg", "math_pipe_throttle": "math", "not_selected": "nsel", "no_instruction": "noin",
         "branch_resolving": "br", "dispatch_stall": "disp"}
print("| id | grid | block | regs | us | DRAM % | warps % | issue % | tensor % | " + " | ".join(short[s] for s in stalls) + " |")
print("|---" * (9 + len(stalls)) + "|")
for k, m in per.items():
    g = lambda n: m.get(n, "?")
    t = g("gpu__time_duration.sum")
    try:
        t = f"{float(t.replace(',', '')) / 1000:.2f}"  # ns -> us
    except ValueError:
        pass
    vals = [g(f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio") for s in stalls]
    print(f"| {k} | {g('launch__grid_size')} | {g('launch__block_size')} | {g('launch__registers_per_thread')} | {t} | "
          f"{g('dram__throughput.avg.pct_of_peak_sustained_elapsed')} | {g('sm__warps_active.avg.pct_of_peak_sustained_active')} | "
          f"{g('sm__inst_issued.avg.pct_of_peak_sustained_active')} | "
          f"{g('sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active')} | " + " | ".join(vals) + " |")
EOF
