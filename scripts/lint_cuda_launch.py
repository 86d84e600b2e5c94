#!/usr/bin/env python3
"""scripts/lint_cuda_launch.py: the launch contract of src/kernels/cuda/cuda_launch.cuh, checked
without a GPU (ctest lint/cuda_launch).

Every kernel of the library is launched with programmatic dependent launch, so it may start while
the kernel before it is still running; it is exact only because every kernel body begins with
cu_pdl_entry() (griddepcontrol.wait) before touching global memory. This script fails, naming file
and line, when a __global__ function under src/kernels/cuda does not begin with cu_pdl_entry();, or
when a kernel there is launched with <<<...>>> instead of cu_launch() (bench/ programs are exempt).
It first runs itself on two deliberately broken sources (a kernel without the entry, a <<<>>>
launch) and fails if it does not flag them.
Usage: scripts/lint_cuda_launch.py [DIR]   (default: src/kernels/cuda next to this script)
"""
import os
import re
import sys


def find_close(s, i):
    """index of the ')' matching the '(' at s[i]"""
    d = 0
    for k in range(i, len(s)):
        if s[k] == "(":
            d += 1
        elif s[k] == ")":
            d -= 1
            if d == 0:
                return k
    return -1


def strip_comments(s):
    """comments replaced by spaces (newlines kept, so line numbers hold)"""
    def blank(m):
        return re.sub(r"[^\n]", " ", m.group(0))
    return re.sub(r"/\*.*?\*/|//[^\n]*", blank, s, flags=re.S)


def check_source(name, text):
    errors = []
    s = strip_comments(text)
    for m in re.finditer(r"\b__global__\b", s):
        line = s.count("\n", 0, m.start()) + 1
        j = s.find("(", m.end())
        if j < 0:
            errors.append(f"{name}:{line}: __global__ without a parameter list")
            continue
        if s[m.end():j].strip().endswith("__launch_bounds__"):
            j = s.find("(", find_close(s, j) + 1)
        k = find_close(s, j)
        b = s.find("{", k) if k >= 0 else -1
        if k < 0 or b < 0 or s[k + 1:b].strip():
            if s[k + 1:].lstrip().startswith(";"):
                continue  # a declaration
            errors.append(f"{name}:{line}: cannot find the body of the kernel")
            continue
        if not re.match(r"\s*cu_pdl_entry\(\);", s[b + 1:]):
            kname = s[m.end():j].split()[-1] if s[m.end():j].split() else "?"
            errors.append(f"{name}:{line}: kernel {kname} does not begin with cu_pdl_entry();")
    for m in re.finditer(r"<<<", s):
        line = s.count("\n", 0, m.start()) + 1
        errors.append(f"{name}:{line}: <<<...>>> launch (use cu_launch, cuda_launch.cuh)")
    return errors


def self_test():
    good = "__global__ void __launch_bounds__(256, 2) k(int *x) {\n    cu_pdl_entry();\n    x[0] = 1;\n}\n"
    bad_entry = "__global__ void k(int *x) {\n    x[0] = 1; /* cu_pdl_entry(); */\n}\n"
    bad_launch = good + "void f(int *x) { k<<<1, 32, 0, 0>>>(x); }\n"
    ok = not check_source("good", good) and check_source("bad_entry", bad_entry) and check_source("bad_launch", bad_launch)
    if not ok:
        print("lint_cuda_launch: self-test failed (a broken source was not flagged, or a good one was)")
    return ok


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    d = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", "src", "kernels", "cuda")
    if not self_test():
        return 1
    errors, kernels = [], 0
    for f in sorted(os.listdir(d)):
        if f.endswith((".cu", ".cuh")):
            text = open(os.path.join(d, f)).read()
            kernels += len(re.findall(r"\b__global__\b", strip_comments(text)))
            errors += check_source(os.path.join(d, f), text)
    for e in errors:
        print(e)
    if kernels == 0:
        print(f"lint_cuda_launch: no kernels found under {d}")
        return 1
    print(f"lint_cuda_launch: {kernels} kernels, {len(errors)} problems")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
