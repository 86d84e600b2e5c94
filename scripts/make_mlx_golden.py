#!/usr/bin/env python3
"""mlx-lm as a second golden oracle (issue 16): writes tests/golden/mlx/*.safetensors.

Run in the venv of scripts/pyenv.sh (pins: scripts/requirements-mlx.txt):
    scripts/pyenv.sh && build/mlx-venv/bin/python scripts/make_mlx_golden.py [--out DIR]
(~10 s on 2 cores). The ctest python/mlx_oracle (scripts/check_mlx_oracle.py) reruns it into a
temporary directory and compares with the committed files.

Everything runs on MLX's CPU device. The models are loaded with mlx_lm.load and then
model.set_dtype(mx.float32): every floating-point parameter (norms, conv, A_log, D, dt_bias, the
router's correction bias, embeddings) and so every activation is fp32; the NVFP4 weights (uint32
codes, uint8 E4M3 scales) are untouched by set_dtype and stay nvfp4.

Models (MLX nvfp4 checkpoints):
  default      models/nemotron-h-tiny-moe; prompt = the first PROMPT_T tokens of
               tests/golden/default/heldout_short.txt (the model's tokenizer, no BOS).
               V = 8192, so full logits are kept for PREFILL_ROWS positions only (spread over the
               prompt, the last one included), plus the teacher-forced argmax of every position.
  tiny-a-mlx,  tests/golden/models/<name>; prompt = the ids of tests/golden/models/reference/<name>
  tiny-b-mlx   .safetensors; logits of every position are kept (V = 272).
Each model file holds:
  prompt        I32 [T]
  rows          I32 [R]       the positions whose full logits are stored
  logits        F32 [R, V]    teacher-forced logits (one forward over the whole prompt, no cache)
  argmax        I32 [T]       argmax of every position's teacher-forced logits
  gen_ids       I32 [n]       greedy continuation by mlx-lm: one prefill with a prompt cache,
                              then one cached decode step per token (mlx-lm's decode path)
  step_logits   F32 [n, V]    the logits that chose gen_ids[i] (row 0 = the prefill's last row)
  metadata: min top-1/top-2 margin of the greedy steps and of the argmax rows, versions.

Per-expert global scales: not covered. mx.gather_qmm(..., mode="nvfp4", global_scale=gs) with
one scale per expert exists in MLX, but it raises "Global scale is only supported on the GPU" on the
CPU (mlx 0.32.4), and this machine has no Metal/CUDA MLX device; so there is no golden MLX model with
global scales and the gather_qmm goldens below have none (fp4moe's global-scale path is checked
against the fp64 reference and by the fault builds of scripts/fault-check.sh, and against
transformers on the ModelOpt golden model).

gather_qmm goldens (gather.safetensors, gather-e128.safetensors): for each case, random N(0,1) f32
weights quantized by mx.quantize(mode="nvfp4", group_size=16) on the CPU; MLX's codes (its uint32
words stored as their little-endian bytes, E x N x K/2) and E4M3 scale bytes (E x N x K/16) are kept
exactly as MLX produced them and are the INPUT of the test (MLX's CPU quantizer rounds exact ties
differently from its Metal kernel, so its bytes are no quantizer oracle). Then x (B x K, f32), the
expert index of every row (uint32, sorted unless the case name says unsorted) and
y = mx.gather_qmm(x, w, scales, rhs_indices=idx, transpose=True, mode="nvfp4") in f32.
Tensors of case C: C.codes U8, C.scales U8, C.x F32, C.idx U32, C.y F32; metadata "cases" lists the
case names, "C" holds "E N K B sorted". MLX's nvfp4 needs K % 32 == 0 (its uint32 words hold 8
codes, two groups of 16 per word pair), so K = 16 x odd, which fp4moe supports, is not covered here;
N need not be a multiple of anything (N = 5, 19, 23, 37, 41 below).
"""
import argparse
import os
import sys

import numpy as np

import mlx.core as mx
import mlx_lm
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from safetensors.numpy import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "golden", "mlx")
PROMPT_T = 96       # default model: prompt tokens
PREFILL_ROWS = 16   # default model: positions with full logits
N_GEN_DEFAULT = 32
N_GEN_TINY = 16


def margin(row):
    s = np.sort(row.astype(np.float64))
    return float(s[-1] - s[-2])


def run_model(model_dir, prompt, n_gen, rows):
    model, tok = mlx_lm.load(model_dir)
    model.set_dtype(mx.float32)
    for _, p in tree_flatten(model.parameters()):
        assert p.dtype in (mx.float32, mx.uint32, mx.uint8), p.dtype
    ids = mx.array(np.asarray(prompt, dtype=np.int32))[None]
    lg = model(ids)                                      # teacher-forced, no cache
    lg = np.array(lg.astype(mx.float32))[0]
    assert lg.dtype == np.float32
    # greedy continuation through mlx-lm's prompt cache (prefill, then cached decode)
    cache = make_prompt_cache(model)
    out = model(ids, cache=cache)
    gen, steps = [], []
    for i in range(n_gen):
        row = np.array(out[0, -1].astype(mx.float32))
        steps.append(row)
        t = int(np.argmax(row))
        gen.append(t)
        if i + 1 < n_gen:
            out = model(mx.array([[t]], dtype=mx.int32), cache=cache)
    steps = np.stack(steps)
    tf_gap = float(np.max(np.abs(steps[0] - lg[-1])) / np.max(np.abs(lg[-1])))
    rows = np.asarray(rows, dtype=np.int32)
    d = {
        "prompt": np.asarray(prompt, dtype=np.int32),
        "rows": rows,
        "logits": np.ascontiguousarray(lg[rows]),
        "argmax": lg.argmax(axis=1).astype(np.int32),
        "gen_ids": np.asarray(gen, dtype=np.int32),
        "step_logits": steps.astype(np.float32),
    }
    meta = {
        "min_greedy_margin": f"{min(margin(r) for r in steps):.6g}",
        "min_argmax_margin": f"{min(margin(r) for r in lg):.6g}",
        "prefill_vs_cached_last_row_rel": f"{tf_gap:.3g}",
        "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
        "model": os.path.relpath(model_dir, ROOT),
    }
    return d, meta


