#!/usr/bin/env bash
# bench/gpu-ncu-gather.sh: Nsight Compute's view of one expert-batched gather_qmm launch (issue 12):
# speed of light, warp states, scheduler issue rate, pipe use (and the per-reason stall metrics where
# this ncu accepts them by regex; on the H200 image of 2026-12-03 it did not), for the first
# launch whose name matches REGEX in `gpu_bench --tokens T` (the up projection's first warm-up call
# of the batched route). On the GPU machine, with the batch package's libraries.
# Usage: bench/gpu-ncu-gather.sh PKG GPU_BENCH[.xz] T REGEX   e.g. gpu-bin/new gpu-bin/cand/gb_v0.xz 2048 gq_batched_wg
set -u
cd "$(dirname "$0")/.."
GP_NAME=batch
GP_BUILD=build-gpum
. scripts/gpu-pack.sh
gp_main "$1"
P=$2
case $P in *.xz) xz -dc "$P" >"$GP_BIN/ncu_gpu_bench" ;; *) cp "$P" "$GP_BIN/ncu_gpu_bench" ;; esac
chmod +x "$GP_BIN/ncu_gpu_bench"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
[ -n "$NCU" ] || { echo "no ncu"; exit 1; }
M=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum
run() {
    timeout 240 "$NCU" -k "regex:$1" --launch-count 1 --section SpeedOfLight --section WarpStateStats \
        --section SchedulerStats --section ComputeWorkloadAnalysis --section Occupancy "${@:3}" \
        "$GP_BIN/ncu_gpu_bench" --tokens "$2" >"${OUT:-/tmp}/ncu_raw.txt" 2>&1
}
# the stall reasons by regex (one metric per reason), else without them
run "$4" "$3" --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" --metrics "$M" ||
    run "$4" "$3" --metrics "$M"
grep -v "^|\|^device\|^$" "${OUT:-/tmp}/ncu_raw.txt" | grep -v "^==PROF==" | cut -c1-150
