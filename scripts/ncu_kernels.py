#!/usr/bin/env python3
"""Kernel-time tables from an Nsight Compute CSV (`ncu --metrics gpu__time_duration.sum --csv`, as
scripts/gpu-decode-profile.sh runs it). The run's kernels are split into forwards at embed_kernel (the
first kernel of every forward).

Usage: scripts/ncu_kernels.py CSV            per kernel name: the prefill (first forward) and the last
                                             decode step (last forward), calls, us and share
       scripts/ncu_kernels.py --by-grid CSV  the last forward's gq_batched kernels summed by (kernel, grid
                                             size) - which call shape costs what - and the first 14 such
                                             calls in order (session 23: the plain linears' row tiles)
"""
import collections
import csv
import sys


def read_rows(path):
    """(kernel name, grid size, microseconds) of every kernel, in launch order."""
    try:
        lines = [l for l in open(path) if l.startswith('"')]
    except OSError as e:
        sys.exit(f"no ncu output: {e}")
    rows = []
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "nsecond")
        us = v / 1000.0 if unit.startswith("n") else (v if unit.startswith("u") else v * 1000.0)
        rows.append((r["Kernel Name"], r.get("Grid Size", "?"), us))
    return rows


def forwards(rows):
    fw, cur = [], None
    for x in rows:
        if x[0].startswith("embed_kernel"):
            cur = []
            fw.append(cur)
        if cur is not None:
            cur.append(x)
    return fw


def by_name(title, seg):
    agg = collections.OrderedDict()
    for n, _, us in seg:
        c, s = agg.get(n, (0, 0.0))
        agg[n] = (c + 1, s + us)
    tot = sum(us for _, _, us in seg)
    print(f"-- {title}: {len(seg)} kernels, {tot:.1f} us of kernel time")
    for n, (c, s) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        print(f"{n[:60]:60s} {c:5d} {s:10.1f} us {100*s/tot:5.1f}%")


def by_grid(seg):
    agg = collections.OrderedDict()
    calls = [x for x in seg if "gq_batched" in x[0]]
    for n, gsz, us in calls:
        c, s = agg.get((n[:48], gsz), (0, 0.0))
        agg[(n[:48], gsz)] = (c + 1, s + us)
    print("-- last forward: gq_batched calls by (kernel, grid)")
    for (n, gsz), (c, s) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        print(f"  {n:48s} grid {gsz:>14s} x{c:4d} {s:9.1f} us  {s / c:7.2f} us a call")
    print("  first 14 gq_batched calls in order:")
    for n, gsz, us in calls[:14]:
        print(f"    {n[:48]:48s} grid {gsz:>14s} {us:8.2f} us")


def main(argv):
    grid = len(argv) > 1 and argv[1] == "--by-grid"
    args = argv[2:] if grid else argv[1:]
    if len(args) != 1:
        sys.exit(__doc__)
    rows = read_rows(args[0])
    fw = forwards(rows)
    if grid:
        if fw:
            by_grid(fw[-1])
        return
    print(f"== ncu: {len(rows)} kernels, {len(fw)} forwards")
    if fw:
        by_name("prefill (first forward)", fw[0])
        by_name("last decode step", fw[-1])


if __name__ == "__main__":
    main(sys.argv)
