#!/usr/bin/env python3
"""Differential test of the C chat-template engine against Python jinja2 (configured as transformers
does, from scripts/make_template_golden.py) on randomly generated templates.

  --mode expr   expressions, operators, filters, tests, methods, whitespace control
  --mode scope  set / for / if / macro / block set / filter blocks and Jinja's scoping rules

Builds scripts/template_render_batch.c against src/template with cc (ASan + UBSan), renders every
case with both, and counts: same output, both fail, output differs, only one fails. A tool for
developing the engine (not run by ctest; the goldens are). Differences known and accepted: jinja2's
lazy generators (`3 | items` prints a generator object), constant folding of literal subscripts
(`2[1:]` inside {{ }}), printf-style `%` and str.format.

usage: build/tmpl-venv/bin/python scripts/template_differential.py [--mode expr|scope] [--seed N] [--n N]
"""
import argparse
import copy
import json
import os
import random
import subprocess
import sys
import tempfile
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import make_template_golden as g  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--mode", choices=["expr", "scope"], default="expr")
ap.add_argument("--seed", type=int, default=1)
ap.add_argument("--n", type=int, default=2000)
ap.add_argument("--show", type=int, default=8)
args = ap.parse_args()
rng = random.Random(args.seed)
warnings.filterwarnings("ignore", category=SyntaxWarning)   # Python compiling `2[1:]` in generated code

# ---- generator: expressions ----
E_CTX = {"s": "Hello World", "e": "", "w": "  a b\tc \n", "u8": "héllo 😀 中文", "n": 3, "m": -7, "f": 2.5, "z": 0,
       "t": True, "fa": False, "nn": None, "l": [3, 1, 2], "ls": ["b", "A", "c"], "ll": [[1, 2], [3, 4]],
       "d": {"b": 1, "a": [1, 2], "c": {"x": "y"}}, "msgs": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "tool_calls": [{"name": "f", "arguments": {"a": 1}}]}]}
VARS = list(E_CTX) + ["undef"]
STRS = ["'a'", "'x,y'", "\"q'\"", "'\\n'", "'é'", "''", "' sp '", "'</think>'", "'{{'"]
FILTERS = ["trim", "length", "string", "upper", "lower", "first", "last", "list", "int", "float", "abs", "tojson",
           "safe", "default('D')", "default('D', true)", "join(',')", "join", "replace('a','b')", "round", "round(1)",
           "unique|list", "sort", "reverse|list", "items", "dictsort", "capitalize", "title", "wordcount",
           "indent(2)", "select('odd')|list", "reject('even')|list", "map('string')|list", "map(attribute='role')|list",
           "selectattr('role','equalto','user')|list", "tojson(indent=1)", "sum", "min", "max", "count", "e"]
TESTS = ["defined", "undefined", "none", "mapping", "sequence", "string", "number", "iterable", "boolean", "true",
         "false", "odd", "even", "divisibleby(2)", "equalto(3)", "in([1,2,3])", "integer", "float"]
METHODS = ["strip()", "split()", "split(',')", "upper()", "lower()", "startswith('H')", "endswith('d')",
           "replace('l','L')", "find('o')", "title()", "lstrip()", "rstrip()", "capitalize()"]
OPS = ["+", "-", "*", "//", "%", "/", "~", "==", "!=", "<", ">=", "and", "or", "in", "not in", "**"]
def atom(d):
    r = rng.random()
    if r < 0.3: return rng.choice(VARS)
    if r < 0.45: return str(rng.choice([0, 1, 2, 3, -1, 10, 7]))
    if r < 0.5: return rng.choice(["1.5", "0.1", "2.0", "-0.5"])
    if r < 0.65: return rng.choice(STRS)
    if r < 0.7: return rng.choice(["true", "false", "none"])
    if r < 0.78 and d < 3: return "[" + ", ".join(expr(d + 1) for _ in range(rng.randint(0, 3))) + "]"
    if r < 0.82 and d < 3: return "{" + ", ".join(f"{rng.choice(STRS)}: {expr(d+1)}" for _ in range(rng.randint(0, 2))) + "}"
    if r < 0.9 and d < 3: return "(" + expr(d + 1) + ")"
    return rng.choice(VARS)
