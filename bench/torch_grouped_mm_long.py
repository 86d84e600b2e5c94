# bench/torch_grouped_mm_long.py: the same-run peer of the MoE gather at long prefill steps (issue 12's 8,192-token
# target, <= 2.0 ms up + down on the H200): torch's bf16 grouped GEMM (torch._grouped_mm, CUTLASS grouped on sm_90)
# on bf16 experts of the Nemotron-3-Nano layer (E = 128, top-6, H = 2688, I = 1856), uniform top-6 routing, at
# 2,048 .. 32,768 tokens; CUDA-event medians of 20 (after 5). Written after ../shared/anchors/moe_anchor.py (which
# stops at 2,048 tokens). Prints one JSON object: per T the up + down ms and their bf16 TFLOP/s.
import json
import torch

dev = "cuda"


def bench(fn, iters=20, warm=5):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(iters):
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


E, H, I, K = 128, 2688, 1856, 6
res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
torch.manual_seed(0)
Wup = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * 0.02  # (E, K, N) for _grouped_mm
Wdn = torch.randn(E, I, H, device=dev, dtype=torch.bfloat16) * 0.02
for T in (2048, 8192, 16384, 32768):
    idx = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)]).flatten()
    counts = torch.bincount(idx, minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(T * K, H, device=dev, dtype=torch.bfloat16)
    h = torch.randn(T * K, I, device=dev, dtype=torch.bfloat16)
    try:
        tu = bench(lambda: torch._grouped_mm(x, Wup, offs=offs))
        td = bench(lambda: torch._grouped_mm(h, Wdn, offs=offs))
        ms = tu + td
        res[f"T{T}_up_plus_down_ms"] = round(ms, 4)
        res[f"T{T}_tflops"] = round(2 * 2 * T * K * H * I / (ms * 1e-3) / 1e12, 1)
    except Exception as ex:  # noqa: BLE001 - reported, not fatal
        res[f"T{T}_err"] = repr(ex)[:200]
    del x, h
print(json.dumps(res, indent=1))
