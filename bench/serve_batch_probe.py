"""bench/serve_batch_probe.py URL: where a server's concurrent greedy answers part from the same requests alone.

64 /v1/completions requests (the gpu-serve-check prompts) are run alone twice (before and after) and 32 at a time;
for each answer that differs, the first differing token and the top-2 logprobs of the alone answer there (a near tie
or not). Prints one line per difference, then a summary. Exit 0 when the alone answers are deterministic and every
concurrent answer that differs parts from its alone answer at a near tie (top-2 gap <= 0.05 nats: bf16 rounding of a
batch's other route through an op), else 1. (scripts/gpu-serve-check.sh runs it on the GPU.)"""
import http.client
import json
import sys
import threading
import urllib.parse

url = urllib.parse.urlparse(sys.argv[1])
words = open("tests/golden/default/heldout_short.txt").read().split()


def req(body):
    c = http.client.HTTPConnection(url.hostname, url.port, timeout=300)
    c.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    r = c.getresponse()
    out = json.loads(r.read().decode())
    c.close()
    return out


def run(i):
    p = " ".join(words[(i * 37) % 500:(i * 37) % 500 + 12 + i % 20])
    b = req({"prompt": p, "max_tokens": 8 + i % 13, "temperature": 0, "logprobs": 2})
    ch = b["choices"][0]
    return ch["logprobs"]["tokens"], ch["logprobs"]["top_logprobs"]


alone_a = {i: run(i) for i in range(64)}
together = {}


def client(k):
    for i in range(k, 64, 32):
        together[i] = run(i)


th = [threading.Thread(target=client, args=(k,)) for k in range(32)]
[t.start() for t in th]
[t.join() for t in th]
alone_b = {i: run(i) for i in range(64)}
solo = sum(alone_a[i][0] != alone_b[i][0] for i in range(64))
gaps = []
for i in range(64):
    a, t = alone_a[i][0], together[i][0]
    if a == t:
        continue
    k = next((j for j in range(min(len(a), len(t))) if a[j] != t[j]), min(len(a), len(t)))
    top = sorted(alone_a[i][1][k].items(), key=lambda kv: -kv[1]) if k < len(a) else []
    gap = top[0][1] - top[1][1] if len(top) > 1 else float("inf")
    gaps.append(gap)
    print("  %2d: token %d alone %r together %r; alone's top 2 %s, gap %.4f nats" % (
        i, k, a[k] if k < len(a) else None, t[k] if k < len(t) else None, top[:2], gap))
ok = solo == 0 and all(g <= 0.05 for g in gaps)
print("alone twice: %d of 64 differ; together vs alone: %d of 64 differ, largest top-2 gap where they part %.4f "
      "nats: %s" % (solo, len(gaps), max(gaps) if gaps else 0.0, "PASS" if ok else "FAIL"))
sys.exit(0 if ok else 1)
