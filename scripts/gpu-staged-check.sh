#!/usr/bin/env bash
# scripts/gpu-staged-check.sh: the changes of a GPU round checked, fault-built and measured in ONE
# command on the GPU machine (2026-12-03: the side stream and the tiled layout made the defaults, the
# 64-row tiles of bf16 gather_qmm calls on wgmma):
#   1. the GPU tests: test_model_gpu (its side_stream case with the diagnostic delay, tiled_layout,
#      batched == solo), test_gather_qmm_gpu (every route against the fp64 reference, the bitwise
#      route switch), test_ops_gpu (tiled layout, every route, bitwise), test_ep_gpu, test_ssm_gpu;
#   2. the deliberate faults of the FAULTS table below (FP4MOE_INJECT_FAULT_<MACRO> builds of one test
#      program each), each must FAIL, each run with only the tests that must catch it (FP4MOE_TEST_FILTER);
#   3. compute-sanitizer memcheck: the small gather_qmm cases (FP4MOE_TEST_SANITIZE=1), test_ssm_gpu's
#      test_chunks (memcheck and racecheck) and a batched decode of the default model;
#   4. end to end on the synthetic Nemotron-3-Nano-30B-A3B shape, the builds alternated in rounds
#      (bench/gpu-compare.sh): OLD (an earlier commit's fp4moe, with OLD_ENV) against this one, at
#      128 + 64 and 512 + 128 tokens, 64 sequences, 2,048 + 32 and 8,192 + 16 (CMPS: which of p128
#      p512 b64 p2k p8k, or bN: N sequences, e.g. b40); this
#      build with FP4MOE_GATHER_EXPERT_BATCHED=0 too: the greedy hashes of a row must be equal across
#      builds;
#      VARIANTS (e.g. "mma=FP4MOE_CUDA_ATTENTION=mma"): this build with one setting, compared too;
#      EXTRA (e.g. "nowpre=gpu-bin/v/1/fp4moe.xz"): other programs (bench/build-variants.sh builds of
#      this package's sources with other macros), compared too;
#   5. candidate programs (CAND, a folder: bench/build-bench-variants.sh), each run (with the
#      arguments CAND_ARGS), their tables last.
# A short table is printed last; logs in $OUT (default gpu-staged-out/).
# Usage: scripts/gpu-staged-check.sh BIN [OLD [CAND]]       on the GPU machine (BIN from --package; OLD an
#                                                           earlier commit's fp4moe or fp4moe.xz)
#        scripts/gpu-staged-check.sh --package BIN           here: build build-gpum, pack the programs and
#                                                           the fault builds into BIN (carry BIN)
# Environment: OLD_ENV (default empty): settings for the OLD build, e.g. "FP4MOE_CUDA_SIDE_STREAM=1";
#              EXTRA_TESTS="NAME=DIR ...": test programs of variant builds (DIR/PROG/0/PROG.xz), run after step 3
#              (also with SKIP_TESTS=1);
#              SKIP_TESTS=1: steps 4-5 only (a second call after one that ran the tests);
#              FAULTS_ONLY="f_w32 f_ring ..." (with --package): only those fault builds (the others are skipped).
set -u
cd "$(dirname "$0")/.."
GP_NAME=batch
GP_BUILD=build-gpum
# GP_PROGS / GP_TARGETS: the batch package's defaults (scripts/gpu-pack.sh)
. scripts/gpu-pack.sh
# The deliberate fault builds, one a line: NAME TEST SOURCE MACRO [FILTER] - bench/build-variants.sh builds
# TEST with SOURCE compiled with -DFP4MOE_INJECT_FAULT_<MACRO>=1 into BIN/NAME/0/TEST, which step 2 runs with
# FP4MOE_TEST_FILTER=FILTER (the tests that must catch it; none: the whole program).
FAULTS="
f_side test_model_gpu src/backend/cuda/backend_cuda.c SIDE_JOIN side_stream
f_dense test_model_gpu src/backend/cuda/backend_cuda.c DENSE_COPY
f_aside test_model_gpu src/model/forward.c ATTN_SIDE side_stream
f_conv test_ssm_gpu src/kernels/cuda/ops_ssm.cu CONV1D
f_runs test_gather_qmm_gpu src/kernels/cuda/gather_qmm_cuda.cu RUNS
f_xb test_ops_gpu src/kernels/cuda/gather_qmv.cu XBCAST test_linear_gather_x1
f_rw test_ops_gpu src/kernels/cuda/ops_elementwise.cu RMSNORM_WIDE test_rmsnorm_residual
f_am test_ops_gpu src/kernels/cuda/ops_elementwise.cu ARGMAX_TIE test_argmax_rows
f_amr test_ops_gpu src/kernels/cuda/ops_elementwise.cu ARGMAX_RESET test_argmax_rows
f_wpre test_ops_gpu src/kernels/cuda/gather_qmv.cu QMMA_WPRE test_tiled_layout
f_kvp test_model_gpu src/model/forward.c KV_PAIR
f_w32 test_ops_gpu src/kernels/cuda/gather_batched.cu W32 test_tiled_layout
f_xrow test_ops_gpu src/kernels/cuda/gather_batched.cu XROW test_linear_gather_rows
f_split test_ops_gpu src/kernels/cuda/ops_linear.cu SPLIT_SUM test_moe_route
f_qmvr test_ops_gpu src/kernels/cuda/gather_qmm_cuda.cu QMV_ROWS test_tiled_layout
f_ssd test_ssm_gpu src/kernels/cuda/ops_ssm.cu SSD_TF32
f_ssdbuf test_ssm_gpu src/kernels/cuda/ops_ssm.cu SSD_SBUF
f_gated test_ops_gpu src/kernels/cuda/ops_elementwise.cu GATED_LANES test_rmsnorm_gated
f_sort test_ops_gpu src/kernels/cuda/ops_moe.cu SORT_BASE test_moe_route
f_sched test_gather_qmm_gpu src/kernels/cuda/gather_batched.cu SCHED
f_ring test_gather_qmm_gpu src/kernels/cuda/gather_batched.cu RING
f_kg test_gather_qmm_gpu src/kernels/cuda/gather_batched.cu KG
f_planes test_ops_gpu src/kernels/cuda/ops_moe.cu PLANES test_moe_route
f_wgd test_gather_qmm_gpu src/kernels/cuda/gather_batched.cu WG_DESC
f_tstr test_ops_gpu src/kernels/cuda/gather_batched.cu TSTREAM test_tiled_layout
f_tcb test_ops_gpu src/kernels/cuda/gather_batched.cu TILED_CODES test_tiled_layout
f_tcq test_ops_gpu src/kernels/cuda/gather_qmv.cu TILED_CODES test_tiled_layout
f_sruns test_ops_gpu src/kernels/cuda/ops_moe.cu SORT_RUNS test_moe_route
f_reset test_ops_gpu src/kernels/cuda/gather_batched.cu SCHED_RESET test_linear_gather_rows
f_e1 test_ops_gpu src/kernels/cuda/gather_batched.cu E1_RUNS test_dense_linear
f_tsign test_ops_gpu src/kernels/cuda/gather_qmv.cu TILED_SIGN test_tiled_scales
f_moew test_ops_gpu src/kernels/cuda/gather_batched.cu MOE_WAIT test_moe_pair
f_moer test_ops_gpu src/kernels/cuda/gather_batched.cu MOE_RESET test_moe_pair
f_moet test_ops_gpu src/kernels/cuda/gather_batched.cu MOE_TILE test_moe_pair
f_route test_gather_qmm_gpu src/kernels/cuda/gather_qmm_cuda.cu ROUTE_ROWS route_choice
f_bigx test_ops_gpu src/kernels/cuda/gather_batched.cu BIG_XCOPY test_moe_big
f_bigy test_ops_gpu src/kernels/cuda/gather_batched.cu BIG_YPERM test_moe_big
f_bigs test_ops_gpu src/kernels/cuda/gather_batched.cu BIG_SCHED test_moe_big
f_bigr test_ops_gpu src/kernels/cuda/gather_qmm_cuda.cu BIG_REM test_moe_big
"
if [ "${1:-}" = "--package" ]; then
    BINP=${2:?usage: --package BIN}
    gp_build || exit 1
    while read -r name test src macro _ <&3; do
        [ -n "$name" ] || continue
        case " ${FAULTS_ONLY:-$name} " in *" $name "*) ;; *) continue ;; esac
        TARGET=$test PROG=$test bench/build-variants.sh "$BINP/$name" "$src" "-DFP4MOE_INJECT_FAULT_$macro=1" || exit 1
    done 3<<<"$FAULTS"
    gp_main --package "$BINP"
