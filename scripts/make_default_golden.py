#!/usr/bin/env python3
"""transformers references for the default model (tests/model/test_default_model.c).

The default model models/nemotron-h-tiny-moe is MLX nvfp4 (scripts/make_default_model.sh). This
script decodes its NVFP4 weights in numpy (spec NVFP4.md sections 1-2: E2M1 codes x E4M3 block
scales, no global scale), unstacks the experts (switch_mlp.fc1/fc2 -> experts.{e}.up/down_proj),
puts them into transformers' NemotronHForCausalLM built from the bf16 original's config.json, and
runs it in fp32 on the CPU with eager attention. So transformers and fp4moe compute with the SAME
weights; only the arithmetic differs.

  golden   writes OUT/reference.json and OUT/heldout_short.txt:
           - a fixed English prompt (tokenized with HF tokenizers from the model's tokenizer.json),
             long enough that fp4moe's prefill sorts the MoE rows and takes the expert-batched
             route (tokens x top-k >= 64), and its 32-token greedy continuation, computed by FULL
             RECOMPUTE each step (use_cache=False): transformers 5.17 clamps dt to >= time_step_min
             in its chunked scan but not in its one-token cached update; fp4moe clamps in both.
             The smallest top-1 / top-2 logit gap over the 32 steps is recorded (the test's margin).
           - the first --short-chars characters of the held-out text (the last 1% of the corpus)
             and the perplexity of it under fp4moe's rule (`fp4moe perplexity`, llama.cpp's):
             non-overlapping windows of --ctx tokens, no BOS, tail dropped, each window from an
             empty state; positions ctx/2 .. ctx-2 predict the next token; ppl = exp(mean NLL).
  ppl      prints the perplexity JSON of a text file under the same rule, for the dequantized
           NVFP4 weights (--weights nvfp4) or the bf16 original (--weights bf16), optionally on the
           first --max-tokens tokens only (used for MODEL.md).

Usage (CPU; /root/venv-train has torch 2.11, transformers 5.17.0, tokenizers, safetensors):
  /root/venv-train/bin/python scripts/make_default_golden.py golden \
      --corpus ../shared/corpus/gutenberg-en-100M.txt.xz          (about a minute)
  /root/venv-train/bin/python scripts/make_default_golden.py ppl --file heldout.txt --weights bf16
"""
import argparse
import json
import lzma
import math
import os
import time

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import NemotronHConfig, NemotronHForCausalLM

PROMPT = ("The old miller lived with his three sons in a small house at the edge of the forest. "
          "Every morning he walked down to the river, and every evening he sat by the fire and told "
          "them stories of the king and the")
GEN_LEN = 32

# ---- NVFP4 decoding (spec NVFP4.md section 1 and 2, MLX layout) ----------------------------------

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def e4m3_table():
    """Values of all 256 E4M3 bytes (0x7F/0xFF: NaN)."""
    out = np.zeros(256, dtype=np.float32)
    for b in range(256):
        e, m = (b >> 3) & 15, b & 7
        v = m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        out[b] = -v if b & 0x80 else v
        if b & 0x7F == 0x7F:
            out[b] = np.nan
    return out


E4M3 = e4m3_table()


def dequantize_mlx(words, scales):
    """MLX nvfp4: U32 words (..., N, K/8) + U8 scales (..., N, K/16) -> float32 (..., N, K).
    Bytes are little-endian; byte b holds element 2b in its low nibble, 2b+1 in its high nibble."""
    b = np.ascontiguousarray(words).view(np.uint8)             # (..., N, K/2)
    codes = np.stack([b & 15, b >> 4], axis=-1).reshape(*b.shape[:-1], -1)
    s = np.repeat(E4M3[scales], 16, axis=-1)
    w = E2M1[codes] * s
    if not np.isfinite(w).all():
        raise ValueError("NaN scale byte in the checkpoint")
    return w.astype(np.float32)


def mlx_to_hf_state(model_dir):
    """The MLX nvfp4 checkpoint as a transformers state dict (HF names, unstacked experts, fp32)."""
    from safetensors.torch import load_file as load_torch          # numpy cannot hold bf16
    t = {k: (v.float() if v.dtype in (torch.bfloat16, torch.float16) else v).numpy()
         for k, v in load_torch(os.path.join(model_dir, "model.safetensors")).items()}
    out = {}
    for name, v in t.items():
        if name.endswith(".scales"):
            continue
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base and base + ".scales" in t:
            w = dequantize_mlx(v, t[base + ".scales"])
            if ".switch_mlp." in base:                                    # (E, N, K) stacked experts
                prefix, fc = base.split(".switch_mlp.")
                proj = {"fc1": "up_proj", "fc2": "down_proj"}[fc]
                for e in range(w.shape[0]):
                    out[f"{prefix}.experts.{e}.{proj}.weight"] = w[e]
                continue
            out[name] = w
        elif "conv1d.weight" in name and v.shape[-1] == 1:               # MLX (C, Kc, 1) -> (C, 1, Kc)
            out[name] = np.transpose(v.astype(np.float32), (0, 2, 1))
        else:
            out[name] = v.astype(np.float32)
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in out.items()}


