#!/usr/bin/env python3
"""The ctest python/mlx_oracle (issue 16), run in the venv of scripts/pyenv.sh:
  1. transformers' strict config validation (AutoConfig.from_pretrained) accepts the config.json of
     the shipped default model and of every golden model directory;
  2. the configs that fp4moe itself writes (`fp4moe quantize` of tiny-a-bf16, `fp4moe dequantize`
     of tiny-a-mlx) pass the same validation, and mlx_lm.load loads the quantized one;
  3. mlx_lm.load works on the shipped default model and the golden MLX models, and the pinned
     mlx-lm reproduces the committed goldens tests/golden/mlx/*.safetensors: scripts/
     make_mlx_golden.py is rerun into a temporary directory; ids and MLX's quantized bytes must be
     identical, float tensors equal within 1e-6 of each row's max |value| (another CPU's SIMD may
     sum in another order).
Usage: check_mlx_oracle.py FP4MOE_EXE      (prints one 'N passed, N failed' line; exit 1 on a failure)
"""
import glob
import os
import subprocess
import sys
import tempfile
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ["HF_HUB_OFFLINE"] = "1"

passed, failed = 0, 0


def check(name, fn):
    global passed, failed
    try:
        msg = fn()
        passed += 1
        print(f"ok    {name}" + (f": {msg}" if msg else ""), flush=True)
    except Exception:
        failed += 1
        print(f"FAIL  {name}\n{traceback.format_exc()}", flush=True)


def strict_config(d):
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(d)
    return f"time_step_limit {list(c.time_step_limit)}"


def mlx_load(d):
    import mlx_lm
    model, _ = mlx_lm.load(d)
    return type(model).__module__


def fp4moe_written(exe, tmp):
    q = os.path.join(tmp, "q")
    dq = os.path.join(tmp, "dq")
    subprocess.run([exe, "quantize", "-i", os.path.join(ROOT, "tests/golden/models/tiny-a-bf16"), "-o", q],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run([exe, "dequantize", "-i", os.path.join(ROOT, "tests/golden/models/tiny-a-mlx"), "-o", dq],
                   check=True, stdout=subprocess.DEVNULL)
    return q, dq


def compare_goldens(tmp):
    import make_mlx_golden
    from safetensors.numpy import load_file
    out = os.path.join(tmp, "mlx")
    make_mlx_golden.main(["--out", out])
    ref_dir = os.path.join(ROOT, "tests", "golden", "mlx")
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ref_dir, "*.safetensors")))
    assert files and files == sorted(os.path.basename(p) for p in glob.glob(os.path.join(out, "*.safetensors"))), files
    worst = 0.0
    for f in files:
        a, b = load_file(os.path.join(ref_dir, f)), load_file(os.path.join(out, f))
        assert sorted(a) == sorted(b), (f, sorted(a), sorted(b))
        for k in a:
            x, y = a[k], b[k]
            assert x.shape == y.shape and x.dtype == y.dtype, (f, k, x.shape, y.shape, x.dtype, y.dtype)
            if x.dtype.kind == "f":
                x2 = x.reshape(-1, x.shape[-1]).astype(np.float64)
                y2 = y.reshape(-1, y.shape[-1]).astype(np.float64)
                m = np.maximum(np.abs(x2).max(axis=1, keepdims=True), 1e-30)
                e = float((np.abs(x2 - y2) / m).max())
                assert e <= 1e-6, (f, k, e)
                worst = max(worst, e)
            else:
                assert np.array_equal(x, y), (f, k)
    return f"{len(files)} files reproduced (max row-relative float difference {worst:.3g})"


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    exe = os.path.abspath(sys.argv[1])
    dirs = [os.path.join(ROOT, "models", "nemotron-h-tiny-moe")] + sorted(
        os.path.dirname(p) for p in glob.glob(os.path.join(ROOT, "tests/golden/models/*/config.json")))
    for d in dirs:
        check(f"strict config {os.path.relpath(d, ROOT)}", lambda d=d: strict_config(d))
    with tempfile.TemporaryDirectory(prefix="fp4moe-mlx-oracle-") as tmp:
        try:
            q, dq = fp4moe_written(exe, tmp)
        except Exception:
            q = dq = None
            check("fp4moe quantize/dequantize", lambda: (_ for _ in ()).throw(RuntimeError("fp4moe failed")))
        if q:
            check("strict config of fp4moe quantize output", lambda: strict_config(q))
            check("strict config of fp4moe dequantize output", lambda: strict_config(dq))
            check("mlx_lm.load fp4moe quantize output", lambda: mlx_load(q))
        for d in ("models/nemotron-h-tiny-moe", "tests/golden/models/tiny-a-mlx", "tests/golden/models/tiny-b-mlx"):
            check(f"mlx_lm.load {d}", lambda d=d: mlx_load(os.path.join(ROOT, d)))
        check("mlx-lm reproduces tests/golden/mlx", lambda: compare_goldens(tmp))
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
