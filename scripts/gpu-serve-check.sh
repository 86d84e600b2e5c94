#!/usr/bin/env bash
# scripts/gpu-serve-check.sh: fp4moe serve on a machine with an NVIDIA GPU (issue 10), in ONE command:
#   1. the default model on the GPU: 32 concurrent streams x 2 greedy requests vs the same requests
#      alone (answers compared: they may part only at a near tie, bench/serve_batch_probe.py, since the
#      batch's row count changes some ops' rounding), a disconnect, bad requests (the server must go on); logprobs and
#      echo + logprobs against a CPU server in float mode (scripts/serve_logprobs_probe.py); structured
#      output and tool calls (scripts/serve_structured_probe.py);
#   2. the synthetic Nemotron-3-Nano-30B-A3B shape (--synthetic, the default model's tokenizer):
#      scripts/loadtest.py at 1 / 8 / 32 / 64 concurrent streams (requests/s, output tok/s, TTFT,
#      ITL), and turn-2 TTFT of a ~2,000-token chat with the prefix cache and without it.
# Logs go to $OUT (default gpu-serve-out/); a short table is printed last.
#
# Usage:
#   scripts/gpu-serve-check.sh [BIN]          run (BIN: prebuilt programs from --package)
#   scripts/gpu-serve-check.sh --package BIN  on the build machine: build build-gpum and pack
#                                             fp4moe (+ its libraries) into BIN/serve.tar.xz
# Environment: SERVE_MAX_TOKENS (default 128), SERVE_RPC (requests per client, default 3);
# SERVE_DEVICE=cpu SERVE_SKIP_SYN=1 tries part 1 on a machine without a GPU; SERVE_ONLY_TURN2=1 runs
# the prefix-reuse measurement only.
set -u
cd "$(dirname "$0")/.."
GP_NAME=serve
GP_BUILD=build-gpum
GP_PROGS="fp4moe"
GP_TARGETS="fp4moe_cli"
. scripts/gpu-pack.sh
[ "${1:-}" = "--package" ] || { OUT=${OUT:-gpu-serve-out}; mkdir -p "$OUT"; }
gp_main "$@"
FP="$GP_BIN/fp4moe"
TMPL=tests/golden/templates/nemotron-3-nano-30b-a3b.jinja
TOK=models/nemotron-h-tiny-moe
MT=${SERVE_MAX_TOKENS:-128}
RPC=${SERVE_RPC:-3}
declare -a ROWS
row() { ROWS+=("$(printf '%-44s %s' "$1" "$2")"); }
{ date -u; nvidia-smi -L; git rev-parse --short HEAD 2>/dev/null; } >"$OUT/env.log" 2>&1

start() { # NAME ARGS...: starts a server, sets PID and URL (waits up to 300 s for "listening")
    local name=$1; shift
    "$FP" serve --port 0 "$@" >"$OUT/$name.out" 2>"$OUT/$name.err" &
    PID=$!
    for _ in $(seq 600); do
        URL=$(grep -o 'http://[0-9.:]*' "$OUT/$name.out" 2>/dev/null | head -1)
        [ -n "$URL" ] && return 0
        kill -0 $PID 2>/dev/null || { echo "server $name died:"; tail -5 "$OUT/$name.err"; return 1; }
        sleep 0.5
    done
    return 1
}
stop() { kill -TERM $PID 2>/dev/null; wait $PID; SRC=$?; }

# ---- 1. default model on the GPU: concurrent == alone ---------------------------------------------
if [ -n "${SERVE_ONLY_TURN2:-}" ]; then :
elif start tiny -m "$TOK" --device "${SERVE_DEVICE:-cuda}" --chat-template "$TMPL"; then
    python3 - "$URL" >"$OUT/tiny-check.log" 2>&1 <<'PY'
import json, sys, threading, http.client, urllib.parse, socket, time
url = urllib.parse.urlparse(sys.argv[1])
words = open("tests/golden/default/heldout_short.txt").read().split()
def req(path, body):
    c = http.client.HTTPConnection(url.hostname, url.port, timeout=300)
    c.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    r = c.getresponse(); out = (r.status, r.read().decode()); c.close(); return out
def run(i):
    p = " ".join(words[(i * 37) % 500:(i * 37) % 500 + 12 + i % 20])
    if i % 3 == 0:
        st, b = req("/v1/chat/completions", {"messages": [{"role": "user", "content": p}], "max_tokens": 8 + i % 13, "temperature": 0})
        return st, json.loads(b)["choices"][0]["message"]["reasoning_content"]
    st, b = req("/v1/completions", {"prompt": p, "max_tokens": 8 + i % 13, "temperature": 0})
    return st, json.loads(b)["choices"][0]["text"]
together = {}
def client(k):
    for i in range(k, 64, 32): together[i] = run(i)