def postfix(e, d):
    r = rng.random()
    if r < 0.1: return e + "." + rng.choice(METHODS)
    if r < 0.2: return e + "[" + rng.choice(["0", "-1", "1:", ":-1", "::-1", "'a'", "'b'", "1:2"]) + "]"
    if r < 0.25: return e + "." + rng.choice(["a", "b", "role", "content", "x"])
    if r < 0.45: return e + " | " + rng.choice(FILTERS)
    if r < 0.55: return e + " is " + rng.choice(["", "not "]) + rng.choice(TESTS)
    return e
def expr(d=0):
    e = postfix(atom(d), d)
    if d < 3 and rng.random() < 0.4:
        e = f"{e} {rng.choice(OPS)} {postfix(atom(d+1), d+1)}"
    if d < 2 and rng.random() < 0.1:
        e = f"{e} if {expr(d+1)} else {expr(d+1)}"
    if rng.random() < 0.05: e = "not " + e
    return e
def ws(): return rng.choice(["", "", "-", "+"]) if rng.random() < 0.5 else ""
def text(): return rng.choice(["", "a", "\n", "  ", "\n  ", "x\n", " \t\n\n  y ", "\n    "])
def e_stmt(d=0):
    r = rng.random()
    if r < 0.35 or d > 2: return text() + "{{" + rng.choice(["", "-"]) + " " + expr() + " " + rng.choice(["", "-"]) + "}}" + text()
    if r < 0.5: return "{%" + ws() + " if " + expr() + " " + ws() + "%}" + e_body(d+1) + ("{%" + ws() + " else " + ws() + "%}" + e_body(d+1) if rng.random() < 0.5 else "") + "{%" + ws() + " endif " + ws() + "%}"
    if r < 0.65: return "{%" + ws() + " for " + rng.choice(["x", "k, v"]) + " in " + rng.choice(["l", "ls", "ll", "d", "d|items", "s", "range(3)", "msgs", "[]", "undef"]) + (" if " + expr() if rng.random() < 0.2 else "") + " " + ws() + "%}" + e_body(d+1) + rng.choice(["", "{{ loop.index }}{{ loop.last }}{{ loop.previtem }}{{ x }}"]) + "{%" + ws() + " endfor " + ws() + "%}"
    if r < 0.75: return "{%" + ws() + " set " + rng.choice(VARS[:6] + ["y"]) + " = " + expr() + " " + ws() + "%}" + text()
    if r < 0.8: return "{# c #}" + text()
    return text()
def e_body(d): return "".join(e_stmt(d) for _ in range(rng.randint(1, 3)))

