#!/bin/sh
# scripts/sass-tools.sh: cuobjdump and nvdisasm for reading the SASS of our kernels on a machine without
# them (the CUDA toolkit here has nvcc and ptxas only). They come from NVIDIA's PyPI wheels
# (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm), unpacked into .cache/sass-tools/bin; prints that directory.
# Use: PATH=$(scripts/sass-tools.sh):$PATH cuobjdump -sass FILE.cubin  (cuobjdump runs nvdisasm from PATH),
# or scripts/sass_loops.py, which calls this.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
dir=$root/.cache/sass-tools
if [ -x "$dir/bin/cuobjdump" ] && [ -x "$dir/bin/nvdisasm" ]; then echo "$dir/bin"; exit 0; fi
mkdir -p "$dir/bin" "$dir/wheels"
for p in nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm; do
    python3 -m pip download --quiet --no-deps -d "$dir/wheels" "$p" >&2 ||
        { echo "sass-tools: pip download $p failed (no network or index?)" >&2; exit 1; }
done
for w in "$dir"/wheels/*.whl; do
    python3 - "$w" "$dir/bin" <<'PY'
import sys, zipfile, os
w, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(w) as z:
    for n in z.namelist():
        b = os.path.basename(n)
        if n.split("/")[-2:-1] == ["bin"] and b in ("cuobjdump", "nvdisasm"):
            open(os.path.join(out, b), "wb").write(z.read(n))
            os.chmod(os.path.join(out, b), 0o755)
PY
done
[ -x "$dir/bin/cuobjdump" ] && [ -x "$dir/bin/nvdisasm" ] || { echo "sass-tools: the wheels had no cuobjdump / nvdisasm" >&2; exit 1; }
echo "$dir/bin"