th = [threading.Thread(target=client, args=(k,)) for k in range(32)]
[t.start() for t in th]; [t.join() for t in th]
alone = {i: run(i) for i in range(64)}
diff = [i for i in range(64) if alone[i] != together.get(i)]
bad = [req("/v1/completions", b)[0] for b in ({"prompt": 5}, {"prompt": "x", "n": 0}, {"prompt": "x", "model": "no"})]
s = socket.create_connection((url.hostname, url.port))
body = json.dumps({"prompt": "Once", "max_tokens": 500, "stream": True, "ignore_eos": True})
s.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)).encode())
s.recv(4096); s.close(); time.sleep(1)
c = http.client.HTTPConnection(url.hostname, url.port); c.request("GET", "/metrics"); m = c.getresponse().read().decode()
running = [l for l in m.split("\n") if l.startswith("fp4moe_running_sequences")]
again = run(1) == alone[1]
print("differ %d of 64; bad statuses %s; after disconnect %s; answers again %s" % (len(diff), bad, running, again))
for i in diff[:5]: print("  %d alone %r together %r" % (i, alone[i], together.get(i)))
# (answers that differ are reported; whether they part only at near ties is bench/serve_batch_probe.py's check below)
sys.exit(0 if bad == [400, 400, 404] and running == ["fp4moe_running_sequences 0"] and again else 1)
PY
    rc=$?
    row "default model, GPU: bad requests, disconnect" "$([ $rc = 0 ] && echo PASS || echo FAIL) ($(head -1 "$OUT/tiny-check.log" | cut -c1-90))"
    python3 bench/serve_batch_probe.py "$URL" >"$OUT/batch-probe.log" 2>&1
    row "  concurrent vs alone: part at near ties only" "$([ $? = 0 ] && echo PASS || echo FAIL) ($(tail -1 "$OUT/batch-probe.log" | cut -c1-90))"
    python3 scripts/serve_logprobs_probe.py "$URL" "$OUT/logprobs-gpu.json" >"$OUT/logprobs-gpu.log" 2>&1
    python3 scripts/serve_structured_probe.py "$URL" >"$OUT/structured-gpu.log" 2>&1
    row "  structured output / tool calls, GPU" "$([ $? = 0 ] && echo PASS || echo FAIL) ($(tail -1 "$OUT/structured-gpu.log" | cut -c1-90))"
    stop
    row "  exit code on SIGTERM" "$SRC"
    # logprobs and echo + logprobs (a 400-token prompt: chunks of rows of logits) against the CPU's float mode
    if start tiny-cpu -m "$TOK" --device cpu --cpu-act float; then
        python3 scripts/serve_logprobs_probe.py "$URL" "$OUT/logprobs-cpu.json" "$OUT/logprobs-gpu.json" \
            >"$OUT/logprobs-cpu.log" 2>&1
        row "  logprobs / echo, GPU vs CPU float" "$([ $? = 0 ] && echo PASS || echo FAIL) ($(tail -1 "$OUT/logprobs-cpu.log" | cut -c1-90))"
        stop
    fi
else
    row "default model on the GPU" "FAIL (server did not start)"
fi

# ---- 2. synthetic 30B-A3B shape: load test and prefix reuse -----------------------------------------
[ -n "${SERVE_SKIP_SYN:-}" ] && { printf '%s\n' "${ROWS[@]}"; exit 0; }
SYN="--synthetic nemotron-3-nano-30b-a3b --tokenizer $TOK --chat-template $TMPL --max-seqs 64 --ctx 32768 ${SERVE_ARGS:---kv-cache-tokens 262144}"
if start syn $SYN; then
    if [ -z "${SERVE_ONLY_TURN2:-}" ]; then
        python3 scripts/loadtest.py --url "$URL" --concurrency 1,8,32,64 --requests-per-client "$RPC" \
            --max-tokens "$MT" --prompt-words 64 --json "$OUT/load.json" >"$OUT/load.log" 2>&1
        row "30B synthetic load test (max_tokens $MT)" "rc $? (table below)"
    fi
    python3 scripts/loadtest.py --url "$URL" --turn2 1500 --json "$OUT/turn2-cache.json" >"$OUT/turn2-cache.log" 2>&1
    row "turn 2, prefix cache on" "$(tail -1 "$OUT/turn2-cache.log" | cut -c1-120)"
    curl -s "$URL/metrics" >"$OUT/metrics-syn.txt" 2>/dev/null || true
    stop
fi
if start syn-nocache $SYN --prefix-cache-mb 0; then
    python3 scripts/loadtest.py --url "$URL" --turn2 1500 --json "$OUT/turn2-nocache.json" >"$OUT/turn2-nocache.log" 2>&1
    row "turn 2, prefix cache off" "$(tail -1 "$OUT/turn2-nocache.log" | cut -c1-120)"
    stop
fi
echo
echo "== fp4moe serve on $(nvidia-smi -L | head -1 | cut -c1-40) =="
printf '%s\n' "${ROWS[@]}"
echo
grep -A8 "^| streams" "$OUT/load.log" 2>/dev/null || tail -5 "$OUT/load.log"
echo; head -8 "$OUT/tiny-check.log" 2>/dev/null
grep -h "chatcmpl" "$OUT"/syn*.err | cut -c1-250
grep -h "warm-up" "$OUT"/syn*.err
# the logs in one file (the device tool returns a few files only)
tail -n +1 "$OUT"/*.log "$OUT"/*.err > "$OUT/all-logs.txt" 2>/dev/null
rm -f "$OUT"/tiny.out "$OUT"/syn*.out "$OUT"/turn2-*.json