fi
OUT=${OUT:-gpu-staged-out}
mkdir -p "$OUT"
PKG=$1
OLDPKG=${2:-}
CAND=${3:-}
gp_main "$PKG"
BIN=$GP_BIN
declare -a ROWS
row() { ROWS+=("$(printf '%-44s %-10s %5ss  %s' "$1" "$2" "$3" "${4:-}")"); }
verdict() { [ "$1" = 0 ] && echo PASS || echo "FAIL($1)"; }
fault_verdict() { [ "$1" = 77 ] && echo "SKIP(77)" || { [ "$1" != 0 ] && echo CAUGHT || echo MISSED; }; }

t() { # NAME LOG ENV... -- PROGRAM
    local name=$1 log=$2; shift 2
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    local t0=$SECONDS
    env ${envs[@]+"${envs[@]}"} timeout 300 "$@" >"$OUT/$log" 2>&1
    local rc=$?
    row "$name" "$(verdict $rc)" $((SECONDS - t0)) "$(grep -c '^\[       OK' "$OUT/$log") ok"
}
if [ "${SKIP_TESTS:-0}" != 1 ]; then # steps 1-3 (SKIP_TESTS=1: only the compares, e.g. a second call)
t "test_model_gpu" model.log -- "$BIN/test_model_gpu"
t "test_gather_qmm_gpu" gather.log -- "$BIN/test_gather_qmm_gpu"
t "test_ops_gpu" ops.log -- "$BIN/test_ops_gpu"
t "test_ep_gpu" ep.log -- "$BIN/test_ep_gpu"
t "test_ssm_gpu" ssm.log -- "$BIN/test_ssm_gpu"
# each fault build with only the test that must catch it (FP4MOE_TEST_FILTER; none: the whole program)
while read -r name test _ _ flt <&3; do
    [ -n "$name" ] || continue
    f=$name/0/$test
    [ -f "$PKG/$f.xz" ] || continue
    n=$(echo "$f" | tr / _)
    xz -dc "$PKG/$f.xz" >"$BIN/$n" && chmod +x "$BIN/$n"
    t0=$SECONDS
    FP4MOE_TEST_FILTER=$flt timeout 300 "$BIN/$n" >"$OUT/$n.log" 2>&1
    rc=$?
    row "fault $name ($test)" "$(fault_verdict $rc)" $((SECONDS - t0)) "$(grep -m1 'FAILED  \] [a-z]' "$OUT/$n.log")"
