#!/usr/bin/env bash
# bench/gpu-ncu-source.sh: where one kernel's warps stall, instruction by instruction (issue 12): Nsight Compute's
# source counters and PC-sampled warp states of one launch of the kernels matching REGEX (after SKIP launches) in
# `fp4moe bench --synthetic nemotron-3-nano-30b-a3b --prompt-tokens P --gen-tokens 1`, exported as the per-SASS-
# instruction CSV of the source page (OUT/NAME.csv.gz) and the report (OUT/NAME.ncu-rep).
# Usage: bench/gpu-ncu-source.sh PKG P REGEX SKIP NAME   (PKG: a folder with batch.tar.xz; on the GPU machine)
#        NCU_SECTIONS="--section ComputeWorkloadAnalysis ...": more sections in the report and its details text.
# Summarise here with bench/ncu_source_summary.py OUT/NAME.csv.gz.
set -u
cd "$(dirname "$0")/.."
PKG=$1 P=$2 RE=$3 SKIP=$4 NAME=$5
OUT=${OUT:-/tmp}
d=$(mktemp -d)
tar -xJf "$PKG/batch.tar.xz" -C "$d"
export LD_LIBRARY_PATH="$d:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu"; exit 1; }
timeout 300 "$NCU" -k "regex:$RE" --launch-skip "$SKIP" --launch-count 1 --cache-control none --clock-control none \
    --section SourceCounters --section WarpStateStats --section SpeedOfLight ${NCU_SECTIONS:-} --import-source no \
    -f -o "$OUT/$NAME" "$d/fp4moe" bench --synthetic nemotron-3-nano-30b-a3b --device cuda --prompt-tokens "$P" \
    --gen-tokens 1 --repeats 1 --warmup 0 >"$OUT/$NAME.log" 2>&1
echo "ncu rc=$? ($NAME)"
"$NCU" -i "$OUT/$NAME.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip >"$OUT/$NAME.csv.gz"
"$NCU" -i "$OUT/$NAME.ncu-rep" --page details 2>&1 | grep -v "^==" | head -${NCU_DETAIL_LINES:-80} >"$OUT/$NAME.details.txt"