# ---- generator: statements and scopes ----
S_CTX = {"l": [3, 1, 2], "ls": ["b", "A", "c"], "d": {"b": 1, "a": [1, 2]}, "n": 2, "s": "ab", "nn": None,
       "msgs": [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"}, {"role": "tool", "content": "t"}, {"role": "user", "content": "u2"}]}
NAMES = ["x", "y", "ns.v", "n", "s"]
def s_val():
    return rng.choice(["x", "y", "n", "s", "ns.v", "loop.index", "loop.index0", "loop.first", "loop.last", "loop.length",
                       "loop.previtem", "loop.nextitem", "m.role", "m['content']", "1", "'q'", "x ~ y", "n + 1", "ns.v ~ 'z'",
                       "mac(x)", "mac(1, b=2)", "mac()", "l|length", "msgs[loop.index0 - 1].role if loop is defined else 0",
                       "y is defined", "x if x is defined else 'u'", "ns.v | default('dv')", "caller_var"])
def s_ws(): return rng.choice(["", "-", "", "+"]) if rng.random() < 0.4 else ""
def s_text(): return rng.choice(["", "", "\n", "  ", "\n  ", ".", "\n\n    "])
def s_stmt(d):
    r = rng.random()
    if r < 0.3 or d > 3: return s_text() + "{{" + rng.choice(["", "-"]) + " " + s_val() + " " + rng.choice(["", "-"]) + "}}" + s_text()
    if r < 0.45:
        tgt = rng.choice(NAMES)
        return "{%" + s_ws() + f" set {tgt} = {s_val()} " + s_ws() + "%}" + s_text()
    if r < 0.65:
        it = rng.choice(["l", "ls", "msgs", "range(n)", "d", "d|items", "[]"])
        var = "k, v" if it == "d|items" else rng.choice(["m", "x", "y"])
        cond = (" if " + rng.choice(["m.role != 'tool'", "x != 1", "loop is undefined", "n > 1"])) if rng.random() < 0.2 else ""
        els = ("{% else %}" + s_body(d + 1)) if rng.random() < 0.15 else ""
        ctl = rng.choice(["", "", "{% if loop.index > 1 %}{% break %}{% endif %}", "{% if loop.first %}{% continue %}{% endif %}"])
        return "{%" + s_ws() + f" for {var} in {it}{cond} " + s_ws() + "%}" + ctl + s_body(d + 1) + els + "{%" + s_ws() + " endfor " + s_ws() + "%}" + s_text()
    if r < 0.8:
        return "{%" + s_ws() + f" if {s_val()} " + s_ws() + "%}" + s_body(d + 1) + rng.choice(["", "{% elif " + s_val() + " %}" + s_body(d+1), "{% else %}" + s_body(d+1)]) + "{%" + s_ws() + " endif " + s_ws() + "%}"
    if r < 0.87:
        return "{% filter upper %}" + s_body(d+1) + "{% endfilter %}"
    if r < 0.93:
        return "{% set blk %}" + s_body(d+1) + "{% endset %}{{ blk | trim }}"
    return "{# " + s_val() + " #}" + s_text()
def s_body(d): return "".join(s_stmt(d) for _ in range(rng.randint(1, 3)))


def make_case():
    if args.mode == "expr":
        return {"template": e_body(0), "context": E_CTX}
    pre = "{% set ns = namespace(v='nv') %}"
    if rng.random() < 0.5:
        pre += "{% macro mac(a='da', b=n) %}[" + s_body(2) + "{{ a }}{{ b }}]{% endmacro %}"
    return {"template": pre + s_body(0), "context": S_CTX}


def main():
    tmp = tempfile.mkdtemp(prefix="tmpl-diff-")
    exe = os.path.join(tmp, "batch")
    srcs = [os.path.join(ROOT, "src", "template", f) for f in sorted(os.listdir(os.path.join(ROOT, "src", "template")))
            if f.endswith(".c")]
    subprocess.run([os.environ.get("CC", "cc"), "-std=c11", "-D_GNU_SOURCE", "-g", "-O1", "-fsanitize=address,undefined",
                    "-I" + os.path.join(ROOT, "include"), "-I" + os.path.join(ROOT, "src"),
                    os.path.join(ROOT, "scripts", "template_render_batch.c"), *srcs,
                    os.path.join(ROOT, "src", "common", "error.c"), "-lcjson", "-lm", "-o", exe], check=True)
    env = g.make_env()
    cases = [make_case() for _ in range(args.n)]
    py = [g.render(env, c["template"], copy.deepcopy(c["context"])) for c in cases]  # jinja2's indent mutates lists
    path = os.path.join(tmp, "cases.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=False)
    out = subprocess.run([exe, path], capture_output=True, text=True)
    if out.returncode != 0:
        print("the C engine crashed:\n" + out.stderr[-4000:])
        return 1
    stats = {"same": 0, "both_fail": 0, "differ": 0, "only_c_fails": 0, "only_jinja2_fails": 0}
    shown = 0
    for c, p, q in zip(cases, py, json.loads(out.stdout)):
        if "expected" in p and "out" in q:
            if p["expected"] == q["out"]:
                stats["same"] += 1
                continue
            kind = "differ"
        elif "error" in p and "error" in q:
            stats["both_fail"] += 1
            continue
        else:
            kind = "only_c_fails" if "error" in q else "only_jinja2_fails"
        stats[kind] += 1
        if shown < args.show:
            shown += 1
            print(kind, repr(c["template"]))
            print("   jinja2:", repr(p)[:400])
            print("   C:     ", repr(q)[:400])
    print(stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
