#!/usr/bin/env bash
# bench/gpu-compare.sh: end-to-end speed of fp4moe builds that differ in one change (variants from
# bench/build-variants.sh, or an old and a new commit), alternated in rounds in ONE run on the GPU
# machine so that every build sees the same machine state; prints per build the prefill and decode
# tok/s of each round, their medians, and the greedy hashes (a variant that must not change the
# arithmetic must print the same hash as the others).
#
# Usage: bench/gpu-compare.sh LIBDIR ROUNDS "BENCH ARGS" NAME=PROGRAM ...
#   LIBDIR     directory with the shared libraries the programs need (an unpacked batch package:
#              scripts/gpu-batch-check.sh --package), or "" when the programs need none
#   ROUNDS     rounds (each build once a round, in the order given)
#   BENCH ARGS arguments of `fp4moe bench` after --json, e.g.
#              "--synthetic nemotron-3-nano-30b-a3b --device cuda --prompt-tokens 512 --gen-tokens 64 --repeats 3"
#   PROGRAM    an fp4moe program, or an .xz of one (unpacked next to it, in $TMPDIR)
# Output: one table (markdown) on stdout; each run's JSON and log in $OUT (default gpu-compare-out).
set -u
LIBDIR=$1 ROUNDS=$2 ARGS=$3
shift 3
OUT=${OUT:-gpu-compare-out}
mkdir -p "$OUT"
[ -n "$LIBDIR" ] && export LD_LIBRARY_PATH="$LIBDIR:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
names=()
declare -A prog
for a in "$@"; do
    n=${a%%=*} p=${a#*=}
    case $p in
    *.xz) d=$(mktemp -d "${TMPDIR:-/tmp}/cmp-XXXXXX"); xz -dc "$p" >"$d/fp4moe" && chmod +x "$d/fp4moe"; p=$d/fp4moe ;;
    esac
    names+=("$n")
    prog[$n]=$p
done
for r in $(seq "$ROUNDS"); do
    for n in "${names[@]}"; do
        # shellcheck disable=SC2086
        timeout 300 "${prog[$n]}" bench $ARGS --json >"$OUT/$n-$r.json" 2>"$OUT/$n-$r.log" ||
            echo "$n round $r: exit $? ($(tail -1 "$OUT/$n-$r.log"))" >&2
    done
done
python3 - "$OUT" "$ROUNDS" "${names[@]}" <<'PY'
import json, statistics, sys
out, rounds, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
print("| build | prefill tok/s (rounds) | median | decode tok/s (rounds) | median | hashes |")
print("|---|---|---:|---|---:|---|")
for n in names:
    pf, dc, hs = [], [], set()
    for r in range(1, rounds + 1):
        try:
            j = json.load(open(f"{out}/{n}-{r}.json"))
        except Exception:
            continue
        pf.append(j["prefill_tok_s_median"] if "prefill_tok_s_median" in j else j["prefill_tok_s_aggregate"])
        dc.append(j["decode_tok_s_median"] if "decode_tok_s_median" in j else j["decode_tok_s_aggregate"])
        hs.add(str(j.get("gen_ids_fnv1a_all") or j.get("gen_ids_fnv1a", "?")))
    if not pf:
        print(f"| {n} | (no result) | | | | |")
        continue
    print(f"| {n} | {' '.join(f'{x:.0f}' for x in pf)} | {statistics.median(pf):.0f} | "
          f"{' '.join(f'{x:.1f}' for x in dc)} | {statistics.median(dc):.1f} | {' '.join(sorted(hs))} |")
PY
