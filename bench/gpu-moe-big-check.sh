#!/usr/bin/env bash
# bench/gpu-moe-big-check.sh: on the GPU machine, ONE call that checks the big-tile MoE path (FP4MOE_CUDA_MOE_BIG) and
# prices it against the 64-row tiles inside a real prefill (issue 12), most important first, each step under a time
# limit and printed at once (a call cut short keeps what it had):
#   1. test_ops_gpu test_moe_pair / test_moe_big (bitwise against the 64-row kernel);
#   2. prefill 2,048 / 4,096 / 8,192 + 8 of the synthetic 30B-A3B, big tiles on (default: from 4,096 tokens, short
#      remainders on 64-row tiles), =all (every row on big tiles) and off (=0), two alternated rounds; hashes must
#      be equal;
#   3. the fault builds f_bigs / f_bigx / f_bigy / f_bigr must fail test_moe_big; compute-sanitizer memcheck / racecheck;
#   4. the greedy hash with FP4MOE_GATHER_EXPERT_BATCHED=0 (TOKENS + 8, default 4,096);
#   5. the bench candidates of CAND (bench/build-bench-variants.sh of gpu_gather_wg, e.g. BG_XCO / BG_XPS) at
#      1,024-8,192 tokens, timings only (uniform / skewed routing: the production column is two 64-row calls);
#   6. every kernel of one prefill timed by Nsight Compute (gpu__time_duration, clocks left alone), summed by kernel
#      name, big tiles on (off: session 46's first call): what the kernels do not account for is the time between them.
# VAR: an fp4moe variant (.xz, bench/build-variants.sh) timed in step 2 as well.
# Usage: bench/gpu-moe-big-check.sh PKG [TOKENS [CAND]]  (PKG: FAULTS_ONLY="f_bigs f_bigx f_bigy"
#        scripts/gpu-staged-check.sh --package PKG, here; OUT: logs)
set -u
cd "$(dirname "$0")/.." || exit 1
PKG=$1 TOK=${2:-4096} CAND=${3:-}
OUT=${OUT:-gpu-moe-big-out}
. scripts/gpu-pack.sh
gp_bench_device "$PKG" # the package unpacked into B, LD_LIBRARY_PATH set, OUT made, the GPU named
T=$B/test_ops_gpu
t0=$SECONDS
FP4MOE_TEST_FILTER=test_moe timeout 150 $T >"$OUT/moe_tests.log" 2>&1
echo "test_ops_gpu test_moe*: exit $? $((SECONDS - t0)) s"; grep -h "OK \]\|FAILED\|moe big\|moe pair" "$OUT/moe_tests.log" | head -8
printf '#!/bin/sh\nexec env FP4MOE_CUDA_MOE_BIG=0 %s "$@"\n' "$B/fp4moe" >$B/big0
printf '#!/bin/sh\nexec env FP4MOE_CUDA_MOE_BIG=all %s "$@"\n' "$B/fp4moe" >$B/bigall
chmod +x $B/big0 $B/bigall
A="--synthetic nemotron-3-nano-30b-a3b --device cuda"
for P in 2048 4096 8192; do
    OUT=$OUT/p$P timeout 200 bash bench/gpu-compare.sh $B 2 "$A --prompt-tokens $P --gen-tokens 8 --repeats 2" \
        dyn=$B/fp4moe ${VAR:+var=$VAR} all=$B/bigall big0=$B/big0 >"$OUT/p$P.txt" 2>&1
    echo "== prefill $P + 8"; grep '^| [a-z]' "$OUT/p$P.txt" | grep -v '^| build'; grep -v '^|' "$OUT/p$P.txt" | head -2
