#!/usr/bin/env bash
# bench/patches/build-packages.sh: the device packages of unrun patches, built here (no GPU needed) for the
# next GPU session (docs/GPU-NOTES.md "Next GPU session"): a worktree of HEAD with the patches applied and
# committed, its staged-check package with every fault build (scripts/gpu-staged-check.sh --package), the
# variant builds the list names, and carry folders of hard links (each under the 64 MiB limit with the tree).
# Sequential on purpose: two builds into one build-gpum break each other (GPU-NOTES, session 24).
# Usage: bench/patches/build-packages.sh OUT PATCH...     e.g. bench/patches/build-packages.sh gpu-bin/s26 \
#            step-overhead kg-min-rows conv1d-c2 ssd-load router-planes
# Environment: OLD_FP4MOE (optional): main's fp4moe (.xz) to copy in as OUT/old_fp4moe.xz;
#              GW (optional): a folder with gw_main.xz / gw_cand.xz (bench/gpu_gather_wg builds) to copy in.
# ~35 min on the 2-core machine. Needs nvcc (sm_90a) and a configured-or-configurable build-gpum.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=$(realpath -m "${1:?usage: build-packages.sh OUT PATCH...}")
shift
OLD_FP4MOE=${OLD_FP4MOE:+$(realpath "$OLD_FP4MOE")}   # absolute: the build runs in the worktree
GW=${GW:+$(realpath "$GW")}
WT=$(mktemp -d /tmp/fp4moe-pkg.XXXXXX)
git worktree add -q --detach "$WT" HEAD
trap 'git -C "$ROOT" worktree remove --force "$WT"' EXIT
cd "$WT"
for p in "$@"; do git apply "$ROOT/bench/patches/$p.diff"; done
git -c user.name=pkg -c user.email=pkg@localhost commit -qam "patches: $*"
rm -rf "$OUT"
scripts/gpu-staged-check.sh --package "$OUT"
G=src/kernels/cuda/gather_batched.cu
TARGET=fp4moe_cli PROG=fp4moe bench/build-variants.sh "$OUT/u2/fp4moe" $G "-DGW_UNROLL=2"
for v in "w4 -DGW_WGS=4" "w6 -DBW_WARPS=6" "xa -DGW_XASYNC=1"; do
    set -- $v
    TARGET=fp4moe_cli PROG=fp4moe bench/build-variants.sh "$OUT/$1/fp4moe" $G "$2"
    for t in test_gather_qmm_gpu test_ops_gpu; do TARGET=$t PROG=$t bench/build-variants.sh "$OUT/$1/$t" $G "$2"; done
done
TARGET=fp4moe_cli PROG=fp4moe bench/build-variants.sh "$OUT/v17/fp4moe" $G "-DKG_MIN_ROWS=17"
for t in test_gather_qmm_gpu test_ops_gpu test_model_gpu; do
    TARGET=$t PROG=$t bench/build-variants.sh "$OUT/v17/$t" $G "-DKG_MIN_ROWS=17"
done
[ -n "${OLD_FP4MOE:-}" ] && cp "$OLD_FP4MOE" "$OUT/old_fp4moe.xz"
[ -n "${GW:-}" ] && cp -r "$GW" "$OUT/gw"
# carry folders: hard links into OUT, one a device call
cd "$OUT/.."
S=$(basename "$OUT")
mk() { local d=$1; shift; rm -rf "$d"; for p in "$@"; do [ -e "$S/$p" ] || continue; mkdir -p "$d/$(dirname "$p")"; cp -al "$S/$p" "$d/$p"; done; }
mk c1 batch.tar.xz old_fp4moe.xz f_w32 f_ring f_wgd f_tstr f_conv f_xrow f_ssd f_planes f_sort w6/fp4moe xa/fp4moe
mk c2 batch.tar.xz old_fp4moe.xz u2/fp4moe w4/fp4moe
mk c3 batch.tar.xz old_fp4moe.xz v17 w4/test_gather_qmm_gpu w4/test_ops_gpu w6/test_gather_qmm_gpu w6/test_ops_gpu \
   xa/test_gather_qmm_gpu xa/test_ops_gpu gw
for d in c1 c2 c3; do echo "$d: $(find "$d" -type f -printf '%s\n' | awk '{s += $1} END {printf "%.1f MB", s / 1e6}')"; done
echo "tree: $(git -C "$ROOT" ls-files -z | (cd "$ROOT" && xargs -0 du -cb) | tail -1 | cut -f1) bytes (a call: tree + one folder <= 64 MiB)"
