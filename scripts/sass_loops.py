#!/usr/bin/env python3
"""sass_loops.py: the instruction mix of a CUDA kernel's loops, read from its SASS (no GPU needed).

  scripts/sass_loops.py [--min N] [--max N] [--nvcc-flag F ...] SOURCE.cu|FILE.cubin KERNEL_SUBSTRING ...

A .cu source is compiled here (nvcc -cubin, sm_90a, -O3, -Iinclude -Isrc, plus --nvcc-flag values, e.g.
-DBT_W32=0) and ptxas's register / spill line is printed for each matching kernel; then, for each
kernel whose mangled name contains a substring, every loop (a backward branch to an earlier address) with
between --min and --max instructions: its address range, its instruction count and the most frequent
opcodes. The body of a loop is the address range [target, branch] - on a path-specialised loop (e.g. the
w32 kernel's switch over n8 tiles) the count includes every case; subtract the cases' bodies for one path.
cuobjdump / nvdisasm come from scripts/sass-tools.sh. Use: compare a kernel's K-loop before and after a
change that should cut instructions (docs/GPU-NOTES.md "Build-time checks")."""
import argparse, collections, os, re, subprocess, sys, tempfile

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(here)
ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("source")
ap.add_argument("kernels", nargs="+")
ap.add_argument("--min", type=int, default=100)
ap.add_argument("--max", type=int, default=10**9)
ap.add_argument("--nvcc-flag", action="append", default=[])
a = ap.parse_args()

tools = subprocess.run([os.path.join(here, "sass-tools.sh")], capture_output=True, text=True)
if tools.returncode:
    sys.exit("sass_loops: " + tools.stderr.strip())
env = dict(os.environ, PATH=tools.stdout.strip() + os.pathsep + os.environ.get("PATH", ""))

cubin = a.source
if a.source.endswith(".cu"):
    cubin = os.path.join(tempfile.mkdtemp(), "k.cubin")
    r = subprocess.run(["nvcc", "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-Iinclude", "-Isrc",
                        "-Xptxas", "-v", *a.nvcc_flag, "-o", cubin, a.source], cwd=root, capture_output=True, text=True)
    if r.returncode:
        sys.exit("sass_loops: nvcc failed:\n" + r.stderr[-3000:])
    cur = None
    for line in r.stderr.splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m: cur = m.group(1)
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and cur and any(k in cur for k in a.kernels): spill = m.group(1)
        m = re.search(r"Used (\d+) registers", line)
        if m and cur and any(k in cur for k in a.kernels):
            print(f"{cur}: {m.group(1)} registers, {spill} bytes spilled")
out = subprocess.run(["cuobjdump", "-sass", cubin], capture_output=True, text=True, env=env)
if out.returncode:
    sys.exit("sass_loops: cuobjdump failed: " + out.stderr.strip())
for f in re.split(r"\n\s+Function : ", out.stdout)[1:]:
    name = f.split("\n", 1)[0].strip()
    if not any(k in name for k in a.kernels): continue
    ins = [(int(m.group(1), 16), m.group(2).strip())
           for m in (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", l) for l in f.split("\n")) if m]
    print(f"{name}: {len(ins)} instructions")
    for addr, txt in ins:
        m = re.search(r"\bBRA (?:`\(\.L_x_\d+\) )?(0x[0-9a-f]+)", txt)
        if not m or int(m.group(1), 16) >= addr: continue
        body = [t for x, t in ins if int(m.group(1), 16) <= x <= addr]
        if not a.min <= len(body) <= a.max: continue
        ops = collections.Counter()
        for t in body:
            w = t.split()
            op = w[1] if w[0].startswith("@") and len(w) > 1 else w[0]
            ops[op.split(".")[0]] += 1
        top = ", ".join(f"{k} {v}" for k, v in ops.most_common(12))
        print(f"  loop {int(m.group(1), 16):#x}..{addr:#x}: {len(body)} instructions; {top}")
