#!/usr/bin/env bash
# The CPU test suite under AddressSanitizer + UndefinedBehaviorSanitizer (float-cast-overflow
# included; any finding fails), built without CUDA into build-asan/. Run by `make test` after ctest.
# Skips the python tests (they drive the normal build's binary) and the GPU tests.
# Usage: scripts/sanitize-check.sh [BUILD_DIR]   (default build-asan)
set -euo pipefail
cd "$(dirname "$0")/.."
B=${1:-build-asan}
FLAGS="-O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined,float-cast-overflow -fno-sanitize-recover=all"
t0=$(date +%s)
cmake -S . -B "$B" -DFP4MOE_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS="$FLAGS" \
      -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" > "$B.configure.log" 2>&1 ||
    { cat "$B.configure.log"; exit 1; }
cmake --build "$B" -j "$(nproc)" > "$B.build.log" 2>&1 || { tail -40 "$B.build.log"; exit 1; }
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:halt_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export LSAN_OPTIONS=suppressions=$PWD/scripts/lsan.supp:print_suppressions=0
(cd "$B" && ctest --output-on-failure -j "$(nproc)" -LE "python|gpu")
echo "sanitize-check: PASS (ASan + UBSan, CPU tests, $(( $(date +%s) - t0 )) s)"
