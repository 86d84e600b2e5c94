# scripts/gpu-pack.sh: sourced by the scripts/gpu-*-check.sh scripts (not run by itself).
# Packs prebuilt GPU programs for the GPU machine and unpacks them there, so that one device call
# needs no build. The caller sets, before sourcing:
#   GP_NAME   package name (the file is BIN/$GP_NAME.tar.xz), also used in messages
#   GP_BUILD  build directory (cmake, RelWithDebInfo)
#   GP_PROGS  programs to pack (names of build outputs); unset: the batch package's (fp4moe and every
#             GPU test: scripts/gpu-batch-check.sh, scripts/gpu-staged-check.sh)
#   GP_TARGETS cmake targets that build them (unset: the batch package's)
# and then calls gp_main "$@": `--package BIN` packs and exits; otherwise it leaves the directory of
# runnable programs in GP_BIN (BIN = $1, default $GP_BUILD/$GP_NAME-bin when packed there, else a
# build here) with LD_LIBRARY_PATH set up (packed libraries, CUDA, pip-wheel CUDA libraries).
# gp_device PKG (the bench/ device scripts): gp_main PKG, then B = GP_BIN, mkdir $OUT and the GPU's name printed.
# gp_bench_device PKG: gp_device with the bench package's settings (GP_NAME batch, GP_BUILD build-gpum, GP_PROGS
# fp4moe test_ops_gpu: the package the bench/ scripts' headers build with gp_package).

GP_PROGS=${GP_PROGS:-fp4moe test_model_gpu test_ssm_gpu test_gather_qmm_gpu test_attention_gpu test_ops_gpu test_ep_gpu}
GP_TARGETS=${GP_TARGETS:-fp4moe_cli test_model_gpu test_ssm_gpu test_gather_qmm_gpu test_attention_gpu test_ops_gpu test_ep_gpu}

gp_build() { # configure + build the targets into GP_BUILD
    cmake -S . -B "$GP_BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null &&
        cmake --build "$GP_BUILD" -j "$(nproc)" --target $GP_TARGETS >/dev/null
}

gp_package() { # BIN: the programs and the shared libraries beyond glibc, the C++ runtime and CUDA
    local bin=$1 stage p    # (the GPU image lacks cjson, pcre2, OpenBLAS, cmocka), xz-compressed
    gp_build || return 1
    stage=$(mktemp -d)
    for p in $GP_PROGS; do cp "$GP_BUILD/$p" "$stage/" && strip "$stage/$p"; done
    for p in $GP_PROGS; do ldd "$GP_BUILD/$p"; done | awk '$3 ~ /^\// {print $1, $3}' | sort -u |
        while read -r name path; do
            case $name in
            libc.so*|libm.so*|libpthread*|libdl.so*|librt.so*|ld-linux*|libstdc++*|libgcc_s*|libcuda*|libcublas*) ;;
            *) cp -L "$path" "$stage/$name" ;;
            esac
        done
    mkdir -p "$bin"
    rm -f "$bin/$GP_NAME.tar.xz"
    tar -C "$stage" -cJf "$bin/$GP_NAME.tar.xz" . && rm -rf "$stage"
    ls -la "$bin"
}

gp_unpack() { # BIN -> prints the directory holding the programs
    if [ -f "$1/$GP_NAME.tar.xz" ]; then
        local d
        d=$(mktemp -d "${TMPDIR:-/tmp}/fp4moe-$GP_NAME-XXXXXX")
        python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
            "$1/$GP_NAME.tar.xz" "$d" && echo "$d"
    else
        (cd "$1" && pwd)
    fi
}

gp_device() { # PKG: on the GPU machine (a bench/ device script): gp_main PKG, its directory in B, $OUT made, the
    gp_main "$1"  # GPU's name printed
    B=$GP_BIN
    mkdir -p "$OUT"
    nvidia-smi --query-gpu=name --format=csv,noheader
}

gp_bench_device() { # PKG: the bench/ device scripts' prologue
    GP_NAME=batch
    GP_BUILD=build-gpum
    GP_PROGS="fp4moe test_ops_gpu"
    gp_device "$1"
}

gp_main() {
    if [ "${1:-}" = "--package" ]; then
        gp_package "${2:?usage: --package BIN}" || { echo "gpu-$GP_NAME: build failed" >&2; exit 1; }
        exit 0
    fi
    local bin=${1:-} d mod
    if [ -z "$bin" ] && [ -f "$GP_BUILD/$GP_NAME-bin/$GP_NAME.tar.xz" ]; then bin=$GP_BUILD/$GP_NAME-bin; fi
    if [ -z "$bin" ]; then
        echo "gpu-$GP_NAME: building into $GP_BUILD" >&2
        gp_build || { echo "gpu-$GP_NAME: build failed" >&2; exit 1; }
        bin=$GP_BUILD
    fi
    GP_BIN=$(gp_unpack "$bin") || { echo "gpu-$GP_NAME: cannot unpack $bin" >&2; exit 1; }
    export LD_LIBRARY_PATH="$GP_BIN:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
    set -- $GP_PROGS
    if ldd "$GP_BIN/$1" | grep -q "libcu.*not found"; then # CUDA libraries from the pip wheels
        for mod in nvidia.cublas nvidia.cuda_runtime nvidia.cu13; do
            d=$(python3 -c "import $mod, os; print(os.path.dirname($mod.__file__) + '/lib')" 2>/dev/null)
            [ -n "$d" ] && [ -d "$d" ] && export LD_LIBRARY_PATH="$d:$LD_LIBRARY_PATH"
        done
    fi
}
