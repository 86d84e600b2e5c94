#!/usr/bin/env python3
"""fp4moe serve under a real evaluation client: EleutherAI's lm-evaluation-harness (`local-completions`).

    build/mlx-venv/bin/python scripts/check_lm_eval.py build/fp4moe [--venv DIR]

Installs lm-eval[api] (pinned below, from PyPI) into its own venv (DIR, default build/lm-eval-venv; kept), starts
`fp4moe serve` on the default model (--cpu-act float: fp32 logits equal to mlx-lm's), and runs two local tasks made
from tests/golden/default/heldout_short.txt through lm-eval:
  fp4moe_mc    multiple_choice, 24 docs: a 20-word context and four 5-word continuations (one true) -> acc
               (lm-eval's loglikelihood requests: echo, logprobs 1, max_tokens 1, token-id prompts)
  fp4moe_roll  loglikelihood_rolling, 4 docs of ~250 words -> word_perplexity, bits_per_byte
lm-eval finds the server's tokenizer through vLLM's /tokenizer_info and /tokenize (its remote tokenizer backend);
fp4moe_mc runs a second time with --batch_size 4 (four prompts a request).
Then mlx-lm (the project venv) computes every request's loglikelihood itself (the same token ids: the server's
tokenizer equals HF's, tests/tokenizer) and the script compares them per request, and the metrics.
Exit 0 when every loglikelihood agrees within 1e-3 nats (a document's sum: 1e-3 x its tokens) and the is_greedy flags
agree. Not a ctest: it downloads lm-eval.
"""
import argparse
import glob
import json
import os
import random
import re
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "nemotron-h-tiny-moe")
LM_EVAL = "lm-eval[api]==0.4.13"