def bf16_state(model_dir):
    from safetensors.torch import load_file as load_torch
    out = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            out.update({k: v.float() for k, v in load_torch(os.path.join(model_dir, f)).items()})
    return out


def to_internal_names(state):
    """Checkpoint names (backbone.*, experts.{e}.up_proj.weight) -> transformers 5.17's module names
    (model.*, experts stacked as experts.up_proj (E, I, H) / experts.down_proj (E, H, I))."""
    out, experts = {}, {}
    for k, v in state.items():
        parts = k.split(".")
        if "experts" in parts and parts[-1] == "weight" and parts[-3].isdigit():
            experts.setdefault((".".join(parts[:-3]), parts[-2]), {})[int(parts[-3])] = v
            continue
        out[k.replace("backbone.", "model.", 1)] = v
    for (base, proj), d in experts.items():
        out[f"{base.replace('backbone.', 'model.', 1)}.{proj}"] = torch.stack([d[e] for e in sorted(d)])
    return out


def build_model(config_dir, state):
    """NemotronHForCausalLM (fp32, eager attention, stock torch Mamba path) holding exactly the given
    HF-named weights (load_state_dict strict: every parameter and buffer, nothing left over)."""
    cfg = NemotronHConfig.from_pretrained(config_dir)
    cfg._attn_implementation = "eager"
    cfg.use_mamba_kernels = False
    model = NemotronHForCausalLM(cfg).float().eval()
    internal = to_internal_names(state)
    model.load_state_dict(internal, strict=True)
    return model, len(internal)


# ---- references -----------------------------------------------------------------------------------

@torch.no_grad()
def greedy_full_recompute(model, prompt, n):
    seq, margins = list(prompt), []
    for _ in range(n):
        lg = model(torch.tensor([seq]), use_cache=False).logits[0, -1].float()
        top2 = torch.topk(lg, 2).values
        margins.append(float(top2[0] - top2[1]))
        seq.append(int(torch.argmax(lg)))
    return seq[len(prompt):], margins


