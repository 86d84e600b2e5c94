#!/usr/bin/env python3
# bench/patches/ssd-load.diff, checked without a GPU: the (shared destination, global source) pairs of
# ssm_ssd_kernel's vec load and PRE copy, every thread of a block, old loops (main) against the new
# compile-time-trip loops, over S = 64 / 128, tails of T, head_dim not a multiple of 32, both buffers.
# A transcription of both forms (the index arithmetic only): it checks the rewrite's algebra, not the compiled code.
# old vs new (dst, src) sets of ssm_ssd_kernel's vec load, every thread, several shapes
import itertools
L, PB, NT = 64, 32, 512
def old(S, T, t0, hd, p0, bcs, xs, grp, h, G, b):
    SP, XP, MP = S + 4, PB + 8, L + 4
    BUF = 2 * L * SP + L * XP
    Cs, Bs = b * BUF, b * BUF + L * SP; Xs = Bs + L * SP
    Mb = 2 * BUF
    tc = min(L, T - t0); out = set()
    for tid in range(NT):
        for i in range(tid, L * L // 4, NT):
            r, v = i // (L // 4), i % (L // 4)
            if 4 * v < 16 * (r // 16 + 1): out.add(('M', Mb + b * L * MP + r * MP + 4 * v, ((t0 // L) * G + grp) * L * L + 4 * i))
        SV, PV = S // 4, PB // 4
        for i in range(tid, L * SV, NT):
            r, v = i // SV, i % SV
            if r < tc:
                row = (t0 + r) * bcs + grp * S + 4 * v
                out.add(('C', Cs + r * SP + 4 * v, row)); out.add(('B', Bs + r * SP + 4 * v, row))
            else: out.add(('z', Cs + r * SP + 4 * v)); out.add(('z', Bs + r * SP + 4 * v))
        for i in range(tid, L * PV, NT):
            r, v = i // PV, i % PV; p = p0 + 4 * v; dst = Xs + r * XP + 4 * v
            if r < tc and p < hd: out.add(('X', dst, (t0 + r) * xs + h * hd + p))
            else: out.add(('z', dst))
    return out
def new(S, T, t0, hd, p0, bcs, xs, grp, h, G, b):
    SP, XP, MP = S + 4, PB + 8, L + 4
    BUF = 2 * L * SP + L * XP
    Cs, Bs = b * BUF, b * BUF + L * SP; Xs = Bs + L * SP
    Mb = 2 * BUF
    SV, PV, LV = S // 4, PB // 4, L // 4
    tc = min(L, T - t0); out = set()
    for tid in range(NT):
        RS = NT // LV; r0, v = tid // LV, tid % LV
        Gt = ((t0 // L) * G + grp) * L * L + 4 * tid; dst = Mb + b * L * MP + r0 * MP + 4 * v
        for k in range(L * LV // NT):
            r = r0 + k * RS
            if 4 * v < 16 * (r // 16 + 1): out.add(('M', dst + k * RS * MP, Gt + 4 * k * NT))
        RS = NT // SV; r0, v = tid // SV, tid % SV; step = RS * bcs
        src = (t0 + r0) * bcs + grp * S + 4 * v; dc = Cs + r0 * SP + 4 * v
        for k in range(L * SV // NT):
            if r0 + k * RS < tc: out.add(('C', dc + k * RS * SP, src)); out.add(('B', dc + L * SP + k * RS * SP, src))
            else: out.add(('z', dc + k * RS * SP)); out.add(('z', dc + L * SP + k * RS * SP))
            src += step
        RX = NT // PV; rx, vx = tid // PV, tid % PV; p = p0 + 4 * vx
        xsrc = (t0 + rx) * xs + h * hd + p; dx = Xs + rx * XP + 4 * vx
        for k in range(L * PV // NT):
            if rx + k * RX < tc and p < hd: out.add(('X', dx + k * RX * XP, xsrc + k * RX * xs))
            else: out.add(('z', dx + k * RX * XP))
    return out
n = 0
for S, T, t0, hd, p0, b in itertools.product([64, 128], [130, 200, 64], [0, 64, 128], [64, 36, 100], [0, 32, 64], [0, 1]):
    if t0 >= T or p0 >= hd: continue
    a = dict(S=S, T=T, t0=t0, hd=hd, p0=p0, bcs=8 * 64 + 2 * 2 * S + 12, xs=4 * hd + 20, grp=1, h=3, G=2, b=b)
    o, w = old(**a), new(**a)
    assert o == w, (a, len(o ^ w)); n += 1
print("equal on", n, "shapes")