done 3<<<"$FAULTS"
CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
if [ -n "$CS" ]; then
    t0=$SECONDS
    FP4MOE_TEST_SANITIZE=1 timeout 300 "$CS" --tool memcheck --error-exitcode 9 "$BIN/test_gather_qmm_gpu" \
        >"$OUT/memcheck_gather.log" 2>&1
    rc=$?
    row "memcheck gather_qmm small cases" "$([ $rc = 0 ] && echo CLEAN || echo "FAIL($rc)")" $((SECONDS - t0)) \
        "$(grep -m1 'ERROR SUMMARY' "$OUT/memcheck_gather.log")"
    for tool in memcheck racecheck; do # the Mamba-2 scans (SSD: cp.async ring, barriers), test_chunks' shapes
        t0=$SECONDS
        FP4MOE_TEST_FILTER=test_chunks timeout 300 "$CS" --tool $tool --error-exitcode 9 "$BIN/test_ssm_gpu" \
            >"$OUT/${tool}_ssm.log" 2>&1
        rc=$?
        row "$tool test_ssm_gpu" "$([ $rc = 0 ] && echo CLEAN || echo "FAIL($rc)")" $((SECONDS - t0)) \
            "$(grep -m1 'ERROR SUMMARY\|RACECHECK SUMMARY' "$OUT/${tool}_ssm.log")"
    done
    t0=$SECONDS
    timeout 200 "$CS" --tool memcheck --error-exitcode 9 "$BIN/fp4moe" bench -m models/nemotron-h-tiny-moe \
        --device cuda --batch 5 --prompt-tokens 70 --gen-tokens 8 --repeats 1 --warmup 0 >"$OUT/memcheck.log" 2>&1
    rc=$?
    row "memcheck batched decode (default model)" "$([ $rc = 0 ] && echo CLEAN || echo "FAIL($rc)")" $((SECONDS - t0)) \
        "$(grep -m1 'ERROR SUMMARY' "$OUT/memcheck.log")"
