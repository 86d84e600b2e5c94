#!/usr/bin/env bash
# Deliberate-fault check (issue 2, spec NVFP4.md section 4): proves that the gather_qmm tests can fail.
#
# Builds the library twice with a fault injected into every CPU gather_qmm route
#   -DFP4MOE_INJECT_FAULT=global_scale   every route ignores the per-expert global scale
#   -DFP4MOE_INJECT_FAULT=expert_offset  every route reads expert e's weights at expert e+1 (e-1 for the last)
#   -DFP4MOE_INJECT_FAULT=q8_offset      the W4A8 kernels drop the correction of their unsigned weights
#   -DFP4MOE_INJECT_FAULT=ep_order       expert parallelism returns the owners' results in sorted order
#                                        (tests/model/test_ep must fail; it runs once, no routes)
#   -DFP4MOE_INJECT_FAULT=kv_fp8_scale   the FP8 KV cache is read without its per-head scales
#                                        (tests/model/test_ops must fail; once, no routes)
#   -DFP4MOE_INJECT_FAULT=sampler_count  the sampler's frequency penalty ignores the counts
#                                        (tests/model/test_ops must fail; once, no routes)
#   -DFP4MOE_INJECT_FAULT=grammar_plain  structured output: tokens holding a quote pass as plain string text
#                                        (tests/grammar/test_grammar must fail; once, no routes)
#   -DFP4MOE_INJECT_FAULT_TILED_CODES      the tiled layout's fourth code pair decoded with a term missing
#                                        (tests/kernels/test_tiled_codes, compiled alone: header-only code)
#   -DFP4MOE_INJECT_FAULT_TILED_SIGN       a negative block scale's sign not folded into the tiled codes
#                                        (the same test program)
# and runs tests/kernels/test_gather_qmm once per route and activation mode (FP4MOE_TEST_ROUTE=
# qmv|batched|dequant_gemm|auto with FP4MOE_TEST_ACT=float, qmv|batched|auto with FP4MOE_TEST_ACT=q8),
# so that one failing route cannot hide another that passes. Passes only if EVERY route's tests FAIL in
# EVERY fault build that touches it (q8_offset: the q8 ones; a crash does not count as a detection).
#
# Environment: JOBS (default 2), FAULT_CMAKE_FLAGS (default -DFP4MOE_CUDA=OFF: the CPU routes are
# checked here), FAULT_CHECK_FULL=1 to run the Nemotron-sized cases too (default: the quick set).
set -uo pipefail
cd "$(dirname "$0")/.."

JOBS=${JOBS:-2}
FAULT_CMAKE_FLAGS=${FAULT_CMAKE_FLAGS:--DFP4MOE_CUDA=OFF}
FAULTS=(global_scale expert_offset q8_offset ep_order kv_fp8_scale sampler_count grammar_plain)
ROUTES=(qmv:float batched:float dequant_gemm:float auto:float qmv:q8 batched:q8 auto:q8)
quick=1
[[ "${FAULT_CHECK_FULL:-0}" == 1 ]] && quick=0

for fault in "${FAULTS[@]}"; do
  dir=build-fault-$fault
  log=$dir/fault-build.log
  echo "fault-check: building $dir (FP4MOE_INJECT_FAULT=$fault)"
  mkdir -p "$dir"
  # shellcheck disable=SC2086
  if ! cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFP4MOE_INJECT_FAULT="$fault" \
         $FAULT_CMAKE_FLAGS > "$log" 2>&1 ||
     ! cmake --build "$dir" -j "$JOBS" --target "$(case $fault in ep_order) echo test_ep ;; kv_fp8_scale|sampler_count) echo test_ops ;; grammar_plain) echo test_grammar ;;
                                                   *) echo test_gather_qmm ;; esac)" \
         >> "$log" 2>&1; then
    echo "fault-check: FAILED to build $dir (see $log)"
    tail -20 "$log"
    exit 1
  fi
done

status=0
printf '\n%-15s %-14s %-10s %s\n' "fault" "route" "tests" "verdict"
for fault in "${FAULTS[@]}"; do
  for combo in "${ROUTES[@]}"; do
    route=${combo%%:*} act=${combo##*:}
    [[ $fault == q8_offset && $act != q8 ]] && continue
    [[ ( $fault == ep_order || $fault == kv_fp8_scale || $fault == sampler_count || $fault == grammar_plain ) &&
       $combo != qmv:float ]] && continue
    log=build-fault-$fault/fault-$route-$act.log
    prog=build-fault-$fault/test_gather_qmm
    [[ $fault == ep_order ]] && prog=build-fault-$fault/test_ep
    [[ $fault == kv_fp8_scale || $fault == sampler_count ]] && prog=build-fault-$fault/test_ops
    [[ $fault == grammar_plain ]] && prog=build-fault-$fault/test_grammar
    FP4MOE_TEST_ROUTE=$route FP4MOE_TEST_ACT=$act FP4MOE_TEST_QUICK=$quick $prog > "$log" 2>&1
    rc=$?
    nfail=$(grep '^\[  FAILED  \] [^0-9]' "$log" | sort -u | wc -l)
    if (( rc > 128 )); then
      verdict="BAD: crashed (signal $((rc - 128))), see $log"; status=1
    elif (( rc != 0 && rc != 77 && nfail > 0 )); then
      verdict="ok: the fault is caught"
    else
      verdict="BAD: tests pass with the fault (rc $rc), see $log"; status=1
    fi
    printf '%-15s %-14s %-10s %s\n' "$fault" "$route $act" "$nfail failed" "$verdict"
  done
done
# header-only code (src/kernels/tiled_codes.h, the tiled layout's code arrangement): its test program alone,
# compiled here with the fault (no library needed)
for tf in TILED_CODES TILED_SIGN; do
  dir=build-fault-tiled_codes-$tf
  mkdir -p $dir
  log=$dir/fault-build.log
  if ! cc -std=c11 -O2 -DFP4MOE_INJECT_FAULT_$tf -Isrc -Iinclude tests/kernels/test_tiled_codes.c \
         $(pkg-config --cflags --libs cmocka) -lm -o $dir/test_tiled_codes > "$log" 2>&1; then
    echo "fault-check: FAILED to build the tiled_codes fault $tf (see $log)"; status=1
  else
    ./$dir/test_tiled_codes >> "$log" 2>&1
    rc=$?
    nfail=$(grep '^\[  FAILED  \] [^0-9]' "$log" | sort -u | wc -l)
    if (( rc > 128 )); then verdict="BAD: crashed (signal $((rc - 128))), see $log"; status=1
    elif (( rc != 0 && nfail > 0 )); then verdict="ok: the fault is caught"
    else verdict="BAD: tests pass with the fault (rc $rc), see $log"; status=1
    fi
    printf '%-15s %-14s %-10s %s\n' "$tf" "(header)" "$nfail failed" "$verdict"
  fi
done
if (( status == 0 )); then
  echo "fault-check: PASS (every route's tests fail under every injected fault)"
else
  echo "fault-check: FAIL"
fi
exit $status
