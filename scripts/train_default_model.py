#!/usr/bin/env python3
"""Train fp4moe's small default model: a nemotron_h MoE (transformers NemotronHForCausalLM).

Runs on one GPU (the H200 of the device machine) in a single call with a hard wall-clock cap;
also runs on the CPU at toy scale (--device cpu --max-steps 3 ...) to check the script.

What it does, in order:
  1. Reads the corpus (gutenberg-en-100M.txt.xz). Held-out = the last 1% of the characters
     (n_held = len // 100), never trained on. Of the rest, the last --val-chars characters are a
     validation slice (monitoring only, not trained on); the remainder is the training text.
  2. Tokenizes with the carried tokenizer.json (byte-level BPE made by scripts/train_tokenizer.py);
     no BOS/EOS: the model learns a plain token stream.
  3. Builds NemotronHForCausalLM from CONFIG (every layer type: Mamba-2, attention, MoE, dense MLP),
     fixed seed, fp32 master weights, bf16 autocast, AdamW, linear warm-up + cosine decay to 10%.
     The cosine length is fitted to the wall-clock cap from the measured step time.
  4. Router balancing: transformers keeps `gate.e_score_correction_bias` as a buffer that no gradient
     touches (zeros at init). We run DeepSeek-V3's auxiliary-loss-free balancing: after each optimizer
     step, bias_e += gamma * sign(mean_load - load_e) per MoE layer (load = routed (token, slot) pairs in
     that step). The bias is used only to CHOOSE experts, exactly as in the forward pass. So the saved
     bias is non-zero and the choice path is exercised.
  5. Training-only speed-ups, each checked against the transformers code on random data at start
     (falls back to the stock path if the check fails):
       - the Mamba-2 chunked scan (transformers' pure-PyTorch `mamba2_chunk_scan`, which materialises
         (b, chunks, l, l, heads, state) products) is replaced during training by the same SSD math
         written with einsum (fp32, autocast off);
       - experts run through transformers' own `grouped_mm` path with the fp32 master weights cast to
         bf16 (grouped_mm is not autocast-aware).
     Evaluation and generation below use the unpatched transformers model loaded from the saved files.
  6. Saves with save_pretrained (bf16 weights; the correction bias stays fp32 as transformers keeps it),
     shards <= --max-shard-mb, then post-edits config.json so every field of NEMOTRON_H.md is present
     (hybrid_override_pattern, num_hidden_layers, time_step_limit as {"__float__": "Infinity"}).
  7. Reloads the saved model in bf16 (transformers, stock code) and measures held-out perplexity:
     the held-out text is tokenized as one string, cut into consecutive non-overlapping windows of
     --eval-ctx tokens (the tail shorter than a window is dropped), each window evaluated on its own
     with no BOS. ppl_all = exp(mean NLL over positions 1..ctx-1 of every window, i.e. every token
     but each window's first); ppl_second_half = llama.cpp's perplexity rule (only the last ctx/2-1
     predictions of each window). Also per-expert routing counts over the held-out windows.
  8. Greedy-generates --gen-tokens tokens from a few English prompts.
  9. Writes train_log.json (config, loss curve, tokens seen, throughput, ppl, samples, expert usage).

Usage (device):  PYTHONUNBUFFERED=1 python3 scripts/train_default_model.py --corpus .train/gutenberg-en-100M.txt.xz \
                   --tokenizer models/nemotron-h-tiny-moe/tokenizer.json --out $OUT/hf --train-seconds 400
Usage (CPU toy): python3 scripts/train_default_model.py --device cpu --max-steps 3 --seq-len 64 --batch 2 \
                   --max-train-chars 2000000 --eval-ctx 64 --eval-max-windows 4 --gen-tokens 8 --out /tmp/x
"""
import argparse
import json
import math
import os
import sys
import time
import types

import numpy as np
import torch
import torch.nn.functional as F

T_START = time.time()

