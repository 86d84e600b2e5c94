#!/usr/bin/env python3
"""fp4moe serve end to end (issue 10), run by ctest as python/server with the project venv's
python (it has the `openai` client from PyPI, scripts/requirements-mlx.txt).

Starts `fp4moe serve` on the default model (CPU, ephemeral localhost ports) and checks, with the
real openai client and with curl: models, completions and chat (stream and not, usage, reasoning
split, stop strings), greedy answers equal to `fp4moe generate`, 32 concurrent clients x 4
requests each equal to the same request sent alone, a client that disconnects mid-stream frees its
sequence, malformed requests get their 4xx and the server goes on, the API key, the bounded queue
(429), prefix reuse across chat turns (same answer as without the cache), shutdown exit codes, and
logprobs / penalties / logit_bias against mlx-lm's logits (a --cpu-act float server).

usage: test_server.py FP4MOE_BINARY
"""
import concurrent.futures as cf
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import openai

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "models", "nemotron-h-tiny-moe")
TEMPLATE = os.path.join(ROOT, "tests", "golden", "templates", "nemotron-3-nano-30b-a3b.jinja")
TEXT = open(os.path.join(ROOT, "tests", "golden", "default", "heldout_short.txt"), encoding="utf-8").read()
BIN = sys.argv[1]
FAILS = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        FAILS.append(what)


class Server:
    def __init__(self, *extra, env=None):
        # stderr (a line per request) into a file: a pipe nobody reads fills at 64 KB and blocks the server's log
        # write, i.e. its engine (what a test with a few hundred requests then sees as a hang)
        self.errf = tempfile.TemporaryFile(mode="w+")
        self.p = subprocess.Popen([BIN, "serve", "-m", MODEL, "--port", "0", *extra], stdout=subprocess.PIPE,
                                  stderr=self.errf, text=True, env=dict(os.environ, **(env or {})))
        line = self.p.stdout.readline()
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if not m:
            self.p.kill()
            self.errf.seek(0)
            raise SystemExit("server did not start: %r %s" % (line, self.errf.read()))
        self.port = int(m.group(1))
        self.url = "http://127.0.0.1:%d" % self.port

    def client(self, key="none"):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def raw(self, method, path, body=None, headers=None, with_headers=False):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = body if isinstance(body, (bytes, type(None))) else body.encode()
        c.request(method, path, body=data, headers=headers or {})
        r = c.getresponse()
        out = r.status, r.read().decode("utf-8", "replace")
        hdrs = {k.lower(): v for k, v in r.getheaders()}
        c.close()
        return (*out, hdrs) if with_headers else out

    def metric(self, name):
        _, text = self.raw("GET", "/metrics")
        m = re.search(r"^%s (\S+)$" % re.escape(name), text, re.M)
        return float(m.group(1)) if m else None

    def stop(self, sig=signal.SIGTERM):
        self.p.send_signal(sig)
        try:
            rc = self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            rc = None
        self.errf.seek(0)
        self.err = self.errf.read()
        return rc


def open_stream(port, prompt_text, events):
    """A raw socket streaming a long completion, returned once `events` SSE events arrived."""
    sock = socket.create_connection(("127.0.0.1", port))
    body = json.dumps({"prompt": prompt_text, "max_tokens": 3000, "stream": True, "ignore_eos": True})
    sock.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  "Content-Length: %d\r\n\r\n%s" % (len(body), body)).encode())
    got = b""
    while got.count(b"data: ") < events:
        got += sock.recv(4096)
    return sock


def freed_and_cancelled(s, cancelled0):
    """Within 5 s: no running sequence, and one more generation ended as cancelled than cancelled0."""
    for _ in range(100):
        if s.metric("fp4moe_running_sequences") == 0 and \
           (s.metric('fp4moe_generations_total{reason="cancelled"}') or 0) == cancelled0 + 1:
            return True
        time.sleep(0.05)
    return False


def prompt(i, words=24):
    w = TEXT.split()
    s = (i * 37) % (len(w) - words)
    return " ".join(w[s:s + words])


def generate_cli(p, n):
    out = subprocess.run([BIN, "generate", "-m", MODEL, "-p", p, "-n", str(n), "--json"], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)["text"]


def complete(c, p, n, stream):
    if not stream:
        r = c.completions.create(model="nemotron-h-tiny-moe", prompt=p, max_tokens=n, temperature=0)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
    text, finish, usage = "", None, None
    for ch in c.completions.create(model="nemotron-h-tiny-moe", prompt=p, max_tokens=n, temperature=0, stream=True,
                                   stream_options={"include_usage": True}):
        if ch.choices:
            text += ch.choices[0].text
            finish = ch.choices[0].finish_reason or finish
        if ch.usage:
            usage = ch.usage.completion_tokens
    return text, finish, usage


