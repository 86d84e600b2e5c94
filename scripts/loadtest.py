#!/usr/bin/env python3
"""Load test of an OpenAI-compatible server (fp4moe serve; any other works too). Standard library
only, so it runs where pip cannot (the GPU machine).

Streams /v1/completions requests (ignore_eos, fixed max_tokens, prompts cut from a text file) from
C concurrent clients for each C in --concurrency, and prints per level: requests/s, output tok/s,
time to first token (TTFT) and inter-token latency (ITL) percentiles. Output tokens are the
server's usage.completion_tokens; TTFT is the time to the first chunk with text; ITL the gaps
between text chunks.

--turn2 N measures prefix reuse: a chat whose system message has N words, turn 1 (answered), then
turn 2 = turn 1 + the answer + a new user message; prints turn 2's TTFT (streamed) and its
usage.prompt_tokens_details.cached_tokens. Run it against a server with and one without the prefix
cache (--prefix-cache-mb 0) to compare.

usage: loadtest.py --url http://127.0.0.1:8080 [--concurrency 1,8,32,64] [--requests-per-client 4]
                   [--max-tokens 128] [--prompt-words 64] [--text FILE] [--json OUT] [--turn2 WORDS]
"""
import argparse
import http.client
import json
import statistics
import sys
import threading
import time
import urllib.parse


def post_stream(url, path, body, key=None, timeout=600):
    u = urllib.parse.urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    h = {"Content-Type": "application/json"}
    if key:
        h["Authorization"] = "Bearer " + key
    t0 = time.perf_counter()
    c.request("POST", path, body=json.dumps(body).encode(), headers=h)
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError("HTTP %d: %s" % (r.status, r.read()[:300]))
    times, usage, text = [], None, []
    for raw in r:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            break
        ev = json.loads(line[6:])
        if "error" in ev:
            raise RuntimeError("stream error: %s" % ev["error"])
        if ev.get("usage"):
            usage = ev["usage"]
        for ch in ev.get("choices", []):
            piece = ch.get("text")
            if piece is None:
                d = ch.get("delta", {})
                piece = (d.get("content") or "") + (d.get("reasoning_content") or "")
            if piece:
                times.append(time.perf_counter() - t0)
                text.append(piece)
    c.close()
    return times, usage, "".join(text)


def pct(v, p):
    if not v:
        return float("nan")
    v = sorted(v)
    k = (len(v) - 1) * p / 100.0
    i = int(k)
    return v[i] if i + 1 >= len(v) else v[i] + (v[i + 1] - v[i]) * (k - i)


def level(args, words, conc):
    res, errs, lock = [], [], threading.Lock()

    def client(ci):
        for r in range(args.requests_per_client):
            k = (ci * 7919 + r * 104729) % max(1, len(words) - args.prompt_words)
            body = {"prompt": " ".join(words[k:k + args.prompt_words]), "max_tokens": args.max_tokens,
                    "temperature": 0, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            if args.model:
                body["model"] = args.model
            try:
                times, usage, _ = post_stream(args.url, "/v1/completions", body, args.api_key)
                with lock:
                    res.append((times, usage))
            except Exception as ex:  # noqa: BLE001 (reported, counted)
                with lock:
                    errs.append(str(ex))

    th = [threading.Thread(target=client, args=(i,)) for i in range(conc)]
    t0 = time.perf_counter()
    for t in th:
        t.start()
    for t in th:
        t.join()
    wall = time.perf_counter() - t0
    toks = sum((u or {}).get("completion_tokens", 0) for _, u in res)
    ttft = [t[0] for t, _ in res if t]
    itl = [b - a for t, _ in res for a, b in zip(t, t[1:])]
    return {"concurrency": conc, "requests": len(res), "errors": len(errs), "wall_s": wall,
            "requests_per_s": len(res) / wall, "output_tok_per_s": toks / wall, "output_tokens": toks,
            "ttft_ms": {p: 1e3 * pct(ttft, p) for p in (50, 90, 99)},
            "itl_ms": {p: 1e3 * pct(itl, p) for p in (50, 90, 99)}, "first_error": errs[0] if errs else None}


def turn2(args, words):
    sys_msg = {"role": "system", "content": " ".join(words[:args.turn2])}
    kw = {"chat_template_kwargs": {"enable_thinking": False}, "temperature": 0, "max_tokens": 32, "stream": True,
          "stream_options": {"include_usage": True}}
    t1 = [sys_msg, {"role": "user", "content": " ".join(words[args.turn2:args.turn2 + 30])}]
    _, u1, a1 = post_stream(args.url, "/v1/chat/completions", dict(messages=t1, **kw), args.api_key)
    t2 = t1 + [{"role": "assistant", "content": a1},
               {"role": "user", "content": " ".join(words[args.turn2 + 30:args.turn2 + 60])}]
    times, u2, _ = post_stream(args.url, "/v1/chat/completions", dict(messages=t2, **kw), args.api_key)
    cached = ((u2 or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"turn1_prompt_tokens": (u1 or {}).get("prompt_tokens"), "turn2_prompt_tokens": (u2 or {}).get("prompt_tokens"),
            "turn2_cached_tokens": cached, "turn2_ttft_ms": 1e3 * times[0] if times else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--api-key")
    ap.add_argument("--model")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-words", type=int, default=64)
    ap.add_argument("--text", default="tests/golden/default/heldout_short.txt")
    ap.add_argument("--json")
    ap.add_argument("--turn2", type=int, default=0, help="words of the system message of the prefix-reuse test")
    args = ap.parse_args()
    words = open(args.text, encoding="utf-8").read().split()
    while len(words) < 4 * (args.prompt_words + args.turn2 + 100):
        words = words + words
    out = {"url": args.url, "max_tokens": args.max_tokens, "prompt_words": args.prompt_words, "levels": []}
    if args.turn2:
        out["turn2"] = turn2(args, words)
        print("turn 2: %s" % json.dumps(out["turn2"]))
    else:
        for c in [int(x) for x in args.concurrency.split(",") if x]:
            r = level(args, words, c)
            out["levels"].append(r)
            print("  C=%-3d %5d req %3d err  %7.2f req/s  %9.1f out tok/s  TTFT p50 %7.1f ms  ITL p50 %6.1f p90 %6.1f "
                  "p99 %6.1f ms" % (c, r["requests"], r["errors"], r["requests_per_s"], r["output_tok_per_s"],
                                    r["ttft_ms"][50], r["itl_ms"][50], r["itl_ms"][90], r["itl_ms"][99]),
                  flush=True)
            if r["first_error"]:
                print("    first error: %s" % r["first_error"])
        print("\n| streams | requests/s | output tok/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | errors |")
        print("|---:|---:|---:|---|---|---:|")
        for r in out["levels"]:
            print("| %d | %.2f | %.1f | %.1f / %.1f / %.1f | %.1f / %.1f / %.1f | %d |" % (
                r["concurrency"], r["requests_per_s"], r["output_tok_per_s"], r["ttft_ms"][50], r["ttft_ms"][90],
                r["ttft_ms"][99], r["itl_ms"][50], r["itl_ms"][90], r["itl_ms"][99], r["errors"]))
    if args.json:
        json.dump(out, open(args.json, "w"), indent=1)
    return 1 if any(r["errors"] for r in out["levels"]) else 0


if __name__ == "__main__":
    sys.exit(main())
