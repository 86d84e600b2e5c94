#!/usr/bin/env python3
"""Structured output and tool calls of a running fp4moe serve (standard library only), for scripts/gpu-serve-check.sh.

    serve_structured_probe.py URL

A constrained request samples on the host from the logits the device returns every step (the mask and the sampler
are the CPU's), so on the GPU this checks that path end to end: (1) a json_schema chat answer parses and satisfies
the schema (checked here by hand: types, required keys, maxLength, enum), (2) 8 concurrent json_object completions at
temperature 1 beside 8 free greedy ones: every ended constrained answer is a JSON object, the free ones answer (how
many equal the request alone is reported), (3) guided_choice with n 4: each choice one of the options, (4) a named tool_choice returns one
call whose arguments satisfy the tool's parameters, tool_choice required one or more such calls. Exit 0 when all holds;
the last line sums it up.
"""
import http.client
import json
import sys
import threading
import urllib.parse

url = urllib.parse.urlparse(sys.argv[1])
off = {"enable_thinking": False}
fails = []


def req(path, body):
    c = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
    c.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    r = c.getresponse()
    return r.status, json.loads(r.read().decode())


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        fails.append(what)


person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer"},
                                           "pet": {"enum": ["cat", "dog", None]}},
          "required": ["name", "age", "pet"]}


def is_person(v):
    return (isinstance(v, dict) and set(v) == {"name", "age", "pet"} and isinstance(v["name"], str) and
            len(v["name"]) <= 16 and isinstance(v["age"], int) and v["pet"] in ("cat", "dog", None))


msgs = [{"role": "user", "content": "A person with a pet, as JSON."}]
st, b = req("/v1/chat/completions", {"messages": msgs, "max_tokens": 400, "temperature": 0, "chat_template_kwargs": off,
                                     "response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "p", "schema": person}}})
m = b["choices"][0]["message"] if st == 200 else {}
try:
    ok = b["choices"][0]["finish_reason"] == "stop" and is_person(json.loads(m["content"]))
except (ValueError, KeyError, TypeError):
    ok = False
check(st == 200 and ok, "json_schema chat answer satisfies the schema: %r" % (m.get("content") or b)[:100])

alone = req("/v1/completions", {"prompt": "The little girl opened the door and saw", "max_tokens": 24, "temperature": 0})
res = {}


def worker(i):
    if i < 8:
        res[i] = req("/v1/completions", {"prompt": "JSON:", "max_tokens": 300, "temperature": 1.0, "seed": i,
                                         "response_format": {"type": "json_object"}})
    else:
        res[i] = req("/v1/completions", {"prompt": "The little girl opened the door and saw", "max_tokens": 24,
                                         "temperature": 0})


th = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
for t in th:
    t.start()
for t in th:
    t.join()
ended, good = 0, 0
for i in range(8):
    st, b = res[i]
    if st == 200 and b["choices"][0]["finish_reason"] == "stop":
        ended += 1
        try:
            good += isinstance(json.loads(b["choices"][0]["text"]), dict)
        except ValueError:
            pass
same = sum(res[i][0] == 200 and res[i][1]["choices"][0]["text"] == alone[1]["choices"][0]["text"] for i in range(8, 16))
ok200 = all(res[i][0] == 200 for i in range(8, 16))
# (the free answers' equality with the one alone is reported, not required: on the GPU the batch's row count picks
#  the gather tiles, so a near tie may part them - docs/PERFORMANCE.md)
check(ended >= 1 and good == ended and ok200,
      "8 json_object (T 1) beside 8 free greedy: %d ended, %d objects; free answers == alone: %d of 8" % (ended, good, same))

opts = ["positive", "negative", "neutral"]
st, b = req("/v1/completions", {"prompt": "Sentiment:", "max_tokens": 24, "n": 4, "temperature": 1.2, "seed": 3,
                                "guided_choice": opts})
got = [c["text"] for c in b.get("choices", [])]
check(st == 200 and len(got) == 4 and all(t in opts for t in got), "guided_choice n 4: %s" % got)

tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}]
st, b = req("/v1/chat/completions", {"messages": msgs, "tools": tools, "max_tokens": 300, "temperature": 0,
                                     "chat_template_kwargs": off,
                                     "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
calls = b["choices"][0]["message"].get("tool_calls") if st == 200 else None
try:
    a = json.loads(calls[0]["function"]["arguments"])
    ok = len(calls) == 1 and calls[0]["function"]["name"] == "get_weather" and set(a) == {"city", "days"} and \
        isinstance(a["days"], int) and len(a["city"]) <= 12
except (TypeError, ValueError, KeyError, IndexError):
    ok = False
check(ok, "named tool_choice: one valid get_weather call %r" % (calls or b)[:1])
st, b = req("/v1/chat/completions", {"messages": msgs, "tools": tools, "max_tokens": 600, "temperature": 0,
                                     "chat_template_kwargs": off, "tool_choice": "required",
                                     "logit_bias": {"63": 8}})
calls = b["choices"][0]["message"].get("tool_calls") if st == 200 else None
try:
    ok = len(calls) >= 1 and all(c["function"]["name"] == "get_weather" and
                                 set(json.loads(c["function"]["arguments"])) == {"city", "days"} for c in calls)
except (TypeError, ValueError, KeyError):
    ok = False
ch = b["choices"][0] if st == 200 else {}
check(ok, "tool_choice required: %d valid call(s), finish %s, usage %s, content %r" % (
    len(calls) if calls else 0, ch.get("finish_reason"), b.get("usage", {}).get("completion_tokens"),
    (ch.get("message", {}).get("content") or "")[:160]))
print("structured output: %d check(s) failed" % len(fails) if fails else "structured output: all checks pass")
sys.exit(1 if fails else 0)