def make_models():
    # default model
    mdir = os.path.join(ROOT, "models", "nemotron-h-tiny-moe")
    _, tok = mlx_lm.load(mdir)
    with open(os.path.join(ROOT, "tests", "golden", "default", "heldout_short.txt"), encoding="utf-8") as f:
        text = f.read()
    ids = tok.encode(text, add_special_tokens=False)[:PROMPT_T]
    assert len(ids) == PROMPT_T
    rows = sorted(set(np.linspace(0, PROMPT_T - 1, PREFILL_ROWS).round().astype(int).tolist()))
    d, meta = run_model(mdir, ids, N_GEN_DEFAULT, rows)
    save("default", d, meta)
    for name in ("tiny-a-mlx", "tiny-b-mlx"):
        ref = load_file(os.path.join(ROOT, "tests", "golden", "models", "reference", name + ".safetensors"))
        prompt = ref["prompt"].tolist()
        d, meta = run_model(os.path.join(ROOT, "tests", "golden", "models", name), prompt, N_GEN_TINY,
                            list(range(len(prompt))))
        save(name, d, meta)


def save(name, d, meta):
    path = os.path.join(OUT, name + ".safetensors")
    save_file(d, path, metadata=meta)
    os.chmod(path, 0o644)
    print(f"{path}: {os.path.getsize(path)} bytes, T {len(d['prompt'])}, V {d['logits'].shape[1]}, "
          f"gen {d['gen_ids'].tolist()}, {meta}")


# name, E, N, K, B, sorted
GATHER_CASES = [
    ("e8_n40_k64_b1", 8, 40, 64, 1, True),
    ("e8_n37_k128_b5", 8, 37, 128, 5, True),
    ("e8_n50_k256_b70", 8, 50, 256, 70, True),
    ("e8_n23_k192_b300", 8, 23, 192, 300, True),
    ("e8_n41_k96_b70_unsorted", 8, 41, 96, 70, False),
    ("e1_n19_k32_b64", 1, 19, 32, 64, True),
]
GATHER_E128 = [("e128_n5_k2688_b64", 128, 5, 2688, 64, True)]


def gather_case(rng, name, E, N, K, B, sorted_):
    w = mx.array(rng.standard_normal((E, N, K)).astype(np.float32))
    wq, sc = mx.quantize(w, group_size=16, bits=4, mode="nvfp4")[:2]
    x = rng.standard_normal((B, K)).astype(np.float32)
    if sorted_:
        # top-k-like: experts in runs, some experts empty (only when E > 1)
        idx = np.sort(rng.integers(0, E, size=B)).astype(np.uint32)
    else:
        idx = rng.integers(0, E, size=B).astype(np.uint32)
    y = mx.gather_qmm(mx.array(x)[:, None, :], wq, sc, None, rhs_indices=mx.array(idx), transpose=True,
                      group_size=16, bits=4, mode="nvfp4", sorted_indices=bool(sorted_))
    y = np.array(y.astype(mx.float32)).reshape(B, N)
    codes = np.array(wq).astype("<u4").view(np.uint8).reshape(E, N, K // 2)
    scales = np.array(sc).astype(np.uint8).reshape(E, N, K // 16)
    assert np.all(np.isfinite(y))
    return {f"{name}.codes": codes, f"{name}.scales": scales, f"{name}.x": x,
            f"{name}.idx": idx, f"{name}.y": y}, f"{E} {N} {K} {B} {int(sorted_)}"


def make_gather(fname, cases, seed):
    rng = np.random.default_rng(seed)
    d, meta = {}, {"mlx": mx.__version__, "cases": " ".join(c[0] for c in cases)}
    for c in cases:
        t, m = gather_case(rng, *c)
        d.update(t)
        meta[c[0]] = m
    path = os.path.join(OUT, fname)
    save_file(d, path, metadata=meta)
    os.chmod(path, 0o644)
    print(f"{path}: {os.path.getsize(path)} bytes, {len(cases)} cases")


def main(argv=None):
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=OUT, help="output directory (default: tests/golden/mlx)")
    OUT = ap.parse_args(argv).out
    mx.set_default_device(mx.cpu)
    os.makedirs(OUT, exist_ok=True)
    make_models()
    make_gather("gather.safetensors", GATHER_CASES, 16)
    make_gather("gather-e128.safetensors", GATHER_E128, 17)


if __name__ == "__main__":
    sys.exit(main())
