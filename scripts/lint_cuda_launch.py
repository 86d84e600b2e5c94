#!/usr/bin/env python3
"""scripts/lint_cuda_launch.py: the launch contract of src/kernels/cuda/cuda_launch.cuh, checked
without a GPU (ctest lint/cuda_launch).

Every kernel of the library is launched with programmatic dependent launch, so it may start while
the kernel before it is still running; it is exact only because every kernel body begins with
cu_pdl_entry() (griddepcontrol.wait) before touching global memory. This script fails, naming file
and line, when a __global__ function under src/kernels/cuda does not begin with cu_pdl_entry();, or
when a kernel there is launched with <<<...>>> instead of cu_launch() (bench/ programs are exempt).
A kernel may instead begin with a helper named *_pdl_entry whose body ends with cu_pdl_entry(); (a
prologue reading only memory that no kernel writes, e.g. weights), called as a statement or as the
initializer of the kernel's first declaration ("const T v = x_pdl_entry(...);", returning what it
read). It first runs itself on deliberately broken sources (a kernel without the entry, a <<<>>>
launch, a helper whose cu_pdl_entry() is conditional or followed by a read, a read before the
entry) and fails if it does not flag them.
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
    # helpers "X_pdl_entry(...)" whose body calls cu_pdl_entry() unconditionally at its end may
    # come first instead (a prologue that touches only memory no kernel writes, e.g. weights)
    helpers = set()
    for m in re.finditer(r"\b(\w+_pdl_entry)\s*\([^)]*\)\s*\{", s):
        d, k = 0, m.end() - 1
        for k in range(m.end() - 1, len(s)):
            d += s[k] == "{"
            d -= s[k] == "}"
            if d == 0:
                break
        if re.search(r"\n    cu_pdl_entry\(\);\s*(return \w+;\s*)?\}$", s[m.end() - 1:k + 1]):
            helpers.add(m.group(1))
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
        first = re.match(r"\s*(?:(?:const\s+)?\w+\s+\w+\s*=\s*)?(\w*pdl_entry)\(", s[b + 1:])
        if first and first.group(1) != "cu_pdl_entry" and first.group(1) not in helpers:
            errors.append(f"{name}:{line}: {first.group(1)} is not a *_pdl_entry helper that calls cu_pdl_entry()")
        if not first:
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
    helper = ("__device__ void x_pdl_entry(int *p) {\n    if (p) p[0] = 0;\n    cu_pdl_entry();\n}\n"
              "__global__ void k(int *x) {\n    x_pdl_entry(x);\n}\n")
    bad_helper = ("__device__ void x_pdl_entry(int *p) {\n    if (p) cu_pdl_entry();\n    p[0] = 0;\n}\n"
                  "__global__ void k(int *x) {\n    x_pdl_entry(x);\n}\n")
    helper_ret = ("__device__ int x_pdl_entry(const int *p) {\n    int v = p[0];\n    cu_pdl_entry();\n    return v;\n}\n"
                  "__global__ void k(int *x) {\n    const int v = x_pdl_entry(x);\n    x[1] = v;\n}\n")
    bad_ret = ("__device__ int x_pdl_entry(const int *p) {\n    cu_pdl_entry();\n    return p[0];\n}\n"
               "__global__ void k(int *x) {\n    const int v = x_pdl_entry(x);\n    x[1] = v;\n}\n")
    bad_decl = "__global__ void k(int *x) {\n    const int v = x[0];\n    cu_pdl_entry();\n    x[1] = v;\n}\n"
    ok = (not check_source("good", good) and not check_source("helper", helper)
          and not check_source("helper_ret", helper_ret) and check_source("bad_ret", bad_ret)
          and check_source("bad_decl", bad_decl) and check_source("bad_entry", bad_entry)
          and check_source("bad_launch", bad_launch) and check_source("bad_helper", bad_helper))
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
