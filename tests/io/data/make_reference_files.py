#!/usr/bin/env python3
"""Cross-checks fp4moe's safetensors code against the reference library (pip install safetensors
numpy ml_dtypes; not needed to build or test fp4moe).

  make_reference_files.py make         writes ref_safetensors.safetensors here (tiny; committed;
                                       read back by tests/io/test_safetensors.c)
  make_reference_files.py check FILE   loads FILE (e.g. written by fp4moe) with the reference
                                       library and prints every tensor: it must load without error
"""
import sys

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file
from safetensors import safe_open


def make():
    t = {
        "a.u8": np.arange(1, 13, dtype=np.uint8).reshape(3, 4),
        "b.f32": (np.arange(1, 7, dtype=np.float32) * 0.5).reshape(2, 3),
        "c.i64": np.array([-1, 2**40, 3], dtype=np.int64),
        "d.f16": np.arange(1, 5, dtype=np.float16),
        "e.u32": np.array([[0x01234567, 0x89ABCDEF]], dtype=np.uint32),
        "f.bf16": np.array([1.5, -2.0, 3.25], dtype=ml_dtypes.bfloat16),
        "g.f8": np.array([0.5, 448.0, -1.0, 0.001953125], dtype=ml_dtypes.float8_e4m3fn),
        "h.scalar": np.array(7.25, dtype=np.float32),
        "i.empty": np.zeros((2, 0), dtype=np.float32),
    }
    save_file(t, "ref_safetensors.safetensors", metadata={"format": "np", "note": "reference"})
    print("wrote ref_safetensors.safetensors")


def check(path):
    # safe_open validates the whole header (offsets contiguous, in bounds, dtypes known)
    with safe_open(path, "np") as f:
        print("metadata:", f.metadata())
        for name in f.keys():
            sl = f.get_slice(name)
            print(f"{name}: {sl.get_dtype()} {sl.get_shape()}")
    # numpy has no float8/bfloat16: load the rest through the library's numpy path too
    try:
        n = len(load_file(path))
        print(f"load_file: {n} tensors")
    except AttributeError as e:
        print(f"load_file: skipped ({e})")


if __name__ == "__main__":
    if sys.argv[1:] == ["make"]:
        make()
    elif len(sys.argv) == 3 and sys.argv[1] == "check":
        check(sys.argv[2])
    else:
        sys.exit(__doc__)