# ---------------------------------------------------------------------------------------------
# The model. Every matrix dimension is a multiple of 16 (NVFP4 blocks of 16 along K).
# ---------------------------------------------------------------------------------------------
PATTERN = "MEM*EMEM-E"  # 4 Mamba-2, 4 MoE, 1 attention, 1 dense MLP
CONFIG = dict(
    architectures=["NemotronHForCausalLM"],
    model_type="nemotron_h",
    vocab_size=8192,
    hidden_size=384,
    hybrid_override_pattern=PATTERN,
    num_hidden_layers=len(PATTERN),
    layer_norm_epsilon=1e-5,
    tie_word_embeddings=False,
    # Mamba-2: d_inner = 16 * 48 = 768 = 2 * hidden; in_proj rows 2*768 + 2*2*64 + 16 = 1808
    mamba_num_heads=16,
    mamba_head_dim=48,
    ssm_state_size=64,
    n_groups=2,
    conv_kernel=4,
    expand=2,
    chunk_size=64,
    use_conv_bias=True,
    mamba_proj_bias=False,
    use_bias=False,
    mamba_hidden_act="silu",
    time_step_min=0.001,
    time_step_max=0.1,
    time_step_floor=1e-4,
    # trained through transformers' chunked path, which clamps dt >= time_step_min: declared as the
    # limit so that fp4moe, mlx-lm and vLLM (which apply time_step_limit) compute the trained model
    time_step_limit=[0.001, float("inf")],
    mamba_ssm_cache_dtype="float32",
    # attention: GQA 6 query heads over 2 KV heads, head_dim 64, no RoPE
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    attention_bias=False,
    max_position_embeddings=4096,
    # MoE: 32 routed experts, top-4, one shared expert, sigmoid router + correction bias
    n_routed_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=96,
    n_shared_experts=1,
    moe_shared_expert_intermediate_size=384,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    moe_latent_size=None,
    # dense MLP (relu^2)
    intermediate_size=1536,
    mlp_hidden_act="relu2",
    mlp_bias=False,
    residual_in_fp32=False,
    rescale_prenorm_residual=True,
    initializer_range=0.02,
    num_logits_to_keep=1,
    use_cache=True,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

PROMPTS = [
    "Once upon a time there was a little rabbit who",
    "The old man looked at the sea and said",
    "It was a dark and stormy night, and",
]


def log(msg):
    print(f"[{time.time() - T_START:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------
def read_corpus(path):
    if path.endswith(".xz"):
        import lzma
        opener = lzma.open
    else:
        opener = open
    with opener(path, "rt", encoding="utf-8", newline="") as f:
        return f.read()


def split_text(text, val_chars):
    """held-out = last 1% (len // 100 chars); val = the val_chars before it; train = the rest."""
    n_held = len(text) // 100
    rest, held = text[: len(text) - n_held], text[len(text) - n_held:]
    return rest[: len(rest) - val_chars], rest[len(rest) - val_chars:], held


def newline_chunks(text, size=1 << 16):
    out, i = [], 0
    while i < len(text):
        j = min(len(text), i + size)
        if j < len(text):
            k = text.rfind("\n", i, j)
            if k > i:
                j = k + 1
        out.append(text[i:j])
        i = j
    return out


def tokenize_stream(tok, text):
    """Token ids of `text` as one int32 array (encoded in newline-cut pieces, in parallel)."""
    encs = tok.encode_batch(newline_chunks(text), add_special_tokens=False)
    return np.concatenate([np.asarray(e.ids, dtype=np.int32) for e in encs])


# ---------------------------------------------------------------------------------------------
# Training-only fast paths (checked against the stock transformers functions at start)
# ---------------------------------------------------------------------------------------------
def make_einsum_chunk_scan(mod):
    """Return a drop-in for modeling_nemotron_h.mamba2_chunk_scan: the same SSD (Mamba-2) chunked
    scan (Dao & Gu 2024, 'ssd_minimal'), with einsum contractions instead of broadcast products,
    in fp32 with autocast off. Falls back to the stock function for cache use (initial/final states)."""
    orig = mod.mamba2_chunk_scan
    segment_sum = mod.segment_sum

    def scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
             dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
        if initial_states is not None or return_final_states:
            return orig(hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias,
                        initial_states=initial_states, dt_softplus=dt_softplus, dt_limit=dt_limit,
                        return_final_states=return_final_states, **kwargs)
        with torch.autocast(device_type=hidden_states.device.type, enabled=False):
            b, L, h, p = hidden_states.shape
            g, n = B.shape[2], B.shape[3]
            r = h // g
            dt = dt.float()
            if dt_bias is not None:
                dt = dt + dt_bias.float()
            if dt_softplus:
                dt = F.softplus(dt)
            dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
            x = hidden_states.float()
            pad = (chunk_size - L % chunk_size) % chunk_size
            c = (L + pad) // chunk_size
            X = F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad))               # (b, L', h, p)
            Adt = F.pad(A.float()[None, None, :] * dt, (0, 0, 0, pad))         # (b, L', h)
            Bc = F.pad(B.float(), (0, 0, 0, 0, 0, pad)).view(b, c, chunk_size, g, n)
            Cc = F.pad(C.float(), (0, 0, 0, 0, 0, pad)).view(b, c, chunk_size, g, n)
            Xc = X.view(b, c, chunk_size, g, r, p)
            Ac = Adt.view(b, c, chunk_size, h).permute(0, 3, 1, 2)              # (b, h, c, l)
            A_cumsum = torch.cumsum(Ac, dim=-1)
            # 1. intra-chunk (diagonal blocks)
            Lm = torch.exp(segment_sum(Ac)).view(b, g, r, c, chunk_size, chunk_size)  # (b,g,r,c,l,s)
            CB = torch.einsum("bclgn,bcsgn->bgcls", Cc, Bc)
            W = CB[:, :, None] * Lm                                             # (b,g,r,c,l,s)
            Y_diag = torch.einsum("bgrcls,bcsgrp->bclgrp", W, Xc)
            # 2. state at the end of each chunk
            decay_states = torch.exp(A_cumsum[..., -1:] - A_cumsum).view(b, g, r, c, chunk_size)
            states = torch.einsum("bclgn,bgrcl,bclgrp->bcgrpn", Bc, decay_states, Xc)
            states = states.reshape(b, c, h, p, n)
            # 3. inter-chunk recurrence
            states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
            decay_chunk = torch.exp(segment_sum(F.pad(A_cumsum[:, :, :, -1], (1, 0))))  # (b,h,c+1,c+1)
            states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)[:, :-1]
            # 4. state -> output
            state_decay_out = torch.exp(A_cumsum).view(b, g, r, c, chunk_size)
            Y_off = torch.einsum("bclgn,bcgrpn,bgrcl->bclgrp", Cc, states.view(b, c, g, r, p, n),
                                 state_decay_out)
            y = (Y_diag + Y_off).reshape(b, c * chunk_size, h, p)
            if D is not None:
                y = y + D.float()[:, None] * F.pad(x, (0, 0, 0, 0, 0, pad))
            return y[:, :L]

    return scan


