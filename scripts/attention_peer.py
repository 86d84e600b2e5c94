#!/usr/bin/env python3
"""The same-run peer of bench/gpu_attention.c: torch's scaled_dot_product_attention on the same
shapes (32 query heads, 2 KV heads, head_dim 128, bf16; prefill causal over T tokens; decode: R
sequences, one query each, over L cached keys), GQA through enable_gqa=True (no repeated K/V),
median ms of one call with CUDA events. The flash backend is asked for; where it refuses a shape
torch's default choice runs and the line says which. Prints lines "prefill T ms backend" and
"decode L R ms backend".  usage: attention_peer.py [--quick]"""
import sys
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

NQ, NKV, DH = 32, 2, 128
quick = "--quick" in sys.argv
dev = torch.device("cuda")


def timed(fn, reps=7, inner=10):
    fn()
    torch.cuda.synchronize()
    ms = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b) / inner)
    return sorted(ms)[len(ms) // 2]


def run(q, k, v, causal, inner):
    for name, backends in (("flash", [SDPBackend.FLASH_ATTENTION]), ("default", None)):
        try:
            if backends:
                with sdpa_kernel(backends):
                    f = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
                    return timed(f, inner=inner), name
            f = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            return timed(f, inner=inner), name
        except RuntimeError:
            continue
    raise SystemExit("no SDPA backend ran")


print("# torch %s, %s" % (torch.__version__, torch.cuda.get_device_name(0)))
for T in (512, 2048, 8192, 32768):
    if quick and T > 2048:
        break
    q = torch.randn(1, NQ, T, DH, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, NKV, T, DH, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, NKV, T, DH, device=dev, dtype=torch.bfloat16)
    ms, be = run(q, k, v, True, 3 if T >= 8192 else 10)
    print("prefill %d %.4f %s" % (T, ms, be), flush=True)
    del q, k, v
for R in (1, 64):
    for L in (512, 2048, 8192, 32768, 131072):
        if (quick and L > 8192) or (R > 1 and L > 32768):
            break
        q = torch.randn(R, NQ, 1, DH, device=dev, dtype=torch.bfloat16)
        k = torch.randn(R, NKV, L, DH, device=dev, dtype=torch.bfloat16)
        v = torch.randn(R, NKV, L, DH, device=dev, dtype=torch.bfloat16)
        ms, be = run(q, k, v, False, 20)
        print("decode %d %d %.4f %s" % (L, R, ms, be), flush=True)
        del q, k, v
        torch.cuda.empty_cache()