fi
fi # SKIP_TESTS
# EXTRA_TESTS (e.g. "v17=gpu-bin/v17"): test programs of other builds (bench/build-variants.sh's DIR/PROG/0/PROG.xz),
# each run whole with this package's libraries (also with SKIP_TESTS=1)
for v in ${EXTRA_TESTS:-}; do
    for f in "${v#*=}"/*/0/test_*.xz; do
        [ -f "$f" ] || continue
        n=${v%%=*}_$(basename "$f" .xz)
        xz -dc "$f" >"$BIN/$n" && chmod +x "$BIN/$n"
        t "$n" "$n.log" -- "$BIN/$n"
    done
done
wrap() { printf '#!/bin/sh\nexec env %s %s "$@"\n' "$3" "$2" >"$BIN/$1" && chmod +x "$BIN/$1"; }
B="new=$BIN/fp4moe"
if [ -n "$OLDPKG" ]; then # an earlier commit's fp4moe (or .xz of it; the same libraries as this package's)
    case $OLDPKG in *.xz) xz -dc "$OLDPKG" >"$BIN/old_fp4moe" ;; *) cp "$OLDPKG" "$BIN/old_fp4moe" ;; esac
    chmod +x "$BIN/old_fp4moe"
    wrap old "$BIN/old_fp4moe" "${OLD_ENV:-FP4MOE_X=0}"
    B="old=$BIN/old $B"
fi
wrap off "$BIN/fp4moe" FP4MOE_GATHER_EXPERT_BATCHED=0
for v in ${VARIANTS:-}; do # NAME=VAR=VALUE: this build with one setting, compared too
    wrap "${v%%=*}" "$BIN/fp4moe" "${v#*=}"
    B="$B ${v%%=*}=$BIN/${v%%=*}"
done
B="$B ${EXTRA:-}"
A="--synthetic nemotron-3-nano-30b-a3b --device cuda"
cmp() { # NAME ROUNDS LIMIT ARGS (LIMIT: seconds for 4 builds, scaled by the number of builds)
    local t0=$SECONDS nb lim
    nb=$(($(echo $B | wc -w) + 1))
    lim=$(($3 * nb / 4))
    # shellcheck disable=SC2086
    OUT=$OUT/$1 timeout "$lim" bench/gpu-compare.sh "$BIN" "$2" "$A $4" $B off=$BIN/off >"$OUT/$1.txt" 2>&1
    row "compare $1" DONE $((SECONDS - t0))
}
CMPS=${CMPS:-p512 b64 p2k p8k}
for f in $CMPS; do
    case $f in
    p128) cmp p128 3 150 "--prompt-tokens 128 --gen-tokens 64 --repeats 3" ;;
    p512) cmp p512 3 200 "--prompt-tokens 512 --gen-tokens 128 --repeats 3" ;;
    b[0-9]*) cmp "$f" 2 150 "--batch ${f#b} --prompt-tokens 256 --gen-tokens 64 --repeats 2" ;;
    p2k) cmp p2k 2 120 "--prompt-tokens 2048 --gen-tokens 32 --repeats 2" ;;
    p8k) cmp p8k 1 120 "--prompt-tokens 8192 --gen-tokens 16 --repeats 2" ;;
    esac
done
for f in $CMPS; do echo "== $f"; grep '^|' "$OUT/$f.txt"; grep -v '^|' "$OUT/$f.txt" | head -3; done
for w in ${CAND:+"$CAND"/*}; do
    [ -e "$w" ] || continue
    n=$(basename "$w" .xz)
    case $w in *.xz) xz -dc "$w" >"$BIN/$n" ;; *) cp "$w" "$BIN/$n" ;; esac
    chmod +x "$BIN/$n"
    t0=$SECONDS
    # shellcheck disable=SC2086
    timeout 150 "$BIN/$n" ${CAND_ARGS:-} >"$OUT/$n.log" 2>&1
    rc=$?
    row "$n" "$(verdict $rc)" $((SECONDS - t0)) "$(grep -c 'PASS$' "$OUT/$n.log") checks pass"
    echo "== $n"; grep 'FAIL' "$OUT/$n.log" | head -3; grep '^|' "$OUT/$n.log"
done
printf '%s\n' "${ROWS[@]}"