def grouped_mm_bf16_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' grouped_mm experts path, with fp32 master weights cast to bf16 under autocast."""
    from transformers.integrations.moe import grouped_mm_experts_forward
    dev = hidden_states.device.type
    if torch.is_autocast_enabled(dev) and self.up_proj.dtype == torch.float32:
        shim = types.SimpleNamespace(
            num_experts=self.num_experts, has_gate=False, has_bias=False, is_transposed=False,
            act_fn=self.act_fn, up_proj=self.up_proj.to(torch.bfloat16),
            down_proj=self.down_proj.to(torch.bfloat16))
        return grouped_mm_experts_forward(shim, hidden_states.to(torch.bfloat16), top_k_index, top_k_weights)
    return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / (b.float().norm() + 1e-30)).item()


def check_scan(mod, fast, device):
    """Compare fast vs stock chunk scan on random inputs (fp32, TF32 off): forward and input gradients."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        return _check_scan(mod, fast, device)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.set_float32_matmul_precision("high" if tf32 else "highest")


def _check_scan(mod, fast, device):
    g = torch.Generator(device="cpu").manual_seed(123)
    b, L, h, p, gr, n, cs = 2, 150, 8, 16, 2, 16, 32
    mk = lambda *s: torch.randn(*s, generator=g).to(device)
    x, dt, B, C = mk(b, L, h, p), mk(b, L, h), mk(b, L, gr, n), mk(b, L, gr, n)
    A = -torch.exp(mk(h) * 0.5)
    D, dtb = mk(h), mk(h)
    outs = []
    for fn in (mod.mamba2_chunk_scan, fast):
        xi = x.clone().requires_grad_(True)
        Bi = B.clone().requires_grad_(True)
        y = fn(xi, dt, A, Bi, C, cs, D=D, dt_bias=dtb, dt_softplus=True, dt_limit=(0.001, float("inf")))
        (y * torch.linspace(-1, 1, y.numel(), device=device).view_as(y)).sum().backward()
        outs.append((y.detach(), xi.grad, Bi.grad))
    return max(rel_err(outs[1][i], outs[0][i]) for i in range(3))


# ---------------------------------------------------------------------------------------------
# Routing statistics and the auxiliary-loss-free balancing bias
# ---------------------------------------------------------------------------------------------
class RouterStats:
    """Forward hooks on every MoE gate: per-layer counts of routed (token, slot) pairs per expert."""

    def __init__(self, model, n_experts):
        self.gates = [(i, blk.mixer.gate) for i, blk in enumerate(model.model.layers) if blk.block_type == "moe"]
        self.n = n_experts
        self.step_counts = {}
        self.handles = [gate.register_forward_hook(self._hook(i)) for i, gate in self.gates]

    def _hook(self, layer):
        def hook(module, inputs, output):
            idx = output[2].detach().reshape(-1)
            cnt = torch.bincount(idx, minlength=self.n).to(torch.float32)
            self.step_counts[layer] = self.step_counts.get(layer, 0) + cnt
        return hook

    def take(self):
        c, self.step_counts = self.step_counts, {}
        return c

    def remove(self):
        for h in self.handles:
            h.remove()


# ---------------------------------------------------------------------------------------------
def build_model(args, device):
    from transformers import NemotronHConfig, NemotronHForCausalLM
    cfg = dict(CONFIG)
    cfg.pop("architectures"), cfg.pop("model_type")
    config = NemotronHConfig(**cfg)
    torch.manual_seed(args.seed)
    model = NemotronHForCausalLM(config).to(device)
    return model


def check_dims(model):
    bad = [(n, tuple(p.shape)) for n, p in model.named_parameters()
           if p.dim() >= 2 and "conv1d" not in n and any(d % 16 for d in p.shape[-2:])]
    return bad


def count_params(model):
    total = sum(p.numel() for p in model.parameters())
    c = CONFIG
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    per_expert = experts // (c["n_routed_experts"] * PATTERN.count("E"))
    active = total - experts + per_expert * c["num_experts_per_tok"] * PATTERN.count("E")
    emb = c["vocab_size"] * c["hidden_size"]
    return dict(total=total, routed_experts=experts, active_per_token=active, embedding=emb, lm_head=emb,
                non_embedding=total - 2 * emb)


def param_groups(model, wd):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if p.dim() >= 2 and "conv1d" not in n:
            decay.append(p)
        else:
            no_decay.append(p)   # norms, A_log, D, dt_bias, conv1d, biases
    return [dict(params=decay, weight_decay=wd), dict(params=no_decay, weight_decay=0.0)]


def lr_at(step, total, warmup, peak, floor_frac):
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor_frac + (1 - floor_frac) * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def window_nll(model, ids, ctx, batch, device, autocast, stats=None):
    """Sum of NLL (nats) and counts over consecutive non-overlapping windows of ctx tokens.
    Returns (nll_all, n_all, nll_half, n_half): 'all' = every position but each window's first;
    'half' = llama.cpp's rule, predictions from position ctx/2 on (ctx/2 - 1 per window)."""
    nw = len(ids) // ctx
    w = torch.as_tensor(ids[: nw * ctx].astype(np.int64)).view(nw, ctx)
    tot = [0.0, 0, 0.0, 0]
    first = ctx // 2
    for i in range(0, nw, batch):
        x = w[i:i + batch].to(device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=x, use_cache=False, logits_to_keep=0).logits.float()
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                              reduction="none").view(x.shape[0], ctx - 1).double()
        tot[0] += nll.sum().item(); tot[1] += nll.numel()
        tot[2] += nll[:, first:].sum().item(); tot[3] += nll[:, first:].numel()
    return tot