def chat(c, msgs, n, stream, **kw):
    if not stream:
        r = c.chat.completions.create(model="nemotron-h-tiny-moe", messages=msgs, max_tokens=n, temperature=0, **kw)
        m = r.choices[0].message
        return (m.content or ""), (getattr(m, "reasoning_content", None) or ""), r.choices[0].finish_reason, r.usage
    content, reasoning, finish = "", "", None
    for ch in c.chat.completions.create(model="nemotron-h-tiny-moe", messages=msgs, max_tokens=n, temperature=0,
                                        stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        finish = ch.choices[0].finish_reason or finish
    return content, reasoning, finish, None


def main():
    s = Server("--chat-template", TEMPLATE, "--max-body", "1048576")
    c = s.client()
    try:
        # --- basics ------------------------------------------------------------------------------
        models = [m.id for m in c.models.list().data]
        check(models == ["nemotron-h-tiny-moe"], "GET /v1/models lists the served model: %s" % models)
        m = c.models.retrieve("nemotron-h-tiny-moe")
        check(m.id == "nemotron-h-tiny-moe" and m.object == "model", "GET /v1/models/ID (models.retrieve): %s" % m.id)
        try:
            c.models.retrieve("other-model")
            check(False, "GET /v1/models/other-model is a 404")
        except openai.NotFoundError as ex:
            check(ex.code == "model_not_found", "GET /v1/models/other-model: 404 model_not_found (%s)" % ex.code)
        st, body = s.raw("POST", "/v1/completions", '{"prompt": [1, 99999]}', {"Content-Type": "application/json"})
        check(st == 400 and "prompt token 99999 (at index 1)" in body, "a bad prompt id is named: %d %s" % (st, body))
        st, body = s.raw("POST", "/v1/completions", '{"prompt": "x", "top_p": 2}', {"Content-Type": "application/json"})
        st0, body0 = s.raw("POST", "/v1/completions", '{"prompt": "x", "top_p": 0}', {"Content-Type": "application/json"})
        check(st == st0 == 400 and "must be in (0, 1]" in body and "must be in (0, 1]" in body0,
              "top_p 0 and 2: the same range in the message: %s / %s" % (body, body0))
        st, body = s.raw("GET", "/health")
        check(st == 200 and json.loads(body)["status"] == "ok", "GET /health: %d %s" % (st, body))
        heads = []
        for method, path in (("HEAD", "/health"), ("HEAD", "/v1/models"), ("GET", "/v1/completions"),
                             ("DELETE", "/health")):
            hc = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
            hc.request(method, path)
            hr = hc.getresponse()
            heads.append((hr.status, hr.getheader("Allow"), hr.read()))
            hc.close()
        st_sl, body_sl = s.raw("POST", "/v1/completions/", json.dumps({"prompt": "x", "max_tokens": 1}),
                               {"Content-Type": "application/json"})
        check(st_sl == 200 and json.loads(body_sl)["usage"]["completion_tokens"] == 1,
              "a trailing slash names the same route: POST /v1/completions/ -> %d" % st_sl)
        check(heads[0][0] == heads[1][0] == 200 and heads[0][2] == heads[1][2] == b"" and
              heads[2][:2] == (405, "POST") and heads[3][:2] == (405, "GET, HEAD"),
              "HEAD answers where GET does (no body); a 405 names the allowed methods (Allow): %s" % heads)
        p0 = "The little girl opened the door and saw"
        ref = generate_cli(p0, 24)
        t, fin, n = complete(c, p0, 24, False)
        check(t == ref and fin == "length" and n == 24, "completion (greedy) equals fp4moe generate: %r" % t[:60])
        r16 = c.completions.create(model="nemotron-h-tiny-moe", prompt=p0, temperature=0)
        check(r16.usage.completion_tokens <= 16 and ref.startswith(r16.choices[0].text) and
              (r16.usage.completion_tokens == 16) == (r16.choices[0].finish_reason == "length"),
              "/v1/completions without max_tokens: 16 tokens at most (OpenAI's / vLLM's default): %d %r" %
              (r16.usage.completion_tokens, r16.choices[0].text))
        # stream_options.continuous_usage_stats (vLLM): every chunk's usage, completion_tokens counting up to the end
        us = [ch.usage for ch in c.completions.create(model="nemotron-h-tiny-moe", prompt=p0, max_tokens=12,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True,
                                                                      "continuous_usage_stats": True})]
        counts = [u.completion_tokens for u in us if u]
        check(all(us) and counts == sorted(counts) and counts[-1] == 12 and
              all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in us),
              "continuous_usage_stats: usage in each of %d chunks, counts %s" % (len(us), counts))
        t2, fin2, n2 = complete(c, p0, 24, True)
        check(t2 == ref and fin2 == "length" and n2 == 24, "streamed completion equals it, usage chunk %s" % n2)
        r = c.completions.create(model="nemotron-h-tiny-moe", prompt=p0, max_tokens=24, temperature=0, stop=["girl"])
        check(r.choices[0].finish_reason == "stop" and "girl" not in r.choices[0].text and
              ref.startswith(r.choices[0].text), "stop string ends the completion before it: %r" % r.choices[0].text)
        # chat: the Nemotron template opens <think> (reasoning) unless enable_thinking is false
        msgs = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": prompt(3)}]
        a = chat(c, msgs, 16, False)
        b = chat(c, msgs, 16, True)
        check(a[0] == "" and a[1] != "" and (a[0], a[1]) == (b[0], b[1]),
              "chat: thinking output is reasoning_content, stream equals non-stream (%r)" % a[1][:40])
        r = c.chat.completions.create(model="nemotron-h-tiny-moe", messages=msgs, max_tokens=16, temperature=0)
        check(r.choices[0].message.content is None and getattr(r.choices[0].message, "reasoning_content", None),
              "chat: an answer that is all reasoning has content null (vLLM): %r" % r.choices[0].message.content)
        off = chat(c, msgs, 16, False, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        check(off[0] != "" and off[1] == "", "chat with enable_thinking false: content %r" % off[0][:40])
        # vLLM's prompt-shaping fields: continue_final_message (the assistant's text left open: the answer continues
        # it), add_generation_prompt, truncate_prompt_tokens; a template in the request is a 400
        prefill = msgs + [{"role": "assistant", "content": "Once upon a time the little"}]
        shape = {"continue_final_message": True, "add_generation_prompt": False,
                 "chat_template_kwargs": {"enable_thinking": False}}
        st, tk = s.raw("POST", "/tokenize", json.dumps(dict(messages=prefill, **shape)))
        st2, dt = s.raw("POST", "/detokenize", json.dumps({"tokens": json.loads(tk)["tokens"]}))
        rc = c.chat.completions.create(model="nemotron-h-tiny-moe", messages=prefill, max_tokens=8, temperature=0,
                                       extra_body=shape)
        check(st == st2 == 200 and json.loads(dt)["prompt"].endswith("Once upon a time the little") and
              rc.usage.prompt_tokens == json.loads(tk)["count"] and rc.choices[0].message.content,
              "continue_final_message: the prompt ends with the assistant's text (%d tokens), the answer goes on: %r" %
              (rc.usage.prompt_tokens, rc.choices[0].message.content))
        # llama.cpp's POST /apply-template: the prompt a chat request renders, byte for byte what transformers'
        # apply_chat_template renders with the same template and arguments, and the text /tokenize counts; a null
        # content is "" (vLLM), so a template adding to it renders; a broken one is a 400 naming the template error
        from transformers import PreTrainedTokenizerFast
        hf = PreTrainedTokenizerFast(tokenizer_file=os.path.join(MODEL, "tokenizer.json"))
        hf.chat_template = open(TEMPLATE, encoding="utf-8").read()
        tool_msgs = msgs + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "2"}]
        empty = dict(messages=msgs + [{"role": "assistant", "content": ""}], continue_final_message=True,
                     add_generation_prompt=False)
        for what, body in (("plain", dict(messages=msgs)), ("continue", dict(messages=prefill, **shape)),
                           ("continue an empty message", empty),
                           ("tool calls", dict(messages=tool_msgs, tools=[{"type": "function", "function": {
                               "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}]))):
            st, at = s.raw("POST", "/apply-template", json.dumps(body))
            st2, tk2 = s.raw("POST", "/tokenize", json.dumps(body))
            st3, tk3 = s.raw("POST", "/tokenize", json.dumps({"prompt": json.loads(at).get("prompt", "") if st == 200 else "",
                                                              "add_special_tokens": False}))
            hmsgs = [dict(m, content="") if m.get("content", "") is None else m for m in body["messages"]]
            for m in hmsgs:
                for tc in m.get("tool_calls", []):
                    tc["function"] = dict(tc["function"], arguments=json.loads(tc["function"]["arguments"]))
            want = hf.apply_chat_template(hmsgs, tools=body.get("tools"), tokenize=False,
                                          add_generation_prompt=body.get("add_generation_prompt", True),
                                          continue_final_message=body.get("continue_final_message", False),
                                          **body.get("chat_template_kwargs", {}))
            got = json.loads(at).get("prompt") if st == 200 else at
            check(st == st2 == st3 == 200 and got == want and json.loads(tk2)["tokens"] == json.loads(tk3)["tokens"],
                  "/apply-template (%s): transformers' rendering (%d chars), /tokenize of it = of the messages%s" %
                  (what, len(want), "" if got == want else ": got %r want %r" % (got[-80:], want[-80:])))
        st, at = s.raw("POST", "/apply-template", '{"messages": "hi"}')
        check(st == 400 and "messages" in at, "/apply-template without a list of messages: 400 (%d)" % st)
        ng = c.chat.completions.create(model="nemotron-h-tiny-moe", messages=msgs, max_tokens=1, temperature=0,
                                       extra_body={"add_generation_prompt": False})
        yg = c.chat.completions.create(model="nemotron-h-tiny-moe", messages=msgs, max_tokens=1, temperature=0)
        check(ng.usage.prompt_tokens < yg.usage.prompt_tokens,
              "add_generation_prompt false: no assistant opening (%d < %d prompt tokens)" %
              (ng.usage.prompt_tokens, yg.usage.prompt_tokens))
        rt = c.completions.create(model="nemotron-h-tiny-moe", prompt=prompt(5, 60), max_tokens=2, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 10})
        check(rt.usage.prompt_tokens == 10, "truncate_prompt_tokens 10: %d prompt tokens" % rt.usage.prompt_tokens)
        try:
            c.chat.completions.create(model="nemotron-h-tiny-moe", messages=msgs, max_tokens=1,
                                      extra_body={"chat_template": "{{ messages[0].content }}"})
            check(False, "a chat template in the request is a 400")
        except openai.BadRequestError as ex:
            check("chat template in the request" in str(ex), "a chat template in the request is a 400: %s" % str(ex)[:100])
        # curl, as a user would
        out = subprocess.run(["curl", "-sS", s.url + "/v1/completions", "-H", "Content-Type: application/json",
                              "-d", json.dumps({"prompt": p0, "max_tokens": 24, "temperature": 0})],
                             capture_output=True, text=True, timeout=60)
        check(json.loads(out.stdout)["choices"][0]["text"] == ref, "curl completion equals it")
        out = subprocess.run(["curl", "-sSN", s.url + "/v1/chat/completions", "-d",
                              json.dumps({"messages": msgs, "max_tokens": 8, "stream": True})],
                             capture_output=True, text=True, timeout=60)
        ev = [l for l in out.stdout.split("\n") if l.startswith("data: ")]
        check(len(ev) >= 3 and ev[-1] == "data: [DONE]" and
              json.loads(ev[0][6:])["choices"][0]["delta"]["role"] == "assistant",
              "curl SSE stream: %d events ending with [DONE]" % len(ev))

        # --- 32 concurrent clients x 4 requests == each request alone ------------------------------
        reqs = []
        for i in range(128):
            kind, stream = ("chat" if i % 3 == 0 else "comp"), bool(i % 2)
            reqs.append((i, kind, stream, prompt(i, 12 + i % 20), 8 + i % 13))

        def run(rq, cl):
            i, kind, stream, p, n = rq
            if kind == "chat":
                return chat(cl, [{"role": "user", "content": p}], n, stream)[:3]
            return complete(cl, p, n, stream)[:2]

        def concurrent(srv, rqs, n):
            """rqs over n concurrent clients of srv (client k sends rqs[k::n] in turn): {index: answer}"""
            def client_job(k):
                cl = srv.client()
                return [(rq[0], run(rq, cl)) for rq in rqs[k::n]]
            with cf.ThreadPoolExecutor(n) as ex:
                return dict(x for lst in ex.map(client_job, range(n)) for x in lst)

        t0 = time.time()
        together = concurrent(s, reqs, 32)
        t_conc = time.time() - t0
        t0 = time.time()
        alone = {rq[0]: run(rq, c) for rq in reqs}
        t_alone = time.time() - t0
        diff = [i for i in alone if alone[i] != together.get(i)]
        check(len(together) == 128 and not diff,
              "32 clients x 4 requests equal the same requests alone (%d differ; %.1f s concurrent, %.1f s alone)"
              % (len(diff), t_conc, t_alone))
        for i in diff[:3]:
            print("   request %d: alone %r / concurrent %r" % (i, alone[i], together.get(i)))

        # --- chats of 100 messages rendered by the HTTP threads at once (the template's literals are shared:
        # counting their references from several threads corrupted the heap; session 26) ---------------------
        long_msgs = [{"role": "user" if k % 2 == 0 else "assistant", "content": prompt(k, 4)} for k in range(99)]
        long_msgs.append({"role": "user", "content": prompt(99, 4)})
        one = chat(c, long_msgs, 1, False)[:3]
        with cf.ThreadPoolExecutor(8) as ex:
            many = list(ex.map(lambda _: chat(s.client(), long_msgs, 1, False)[:3], range(64)))
        check(all(m == one for m in many) and s.p.poll() is None,
              "64 chats of 100 messages from 8 clients at once: all answered as alone, the server alive")

        # --- a client that disconnects mid-stream frees its sequence -------------------------------
        cancelled0 = s.metric('fp4moe_generations_total{reason="cancelled"}') or 0
        sock = open_stream(s.port, p0, 3)
        running = s.metric("fp4moe_running_sequences")
        sock.close()
        ok = freed_and_cancelled(s, cancelled0)
        check(running == 1 and ok, "a client gone mid-stream: its sequence is freed (running %s -> 0)" % running)

        # --- clients that close with their request unfinished: every connection is freed at once -----
        # (libmicrohttpd's epoll mode kept them in CLOSE-WAIT until the 600 s timeout, so ~1,000 aborted requests
        # wedged the server for 10 minutes: a helper's trial, session 32; the daemon runs on poll now)
        fd_dir = "/proc/%d/fd" % s.p.pid
        fds0 = len(os.listdir(fd_dir))
        for i in range(120):
            g = socket.create_connection(("127.0.0.1", s.port))
            if i % 2:
                g.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers never finished
            else:
                g.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{\"prompt\": ")
            g.close()
        fds1 = fds0 + 1000
        for _ in range(100):
            fds1 = len(os.listdir(fd_dir))
            if fds1 <= fds0 + 4:
                break
            time.sleep(0.05)
        g = socket.create_connection(("127.0.0.1", s.port))  # a half-closed client still gets its answer
        g.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        g.shutdown(socket.SHUT_WR)
        head = g.recv(64)
        g.close()
        check(fds1 <= fds0 + 4 and head.startswith(b"HTTP/1.1 200"),
              "120 requests abandoned mid-header / mid-body: their connections freed (fds %d -> %d); a half-closed "
              "client answered (%r)" % (fds0, fds1, head[:15]))

        # --- a client that goes away while waiting for a whole (non-stream) answer -------------------
        cancelled0 = s.metric('fp4moe_generations_total{reason="cancelled"}') or 0
        c499 = s.metric('fp4moe_requests_total{code="499"}') or 0
        sock = socket.create_connection(("127.0.0.1", s.port))
        body = json.dumps({"prompt": p0, "max_tokens": 3000, "ignore_eos": True})
        sock.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      "Content-Length: %d\r\n\r\n%s" % (len(body), body)).encode())
        running = 0
        for _ in range(100):
            running = s.metric("fp4moe_running_sequences")
            if running == 1:
                break
            time.sleep(0.01)
        sock.close()
        ok = freed_and_cancelled(s, cancelled0)
        t, _, _ = complete(c, p0, 24, False)
        n499 = s.metric('fp4moe_requests_total{code="499"}') or 0
        check(running == 1 and ok and t == ref and n499 == c499 + 1, "a non-stream client gone while waiting: its "
              "sequence is freed, counted as cancelled and as a 499 response (%s -> %s; a helper's audit, session 44: "
              "never counted), the server answers the same afterwards (running %s -> 0)" % (c499, n499, running))

        # --- n choices: each its own sequence and sampler; choice 0 is the request's seed ---------------------------
        kw3 = dict(model="nemotron-h-tiny-moe", prompt=p0, max_tokens=12, temperature=1.0, seed=77)
        pt0 = s.metric("fp4moe_prompt_tokens_total")
        r3 = c.completions.create(n=3, **kw3)
        pt1 = s.metric("fp4moe_prompt_tokens_total")
        again3 = c.completions.create(n=3, **kw3)
        one = c.completions.create(**kw3)
        texts = [ch.text for ch in sorted(r3.choices, key=lambda ch: ch.index)]
        check([ch.index for ch in r3.choices] == [0, 1, 2] and texts == [ch.text for ch in again3.choices] and
              texts[0] == one.choices[0].text and len(set(texts)) > 1 and r3.usage.completion_tokens == 36 and
              r3.usage.prompt_tokens == one.usage.prompt_tokens and pt1 - pt0 == r3.usage.prompt_tokens,
              "n 3 (seeded sampling): indices 0-2, repeatable, choice 0 = the n 1 answer, distinct choices, usage sums "
              "the output, the prompt computed once (%s)" % [t[:12] for t in texts])
        parts, fins, usage = {}, {}, None
        for ch in c.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw3):
            for x in ch.choices:
                parts[x.index] = parts.get(x.index, "") + x.text
                fins[x.index] = x.finish_reason or fins.get(x.index)
            usage = ch.usage or usage
        check([parts.get(i) for i in range(3)] == texts and all(fins.get(i) == "length" for i in range(3)) and
              usage.completion_tokens == 36, "n 3 streamed: each choice's chunks make its text, each ends, one usage")
        g4 = c.chat.completions.create(model="nemotron-h-tiny-moe", messages=msgs, max_tokens=8, temperature=0, n=4)
        g1 = chat(c, msgs, 8, False)
        check(len(g4.choices) == 4 and all((x.message.content or "", getattr(x.message, "reasoning_content", "") or "")
                                           == (g1[0], g1[1]) for x in g4.choices),
              "chat n 4, greedy: four choices equal to the n 1 answer")
        cancelled0 = s.metric('fp4moe_generations_total{reason="cancelled"}') or 0
        sock = socket.create_connection(("127.0.0.1", s.port))
        body = json.dumps({"prompt": p0, "max_tokens": 3000, "stream": True, "ignore_eos": True, "n": 3})
        sock.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      "Content-Length: %d\r\n\r\n%s" % (len(body), body)).encode())
        got = b""
        while got.count(b"data: ") < 6:
            got += sock.recv(4096)
        running = s.metric("fp4moe_running_sequences")
        sock.close()
        freed = False
        for _ in range(100):
            if s.metric("fp4moe_running_sequences") == 0 and \
               (s.metric('fp4moe_generations_total{reason="cancelled"}') or 0) == cancelled0 + 3:
                freed = True
                break
            time.sleep(0.05)
        check(running == 3 and freed, "n 3 streamed, the client gone: its 3 sequences freed (running %s -> 0)" % running)

        # --- every response has its own id ---------------------------------------------------------
        ids = [c.completions.create(model="nemotron-h-tiny-moe", prompt="a", max_tokens=1).id for _ in range(60)]
        check(len(set(ids)) == len(ids), "60 responses, 60 distinct ids")

        # --- bad requests: 4xx with an OpenAI error body, and the server goes on -------------------
        long_prompt = "word " * 5000
        bad = [
            ("POST", "/v1/completions", "{bad json", 400),
            ("POST", "/v1/completions", "[1, 2]", 400),
            ("POST", "/v1/completions", '{"prompt": "x"} trailing', 400),
            ("POST", "/v1/completions", '{"prompt": 5}', 400),
            ("POST", "/v1/completions", '{"prompt": "x", "temperature": "hot"}', 400),
            ("POST", "/v1/completions", '{"prompt": "x", "max_tokens": -1}', 400),
            ("POST", "/v1/completions", '{"prompt": "x", "max_tokens": 100000}', 400),
            ("POST", "/v1/completions", '{"prompt": "x", "n": 0}', 400),
            ("POST", "/v1/completions", '{"prompt": "x", "logprobs": 21}', 400),
            ("POST", "/v1/completions", '{"prompt": "x", "logit_bias": {"x": 1}}', 400),
            ("POST", "/v1/completions", '{"prompt": [1, 2, 99999999]}', 400),
            ("POST", "/v1/completions", '{"prompt": ""}', 400),
            ("POST", "/v1/completions", json.dumps({"prompt": long_prompt}), 400),
            ("POST", "/v1/completions", '{"prompt": "x", "model": "gpt-4"}', 404),
            ("POST", "/v1/chat/completions", '{"messages": []}', 400),
            ("POST", "/v1/chat/completions", '{"messages": [{"content": "no role"}]}', 400),
            ("POST", "/v1/chat/completions", '{"messages": "hi"}', 400),
            ("POST", "/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400),
            ("POST", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "stop": [1]}', 400),
            ("POST", "/v1/completions", '{"prompt": "x\\u0000 and more"}', 400),   # would end at the NUL
            ("POST", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\u0000b"}]}', 400),
            ("POST", "/v1/completions", json.dumps({"prompt": "x" * 2000000}), 413),
            ("GET", "/v1/chat/completions", None, 405),
            ("GET", "/v2/nothing", None, 404),
        ]
        results = []
        for method, path, b, want in bad:
            st, text = s.raw(method, path, b, {"Content-Type": "application/json"})
            try:
                err = json.loads(text)["error"]
                good = st == want and isinstance(err["message"], str) and err["message"]
            except Exception:
                good = False
            results.append(good)
            if not good:
                print("   %s %s %r -> %d %s (want %d)" % (method, path, (b or "")[:60], st, text[:200], want))
        # raw garbage on a socket, and a connection closed halfway through its headers
        for junk in (b"GARBAGE\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nContent-Len"):
            g = socket.create_connection(("127.0.0.1", s.port))
            g.sendall(junk)
            g.close()
        t, _, _ = complete(c, p0, 24, False)
        check(all(results) and t == ref, "%d malformed requests get their 4xx + error body; the server still "
              "answers the same afterwards" % len(bad))
        try:
            c.completions.create(model="nemotron-h-tiny-moe", prompt=long_prompt, max_tokens=4)
            check(False, "openai client sees a 400 for a prompt longer than the context")
        except openai.BadRequestError as ex:
            check("maximum context length" in str(ex), "openai client: BadRequestError for a too-long prompt")

        structured_outputs(s, c)
        tool_calls(s, c)

        # --- prefix reuse across chat turns -------------------------------------------------------
        sys_msg = {"role": "system", "content": " ".join(TEXT.split()[:220])}
        turn1 = [sys_msg, {"role": "user", "content": prompt(11)}]
        off_kw = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
        a1 = chat(c, turn1, 24, False, **off_kw)
        turn2 = turn1 + [{"role": "assistant", "content": a1[0]}, {"role": "user", "content": prompt(12)}]
        a2 = chat(c, turn2, 24, False, **off_kw)
        cached = a2[3].prompt_tokens_details.cached_tokens if a2[3].prompt_tokens_details else 0
    finally:
        rc = s.stop(signal.SIGTERM)
    check(rc == 0, "SIGTERM: exit 0 (got %s)" % rc)
    if rc != 0:
        print("   server stderr (tail): %r" % (s.err or "")[-800:])

    # --- expert parallelism: 3 ranks (in-process loopback, uneven expert split), each with its own
    # requests; answers equal those of the plain server above ------------------------------------
    se = Server("--chat-template", TEMPLATE, "--ep-ranks", "3")
    try:
        check(se.metric("fp4moe_ranks") == 3, "--ep-ranks 3: fp4moe_ranks 3")
        sub = reqs[:48]
        t0 = time.time()
        ep_got = concurrent(se, sub, 16)
        diff = [rq[0] for rq in sub if ep_got.get(rq[0]) != alone[rq[0]]]
        check(len(ep_got) == 48 and not diff, "--ep-ranks 3: 16 clients x 3 requests equal the plain server's answers "
              "(%d differ, %.1f s)" % (len(diff), time.time() - t0))
        for i in diff[:3]:
            print("   request %d: plain %r / ep %r" % (i, alone[i], ep_got.get(i)))
        e1 = chat(se.client(), turn1, 24, False, **off_kw)
        e2 = chat(se.client(), turn2, 24, False, **off_kw)
        check(e1[:3] == a1[:3] and e2[:3] == a2[:3], "--ep-ranks 3: two chat turns (prefix cache per rank) answer as "
              "the plain server")
        rn = se.client().completions.create(model="nemotron-h-tiny-moe", prompt=p0, max_tokens=24, temperature=0, n=3)
        check([x.text for x in rn.choices] == [ref] * 3, "--ep-ranks 3: n 3 greedy (choices on several ranks) equal "
              "the plain answer")
        steps = se.metric("fp4moe_steps_total")
        time.sleep(0.5)
        check(se.metric("fp4moe_steps_total") == steps, "--ep-ranks 3: idle ranks do not step while no request runs")
        held = [se.metric('fp4moe_rank_sequences{rank="%d"}' % r) for r in range(3)]
        check(held == [0, 0, 0], "--ep-ranks 3: fp4moe_rank_sequences per rank, all 0 when idle (%s)" % held)
        sock = open_stream(se.port, p0, 2)      # shutdown while a stream runs on one rank
    finally:
        t0 = time.time()
        rc = se.stop(signal.SIGTERM)
    check(rc == 0 and time.time() - t0 < 20, "--ep-ranks 3: SIGTERM during a stream: exit 0 in %.1f s (got %s)"
          % (time.time() - t0, rc))
    if rc != 0:
        print("   server stderr (tail): %r" % (se.err or "")[-800:])
    sock.close()

    # reference for turn 2 without any cache; API key on this one
    s2 = Server("--chat-template", TEMPLATE, "--prefix-cache-mb", "0", "--api-key", "sekret")
    try:
        try:
            s2.client("wrong").models.list()
            check(False, "a wrong API key is refused")
        except openai.AuthenticationError:
            check(True, "a wrong API key gets 401")
        st, _ = s2.raw("POST", "/v1/completions", '{"prompt": "x"}')
        check(st == 401, "no API key: 401 (%d)" % st)
        st, _ = s2.raw("GET", "/v1/models", None, {"Authorization": "bearer sekret"})
        check(st == 200, "the auth scheme is case-insensitive ('bearer KEY'): %d" % st)
        st, _ = s2.raw("POST", "/tokenize", '{"prompt": "x"}')
        check(st == 200, "the tokenizer endpoints need no key (vLLM guards /v1 only; lm-eval's remote tokenizer): %d" % st)
        # CORS (vLLM's default: any origin): a preflight is answered without the key, answers carry the header
        pre = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization,content-type"}
        st, _, hd = s2.raw("OPTIONS", "/v1/chat/completions", None, pre, with_headers=True)
        check(st == 204 and hd.get("access-control-allow-origin") == "*" and "POST" in
              hd.get("access-control-allow-methods", "") and hd.get("access-control-allow-headers") ==
              "authorization,content-type", "a CORS preflight: 204 with the allow headers, no API key needed (%d %r)"
              % (st, hd))
        st, _, hd = s2.raw("GET", "/v1/models", None, {"Origin": "http://ui.example", "Authorization": "Bearer sekret"},
                           with_headers=True)
        check(st == 200 and hd.get("access-control-allow-origin") == "*", "an answer to a page: Allow-Origin * (%r)" % hd)
        # a busy port: the second server fails at once, before loading the model, naming the system's reason
        t0 = time.time()
        r = subprocess.run([BIN, "serve", "-m", MODEL, "--port", str(s2.port)], capture_output=True, text=True,
                           timeout=60)
        check(r.returncode == 1 and "Address already in use" in r.stderr and "loaded" not in r.stderr and
              time.time() - t0 < 10, "a busy port: exit 1 before the model loads, with the system's reason (%r)"
              % r.stderr[-200:])
        ref2 = chat(s2.client("sekret"), turn2, 24, False, **off_kw)
        check(cached > 0 and a2[:3] == ref2[:3] and ref2[3].prompt_tokens_details is None,
              "turn 2 reuses %d of %d prompt tokens and answers as without the cache" % (cached, a2[3].prompt_tokens))
    finally:
        rc = s2.stop(signal.SIGINT)
    check(rc == 130, "Ctrl-C: exit 130 (got %s)" % rc)
    check(re.search(r"serve: 127\.0\.0\.1 POST /v1/completions 401: ", s2.err or "") is not None,
          "failed requests are logged with the client, method, path and status (%r)" % (s2.err or "")[-300:])

    # a fixed KV pool too small for three prompts at once: the third waits in the queue (it got a 503 before: a
    # helper's trial, session 32); a prompt larger than the whole pool: a 400 at once
    s5 = Server("--kv-cache-tokens", "512", "--max-step-tokens", "64")
    try:
        c5 = s5.client()
        long_p = [prompt(100 + i, 150) for i in range(3)]
        n_tok = [len(c5.completions.create(model="nemotron-h-tiny-moe", prompt=p, max_tokens=1).choices) for p in long_p]

        def one(p):
            try:
                r = c5.completions.create(model="nemotron-h-tiny-moe", prompt=p, max_tokens=40, temperature=0)
                return r.usage.prompt_tokens, r.usage.completion_tokens
            except openai.APIStatusError as ex:
                return ex.status_code, str(ex)[:120]
        with cf.ThreadPoolExecutor(3) as ex:
            res = list(ex.map(one, long_p))
        check(all(r[1] == 40 for r in res) and all(r[0] > 170 for r in res) and n_tok == [1, 1, 1],
              "three prompts of ~200 tokens with a 512-token KV pool: all answered, the third after waiting (%r)" % res)
        try:
            c5.completions.create(model="nemotron-h-tiny-moe", prompt=prompt(7, 700), max_tokens=4)
            check(False, "a prompt larger than the KV pool: 400")
        except openai.BadRequestError as ex:
            check("KV cache pool holds 512" in str(ex), "a prompt larger than the KV pool: 400 naming it (%s)" % ex)
        # a request alone whose prompt + answer outgrow the pool: the answer so far with finish_reason "length", as at
        # the context limit (a 503 threw the text away: a long-context user's trial), streamed or not; the last token is
        # not fed, so prompt + answer may be the pool + 1
        lp = prompt(11, 300)
        r = c5.completions.create(model="nemotron-h-tiny-moe", prompt=lp, max_tokens=300, temperature=0,
                                  extra_body={"ignore_eos": True})
        st_text, st_fin = "", None
        for ch in c5.completions.create(model="nemotron-h-tiny-moe", prompt=lp, max_tokens=300, temperature=0,
                                        stream=True, extra_body={"ignore_eos": True}):
            if ch.choices:
                st_text += ch.choices[0].text
                st_fin = ch.choices[0].finish_reason or st_fin
        check(r.choices[0].finish_reason == "length" and 0 < r.usage.completion_tokens < 300 and
              r.usage.prompt_tokens + r.usage.completion_tokens <= 513 and st_fin == "length" and st_text == r.choices[0].text,
              "a prompt + answer past the KV pool: the answer so far, finish_reason length (%d + %d tokens, %r)" %
              (r.usage.prompt_tokens, r.usage.completion_tokens, r.choices[0].finish_reason))
    finally:
        s5.stop()

    # the key from the environment (FP4MOE_API_KEY, as vLLM's VLLM_API_KEY) and CORS for listed origins only
    s4 = Server("--allowed-origins", "http://a.example, http://b.example", env={"FP4MOE_API_KEY": "envkey"})
    try:
        st, _ = s4.raw("GET", "/v1/models")
        st2, _, hd = s4.raw("GET", "/v1/models", None, {"Authorization": "Bearer envkey", "Origin": "http://b.example"},
                            with_headers=True)
        _, _, hd2 = s4.raw("GET", "/v1/models", None, {"Authorization": "Bearer envkey", "Origin": "http://c.example"},
                           with_headers=True)
        check(st == 401 and st2 == 200 and hd.get("access-control-allow-origin") == "http://b.example" and
              hd.get("vary") == "Origin" and "access-control-allow-origin" not in hd2,
              "FP4MOE_API_KEY sets the key; --allowed-origins: a listed origin echoed (Vary: Origin), another none "
              "(%d %d %r %r)" % (st, st2, hd, hd2))
    finally:
        s4.stop()

    # bounded queue: one sequence, no queue -> the second concurrent request gets 429
    s3 = Server("--max-seqs", "1", "--max-queue", "0")
    try:
        sock = open_stream(s3.port, p0, 1)
        try:
            s3.client().completions.create(model="nemotron-h-tiny-moe", prompt="x", max_tokens=2)
            check(False, "a request beyond --max-seqs + --max-queue gets 429")
        except openai.RateLimitError as ex:
            check(ex.response.headers.get("retry-after") == "1",
                  "a request beyond --max-seqs + --max-queue gets 429, with Retry-After: %r"
                  % ex.response.headers.get("retry-after"))
        sock.close()
        t = None
        for _ in range(100):  # the server frees the slot when it sees the disconnect (a loaded machine: later)
            time.sleep(0.1)
            try:
                t, _, _ = complete(s3.client(), p0, 24, False)
                break
            except openai.RateLimitError:
                continue
        check(t == ref, "after the 429 and the disconnect the server answers again (within 10 s)")
    finally:
        s3.stop()
    logprobs_and_penalties(p0)
    chat_terminal()
    print("%d failure(s)" % len(FAILS))
    return 1 if FAILS else 0


def chat_terminal():
    """fp4moe chat in a pseudo-terminal (a helper's trial, session 32): a 21 KB line arrives whole (the terminal's
    line mode cut it at 4,095 bytes), cursor keys edit and recall lines (libedit), a line ending in a backslash goes
    on, Ctrl-C at the prompt exits 130 on a fresh line. Skipped parts without libedit in the build."""
    import pty
    import select
    tmpl = os.path.join(tempfile.gettempdir(), "fp4moe-chat-tty.jinja")
    with open(tmpl, "w") as f:
        f.write("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    edit = "libedit" in subprocess.run(["ldd", BIN], capture_output=True, text=True).stdout

    def run(keys, args):
        pid, fd = pty.fork()
        if pid == 0:
            os.execv(BIN, [BIN, "chat", "-m", MODEL, "--chat-template", tmpl, "-n", "4", "--threads", "1", *args])
        out = b""

        def drain(t):
            nonlocal out
            end = time.time() + t
            while time.time() < end:
                r, _, _ = select.select([fd], [], [], 0.05)
                if r:
                    try:
                        out += os.read(fd, 65536)
                    except OSError:
                        return
        drain(2)
        for k in keys:
            if k == "SIGINT":
                os.kill(pid, signal.SIGINT)
            else:
                for i in range(0, len(k), 512):
                    os.write(fd, k[i:i + 512])
                    drain(0.01)
            drain(1.5)
        _, st = os.waitpid(pid, 0)
        os.close(fd)
        return out.decode("utf-8", "replace"), os.waitstatus_to_exitcode(st)
    if edit:
        long_line = " ".join("w%05d" % i for i in range(3000)).encode()
        out, rc = run([long_line + b"\r", b"/exit\r"], ("--ctx", "100"))
        m = re.search(r"with this message is (\d+) tokens", out)
        check(rc == 0 and m and int(m.group(1)) > 10000, "chat in a terminal: a 21 KB line arrives whole (%s tokens)"
              % (m.group(1) if m else out[-200:]))
        out, rc = run([b"abc\x1b[D\x1b[Dx\r", b"\x1b[A\r", b"/exit\r"], ("--ctx", "30"))
        check(rc == 0 and out.count("axbc") >= 2 and "\x1b[D" not in out.split("axbc")[0][-20:],
              "chat in a terminal: Left edits the line, Up recalls it (%r)" % out[-300:])
        out, rc = run([b"first line\\\r", b"second line\r", b"/exit\r"], ("--ctx", "40"))
        check(rc == 0 and "\n. " in out.replace("\r", ""), "chat in a terminal: a backslash continues the message (%r)"
              % out[-300:])
    out, rc = run(["SIGINT"], ())
    check(rc == 130 and out.replace("\r", "").endswith("> \n"), "chat: Ctrl-C at the prompt exits 130 on a new line "
          "(%s %r)" % (rc, out[-30:]))


def structured_outputs(s, c):
    """response_format json_schema / json_object, vLLM's guided_choice / guided_json / structured_outputs: the
    outputs parse and satisfy their schema (pydantic through the openai client's parse(), the oracle), stream
    equals non-stream, the constraint waits for the end of the reasoning the prompt opened, bad schemas are 400s
    naming the keyword, and free requests beside constrained ones answer as when alone."""
    from typing import List, Literal, Optional
    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        kind: Literal["cat", "dog", "fish"]
        name: str = Field(max_length=12)

    class Person(BaseModel):
        name: str = Field(max_length=24)
        age: int
        nick: Optional[str] = Field(max_length=16)
        pets: List[Pet] = Field(max_length=2)

    off = {"chat_template_kwargs": {"enable_thinking": False}}
    msgs = [{"role": "user", "content": "Describe a person with their pets as JSON."}]
    r = c.chat.completions.parse(model="nemotron-h-tiny-moe", messages=msgs, response_format=Person, max_tokens=1500,
                                 temperature=0, extra_body=off)
    m = r.choices[0].message
    check(r.choices[0].finish_reason == "stop" and isinstance(m.parsed, Person),
          "openai chat.completions.parse(response_format=pydantic model): a valid %s (%r)"
          % (type(m.parsed).__name__, (m.content or "")[:80]))
    # the same schema by hand, streamed: the same text
    schema = Person.model_json_schema()
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    st = c.chat.completions.create(model="nemotron-h-tiny-moe", messages=msgs, response_format=rf, max_tokens=1500,
                                   temperature=0, stream=True, extra_body=off)
    text = "".join((ch.choices[0].delta.content or "") for ch in st if ch.choices)
    check(text == (m.content or ""), "response_format json_schema streamed equals the non-streamed text")
    # json_object, sampled: every answer that ends (free strings of a tiny model may run to max_tokens) is an object
    objs = []
    for seed in range(6):
        r = c.chat.completions.create(model="nemotron-h-tiny-moe", messages=msgs, max_tokens=600, temperature=1.0,
                                      seed=seed, response_format={"type": "json_object"}, extra_body=off)
        if r.choices[0].finish_reason != "stop":
            continue
        try:
            objs.append(isinstance(json.loads(r.choices[0].message.content), dict))
        except ValueError:
            objs.append(False)
    check(len(objs) >= 2 and all(objs), "response_format json_object, temperature 1, 6 seeds: the %d that ended are "
          "JSON objects %s" % (len(objs), objs))
    # completions: guided_choice (n 6 sampled), structured_outputs.json as a string, guided_json
    ch = ["positive", "negative", "neutral"]
    r = c.completions.create(model="nemotron-h-tiny-moe", prompt="The review was great. Sentiment:", max_tokens=24, n=6,
                             temperature=1.5, seed=7, extra_body={"guided_choice": ch})
    got = [x.text for x in r.choices]
    check(all(t in ch for t in got) and all(x.finish_reason == "stop" for x in r.choices),
          "guided_choice, n 6 at temperature 1.5: every choice one of the options %s" % got)
    colors = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 4}
    r = c.completions.create(model="nemotron-h-tiny-moe", prompt="Colors:", max_tokens=300, temperature=0.7, seed=1,
                             extra_body={"structured_outputs": {"json": json.dumps(colors)}})
    try:
        v = json.loads(r.choices[0].text)
        ok = isinstance(v, list) and 2 <= len(v) <= 4 and all(x in ("red", "green", "blue") for x in v)
    except ValueError:
        ok = False
    check(ok and r.choices[0].finish_reason == "stop",
          "structured_outputs.json (schema as text): an array of 2..4 colors %r" % r.choices[0].text[-60:])
    r = c.completions.create(model="nemotron-h-tiny-moe", prompt="Age:", max_tokens=40, temperature=0,
                             extra_body={"guided_json": {"type": "integer"}})
    check(re.fullmatch(r"\s*-?(0|[1-9][0-9]*)", r.choices[0].text) is not None,
          "guided_json integer: %r" % r.choices[0].text)
    # the reasoning the template opened is free text; the constraint applies to the content after it
    r = c.chat.completions.create(model="nemotron-h-tiny-moe", messages=msgs, max_tokens=24, temperature=0,
                                  response_format={"type": "json_object"})
    rc = getattr(r.choices[0].message, "reasoning_content", None) or ""
    check(rc.strip() != "" and not rc.lstrip().startswith("{"),
          "json_object with thinking on: the reasoning is not constrained (%r)" % rc[:40])
    # with thinking off, a constrained output that opens <think> itself stays under the constraint (then split)
    r = c.chat.completions.create(model="nemotron-h-tiny-moe", messages=msgs, max_tokens=30, temperature=0,
                                  extra_body=dict(off, guided_choice=["<think>y</think>z"]))
    check((r.choices[0].message.content, getattr(r.choices[0].message, "reasoning_content", None),
           r.choices[0].finish_reason) == ("z", "y", "stop"),
          "guided_choice ['<think>y</think>z'] with thinking off: reasoning 'y', content 'z' (%r)" % r.choices[0].message)
    r = c.completions.create(model="nemotron-h-tiny-moe", prompt="x", max_tokens=80, temperature=0,
                             extra_body={"guided_json": {"const": [1, 2]}, "guided_decoding_backend": "xgrammar"})
    check(r.choices[0].text.strip() == "[1,2]", "const [1, 2] is that array (a backend name is accepted): %r"
          % r.choices[0].text)
    # errors name the field and the keyword
    bad = [({"guided_json": {"type": "integer", "minimum": 0}}, "'minimum' is not supported"),
           ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
             "properties": {"a": {"type": "string", "pattern": "^a"}}}}}},
            "response_format.json_schema.schema.properties.a: 'pattern' is not supported"),
           ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "give one of"),
           ({"guided_json": "{not json"}, "not JSON text"),
           ({"guided_choice": []}, "list of 1..65536 strings"),
           ({"response_format": {"type": "json_schema"}}, "must be an object with a 'schema'"),
           ({"guided_regex": "a+"}, "'guided_regex' is not supported"),
           ({"structured_outputs": {"grammar": "root ::= x"}}, "'structured_outputs.grammar' is not supported"),
           ({"guided_json": "{\"type\": \"string\"} garbage"}, "has more after it"),
           ({"guided_json": {"type": "string"}, "guided_whitespace_pattern": "[ ]?"}, "'guided_whitespace_pattern'"),
           ({"guided_json": {"type": "string"}, "guided_decoding_backend": "xgrammar:disable-any-whitespace"},
            "'guided_decoding_backend' options"),
           ({"include_stop_str_in_output": True}, "'include_stop_str_in_output'"),
           ({"guided_json": {"$ref": "#"}}, "no finite document"),
           ({"guided_json": {"type": "string", "enum": ["abc", "x"], "maxLength": 1}}, "'maxLength' beside 'enum'")]
    for extra, msg in bad:
        body = {"prompt": "x", "max_tokens": 4}
        body.update(extra)
        code, txt = s.raw("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        check(code == 400 and msg in txt, "structured output error %s: %d %s" % (list(extra)[0], code, txt[:140]))
    # constrained and free requests at once: the free ones answer as alone
    p = "The little girl opened the door and saw"
    alone = complete(c, p, 24, False)[0]
    with cf.ThreadPoolExecutor(8) as ex:
        fut = [ex.submit(lambda i=i: c.completions.create(model="nemotron-h-tiny-moe", prompt=p, max_tokens=300,
                                                         temperature=0.9, seed=i, extra_body={"guided_json": colors}))
               for i in range(4)] + [ex.submit(lambda: complete(c, p, 24, False)[0]) for _ in range(4)]
        res = [f.result() for f in fut]
    check(all(t == alone for t in res[4:]) and all(x.choices[0].finish_reason in ("stop", "length") for x in res[:4]),
          "4 free greedy completions beside 4 constrained ones equal the one alone")


def tool_calls(s, c):
    """tools: a named tool_choice returns one call whose arguments satisfy the tool's parameters (stream: the same
    arguments in deltas); with tool_choice auto the model's own call format (Nemotron-3: <tool_call><function=...>) in
    the answer becomes tool_calls with finish_reason "tool_calls" - the tiny model is made to write one through
    guided_choice -, the conversation goes on with the call and its result; "required" gives calls of the tools with
    valid arguments; unknown names are 400s."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                              "days": {"type": "integer"}},
                             "required": ["city", "days"]}}},
             {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
    msgs = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model="nemotron-h-tiny-moe", messages=msgs, tools=tools, tool_choice=named,
                                  max_tokens=400, temperature=0, extra_body=off)
    m = r.choices[0].message
    ok = bool(m.tool_calls) and len(m.tool_calls) == 1 and m.tool_calls[0].function.name == "get_weather"
    args = json.loads(m.tool_calls[0].function.arguments) if ok else {}
    check(ok and set(args) == {"city", "days"} and isinstance(args["days"], int) and len(args["city"]) <= 12 and
          m.tool_calls[0].id.startswith("call_") and r.choices[0].finish_reason == "stop",
          "named tool_choice: one get_weather call with valid arguments %r" % (m.tool_calls and m.tool_calls[0]))
    st = c.chat.completions.create(model="nemotron-h-tiny-moe", messages=msgs, tools=tools, tool_choice=named,
                                   max_tokens=400, temperature=0, stream=True, extra_body=off)
    name, sargs, ids = None, "", set()
    for ch in st:
        for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            name = name or (d.function.name if d.function else None)
            sargs += (d.function.arguments or "") if d.function else ""
            if d.id:
                ids.add(d.id)
    check(name == "get_weather" and len(ids) == 1 and ok and sargs == m.tool_calls[0].function.arguments,
          "named tool_choice streamed: the name once, the same arguments in deltas")
    # tool_choice auto: a call in the model's format becomes tool_calls (forced here through guided_choice)
    call_text = "Sure.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n" \
                "3\n</parameter>\n</function>\n</tool_call>"
    for stream in (False, True):
        kw = dict(model="nemotron-h-tiny-moe", messages=msgs, tools=tools, max_tokens=200, temperature=0,
                  extra_body=dict(off, guided_choice=[call_text]))
        if not stream:
            r = c.chat.completions.create(**kw)
            m = r.choices[0].message
            calls = [(t.function.name, json.loads(t.function.arguments), t.id) for t in (m.tool_calls or [])]
            content, fin = m.content, r.choices[0].finish_reason
        else:
            acc = {}
            content, fin = "", None
            for ch in c.chat.completions.create(stream=True, **kw):
                if not ch.choices:
                    continue
                dl = ch.choices[0].delta
                content += dl.content or ""
                for d in dl.tool_calls or []:
                    e = acc.setdefault(d.index, ["", "", d.id])
                    e[0] += (d.function.name or "") if d.function else ""
                    e[1] += (d.function.arguments or "") if d.function else ""
                fin = ch.choices[0].finish_reason or fin
            calls = [(v[0], json.loads(v[1]), v[2]) for _, v in sorted(acc.items())]
        check(len(calls) == 1 and calls[0][0] == "get_weather" and calls[0][1] == {"city": "Paris", "days": 3} and
              content == "Sure." and fin == "tool_calls",
              "tool_choice auto%s: the model's <tool_call> becomes tool_calls %r, content %r, finish %s"
              % (" (stream)" if stream else "", calls, content, fin))
    # the conversation goes on: the call and its result in the messages
    if calls:
        turn = msgs + [{"role": "assistant", "content": None, "tool_calls": [{"id": calls[0][2], "type": "function",
                        "function": {"name": "get_weather", "arguments": json.dumps(calls[0][1])}}]},
                       {"role": "tool", "tool_call_id": calls[0][2], "content": "{\"temp_c\": 18}"}]
        r = c.chat.completions.create(model="nemotron-h-tiny-moe", messages=turn, tools=tools, max_tokens=8,
                                      temperature=0, extra_body=off)
        check(r.choices[0].finish_reason in ("stop", "length", "tool_calls"),
              "a turn with the call and its result is answered (%r)" % r.choices[0].message.content)
    # tool_choice none: the call stays text
    r = c.chat.completions.create(model="nemotron-h-tiny-moe", messages=msgs, tools=tools, tool_choice="none",
                                  max_tokens=200, temperature=0, extra_body=dict(off, guided_choice=[call_text]))
    check(r.choices[0].message.content == call_text and not r.choices[0].message.tool_calls,
          "tool_choice none: the call stays content")
    # tool_choice required: one or more calls of the given tools, each with valid arguments (stream: the same calls)
    got = []
    for stream in (False, True):
        # (a logit bias on "]" (id 63) ends the list after a call: the tiny model would go on adding calls)
        kw = dict(model="nemotron-h-tiny-moe", messages=msgs, tools=tools, tool_choice="required", max_tokens=600,
                  temperature=0, logit_bias={"63": 8}, extra_body=off)
        if not stream:
            r = c.chat.completions.create(**kw)
            got.append(([(t.function.name, json.loads(t.function.arguments)) for t in r.choices[0].message.tool_calls or []],
                        r.choices[0].finish_reason, r.choices[0].message.content))
        else:
            acc, fin, content = {}, None, ""
            for ch in c.chat.completions.create(stream=True, **kw):
                if not ch.choices:
                    continue
                content += ch.choices[0].delta.content or ""
                for d in ch.choices[0].delta.tool_calls or []:
                    e = acc.setdefault(d.index, ["", ""])
                    e[0] += (d.function.name or "") if d.function else ""
                    e[1] += (d.function.arguments or "") if d.function else ""
                fin = ch.choices[0].finish_reason or fin
            got.append(([(v[0], json.loads(v[1])) for _, v in sorted(acc.items())], fin, content or None))
    valid = all(n == "now" and isinstance(a, dict) or n == "get_weather" and set(a) == {"city", "days"} and
                isinstance(a["days"], int) and len(a["city"]) <= 12 for n, a in got[0][0])
    check(len(got[0][0]) >= 1 and valid and got[0][1] == "tool_calls" and not got[0][2] and got[1] == got[0],
          "tool_choice required: %d valid call(s), finish tool_calls, the stream the same: %r" % (len(got[0][0]), got))
    # parallel_tool_calls false keeps the first of two calls; the legacy function_call names one; a stream holding a
    # call back sends SSE comments (what finds a client gone)
    two = call_text + "<tool_call>\n<function=now>\n</function>\n</tool_call>"
    r = c.chat.completions.create(model="nemotron-h-tiny-moe", messages=msgs, tools=tools, max_tokens=200, temperature=0,
                                  extra_body=dict(off, guided_choice=[two]))
    r1 = c.chat.completions.create(model="nemotron-h-tiny-moe", messages=msgs, tools=tools, max_tokens=200, temperature=0,
                                   parallel_tool_calls=False, extra_body=dict(off, guided_choice=[two]))
    check(len(r.choices[0].message.tool_calls or []) == 2 and len(r1.choices[0].message.tool_calls or []) == 1,
          "two calls; parallel_tool_calls false keeps the first")
    # cut by max_tokens inside the second call: only the first, closed one is a call (the cut one would read as a
    # call with other values); finish length
    r1 = c.chat.completions.create(model="nemotron-h-tiny-moe", messages=msgs, tools=tools, max_tokens=200, temperature=0,
                                   extra_body=dict(off, guided_choice=[call_text]))
    cut = r1.usage.completion_tokens + 4
    r = c.chat.completions.create(model="nemotron-h-tiny-moe", messages=msgs, tools=tools, max_tokens=cut, temperature=0,
                                  extra_body=dict(off, guided_choice=[two]))
    tcs = r.choices[0].message.tool_calls or []
    check(r.choices[0].finish_reason == "length" and [t.function.name for t in tcs] == ["get_weather"],
          "auto tool calls cut by max_tokens (%d): the closed call only, finish length: %r" % (cut, r.choices[0]))
    # tool_choice required with parallel_tool_calls false: the grammar closes the list after one call (vLLM's
    # maxItems 1; no logit bias needed); the same request with more calls allowed and max_tokens cut inside the second
    # one returns the first, complete call with finish length (it was text before)
    kw = dict(model="nemotron-h-tiny-moe", messages=msgs, tools=tools, tool_choice="required", temperature=0,
              extra_body=off)
    r1 = c.chat.completions.create(max_tokens=600, parallel_tool_calls=False, **kw)
    one = [(t.function.name, t.function.arguments) for t in r1.choices[0].message.tool_calls or []]
    check(len(one) == 1 and r1.choices[0].finish_reason == "tool_calls",
          "tool_choice required, parallel_tool_calls false: one call, finish tool_calls: %r" % r1.choices[0])
    r = c.chat.completions.create(max_tokens=r1.usage.completion_tokens + 3, **kw)
    got = [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls or []]
    check(r.choices[0].finish_reason == "length" and got == one and not r.choices[0].message.content,
          "tool_choice required cut by max_tokens: the complete call, finish length: %r" % r.choices[0])
    r = c.chat.completions.create(max_tokens=6, **kw)  # cut inside the first call: no call, and no content either
    check(r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls and
          r.choices[0].message.content is None, "tool_choice required cut before a call completes: content null, "
          "no calls: %r" % r.choices[0])
    code, txt = s.raw("POST", "/v1/chat/completions", json.dumps({"messages": msgs, "tools": tools, "max_tokens": 300,
                      "temperature": 0, "function_call": {"name": "get_weather"}, "chat_template_kwargs": off["chat_template_kwargs"]}),
                      {"Content-Type": "application/json"})
    tcs = json.loads(txt)["choices"][0]["message"].get("tool_calls") if code == 200 else None
    check(code == 200 and tcs and tcs[0]["function"]["name"] == "get_weather",
          "legacy function_call {name} forces that function: %d" % code)
    code, txt = s.raw("POST", "/v1/chat/completions", json.dumps({"messages": msgs, "tools": tools, "max_tokens": 200,
                      "temperature": 0, "stream": True, "guided_choice": [call_text], "chat_template_kwargs":
                      off["chat_template_kwargs"]}), {"Content-Type": "application/json"})
    check(code == 200 and "\n:\n\n" in txt and txt.rstrip().endswith("data: [DONE]"),
          "a stream holding a call back sends SSE comments (%d)" % txt.count("\n:\n\n"))
    for tc, msg in (({"type": "function", "function": {"name": "nope"}}, "names the function 'nope'"),
                    ({"type": "function"}, "must be {")):
        body = {"messages": msgs, "tools": tools, "tool_choice": tc, "max_tokens": 4}
        code, txt = s.raw("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        check(code == 400 and msg in txt, "tool_choice %s: 400 %s" % (tc, txt[:120]))
    bad = [({"tools": [{"type": "function"}]}, "'tools[0].function.name' must be a non-empty string"),
           ({"tools": [{"type": "retrieval"}]}, "'tools[0].type' must be"),
           ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "abc"}}]}, "'tools[0].function.parameters'"),
           ({"messages": msgs + [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
             "function": {"name": "f", "arguments": "abc"}}]}]}, "messages[1].tool_calls[0].function.arguments"),
           ({"messages": msgs + [{"role": "assistant", "content": None, "tool_calls": "ab"}]}, "messages[1].tool_calls must be a list")]
    for extra, msg in bad:
        body = {"messages": msgs, "max_tokens": 4}
        body.update(extra)
        code, txt = s.raw("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        check(code == 400 and msg in txt, "bad tools / tool_calls: 400 naming it (%s)" % txt[:110])


def logprobs_and_penalties(p0):
    """logprobs, presence / frequency / repetition penalties and logit_bias against mlx-lm (the second oracle of the
    default model: its fp32 logits equal fp4moe's float mode within ~1e-6, tests/golden/mlx): a server with
    --cpu-act float; mlx-lm teacher-forced on the prompt and the output gives every step's raw logits, vLLM's
    formulas on them give the penalized greedy choices."""
    import numpy as np
    import mlx.core as mx
    import mlx_lm
    model, hf_tok = mlx_lm.load(MODEL)
    model.set_dtype(mx.float32)

    def log_softmax_rows(ids, first):
        """float64 log_softmax of the logits that chose ids[first:] (rows first-1 .., one forward)"""
        lg = np.array(model(mx.array([ids[:-1]]))[0].astype(mx.float32)).astype(np.float64)[first - 1:]
        return lg, lg - (lg.max(axis=1, keepdims=True) +
                         np.log(np.exp(lg - lg.max(axis=1, keepdims=True)).sum(axis=1, keepdims=True)))

    def ids_of(tokens):
        return [int(t.split(":")[1]) for t in tokens]

    pids = hf_tok.encode(p0, add_special_tokens=False)
    sf = Server("--cpu-act", "float", "--chat-template", TEMPLATE, "--max-step-tokens", "16")
    try:
        c = sf.client()
        kw = dict(model="nemotron-h-tiny-moe", prompt=pids, max_tokens=14, temperature=0,
                  extra_body={"return_tokens_as_token_ids": True})
        r = c.completions.create(logprobs=5, **kw)
        lp = r.choices[0].logprobs
        gen = ids_of(lp.tokens)
        _, L = log_softmax_rows(pids + gen, len(pids))
        err = max(abs(lp.token_logprobs[t] - L[t, g]) for t, g in enumerate(gen))
        top_ok, near = True, 0
        for t in range(len(gen)):
            order = np.argsort(-L[t], kind="stable")
            if L[t, order[4]] - L[t, order[5]] < 1e-3:
                near += 1
                continue
            got = {int(k.split(":")[1]): v for k, v in lp.top_logprobs[t].items()}
            top_ok &= set(got) == set(int(i) for i in order[:5]) and \
                all(abs(v - L[t, i]) <= 1e-3 for i, v in got.items())
        check(len(gen) == 14 and err <= 1e-3 and top_ok and all(int(np.argmax(L[t])) == g for t, g in enumerate(gen)),
              "completion logprobs (top 5, 14 greedy tokens) equal mlx-lm's log_softmax: max |diff| %.2e, top-5 sets "
              "equal (%d steps with a near tie skipped)" % (err, near))
        text_offsets_ok = lp.text_offset[0] == 0 and all(b >= a for a, b in zip(lp.text_offset, lp.text_offset[1:]))
        check(text_offsets_ok, "text_offset starts at 0 and grows: %s" % lp.text_offset[:6])
        # streamed: the same entries, each once, in order
        st_tok, st_lp = [], []
        for ch in c.completions.create(logprobs=5, stream=True, **kw):
            if ch.choices and ch.choices[0].logprobs:
                st_tok += ch.choices[0].logprobs.tokens
                st_lp += ch.choices[0].logprobs.token_logprobs
        check(st_tok == lp.tokens and st_lp == lp.token_logprobs, "streamed logprobs equal the whole answer's")
        # with a stop string that the text keeps matching in part, each chunk's entries come with their text or after
        # it: the tokens received so far always make a prefix of the text received so far (a trial found entries
        # sent ahead of their held-back text)
        ahead, text, toks, n_ev = [], "", "", 0
        for ch in c.completions.create(model="nemotron-h-tiny-moe", prompt="Once upon a time", max_tokens=16,
                                       temperature=0, logprobs=0, stop=["said to tx"], stream=True):
            if not ch.choices:
                continue
            n_ev += 1
            text += ch.choices[0].text
            if ch.choices[0].logprobs:
                toks += "".join(ch.choices[0].logprobs.tokens)
                tops = ch.choices[0].logprobs.top_logprobs
                ahead += [t for t, d in zip(ch.choices[0].logprobs.tokens, tops) if list(d) != [t]]
            if not ch.choices[0].finish_reason and not text.startswith(toks):
                ahead.append((text, toks))
        check(not ahead and n_ev > 3, "a stop string held back: no logprobs entry ahead of its text (%d chunks); "
              "logprobs 0 gives each token's own entry in top_logprobs (OpenAI: up to logprobs + 1)" % n_ev)
        # chat: the entries' tokens (and bytes) make the text; top_logprobs[0] is the greedy token
        msgs = [{"role": "user", "content": prompt(5)}]
        rc_ = c.chat.completions.create(model="nemotron-h-tiny-moe", messages=msgs, max_tokens=12, temperature=0,
                                        logprobs=True, top_logprobs=3,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        ents = rc_.choices[0].logprobs.content
        text = rc_.choices[0].message.content
        check("".join(e.token for e in ents) == text and bytes(b for e in ents for b in e.bytes).decode() == text and
              all(len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token and
                  e.top_logprobs[0].logprob == e.logprob for e in ents) and
              len(ents) == rc_.usage.completion_tokens - (rc_.choices[0].finish_reason == "stop"),
              "chat logprobs: %d entries; their tokens and bytes make the content %r" % (len(ents), text[:30]))

        # penalties and logit_bias: the greedy choices of vLLM's formulas on mlx-lm's raw logits; the logprobs stay raw
        plain = gen
        bias = {plain[0]: -5.0, plain[3]: 1.5}
        pen = dict(presence_penalty=0.7, frequency_penalty=0.9)
        rp = 1.3
        r = c.completions.create(logprobs=0, logit_bias={str(k): v for k, v in bias.items()},
                                 **dict(kw, extra_body={"return_tokens_as_token_ids": True, "repetition_penalty": rp}),
                                 **pen)
        g2 = ids_of(r.choices[0].logprobs.tokens)
        raw, L2 = log_softmax_rows(pids + g2, len(pids))
        ok, margin = True, 1e9
        for t, g in enumerate(g2):
            y = raw[t].copy()
            for k, v in bias.items():
                y[k] += v
            seen = sorted(set(pids + g2[:t]))
            y[seen] = np.where(y[seen] > 0, y[seen] / rp, y[seen] * rp)
            cnt = np.bincount(np.array(g2[:t], dtype=np.int64), minlength=len(y)) if t else np.zeros(len(y))
            y -= pen["frequency_penalty"] * cnt + pen["presence_penalty"] * (cnt > 0)
            s2 = np.sort(y)
            margin = min(margin, s2[-1] - s2[-2])
            ok &= int(np.argmax(y)) == g
        lp_raw = max(abs(v - L2[t, g]) for t, (v, g) in enumerate(zip(r.choices[0].logprobs.token_logprobs, g2)))
        check(ok and g2 != plain and lp_raw <= 1e-3,
              "presence 0.7 / frequency 0.9 / repetition 1.3 / logit_bias: the 14 greedy tokens are vLLM's formulas' "
              "choices on mlx-lm's logits (min margin %.3g; output differs from the plain one; logprobs raw, %.1e)"
              % (margin, lp_raw))
        # fp4moe generate's --presence-penalty / --frequency-penalty / --repeat-penalty (same sampler): the same text
        # as the server's request with those fields (the window covering prompt and output, as vLLM)
        out = subprocess.run([BIN, "generate", "-m", MODEL, "-p", p0, "-n", "14", "--json", "--cpu-act", "float",
                              "--presence-penalty", "0.7", "--frequency-penalty", "0.9", "--repeat-penalty", "1.3",
                              "--repeat-last-n", "1000"], capture_output=True, text=True)
        r = c.completions.create(model="nemotron-h-tiny-moe", prompt=p0, max_tokens=14, temperature=0,
                                 extra_body={"repetition_penalty": 1.3}, **pen)
        check(out.returncode == 0 and json.loads(out.stdout)["text"] == r.choices[0].text,
              "generate --presence-penalty / --frequency-penalty / --repeat-penalty equals the server's request: %r"
              % r.choices[0].text[:40])
        # echo + logprobs (lm-evaluation-harness's loglikelihood request: max_tokens 1, logprobs 1, the prompt as ids):
        # the prompt's tokens with their log-probabilities (the first null), in chunks of 16 rows here
        ctx = hf_tok.encode(prompt(7, 30), add_special_tokens=False)
        cont = hf_tok.encode(" and the little girl was very happy", add_special_tokens=False)
        ids = ctx + cont
        r = c.completions.create(model="nemotron-h-tiny-moe", prompt=[ids], max_tokens=1, temperature=0, logprobs=1,
                                 echo=True, extra_body={"return_tokens_as_token_ids": True})
        lp = r.choices[0].logprobs
        _, Lp = log_softmax_rows(ids + [0], 1)   # rows 0 .. len(ids) - 1: each predicts the token after it
        n = len(ids)
        ll = sum(lp.token_logprobs[len(ctx):-1])
        want = sum(Lp[k - 1, ids[k]] for k in range(len(ctx), n))
        greedy = all(t == max(top.values()) for t, top in zip(lp.token_logprobs[len(ctx):-1], lp.top_logprobs[len(ctx):-1]))
        want_greedy = all(int(np.argmax(Lp[k - 1])) == ids[k] for k in range(len(ctx), n))
        err = max(abs(lp.token_logprobs[k] - Lp[k - 1, ids[k]]) for k in range(1, n))
        check(len(lp.tokens) == n + 1 and ids_of(lp.tokens[:n]) == ids and lp.token_logprobs[0] is None and
              lp.top_logprobs[0] is None and err <= 1e-3 and abs(ll - want) <= 1e-3 * len(cont) and greedy == want_greedy
              and r.usage.completion_tokens == 1,
              "echo + logprobs (%d prompt tokens, 16-row chunks): the prompt's logprobs equal mlx-lm's (max |diff| %.1e), "
              "the continuation's loglikelihood %.4f (mlx-lm %.4f), is_greedy %s as lm-eval computes it"
              % (n, err, ll, want, greedy))
        # the same request while three others decode: a step returns at most 16 rows of logits here (the server's
        # --max-step-tokens), so the prompt's chunks share them with the decode rows (a chunk of 16 failed with 503)
        with cf.ThreadPoolExecutor(4) as ex:
            busy = [ex.submit(lambda k: c.completions.create(model="nemotron-h-tiny-moe", prompt=prompt(k),
                                                             max_tokens=40, temperature=0,
                                                             extra_body={"ignore_eos": True}), k) for k in range(3)]
            time.sleep(0.3)
            again = c.completions.create(model="nemotron-h-tiny-moe", prompt=[ids], max_tokens=1, temperature=0,
                                         logprobs=1, echo=True, extra_body={"return_tokens_as_token_ids": True})
            busy_n = [f.result().usage.completion_tokens for f in busy]
        diff = max(abs(a - b) for a, b in zip(again.choices[0].logprobs.token_logprobs[1:], lp.token_logprobs[1:]))
        # (within 1e-4, not bitwise: the prompt's chunks then end elsewhere, and the CPU's prefill sums depend on
        # where a chunk ends at the ~1e-6 level)
        check(busy_n == [40, 40, 40] and again.choices[0].logprobs.token_logprobs[0] is None and diff <= 1e-4,
              "echo + logprobs beside three decoding requests: the logprobs of the request alone (max |diff| %.2e), "
              "all answered (%s tokens)" % (diff, busy_n))
        # a NUL token (byte 0) in the text: \u0000 in the JSON, not its end
        rn = c.completions.create(model="nemotron-h-tiny-moe", prompt=[[67, 191, 68]], max_tokens=2, temperature=0,
                                  echo=True, logprobs=1)
        check(rn.choices[0].text.startswith("a\x00b") and len(rn.choices[0].text) > 3 and
              rn.choices[0].logprobs.tokens[:3] == ["a", "\x00", "b"] and
              rn.choices[0].logprobs.text_offset[-1] < len(rn.choices[0].text),
              "echo of a prompt with a NUL token: the whole text (%r)" % rn.choices[0].text)
        # a list of prompts (lm-eval --batch_size: several loglikelihood requests in one): each choice as its
        # prompt alone
        batch = [ids, ctx, cont + ctx]
        rb = c.completions.create(model="nemotron-h-tiny-moe", prompt=batch, max_tokens=1, temperature=0, logprobs=1,
                                  echo=True, extra_body={"return_tokens_as_token_ids": True})
        alone_b = [c.completions.create(model="nemotron-h-tiny-moe", prompt=[b], max_tokens=1, temperature=0,
                                        logprobs=1, echo=True, extra_body={"return_tokens_as_token_ids": True})
                   for b in batch]
        bd = max(abs(x - y) for got, one in zip(sorted(rb.choices, key=lambda x: x.index), alone_b)
                 for x, y in zip(got.logprobs.token_logprobs[1:], one.choices[0].logprobs.token_logprobs[1:]))
        check([x.index for x in rb.choices] == [0, 1, 2] and
              [ids_of(x.logprobs.tokens[:-1]) for x in rb.choices] == batch and bd <= 1e-4 and
              rb.usage.prompt_tokens == sum(len(b) for b in batch),
              "a list of 3 prompts with echo + logprobs: each choice is its prompt's answer alone (max |diff| %.1e), "
              "the usage counts every prompt" % bd)
        r0 = c.completions.create(model="nemotron-h-tiny-moe", prompt=p0, max_tokens=0, echo=True, logprobs=0)
        rs = c.completions.create(model="nemotron-h-tiny-moe", prompt=p0, max_tokens=6, echo=True, temperature=0,
                                  stop=["girl"])
        plain6 = c.completions.create(model="nemotron-h-tiny-moe", prompt=p0, max_tokens=6, temperature=0, stop=["girl"])
        check(r0.choices[0].text == p0 and r0.usage.completion_tokens == 0 and
              len(r0.choices[0].logprobs.tokens) == r0.usage.prompt_tokens and
              rs.choices[0].text == p0 + plain6.choices[0].text,
              "echo with max_tokens 0: the prompt alone (%d tokens); echo with a stop string: the prompt + the same "
              "output as without echo (%r)" % (r0.usage.prompt_tokens, plain6.choices[0].text))
        # vLLM's tokenizer endpoints (lm-evaluation-harness finds its remote tokenizer through them)
        st, info = sf.raw("GET", "/tokenizer_info")
        info = json.loads(info)
        st2, tk = sf.raw("POST", "/tokenize", json.dumps({"prompt": p0, "add_special_tokens": False}))
        st3, dt = sf.raw("POST", "/detokenize", json.dumps({"tokens": json.loads(tk)["tokens"]}))
        st4, _ = sf.raw("POST", "/tokenize", "{}")
        check(st == st2 == st3 == 200 and st4 == 400 and info["eos_token"] == "</s>" and
              json.loads(tk)["tokens"] == hf_tok.encode(p0, add_special_tokens=False) and json.loads(dt)["prompt"] == p0,
              "/tokenizer_info (eos %r), /tokenize equals HF's ids, /detokenize gives the text back, a bad body 400"
              % info["eos_token"])
        # logit_bias -100 on the greedy token: the runner-up comes
        r = c.completions.create(model="nemotron-h-tiny-moe", prompt=pids, max_tokens=1, temperature=0,
                                 logit_bias={str(plain[0]): -100}, logprobs=0,
                                 extra_body={"return_tokens_as_token_ids": True})
        runner = int(np.argsort(-L[0], kind="stable")[1])
        check(ids_of(r.choices[0].logprobs.tokens) == [runner], "logit_bias -100 on the greedy token: the runner-up "
              "(id %d) is chosen" % runner)
    finally:
        sf.stop()


if __name__ == "__main__":
    sys.exit(main())
