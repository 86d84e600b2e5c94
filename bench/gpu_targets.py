#!/usr/bin/env python3
"""gpu_targets.py: issue 12's targets against what one bench/gpu-peers.sh call measured (its folder T): measured,
target, met or missed, fraction of the floor where the target has one, and the same-run peer.

Usage: bench/gpu_targets.py T      (T: the folder gpu-peers.sh wrote: gather.txt, decode.txt, torch.json,
                                    e2e_512.json, e2e_2048.json, prof_512.json, prof_2048.json)

Inputs, all from the same call on one GPU: gather.txt - bench/gpu_gather_wg's table (the production column: up +
down of one 30B-A3B MoE layer, tiled layout, uniform routing, ms; since session 47 the model's MoE step where it
takes the big tiles, i.e. 8,192 tokens); decode.txt - bench/gpu_moe_decode 8 6 0 (the
decode MoE pair as the model runs it: graph replay, weights from DRAM, us); torch.json - ../shared/anchors/
moe_anchor.py (copy rate, torch bf16 _grouped_mm up + down); e2e_P.json - `fp4moe bench --json` on the synthetic
30B-A3B shape (P prompt tokens); prof_P.json - the same with --profile (device ms of the Mamba-2 layers). A missing
input leaves its rows as "-". Floors: the MoE layer's NVFP4 bytes (codes + E4M3 block scales of 128 experts, up and
down) or the 6 decode experts' bytes, at the copy rate of torch.json; for the gathers the larger of that and their
bf16 tensor FLOPs at 765 TFLOP/s (2,048 and 8,192 tokens are compute-bound)."""
import json, os, re, sys

T = sys.argv[1] if len(sys.argv) > 1 else "."
E, H, I, TOPK = 128, 2688, 1856, 6
EXPERT_BYTES = 2 * H * I * (0.5 + 1 / 16)   # up + down of one expert: E2M1 codes + one E4M3 scale a 16-block


def load_json(name):
    try:
        with open(os.path.join(T, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def gather_ms():
    """tokens -> production ms (tiled layout, uniform routing) from gpu_gather_wg's table"""
    out = {}
    try:
        lines = open(os.path.join(T, "gather.txt")).read().splitlines()
    except OSError:
        return out
    for l in lines:
        c = [x.strip() for x in l.strip().strip("|").split("|")]
        if len(c) > 2 and c[0].isdigit() and c[1].startswith("tiled, skew 0.0"):
            try:
                out.setdefault(int(c[0]), float(c[2]))
            except ValueError:
                pass
    return out


def decode_us():
    try:
        for l in open(os.path.join(T, "decode.txt")):
            if "8 layers" in l:
                return float(l.split("|")[2])
    except (OSError, ValueError, IndexError):
        pass
    return None


torch = load_json("torch.json") or {}
copy = torch.get("copy_TBps")
g = gather_ms()
dec = decode_us()
rows = []  # (what, measured, unit, target, op, floor value or None, peer text)


def add(what, v, unit, target, op, floor=None, peer=""):
    rows.append((what, v, unit, target, op, floor, peer))


BF16_PEAK = 765e12  # dense bf16 FLOP/s that these notes take for the H100 / H200 (docs/PERFORMANCE.md)
tlong = load_json("torch_long.json") or {}  # bench/torch_grouped_mm_long.py: the same peer at 8,192+ tokens
for tok, tgt in ((128, 0.26), (512, 0.28), (2048, 0.60), (8192, 2.0)):
    tv = torch.get(f"bf16_grouped_mm_T{tok}_up_plus_down_ms") or tlong.get(f"T{tok}_up_plus_down_ms")
    fl = max(E * EXPERT_BYTES / (copy * 1e12), tok * TOPK * 2 * 2 * H * I / BF16_PEAK) * 1e3 if copy else None
    add(f"MoE gather up + down, {tok} tokens", g.get(tok), "ms", tgt, "<=", fl,
        f"torch bf16 _grouped_mm {tv:.4f} ms" if tv else "")
tv = torch.get("bf16_grouped_mm_T1_up_plus_down_ms")
add("MoE decode pair, 6 rows (graph)", dec, "us", 14.0, "<=",
    TOPK * EXPERT_BYTES / (copy * 1e12) * 1e6 if copy else None, f"torch bf16 _grouped_mm {tv * 1e3:.1f} us" if tv else "")
for P, tgt in ((512, 2.5), (2048, 6.0)):
    pj = load_json(f"prof_{P}.json")
    m = pj.get("prefill_split_ms", {}).get("mamba") if pj else None
    add(f"Mamba-2 layers (23), {P} tokens", m, "ms", tgt, "<=")
for P, tgt in ((512, 40000), (2048, 50000)):
    ej = load_json(f"e2e_{P}.json")
    add(f"prefill {P} tokens", ej.get("prefill_tok_s_median") if ej else None, "tok/s", tgt, ">=")
ej = load_json("e2e_512.json")
add("decode batch 1 (after 512 tokens)", ej.get("decode_tok_s_median") if ej else None, "tok/s", 600, ">=")

print(f"issue 12 targets, {torch.get('gpu', '?')} (copy {copy:.2f} TB/s)" if copy else "issue 12 targets")
print("| target | measured | goal | met | of floor | same-run peer |")
print("|---|---:|---:|---|---:|---|")
met = 0
for what, v, unit, tgt, op, floor, peer in rows:
    if v is None:
        print(f"| {what} | - | {op} {tgt:g} {unit} | - | - | {peer} |")
        continue
    ok = v <= tgt if op == "<=" else v >= tgt
    met += ok
    ff = f"{floor / v:.0%}" if floor else "-"
    fmt = f"{v:,.0f}" if unit == "tok/s" else f"{v:.4g}"
    print(f"| {what} | {fmt} {unit} | {op} {tgt:g} | {'met' if ok else 'missed'} | {ff} | {peer} |")
print(f"{met} of {len(rows)} met")
extra = []  # beyond the targets: long prompts at the CLI's default chunk (bench/gpu-peers.sh runs them when it can)
for P in (8192, 32768):
    ej = load_json(f"e2e_{P}.json")
    if ej and ej.get("prefill_tok_s_median"):
        extra.append(f"prefill {P:,} tokens {ej['prefill_tok_s_median']:,.0f} tok/s (hash {ej.get('gen_ids_fnv1a', '?')})")
for T in (16384, 32768):
    if tlong.get(f"T{T}_up_plus_down_ms"):
        extra.append(f"torch bf16 _grouped_mm {T:,} tokens {tlong[f'T{T}_up_plus_down_ms']:.3f} ms")
if extra:
    print("beyond the targets: " + "; ".join(extra))