def make_tasks(d):
    lines = [l for l in open(os.path.join(ROOT, "tests", "golden", "default", "heldout_short.txt"),
                              encoding="utf-8").read().split("\n") if l.strip()]
    words = " ".join(lines).split()
    rng = random.Random(3)
    with open(os.path.join(d, "mc.jsonl"), "w") as f:
        for _ in range(24):
            s = rng.randrange(0, len(words) - 40)
            true = " ".join(words[s + 20:s + 25])
            ch = [true]
            while len(ch) < 4:
                t = rng.randrange(0, len(words) - 6)
                if abs(t - (s + 20)) > 10:
                    ch.append(" ".join(words[t:t + 5]))
            rng.shuffle(ch)
            f.write(json.dumps({"context": " ".join(words[s:s + 20]), "choices": ch, "label": ch.index(true)}) + "\n")
    with open(os.path.join(d, "roll.jsonl"), "w") as f:
        for _ in range(4):   # whole lines (the model was trained on text with its line breaks)
            s = rng.randrange(0, len(lines) - 30)
            f.write(json.dumps({"text": "\n".join(lines[s:s + 24])}) + "\n")
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: %s\ntest_split: test\n"
    with open(os.path.join(d, "fp4moe_mc.yaml"), "w") as f:
        f.write("task: fp4moe_mc\n" + common % os.path.join(d, "mc.jsonl") +
                'output_type: multiple_choice\ndoc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\n'
                'doc_to_target: "{{label}}"\nmetric_list:\n  - metric: acc\n')
    with open(os.path.join(d, "fp4moe_roll.yaml"), "w") as f:
        f.write("task: fp4moe_roll\n" + common % os.path.join(d, "roll.jsonl") +
                'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
                "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("fp4moe")
    ap.add_argument("--venv", default=os.path.join(ROOT, "build", "lm-eval-venv"))
    a = ap.parse_args()
    lm_eval = os.path.join(a.venv, "bin", "lm_eval")
    if not os.path.exists(lm_eval):
        print("check_lm_eval: installing %s into %s" % (LM_EVAL, a.venv), flush=True)
        subprocess.run([sys.executable, "-m", "venv", a.venv], check=True)
        subprocess.run([os.path.join(a.venv, "bin", "pip"), "install", "-q", LM_EVAL], check=True)
    tmp = tempfile.mkdtemp(prefix="fp4moe-lm-eval-")
    make_tasks(tmp)
    errf = open(os.path.join(tmp, "serve.err"), "w")
    srv = subprocess.Popen([a.fp4moe, "serve", "-m", MODEL, "--port", "0", "--cpu-act", "float", "-q"],
                           stdout=subprocess.PIPE, stderr=errf, text=True)
    m = re.search(r"listening on (http://\S+)", srv.stdout.readline())
    if not m:
        srv.kill()
        sys.exit("check_lm_eval: the server did not start (%s)" % os.path.join(tmp, "serve.err"))
    url = m.group(1)
    try:
        env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
        args = ["--model", "local-completions", "--model_args",
                "model=nemotron-h-tiny-moe,base_url=%s/v1/completions,tokenized_requests=True,num_concurrent=4,"
                "max_length=512,max_retries=1" % url, "--include_path", tmp, "--log_samples"]
        run = subprocess.run([lm_eval, *args, "--tasks", "fp4moe_mc,fp4moe_roll", "--output_path",
                              os.path.join(tmp, "out")], capture_output=True, text=True, env=env)
        # the multiple-choice task again with --batch_size 4: four prompts a request (a list of prompts)
        run_b = subprocess.run([lm_eval, *args, "--tasks", "fp4moe_mc", "--batch_size", "4", "--output_path",
                                os.path.join(tmp, "out-b4")], capture_output=True, text=True, env=env)
    finally:
        srv.terminate()
        srv.wait(timeout=30)
    for r in (run, run_b):
        if r.returncode:
            print(r.stdout[-3000:], r.stderr[-3000:])
            sys.exit("check_lm_eval: lm_eval failed (exit %d)" % r.returncode)
    tokenizer_line = [l for l in run.stderr.split("\n") if "tokenizer" in l.lower()][:2]

    import mlx.core as mx
    import mlx_lm
    model, tok = mlx_lm.load(MODEL)
    model.set_dtype(mx.float32)

    def logprob_rows(ids):
        lg = np.array(model(mx.array([ids]))[0].astype(mx.float32)).astype(np.float64)
        return lg - (lg.max(1, keepdims=True) + np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1, keepdims=True)))

    def score(ctx, cont):   # lm-eval's loglikelihood of cont after ctx, and its is_greedy
        L = logprob_rows(ctx + cont)
        lp = [L[len(ctx) - 1 + i, t] for i, t in enumerate(cont)]
        return sum(lp), all(int(np.argmax(L[len(ctx) - 1 + i])) == t for i, t in enumerate(cont))

    def enc(s):
        return tok.encode(s, add_special_tokens=False)

    res = json.load(open(glob.glob(os.path.join(tmp, "out", "*", "results_*.json"))[0]))["results"]
    worst, greedy_diff, n_req = 0.0, 0, 0
    acc_ref, nll, words, nbytes = [], 0.0, 0, 0
    for f in sorted(glob.glob(os.path.join(tmp, "out", "*", "samples_*.jsonl"))):
        for d in map(json.loads, open(f)):
            if "fp4moe_mc" in f:
                lls = []
                for k, r in enumerate(d["resps"]):
                    a_ = d["arguments"]["gen_args_%d" % k]
                    ctx_ids = enc(a_["arg_0"])    # lm-eval's _encode_pair: the whole minus the context's tokens
                    whole = enc(a_["arg_0"] + a_["arg_1"])
                    ll, gr = score(ctx_ids, whole[len(ctx_ids):])
                    worst = max(worst, abs(ll - float(r[0][0])) / max(1, len(whole) - len(ctx_ids)))
                    greedy_diff += gr != (r[0][1] in (True, "True"))
                    lls.append(ll)
                    n_req += 1
                acc_ref.append(int(np.argmax(lls)) == int(d["target"]))
            else:
                text = d["arguments"]["gen_args_0"]["arg_0"]
                ids = enc(text)   # one window (max_length 512), prefix: the BOS the server's /tokenizer_info names
                ll, _ = score([1], ids)
                worst = max(worst, abs(ll - float(d["resps"][0][0])) / len(ids))
                n_req += 1
                nll -= ll
                words += len(re.split(r"\s+", text))
                nbytes += len(text.encode("utf-8"))
    ref_wppl, ref_bpb = float(np.exp(nll / words)), nll / nbytes / np.log(2)
    # --batch_size 4 against the first run, request by request
    first = {d["doc_id"]: d["resps"] for d in map(json.loads, open(glob.glob(os.path.join(tmp, "out", "*",
                                                                                 "samples_fp4moe_mc_*.jsonl"))[0]))}
    b4 = [json.loads(l) for l in open(glob.glob(os.path.join(tmp, "out-b4", "*", "samples_fp4moe_mc_*.jsonl"))[0])]
    b4_diff = max(abs(float(x[0][0]) - float(y[0][0])) for d in b4 for x, y in zip(d["resps"], first[d["doc_id"]]))
    acc_b4 = json.load(open(glob.glob(os.path.join(tmp, "out-b4", "*", "results_*.json"))[0]))["results"]["fp4moe_mc"]["acc,none"]
    got = res["fp4moe_mc"]["acc,none"], res["fp4moe_roll"]["word_perplexity,none"], res["fp4moe_roll"]["bits_per_byte,none"]
    print("\n".join(tokenizer_line))
    print("| metric | lm-eval through fp4moe serve | mlx-lm on the same requests |")
    print("|---|---:|---:|")
    print("| fp4moe_mc acc (24 docs, 96 loglikelihood requests) | %.4f | %.4f |" % (got[0], np.mean(acc_ref)))
    print("| fp4moe_roll word_perplexity (4 docs) | %.4f | %.4f |" % (got[1], ref_wppl))
    print("| fp4moe_roll bits_per_byte | %.5f | %.5f |" % (got[2], ref_bpb))
    print("| fp4moe_mc acc with --batch_size 4 (lists of 4 prompts) | %.4f | |" % acc_b4)
    print("requests compared: %d; max |loglikelihood difference| per token %.2e nats; is_greedy flags differing: %d; "
          "--batch_size 4 against the first run: max |loglikelihood difference| %.2e nats" % (n_req, worst, greedy_diff,
                                                                                              b4_diff))
    ok = worst <= 1e-3 and greedy_diff == 0 and abs(got[0] - np.mean(acc_ref)) < 1e-9 and acc_b4 == got[0] and \
        b4_diff <= 1e-3
    print("check_lm_eval: %s" % ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