done
summ() { # ncu csv -> per kernel name: launches, total us, mean us; and the sum
    python3 - "$1" <<'PY'
import csv, sys, collections
tot = collections.OrderedDict(); n = collections.Counter()
with open(sys.argv[1]) as f:
    rows = [l for l in f if l.startswith('"')]
for r in csv.DictReader(rows):
    if r.get("Metric Name") != "gpu__time_duration.sum": continue
    k = r["Kernel Name"].split("(")[0].split("<")[0].replace("void ", "")
    v = float(r["Metric Value"].replace(",", ""))
    u = r.get("Metric Unit", "")
    v = v / 1e3 if u in ("ns", "nsecond") else v * 1e3 if u in ("ms", "msecond") else v  # -> us
    tot[k] = tot.get(k, 0.0) + v; n[k] += 1
s = sum(tot.values())
for k, v in sorted(tot.items(), key=lambda kv: -kv[1])[:16]:
    print(f"  {k[:40]:40s} {n[k]:5d} x {v / n[k]:9.1f} us = {v / 1e3:8.3f} ms")
print(f"  {'ALL KERNELS':40s} {sum(n.values()):5d}          = {s / 1e3:8.3f} ms")
PY
}
for t in test_ops_gpu test_gather_qmm_gpu test_model_gpu; do
    t0=$SECONDS
    FP4MOE_TEST_QUICK=1 timeout 120 $B/$t >"$OUT/$t.log" 2>&1
    echo "$t: exit $? $((SECONDS - t0)) s, $(grep -c '^\[       OK' "$OUT/$t.log") ok; $(grep -m2 'FAILED  \] [a-z]' "$OUT/$t.log" | tr '\n' ' ')"
done
for f in f_bigs f_bigx f_bigy f_bigr; do
    [ -f "$PKG/$f/0/test_ops_gpu.xz" ] || continue
    xz -dc "$PKG/$f/0/test_ops_gpu.xz" >$B/$f && chmod +x $B/$f
    FP4MOE_TEST_FILTER=test_moe_big timeout 60 $B/$f >"$OUT/$f.log" 2>&1
    echo "fault $f: exit $? (nonzero: CAUGHT) $(grep -m1 'moe big' "$OUT/$f.log" | cut -c1-150)"
done
CS=/usr/local/cuda/bin/compute-sanitizer
for t in memcheck racecheck; do
    t0=$SECONDS
    FP4MOE_TEST_SANITIZE=1 FP4MOE_TEST_FILTER=test_moe_big timeout 150 $CS --tool $t --error-exitcode 9 $T \
        >"$OUT/san-big-$t.log" 2>&1
    echo "$t test_moe_big: exit $? $((SECONDS - t0)) s $(grep -m1 'ERROR SUMMARY\|RACECHECK SUMMARY' "$OUT/san-big-$t.log")"
done
FP4MOE_GATHER_EXPERT_BATCHED=0 timeout 60 $B/fp4moe bench $A --prompt-tokens $TOK --gen-tokens 8 --repeats 1 --json \
    >"$OUT/hash-off.json" 2>&1
echo "FP4MOE_GATHER_EXPERT_BATCHED=0: $(grep -o '"gen_ids_fnv1a"[^,]*' "$OUT/hash-off.json")"
if [ -n "$CAND" ]; then
    OUT=$OUT/cand WK_CHECKS=none WK_TILED_ONLY=1 WK_TOKENS=1024,2048,4096,8192 timeout 100 \
        bash bench/gpu-run-candidates.sh "$PKG" "$CAND" 30 >"$OUT/cand.txt" 2>&1
    echo "--- candidates"; grep -h '^==\|^| [0-9]\|FAIL' "$OUT/cand.txt"
fi
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
for big in 1; do
    t0=$SECONDS
    FP4MOE_CUDA_MOE_BIG=$big timeout 150 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv \
        -k "regex:^(?!synth|spin)" --launch-count 3000 \
        $B/fp4moe bench $A --prompt-tokens $TOK --gen-tokens 1 --repeats 1 --warmup 0 >"$OUT/ncu$big.csv" 2>"$OUT/ncu$big.err"
    echo "== ncu, big tiles $big: exit $? $((SECONDS - t0)) s, $(grep -c gpu__time_duration "$OUT/ncu$big.csv") kernels"
    grep -v "^==PROF==" "$OUT/ncu$big.err" | tail -2 | cut -c1-200
    summ "$OUT/ncu$big.csv"
done
