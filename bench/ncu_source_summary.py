#!/usr/bin/env python3
"""ncu_source_summary.py: a kernel's PC-sampled warp stalls by instruction, from the source-page CSV of
bench/gpu-ncu-source.sh (ncu --page source --csv --print-source sass): the stall reasons summed over the kernel,
then by opcode, then the TOP instructions with most samples (address offset, SASS, samples, main reasons).
Usage: bench/ncu_source_summary.py FILE.csv[.gz] [--top N]"""
import csv, gzip, io, sys, collections, argparse

ap = argparse.ArgumentParser()
ap.add_argument("file")
ap.add_argument("--top", type=int, default=40)
args = ap.parse_args()
raw = gzip.open(args.file, "rt").read() if args.file.endswith(".gz") else open(args.file).read()
lines = raw.splitlines()
i = next(k for k, l in enumerate(lines) if l.startswith('"Address"'))
rows = list(csv.DictReader(io.StringIO("\n".join(lines[i:]))))
reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
def num(v):
    try: return float(v.replace(",", ""))
    except: return 0.0
tot = collections.Counter()
byop = collections.defaultdict(collections.Counter)
base = None
ins = []
for r in rows:
    a = int(r["Address"], 16)
    base = a if base is None else min(base, a)
    src = r["Source"].strip()
    op = src.split()[0] if src else "?"
    if op.startswith("@"):
        op = src.split()[1]
    op = op.split(".")[0]
    s = num(r["Warp Stall Sampling (All Samples)"])
    ex = num(r["Instructions Executed"])
    c = collections.Counter({k: num(r[k]) for k in reasons})
    tot.update(c)
    byop[op].update(c)
    byop[op]["_samples"] += s
    byop[op]["_exec"] += ex
    ins.append((s, a, src, c, ex))
S = sum(tot.values())
print(f"samples {S:.0f}; reasons: " + ", ".join(f"{k[6:]} {v / S:.1%}" for k, v in tot.most_common() if v / S >= 0.005))
print(f"{'opcode':10s} {'samples':>8s} {'share':>6s} {'executed':>12s}  main reasons")
for op, c in sorted(byop.items(), key=lambda kv: -kv[1]["_samples"])[:25]:
    rs = collections.Counter({k: v for k, v in c.items() if not k.startswith("_")})
    print(f"{op:10s} {c['_samples']:8.0f} {c['_samples'] / S:6.1%} {c['_exec']:12.0f}  " +
          ", ".join(f"{k[6:]} {v / max(c['_samples'], 1):.0%}" for k, v in rs.most_common(3) if v))
print(f"top {args.top} instructions (offset, samples, executed, reasons)")
for s, a, src, c, ex in sorted(ins, key=lambda t: -t[0])[:args.top]:
    print(f"  {a - base:#07x} {s:6.0f} {ex:9.0f}  {src[:60]:60s} " +
          ", ".join(f"{k[6:]} {v:.0f}" for k, v in c.most_common(3) if v))