def finish_config(path):
    """Make config.json carry every field of NEMOTRON_H.md in the spellings fp4moe reads."""
    with open(path) as f:
        cfg = json.load(f)
    cfg["hybrid_override_pattern"] = PATTERN
    cfg["num_hidden_layers"] = len(PATTERN)
    for k, v in CONFIG.items():
        if k not in cfg:
            cfg[k] = v
    tsl = cfg.get("time_step_limit", [0.0, float("inf")])
    cfg["time_step_limit"] = [{"__float__": "Infinity" if x > 0 else "-Infinity"}
                              if isinstance(x, float) and not math.isfinite(x) else x for x in tsl]
    for k in ("dtype", "torch_dtype"):
        if k in cfg:
            cfg[k] = "bfloat16"
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True, allow_nan=False)
        f.write("\n")
    return cfg


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default=".train/gutenberg-en-100M.txt.xz")
    ap.add_argument("--tokenizer", default="models/nemotron-h-tiny-moe/tokenizer.json")
    ap.add_argument("--out", required=True, help="save_pretrained directory")
    ap.add_argument("--log-json", default=None, help="train_log.json path (default OUT/../train_log.json)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--bias-gamma", type=float, default=1e-3, help="aux-loss-free balancing step")
    ap.add_argument("--train-seconds", type=float, default=400.0, help="hard cap on the training loop")
    ap.add_argument("--deadline", type=float, default=0.0, help="stop training so that the script can "
                    "end by this many seconds after start (0 = off)")
    ap.add_argument("--post-reserve", type=float, default=75.0, help="seconds kept for save/eval/gen")
    ap.add_argument("--max-steps", type=int, default=0, help="fixed step count (toy runs); 0 = fit to the cap")
    ap.add_argument("--calib-start", type=int, default=10)
    ap.add_argument("--calib-end", type=int, default=30)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--val-every", type=int, default=250)
    ap.add_argument("--val-chars", type=int, default=400_000)
    ap.add_argument("--val-windows", type=int, default=64)
    ap.add_argument("--max-train-chars", type=int, default=0, help="toy runs: use only this many chars")
    ap.add_argument("--eval-ctx", type=int, default=512)
    ap.add_argument("--eval-batch", type=int, default=32)
    ap.add_argument("--eval-max-windows", type=int, default=0)
    ap.add_argument("--gen-tokens", type=int, default=60)
    ap.add_argument("--max-shard-mb", type=int, default=14)
    ap.add_argument("--no-fast-scan", action="store_true")
    ap.add_argument("--no-autocast", action="store_true")
    args = ap.parse_args()

    import transformers
    from tokenizers import Tokenizer
    from transformers.integrations.moe import ExpertsInterface
    from transformers.models.nemotron_h import modeling_nemotron_h as mod

    device = torch.device(args.device)
    autocast = not args.no_autocast
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("high")
    os.makedirs(args.out, exist_ok=True)
    log_json = args.log_json or os.path.join(os.path.dirname(os.path.abspath(args.out)), "train_log.json")
    R = dict(script="scripts/train_default_model.py", args=vars(args), versions=dict(
        torch=torch.__version__, transformers=transformers.__version__, python=sys.version.split()[0]))
    if device.type == "cuda":
        R["device"] = torch.cuda.get_device_name(0)
    log(f"torch {torch.__version__} transformers {transformers.__version__} device {R.get('device', device)}")

    def dump():
        with open(log_json, "w") as f:
            json.dump(R, f, indent=1, allow_nan=True)

    # ---- data --------------------------------------------------------------------------------
    text = read_corpus(args.corpus)
    train_text, val_text, held_text = split_text(text, args.val_chars)
    R["data"] = dict(corpus=os.path.basename(args.corpus), chars=len(text), train_chars=len(train_text),
                     val_chars=len(val_text), heldout_chars=len(held_text),
                     split="held-out = last len//100 chars; val = the val_chars before it; train = the rest")
    if args.max_train_chars:
        train_text = train_text[: args.max_train_chars]
    del text
    tok = Tokenizer.from_file(args.tokenizer)
    assert tok.get_vocab_size() == CONFIG["vocab_size"], tok.get_vocab_size()
    t0 = time.time()
    train_ids = tokenize_stream(tok, train_text)
    val_ids = np.asarray(tok.encode(val_text, add_special_tokens=False).ids, dtype=np.int32)
    held_ids = np.asarray(tok.encode(held_text, add_special_tokens=False).ids, dtype=np.int32)
    R["data"].update(train_tokens=int(len(train_ids)), val_tokens=int(len(val_ids)),
                     heldout_tokens=int(len(held_ids)), tokenize_s=round(time.time() - t0, 1))
    log(f"data: {R['data']}")
    del train_text
    data = torch.as_tensor(train_ids.astype(np.int64)).to(device)
    n_data = data.numel()

    # ---- model -------------------------------------------------------------------------------
    model = build_model(args, device)
    pc = count_params(model)
    R["params"] = pc
    bad = check_dims(model)
    log(f"params {pc}; matrices with a dim not a multiple of 16: {bad}")
    assert not bad, bad
    ExpertsInterface.register("grouped_mm_bf16", grouped_mm_bf16_experts_forward)
    model.config._experts_implementation = "grouped_mm_bf16"

    orig_scan = mod.mamba2_chunk_scan
    R["fast_paths"] = {}
    if not args.no_fast_scan:
        fast = make_einsum_chunk_scan(mod)
        err = check_scan(mod, fast, device)
        ok = err < 1e-4
        R["fast_paths"]["einsum_chunk_scan_rel_err"] = err
        log(f"einsum chunk scan vs transformers: max rel err {err:.2e} -> {'use' if ok else 'NOT used'}")
        if ok:
            mod.mamba2_chunk_scan = fast
        elif device.type == "cuda":
            args.batch = min(args.batch, 32)
    R["fast_paths"]["einsum_chunk_scan_used"] = mod.mamba2_chunk_scan is not orig_scan

    stats = RouterStats(model, CONFIG["n_routed_experts"])
    gen = torch.Generator(device=device).manual_seed(args.seed)
    ar = torch.arange(args.seq_len + 1, device=device)

    def batch():
        start = torch.randint(0, n_data - args.seq_len - 1, (args.batch,), device=device, generator=gen)
        xy = data[start[:, None] + ar]
        return xy[:, :-1], xy[:, 1:]

    def fwd_loss(x, y):
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=x, use_cache=False, logits_to_keep=0).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    # Whole-model check of the fast paths: same loss as the stock transformers code on one batch.
    model.eval()
    with torch.no_grad():
        x, y = batch()
        x, y = x[:4], y[:4]
        try:
            l_fast = fwd_loss(x, y).item()
        except Exception as e:
            log(f"fast-path forward failed: {type(e).__name__}: {str(e)[:300]} -> experts eager")
            R["fast_paths"]["forward_error"] = str(e)[:300]
            model.config._experts_implementation = "eager"
            l_fast = fwd_loss(x, y).item()
        saved = mod.mamba2_chunk_scan, model.config._experts_implementation
        mod.mamba2_chunk_scan = orig_scan
        model.config._experts_implementation = "eager"
        l_ref = fwd_loss(x, y).item()
        mod.mamba2_chunk_scan, model.config._experts_implementation = saved
    stats.take()
    R["fast_paths"].update(loss_fast=l_fast, loss_stock=l_ref)
    log(f"init loss fast paths {l_fast:.5f} vs stock transformers {l_ref:.5f} (ln V = {math.log(CONFIG['vocab_size']):.3f})")
    if abs(l_fast - l_ref) > 2e-2:
        log("fast paths disagree with stock: using stock transformers code")
        mod.mamba2_chunk_scan = orig_scan
        model.config._experts_implementation = "eager"
        R["fast_paths"]["einsum_chunk_scan_used"] = False
        R["fast_paths"]["experts"] = "eager"
        if device.type == "cuda":
            args.batch = min(args.batch, 32)
    else:
        R["fast_paths"]["experts"] = model.config._experts_implementation
    model.train()

    opt = torch.optim.AdamW(param_groups(model, args.wd), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=(device.type == "cuda"))
    moe_layers = [i for i, _ in stats.gates]
    biases = {i: g.e_score_correction_bias for i, g in stats.gates}
    usage_total = {i: torch.zeros(CONFIG["n_routed_experts"], device=device) for i in moe_layers}

    # ---- train -------------------------------------------------------------------------------
    tok_per_step = args.batch * args.seq_len
    cap = args.train_seconds
    if args.deadline:
        cap = min(cap, args.deadline - args.post_reserve - (time.time() - T_START))
    log(f"training: batch {args.batch} x seq {args.seq_len} = {tok_per_step} tokens/step; cap {cap:.0f} s")
    curve, val_curve = [], []
    total_steps = args.max_steps or 10 ** 9
    warmup = args.warmup
    def use_eager_experts():
        model.config._experts_implementation = "eager"
        R["fast_paths"]["experts"] = "eager"

    def use_stock_scan():
        mod.mamba2_chunk_scan = orig_scan
        R["fast_paths"]["einsum_chunk_scan_used"] = False
        args.batch = min(args.batch, 32)
        R["fast_paths"]["batch_after_fallback"] = args.batch

    fallbacks = [("experts eager", use_eager_experts), ("stock mamba scan, batch <= 32", use_stock_scan)]
    step, t_train0 = 0, time.time()
    t_mark, t_calib = None, None
    run_loss, run_n, tokens = 0.0, 0, 0
    stop_reason = "schedule complete"
    while step < total_steps:
        elapsed = time.time() - t_train0
        if elapsed >= cap:
            stop_reason = "wall-clock cap"
            break
        lr = lr_at(step, total_steps if total_steps < 10 ** 9 else 10 ** 9, warmup, args.lr, args.min_lr_frac)
        for grp in opt.param_groups:
            grp["lr"] = lr
        try:
            x, y = batch()
            loss = fwd_loss(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
        except Exception as e:  # a fast path failing on the device: fall back to stock code
            opt.zero_grad(set_to_none=True)
            stats.take()
            loss = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if step >= 5 or not fallbacks:
                log(f"training step {step} failed: {type(e).__name__}: {e}; stopping training here")
                stop_reason = f"error: {type(e).__name__}: {str(e)[:200]}"
                break
            name, apply = fallbacks.pop(0)
            log(f"training step {step} failed: {type(e).__name__}: {str(e)[:300]} -> fallback: {name}")
            apply()
            R["fast_paths"].setdefault("fallbacks", []).append(dict(step=step, error=str(e)[:300], fallback=name))
            tok_per_step = args.batch * args.seq_len
            continue
        # auxiliary-loss-free balancing (DeepSeek-V3 sec. 2.1.2): nudge the choice bias
        with torch.no_grad():
            for i, cnt in stats.take().items():
                biases[i].add_(args.bias_gamma * torch.sign(cnt.mean() - cnt))
                usage_total[i] += cnt
        step += 1
        tokens += tok_per_step
        run_loss += loss.detach()
        run_n += 1
        # fit the cosine length to the cap from the measured step time (steps calib_start..calib_end
        # first, then re-fitted every 200 steps over everything since calib_start, val passes included)
        if not args.max_steps and (step == args.calib_start or step == args.calib_end
                                   or (t_calib is not None and step % 200 == 0)):
            if device.type == "cuda":
                torch.cuda.synchronize()
            now = time.time() - t_train0
            if step == args.calib_start:
                t_mark = (now, step)
            else:
                t_calib = True
                sec_per_step = (now - t_mark[0]) / (step - t_mark[1])
                total_steps = step + max(1, int((cap - now) / sec_per_step * 0.99))
                warmup = min(args.warmup, max(1, total_steps // 5))
                log(f"schedule: {sec_per_step * 1000:.1f} ms/step -> total_steps {total_steps}, warmup {warmup}")
        if step % args.log_every == 0 or step == total_steps or step <= 3:
            lval = (run_loss / run_n).item()
            el = time.time() - t_train0
            curve.append(dict(step=step, tokens=tokens, loss=round(lval, 4), lr=lr, grad_norm=round(gnorm.item(), 3),
                              elapsed_s=round(el, 1), tok_per_s=round(tokens / el)))
            log(f"step {step:5d} loss {lval:.4f} lr {lr:.2e} gnorm {gnorm.item():.2f} "
                f"tok {tokens / 1e6:.1f}M {tokens / el / 1e3:.0f}k tok/s")
            run_loss, run_n = 0.0, 0
            if not math.isfinite(lval):
                stop_reason = "non-finite loss"
                break
        if step % args.val_every == 0:
            model.eval()
            s = window_nll(model, val_ids[: args.val_windows * args.seq_len], args.seq_len, 32, device, autocast)
            stats.take()
            model.train()
            val_curve.append(dict(step=step, tokens=tokens, val_loss=round(s[0] / s[1], 4)))
            log(f"  val loss {s[0] / s[1]:.4f} (ppl {math.exp(s[0] / s[1]):.2f})")
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.time() - t_train0
    model.eval()
    s = window_nll(model, val_ids[: args.val_windows * args.seq_len], args.seq_len, 32, device, autocast)
    stats.take()
    val_curve.append(dict(step=step, tokens=tokens, val_loss=round(s[0] / s[1], 4)))
    log(f"training stopped ({stop_reason}) after {step} steps, {tokens} tokens, {train_s:.1f} s; "
        f"final val loss {s[0] / s[1]:.4f}")
    R["train"] = dict(steps=step, tokens=tokens, epochs=round(tokens / n_data, 3), seconds=round(train_s, 1),
                      tok_per_s=round(tokens / train_s), stop_reason=stop_reason, batch=args.batch,
                      seq_len=args.seq_len, lr_peak=args.lr, warmup=warmup, total_steps_planned=total_steps,
                      final_train_loss=curve[-1]["loss"] if curve else None,
                      final_val_loss=val_curve[-1]["val_loss"], loss_curve=curve, val_curve=val_curve)
    R["router"] = {str(i): dict(e_score_correction_bias=[round(v, 4) for v in biases[i].tolist()],
                                train_usage=[int(v) for v in usage_total[i].tolist()]) for i in moe_layers}
    dump()

    # ---- save --------------------------------------------------------------------------------
    stats.remove()
    mod.mamba2_chunk_scan = orig_scan
    model.config._experts_implementation = "grouped_mm"
    model = model.to(torch.bfloat16)
    for _, g in stats.gates:
        g.e_score_correction_bias.data = g.e_score_correction_bias.data.float()
    model.generation_config.do_sample = False
    model.generation_config.pad_token_id = 0
    model.generation_config.bos_token_id = 1
    model.generation_config.eos_token_id = 2
    model.save_pretrained(args.out, max_shard_size=f"{args.max_shard_mb}MB")
    cfg = finish_config(os.path.join(args.out, "config.json"))
    files = {f: os.path.getsize(os.path.join(args.out, f)) for f in sorted(os.listdir(args.out))}
    R["saved"] = dict(files=files, config=cfg)
    log(f"saved: {files}")
    dump()
    model = opt = data = None  # free GPU memory before the reload
    if device.type == "cuda":
        torch.cuda.empty_cache()

    try:
        evaluate_and_sample(args, R, dump, device, tok, held_text, held_ids)
    except Exception as e:
        import traceback
        traceback.print_exc()
        R["eval_error"] = f"{type(e).__name__}: {e}"
        dump()
    R["total_script_s"] = round(time.time() - T_START, 1)
    dump()
    log("done")


def evaluate_and_sample(args, R, dump, device, tok, held_text, held_ids):
    # ---- evaluate the saved model with stock transformers ------------------------------------
    from transformers import NemotronHForCausalLM
    m = NemotronHForCausalLM.from_pretrained(args.out, dtype=torch.bfloat16).to(device).eval()
    bias_dtypes = sorted({str(l.mixer.gate.e_score_correction_bias.dtype) for l in m.model.layers
                          if l.block_type == "moe"})
    log(f"reloaded: experts impl {m.config._experts_implementation}; correction bias dtype {bias_dtypes}")
    stats = RouterStats(m, CONFIG["n_routed_experts"])
    ids = held_ids
    if args.eval_max_windows:
        ids = ids[: args.eval_max_windows * args.eval_ctx]
    t0 = time.time()
    s = window_nll(m, ids, args.eval_ctx, args.eval_batch, device, autocast=False)
    usage = {str(i): [int(v) for v in c.tolist()] for i, c in stats.take().items()}
    stats.remove()
    ev = dict(model="saved bf16 weights, NemotronHForCausalLM.from_pretrained(dtype=bfloat16), stock code",
              ctx=args.eval_ctx, windows=len(ids) // args.eval_ctx, tokens_scored_all=s[1],
              nll_all=s[0] / s[1], ppl_all=math.exp(s[0] / s[1]),
              tokens_scored_second_half=s[3], nll_second_half=s[2] / s[3], ppl_second_half=math.exp(s[2] / s[3]),
              chars_per_token=len(held_text) / len(held_ids), seconds=round(time.time() - t0, 1),
              rule="consecutive non-overlapping windows of ctx tokens of the held-out text (tokenized as one "
                   "string, tail dropped), no BOS; all = NLL of every position but the window's first; "
                   "second_half = llama.cpp rule (positions ctx/2 .. ctx-1 predicted)")
    dead = {k: [e for e, v in enumerate(c) if v == 0] for k, c in usage.items()}
    R["heldout"] = ev
    R["router_heldout_usage"] = dict(counts=usage, dead_experts=dead,
                                     max_over_mean={k: round(max(c) / (sum(c) / len(c)), 3) for k, c in usage.items()})
    log(f"held-out: ppl_all {ev['ppl_all']:.3f} ppl_second_half {ev['ppl_second_half']:.3f} "
        f"over {ev['windows']} windows of {args.eval_ctx}; dead experts {dead}")
    dump()

    # ---- greedy samples ----------------------------------------------------------------------
    samples = []
    for p in PROMPTS:
        pid = tok.encode(p, add_special_tokens=False).ids
        x = torch.tensor([pid], device=device)
        with torch.no_grad():
            out = m.generate(x, max_new_tokens=args.gen_tokens, do_sample=False, pad_token_id=0)
        new = out[0, len(pid):].tolist()
        # cached decode (Mamba recurrent step + KV cache) vs one full forward over prompt + output
        with torch.no_grad():
            full = m(input_ids=out, use_cache=False, logits_to_keep=0).logits[0, len(pid) - 1:-1].argmax(-1)
        mism = int((full != out[0, len(pid):]).sum().item())
        samples.append(dict(prompt=p, prompt_ids=pid, ids=new, text=tok.decode(new),
                            full_forward_argmax_mismatches=mism))
        log(f"SAMPLE {p!r} -> {tok.decode(new)!r}")
    R["samples"] = samples


if __name__ == "__main__":
    main()
