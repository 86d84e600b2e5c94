#!/usr/bin/env bash
# bench/build-bench-variants.sh: one bench/gpu_*.cu program built once per macro set, for measuring
# kernel variants in ONE device run. (bench/build-variants.sh does the same for a source of the
# library; a bench program includes its kernel source itself, so it is rebuilt here whole.)
# Writes OUT/<PROG>-<i> (stripped; its shared libraries: those of the batch package) and prints
# "i: flags". Needs a configured build-gpum where the target PROG was built once.
# Usage: bench/build-bench-variants.sh OUT PROG "FLAGS0" "FLAGS1" ...
#   e.g. bench/build-bench-variants.sh gpu-bin/var gpu_qmv_tiled "" "-DQMMA_ROLL=2"
set -eu
cd "$(dirname "$0")/.."
OUTD=$1; PROG=$2; shift 2
B=build-gpum
D=CMakeFiles/$PROG.dir
SRC=$(ls bench/$PROG.cu)
flags=$(sed -n "s/^CUDA_FLAGS = //p" $B/$D/flags.make)
defs=$(sed -n "s/^CUDA_DEFINES = //p" $B/$D/flags.make)
mkdir -p "$OUTD"
OUTD=$(cd "$OUTD" && pwd) # absolute: the link runs in the build directory
i=0
for v in "$@"; do
    obj=$(mktemp --suffix=.o)
    # shellcheck disable=SC2086
    (cd $B && /usr/local/cuda/bin/nvcc -forward-unknown-to-host-compiler $defs --options-file $D/includes_CUDA.rsp \
        $flags $v -x cu -c "$PWD/../$SRC" -o "$obj")
    objs=$(sed "s|[^ ]*$PROG.cu.o|$obj|" $B/$D/objects1)
    # shellcheck disable=SC2086
    (cd $B && g++ $objs -o "$OUTD/$PROG-$i" @$D/linkLibs.rsp -L/usr/local/cuda/targets/x86_64-linux/lib/stubs \
        -L/usr/local/cuda/targets/x86_64-linux/lib)
    strip "$OUTD/$PROG-$i"
    rm -f "$obj"
    echo "$i: ${v:-defaults}"
    i=$((i + 1))
done