@torch.no_grad()
def perplexity(model, ids, ctx, max_tokens=0, log_every=0):
    """fp4moe's rule (src/cli/cmd_perplexity.c): windows of ctx tokens, positions ctx/2..ctx-2 scored;
    also every position 0..ctx-2 ("all")."""
    if max_tokens:
        ids = ids[:max_tokens]
    windows = len(ids) // ctx
    half, half_sq, n_half, all_, n_all = 0.0, 0.0, 0, 0.0, 0
    t0 = time.time()
    for w in range(windows):
        x = torch.tensor([ids[w * ctx:(w + 1) * ctx]])
        logp = torch.log_softmax(model(x, use_cache=False).logits[0].double(), dim=-1)
        nll = -logp[:-1].gather(1, x[0, 1:, None]).squeeze(1)             # position j predicts j+1
        all_ += float(nll.sum())
        n_all += nll.numel()
        h = nll[ctx // 2:]
        half += float(h.sum())
        half_sq += float((h * h).sum())
        n_half += h.numel()
        if log_every and (w + 1) % log_every == 0:
            print(f"  window {w + 1}/{windows}: ppl {math.exp(half / n_half):.4f} "
                  f"({time.time() - t0:.0f} s)", flush=True)
    mean = half / n_half
    var = half_sq / n_half - mean * mean
    return dict(ctx=ctx, windows=windows, tokens_scored=n_half, nll=mean, ppl=math.exp(mean),
                ppl_stderr=math.exp(mean) * math.sqrt(max(var, 0) / (n_half - 1)),
                tokens_scored_all=n_all, nll_all=all_ / n_all, ppl_all=math.exp(all_ / n_all),
                seconds=round(time.time() - t0, 1))


def heldout_text(corpus):
    """The last 1% (len // 100 characters) of the corpus, as scripts/train_default_model.py cuts it."""
    opener = lzma.open if corpus.endswith(".xz") else open
    with opener(corpus, "rt", encoding="utf-8", newline="") as f:
        text = f.read()
    return text[len(text) - len(text) // 100:]


def cut_at_line(text, n_chars):
    """The first n_chars characters, extended to the end of that line."""
    end = text.find("\n", n_chars)
    return text[: end + 1 if end >= 0 else len(text)]


def cmd_golden(a):
    torch.manual_seed(0)
    tok = Tokenizer.from_file(os.path.join(a.model, "tokenizer.json"))
    state = mlx_to_hf_state(a.model)
    model, n = build_model(a.config, state)
    print(f"transformers model with {n} parameter tensors from {a.model} (dequantized NVFP4)")

    prompt = tok.encode(PROMPT, add_special_tokens=False).ids
    topk = model.config.num_experts_per_tok
    assert len(prompt) * topk >= 64, "prompt too short for the expert-batched prefill route"
    t0 = time.time()
    gen, margins = greedy_full_recompute(model, prompt, GEN_LEN)
    print(f"prompt {len(prompt)} tokens; greedy {GEN_LEN} tokens in {time.time() - t0:.1f} s, "
          f"min top-1/top-2 logit gap {min(margins):.4f}")
    print("continuation:", repr(tok.decode(gen)))

    short = cut_at_line(heldout_text(a.corpus), a.short_chars)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "heldout_short.txt"), "w", encoding="utf-8", newline="") as f:
        f.write(short)
    ids = tok.encode(short, add_special_tokens=False).ids
    ppl = perplexity(model, ids, a.ctx)
    print(f"heldout_short.txt: {len(short)} chars, {len(ids)} tokens; ppl {ppl['ppl']:.6f} "
          f"(ctx {a.ctx}, {ppl['windows']} windows, {ppl['tokens_scored']} scored), "
          f"ppl_all {ppl['ppl_all']:.6f}")

    ref = dict(
        note="transformers NemotronHForCausalLM (fp32, eager attention, CPU) on the dequantized NVFP4 "
             "weights of models/nemotron-h-tiny-moe; made by scripts/make_default_golden.py",
        transformers=__import__("transformers").__version__, torch=torch.__version__,
        prompt=PROMPT, prompt_ids=prompt, gen_ids=gen, gen_text=tok.decode(gen),
        greedy="full recompute each step (use_cache=False), argmax (lowest id on ties)",
        min_greedy_margin=min(margins), greedy_margins=[round(m, 5) for m in margins],
        perplexity=dict(file="heldout_short.txt", chars=len(short), text_tokens=len(ids),
                        rule="fp4moe perplexity: non-overlapping windows of ctx tokens, no BOS; "
                             "positions ctx/2..ctx-2 predict the next token", **ppl))
    with open(os.path.join(a.out, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")
    print(f"wrote {a.out}/reference.json and {a.out}/heldout_short.txt")


def cmd_ppl(a):
    tok = Tokenizer.from_file(os.path.join(a.model, "tokenizer.json"))
    state = mlx_to_hf_state(a.model) if a.weights == "nvfp4" else bf16_state(a.config)
    model, _ = build_model(a.config, state)
    with open(a.file, encoding="utf-8", newline="") as f:
        ids = tok.encode(f.read(), add_special_tokens=False).ids
    torch.set_num_threads(a.threads) if a.threads else None
    r = perplexity(model, ids, a.ctx, a.max_tokens, log_every=20)
    r.update(weights=a.weights, file=a.file, text_tokens=len(ids), max_tokens=a.max_tokens,
             engine=f"transformers {__import__('transformers').__version__} fp32 CPU, eager attention",
             threads=torch.get_num_threads())
    print(json.dumps(r, indent=1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("golden", "ppl"):
        p = sub.add_parser(name)
        p.add_argument("--model", default="models/nemotron-h-tiny-moe", help="MLX nvfp4 model dir")
        p.add_argument("--config", default="models/nemotron-h-tiny-moe-bf16",
                       help="bf16 original (config.json; its weights for ppl --weights bf16)")
        p.add_argument("--ctx", type=int, default=256 if name == "golden" else 512)
    g = sub.choices["golden"]
    g.add_argument("--corpus", default="../shared/corpus/gutenberg-en-100M.txt.xz")
    g.add_argument("--short-chars", type=int, default=4000)
    g.add_argument("--out", default="tests/golden/default")
    p = sub.choices["ppl"]
    p.add_argument("--file", required=True)
    p.add_argument("--weights", choices=("nvfp4", "bf16"), default="nvfp4")
    p.add_argument("--max-tokens", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    cmd_golden(a) if a.cmd == "golden" else cmd_ppl(a)


if __name__ == "__main__":
    main()
