#!/usr/bin/env bash
# bench/build-variants.sh: programs that differ only in compile-time macros of one source (CUDA, or a
# C source of the library),
# for measuring kernel variants against each other in ONE device run (the production code keeps
# one variant: its defaults), or for deliberate-fault builds of one test (FP4MOE_INJECT_FAULT_*).
# Rebuilds SRC's object in the CUDA build directory with each macro set, relinks the program and
# writes it, stripped and xz-compressed, to OUT/<i>/PROG.xz (its shared libraries: those of the
# batch package, scripts/gpu-batch-check.sh --package); prints "i: flags".
#
# Usage: [TARGET=cmake-target PROG=program] bench/build-variants.sh OUT SRC "FLAGS0" "FLAGS1" ...
#   e.g. bench/build-variants.sh build-gpum/var src/kernels/cuda/gather_qmv.cu "" "-DQMMA_PM=2"
#        TARGET=test_ops_gpu PROG=test_ops_gpu bench/build-variants.sh build-gpum/faults \
#            src/kernels/cuda/ops_moe.cu -DFP4MOE_INJECT_FAULT_ROUTE_SORT=1
# (default TARGET=fp4moe_cli PROG=fp4moe). Needs a configured build-gpum. The object is rebuilt
# with the defaults at the end.
set -eu
cd "$(dirname "$0")/.."
OUTD=$1; SRC=$2; shift 2
B=build-gpum
OBJ=CMakeFiles/fp4moe.dir/$SRC.o
TARGET=${TARGET:-fp4moe_cli}
PROG=${PROG:-fp4moe}
case "$SRC" in
*.c) LANG_=C ;;   # a host source of the library: the C compiler with the build's flags
*) LANG_=CUDA ;;
esac
flags=$(sed -n "s/^${LANG_}_FLAGS = //p" $B/CMakeFiles/fp4moe.dir/flags.make)
defs=$(sed -n "s/^${LANG_}_DEFINES = //p" $B/CMakeFiles/fp4moe.dir/flags.make)
incs=$(sed -n "s/^${LANG_}_INCLUDES = //p" $B/CMakeFiles/fp4moe.dir/flags.make)
# A variant's object must never stay in the build directory: a run interrupted after a fault build (session 36)
# left a fault-injected library object, newer than its source, that the next packages carried (a side stream
# without its join: tests failing, greedy decoding not repeatable). On any exit before the end the object is
# removed and SRC touched, so the next build compiles it with the defaults.
trap 'rm -f "$B/$OBJ"; touch "$SRC"' EXIT
i=0
for v in "$@"; do
    # shellcheck disable=SC2086
    if [ $LANG_ = C ]; then
        (cd $B && eval cc $defs $incs $flags $v -c "$PWD/../$SRC" -o "$OBJ")
    else
        (cd $B && /usr/local/cuda/bin/nvcc -forward-unknown-to-host-compiler $defs \
            --options-file CMakeFiles/fp4moe.dir/includes_CUDA.rsp $flags $v -x cu -c "$PWD/../$SRC" -o "$OBJ")
    fi
    cmake --build $B --target "$TARGET" -j2 >/dev/null
    mkdir -p "$OUTD/$i"
    stage=$(mktemp -d)
    cp "$B/$PROG" "$stage/" && strip "$stage/$PROG"
    xz -9 -c "$stage/$PROG" >"$OUTD/$i/$PROG.xz"
    rm -rf "$stage"
    echo "$i: ${v:-defaults}"
    i=$((i + 1))
done
touch "$SRC"
cmake --build $B --target "$TARGET" -j2 >/dev/null
trap - EXIT
