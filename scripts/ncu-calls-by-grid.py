#!/usr/bin/env python3
# scripts/ncu-calls-by-grid.py NCU_CSV: the last forward (decode step) of an `ncu --metrics gpu__time_duration.sum --csv`
# run (as scripts/gpu-decode-profile.sh makes it; forwards split at embed_kernel): the gq_batched kernels summed by
# (kernel, grid size) - which call shape costs what - and the first 14 such calls in order (session 23).
import csv, sys, collections
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
rows = []
for r in csv.DictReader(lines):
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    v = float(r["Metric Value"].replace(",", ""))
    unit = r.get("Metric Unit", "nsecond")
    us = v / 1000.0 if unit.startswith("n") else (v if unit.startswith("u") else v * 1000.0)
    rows.append((r["Kernel Name"], r.get("Grid Size", "?"), r.get("Block Size", "?"), us))
fw, cur = [], None
for x in rows:
    if x[0].startswith("embed_kernel"):
        cur = []
        fw.append(cur)
    if cur is not None:
        cur.append(x)
seg = fw[-1]
agg = collections.OrderedDict()
for n, gsz, bsz, us in seg:
    if not n.startswith("gq_batched") and "gq_batched" not in n:
        continue
    k = (n[:48], gsz)
    c, s = agg.get(k, (0, 0.0))
    agg[k] = (c + 1, s + us)
print(f"{sys.argv[1]}: last decode step, gq_batched calls by (kernel, grid)")
for (n, gsz), (c, s) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
    print(f"  {n:48s} grid {gsz:>14s} x{c:4d} {s:9.1f} us  {s / c:7.2f} us a call")
print("  first 14 gq_batched calls in order:")
i = 0
for n, gsz, bsz, us in seg:
    if "gq_batched" in n:
        print(f"    {n[:48]:48s} grid {gsz:>14s} {us:8.2f} us")
        i += 1
        if i >= 14:
            break
