#!/usr/bin/env bash
# bench/gpu-run-candidates.sh: on the GPU machine, runs every candidate program of DIR (NAME or
# NAME.xz, e.g. from bench/build-bench-variants.sh) in turn, with the arguments CAND_ARGS if set and
# the batch package's libraries (PKG: scripts/gpu-staged-check.sh --package PKG), each under a time
# limit, its whole output to $OUT/<name>.log; then prints each program's "check" failures and its
# "|" table lines, headed by its name. Usage: bench/gpu-run-candidates.sh PKG DIR [SECONDS_EACH]
set -u
cd "$(dirname "$0")/.."
GP_NAME=batch
GP_BUILD=build-gpum
. scripts/gpu-pack.sh
OUT=${OUT:-gpu-cand-out}
mkdir -p "$OUT"
gp_main "$1"
DIR=$2
LIM=${3:-120}
for w in "$DIR"/*; do
    [ -e "$w" ] || continue
    n=$(basename "$w" .xz)
    case $w in *.xz) xz -dc "$w" >"$GP_BIN/$n" ;; *) cp "$w" "$GP_BIN/$n" ;; esac
    chmod +x "$GP_BIN/$n"
    t0=$SECONDS
    # shellcheck disable=SC2086
    timeout "$LIM" "$GP_BIN/$n" ${CAND_ARGS:-} >"$OUT/$n.log" 2>&1
    rc=$?
    echo "== $n: exit $rc, $((SECONDS - t0)) s, $(grep -c 'PASS' "$OUT/$n.log") PASS, $(grep -c 'FAIL' "$OUT/$n.log") FAIL"
    grep 'FAIL' "$OUT/$n.log" | head -5
    grep '^|' "$OUT/$n.log"
done
