#!/usr/bin/env bash
# bench/patches/build-packages.sh: the device packages of unrun patches, built here (no GPU needed) for the
# next GPU session (docs/GPU-NOTES.md "Next GPU session"): a worktree of HEAD with the patches applied and
# committed, its staged-check package with every fault build (scripts/gpu-staged-check.sh --package), the
# variant builds the list names, and carry folders of hard links (each under the 64 MiB limit with the tree).
# Sequential on purpose: two builds into one build-gpum break each other (GPU-NOTES, session 24).
# Usage: [VARIANTS=...] [CARRY=...] bench/patches/build-packages.sh OUT [PATCH...]   e.g.
#   VARIANTS="ov|src/kernels/cuda/gather_batched.cu|-DGW_OVL=1|fp4moe test_gather_qmm_gpu" \
#   CARRY="c1=batch.tar.xz old_fp4moe.xz ov" bench/patches/build-packages.sh gpu-bin/s27 my-patch
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
[ $# -eq 0 ] || git -c user.name=pkg -c user.email=pkg@localhost commit -qam "patches: $*"
rm -rf "$OUT"
scripts/gpu-staged-check.sh --package "$OUT"
# variants: VARIANTS="name|SRC|FLAGS|prog prog ..." entries separated by ';' (programs: fp4moe or test / bench
# target names), each to OUT/name/<prog>/0/<prog>.xz
IFS=';' read -ra VS <<<"${VARIANTS:-}"
for v in "${VS[@]}"; do
    [ -n "${v// /}" ] || continue
    IFS='|' read -r name src flags progs <<<"$v"
    for t in $progs; do
        tg=$t; [ "$t" = fp4moe ] && tg=fp4moe_cli
        TARGET=$tg PROG=$t bench/build-variants.sh "$OUT/$name/$t" "$src" "$flags"
    done
done
[ -n "${OLD_FP4MOE:-}" ] && cp "$OLD_FP4MOE" "$OUT/old_fp4moe.xz"
[ -n "${GW:-}" ] && cp -r "$GW" "$OUT/gw"
# carry folders: hard links into OUT, one a device call
cd "$OUT/.."
S=$(basename "$OUT")
mk() { local d=$1; shift; rm -rf "$d"; for p in "$@"; do [ -e "$S/$p" ] || continue; mkdir -p "$d/$(dirname "$p")"; cp -al "$S/$p" "$d/$p"; done; }
# CARRY="c1=path path ...;c2=..." (paths relative to OUT)
IFS=';' read -ra CS <<<"${CARRY:-}"
names=
for c in "${CS[@]}"; do
    [ -n "${c// /}" ] || continue
    d=${c%%=*}
    # shellcheck disable=SC2086
    mk "$d" ${c#*=}
    names="$names $d"
done
for d in $names; do echo "$d: $(find "$d" -type f -printf '%s\n' | awk '{s += $1} END {printf "%.1f MB", s / 1e6}')"; done
echo "tree: $(git -C "$ROOT" ls-files -z | (cd "$ROOT" && xargs -0 du -cb) | tail -1 | cut -f1) bytes (a call: tree + one folder <= 64 MiB)"
