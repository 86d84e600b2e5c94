#!/usr/bin/env python3
"""Golden nemotron_h models and transformers reference outputs for fp4moe's C tests.

Builds two tiny random nemotron_h models with transformers' NemotronHForCausalLM (5.17), writes each
in the checkpoint formats fp4moe loads, and records transformers' outputs on the CPU in fp32:

  tiny-a  H=64, layers "M*EM-E" (every layer type), Mamba G=2 (nh 8, hd 16, S 16, chunk 16),
          GQA 4/2 heads, MoE E=8 k=2 (+ shared expert), n_group 1, routed scaling 2.5
  tiny-b  H=96, layers "ME*-EM", Mamba G=3, GQA 6/2, MoE E=16 k=4 with n_group=4, topk_group=2,
          moe_latent_size=48, no norm_topk_prob

  models/tiny-a-bf16      transformers save_pretrained, bf16 (correction bias F32)
  models/tiny-a-mlx       MLX nvfp4: U32 .weight + U8 .scales for every linear layer, lm_head and
                          the embedding; experts stacked as switch_mlp.fc1/fc2; conv1d (C, Kc, 1);
                          config with hybrid_override_pattern + "quantization"; an mtp.* tensor
  models/tiny-a-modelopt  ModelOpt NVFP4: U8 .weight + F8_E4M3 .weight_scale + F32 .weight_scale_2
                          (per-tensor global scale) + .input_scale; experts unstacked; lm_head,
                          attention and the Mamba layer before attention excluded (bf16);
                          hf_quant_config.json
  models/tiny-b-f32       transformers save_pretrained, f32
  models/tiny-b-mlx       MLX nvfp4 of tiny-b
Every model directory also gets a small byte-level BPE tokenizer.json (259 byte/special tokens + 13
merges = 272 = vocab_size) so that `fp4moe generate` runs on it.

References (models/reference/NAME.safetensors): prompt (I32, 40 fixed ids), logits (F32, 40 x V: every
prompt position), gen_ids (I32, 16: the greedy continuation), step_logits (F32, 16 x V: the logits that
chose gen_ids[i], i.e. of the sequence prompt + gen_ids[:i]). Each is transformers run in fp32 with
eager attention on the weights the C side computes with:
  NAME = tiny-a-bf16 / tiny-b-f32        the stored weights (the --no-quantize path)
  NAME = tiny-a-bf16-q / tiny-b-f32-q    every linear layer and lm_head NVFP4-quantized (spec
                                         NVFP4.md section 3, no global scale) and dequantized, the
                                         embedding as stored: what fp4moe's quantize-on-load computes
  NAME = tiny-a-mlx / tiny-b-mlx / tiny-a-modelopt   the dequantized checkpoint
The greedy continuation recomputes the whole sequence at every step (use_cache=False): transformers
5.17 clamps dt to >= time_step_min in its chunked (prefill) scan, while fp4moe (like mlx-lm and
vLLM) clamps dt to the config's time_step_limit in prefill and decode. The configs here declare
time_step_limit = [time_step_min, inf], so both rules are one function on these models (whose
heads have dt below time_step_min: the clamp is exercised); the goldens made before fp4moe switched
to time_step_limit stay valid unchanged. The cached greedy tokens are recorded in the metadata for
information.

The NVFP4 quantizer below follows spec NVFP4.md section 3 bit for bit (fp32 arithmetic, round to
nearest even, ties to the even code); the C test checks fp4moe's quantize-on-load against the MLX files.

Usage (CPU, a few seconds): python3 scripts/make_golden.py [--out tests/golden/models]
Needs torch, transformers==5.17.0, safetensors, tokenizers, numpy.
"""
import argparse
import json
import math
import os
import shutil

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import NemotronHConfig, NemotronHForCausalLM

PROMPT_LEN = 40
GEN_LEN = 16

COMMON = dict(vocab_size=272, use_mamba_kernels=False, conv_kernel=4, chunk_size=16,
              time_step_min=0.01, time_step_limit=(0.01, float("inf")), layer_norm_epsilon=1e-5, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)

MODEL_CONFIGS = {
    "tiny-a": dict(COMMON, hidden_size=64, hybrid_override_pattern="M*EM-E",
                   mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   moe_shared_expert_intermediate_size=48, n_group=1, topk_group=1,
                   norm_topk_prob=True, routed_scaling_factor=2.5, intermediate_size=96),
    "tiny-b": dict(COMMON, hidden_size=96, hybrid_override_pattern="ME*-EM",
                   mamba_num_heads=6, mamba_head_dim=16, ssm_state_size=16, n_groups=3,
                   num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                   n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                   moe_shared_expert_intermediate_size=64, n_group=4, topk_group=2,
                   norm_topk_prob=False, routed_scaling_factor=1.5, moe_latent_size=48,
                   intermediate_size=80),
}

# ---- NVFP4 (spec NVFP4.md sections 1 and 3) ------------------------------------------------------

E2M1_GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)


def e4m3_values():
    """Values of the 127 non-negative finite E4M3 bytes 0x00..0x7E."""
    out = []
    for b in range(0x7F):
        e, m = (b >> 3) & 15, b & 7
        out.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(out, dtype=np.float64)


E4M3 = e4m3_values()


def nearest_even(a, grid):
    """Index of the grid point nearest to each a (>= 0, float64-exact); ties -> even index."""
    hi = np.clip(np.searchsorted(grid, a, side="left"), 1, len(grid) - 1)
    lo = hi - 1
    dlo, dhi = a - grid[lo], grid[hi] - a
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
    return np.where(pick_hi, hi, lo)


def f32_to_e4m3(v):
    """Round-to-nearest-even, saturating at 448 (0x7E); v >= 0 (float32 array)."""
    a = v.astype(np.float64)
    idx = nearest_even(np.minimum(a, 448.0), E4M3)
    idx = np.where(np.isnan(a) | (a >= 448.0), 0x7E, idx)
    return idx.astype(np.uint8)


def f32_to_e2m1(v):
    """Codes of float32 v: nearest-even on the E2M1 grid, saturating at 6, sign in bit 3."""
    a = np.abs(v).astype(np.float64)
    idx = nearest_even(np.minimum(a, 6.0), E2M1_GRID.astype(np.float64))
    idx = np.where(np.isnan(a) | (a >= 6.0), 7, idx)
    return (idx | np.where(np.signbit(v), 8, 0)).astype(np.uint8)


def quantize(w, global_amax=None):
    """w: (N, K) float32 -> codes (N, K/2) u8, scales (N, K/16) u8, decode multiplier gs (float32)."""
    w = np.asarray(w, dtype=np.float32)
    N, K = w.shape
    blocks = w.reshape(N, K // 16, 16)
    if global_amax:
        enc = np.float32(2688.0) / np.float32(global_amax)
        gs = np.float32(global_amax) / np.float32(2688.0)
    else:
        enc, gs = np.float32(1.0), np.float32(1.0)
    amax = np.abs(blocks).max(axis=-1)                                        # step 1
    s = f32_to_e4m3((amax / np.float32(6.0) * enc).astype(np.float32))        # step 2
    ds = E4M3[s].astype(np.float32)
    with np.errstate(divide="ignore"):
        r = np.where(ds == 0, np.float32(0), enc / np.where(ds == 0, 1, ds)).astype(np.float32)  # 3
    codes = f32_to_e2m1((blocks * r[..., None]).astype(np.float32)).reshape(N, K)  # step 4
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, s, gs


def dequantize(packed, scales, gs=np.float32(1.0)):
    N = packed.shape[0]
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(N, -1)
    vals = np.where(codes & 8, -1, 1) * E2M1_GRID[codes & 7]
    s = np.repeat(E4M3[scales].astype(np.float32), 16, axis=1)
    return (vals.astype(np.float32) * s * np.float32(gs)).astype(np.float32)


def to_mlx_u32(packed):
    """(..., K/2) bytes -> (..., K/8) little-endian uint32 words (MLX layout)."""
    return np.ascontiguousarray(packed).view("<u4")


# ---- models ---------------------------------------------------------------------------------------

def build_model(name, seed):
    kw = dict(MODEL_CONFIGS[name])
    cfg = NemotronHConfig(**kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in list(model.named_parameters()) + list(model.named_buffers()):
            p.copy_(init_tensor(pname, p, cfg, g))
    return model, cfg


def randn(shape, g):
    return torch.randn(shape, generator=g, dtype=torch.float32)


def init_tensor(pname, p, cfg, g):
    """Random weights that keep activations O(1) and give clear greedy margins."""
    shape = p.shape
    if pname.endswith("norm.weight") or pname.endswith("norm_f.weight"):
        return 1.0 + 0.2 * randn(shape, g)
    if pname.endswith("A_log"):
        return torch.log(1.0 + 15.0 * torch.rand(shape, generator=g))
    if pname.endswith(".D"):
        return 1.0 + 0.5 * randn(shape, g)
    if pname.endswith("dt_bias"):
        dt = torch.exp(torch.rand(shape, generator=g) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
        b = dt + torch.log(-torch.expm1(-dt))
        b[0] = -8.0    # head 0: softplus below time_step_min -> exercises the dt clamp
        return b
    if "conv1d.weight" in pname:
        return 0.5 * randn(shape, g)
    if "conv1d.bias" in pname:
        return 0.2 * randn(shape, g)
    if "e_score_correction_bias" in pname:
        return 0.05 * randn(shape, g)
    if "embeddings" in pname:
        return randn(shape, g)
    if pname.startswith("lm_head"):
        return 4.0 * randn(shape, g) / math.sqrt(shape[-1])
    if p.dim() >= 2:   # linear layers and stacked experts (E, N, K): N(0, 1/K)
        return randn(shape, g) / math.sqrt(shape[-1])
    raise ValueError(f"no init rule for {pname}")


def prompt_ids(vocab):
    rng = np.random.RandomState(1234)
    return [int(x) for x in rng.randint(3, vocab, size=PROMPT_LEN)]


# ---- references -----------------------------------------------------------------------------------

@torch.no_grad()
def reference(model, prompt):
    logits = model(torch.tensor([prompt]), use_cache=False).logits[0].float()
    seq, steps, margins = list(prompt), [], []
    for _ in range(GEN_LEN):
        lg = model(torch.tensor([seq]), use_cache=False).logits[0, -1].float()
        top2 = torch.topk(lg, 2).values
        margins.append(float(top2[0] - top2[1]))
        steps.append(lg)
        seq.append(int(torch.argmax(lg)))      # first maximal index: lowest id on ties
    gen = seq[len(prompt):]
    cached = model.generate(torch.tensor([prompt]), max_new_tokens=GEN_LEN, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    return logits, gen, torch.stack(steps), min(margins), cached


def save_reference(path, prompt, logits, gen, steps, margin, cached, note):
    meta = {"min_greedy_margin": f"{margin:.6g}", "cached_generate_ids": json.dumps(cached),
            "cached_matches": str(cached == gen).lower(), "weights": note,
            "transformers": __import__("transformers").__version__}
    save_file({"prompt": torch.tensor(prompt, dtype=torch.int32),
               "logits": logits.contiguous(), "gen_ids": torch.tensor(gen, dtype=torch.int32),
               "step_logits": steps.contiguous()}, path, metadata=meta)
    print(f"  {os.path.basename(path)}: min greedy margin {margin:.4f}, gen {gen}, "
          f"cached generate {'agrees' if cached == gen else 'differs: ' + str(cached)}")


def model_with(state, cfg):
    m = NemotronHForCausalLM(cfg).eval()
    m.load_state_dict(state, strict=True)
    return m


# ---- checkpoint writers ---------------------------------------------------------------------------

def is_linear(name, t):
    """Modules fp4moe quantizes on load: every 2-D/3-D projection weight except the router gate."""
    if name.endswith("embeddings.weight") or ".gate." in name or "conv1d" in name:
        return False
    return t.dim() >= 2 and name.endswith(("weight", "up_proj", "down_proj"))


def internal_to_file_names(sd):
    """transformers' internal state dict (model.*, stacked experts) -> checkpoint names."""
    out = {}
    for k, v in sd.items():
        k = k.replace("model.", "backbone.", 1) if k.startswith("model.") else k
        if k.endswith("experts.up_proj") or k.endswith("experts.down_proj"):
            base, proj = k.rsplit(".", 1)
            for e in range(v.shape[0]):
                out[f"{base}.{e}.{proj}.weight"] = v[e]
        else:
            out[k] = v
    return out


def file_to_internal_names(fsd):
    out, experts = {}, {}
    for k, v in fsd.items():
        parts = k.split(".")
        if "experts" in parts and parts[-1] == "weight" and parts[-3].isdigit():
            base = ".".join(parts[:-3])
            experts.setdefault((base, parts[-2]), {})[int(parts[-3])] = v
            continue
        out[k.replace("backbone.", "model.", 1)] = v
    for (base, proj), d in experts.items():
        out[f"{base.replace('backbone.', 'model.', 1)}.{proj}"] = torch.stack([d[e] for e in sorted(d)])
    return out


def write_config(model_dir, cfg, edit=None):
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        c = json.load(f)
    if edit:
        edit(c)
    with open(path, "w") as f:
        json.dump(c, f, indent=2)


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def write_tokenizer(model_dir):
    """A byte-level BPE: <pad> <s> </s>, the 256 byte symbols, 13 merges (272 ids)."""
    b2u = bytes_to_unicode()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[b2u[b]] = 3 + b
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("a", "n"), ("o", "n"),
              ("Ġ", "a"), ("r", "e"), ("Ġ", "s"), ("e", "d"), ("o", "u"), ("Ġ", "w")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    tok.save(os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"add_bos_token": False, "bos_token": "<s>", "eos_token": "</s>",
                   "pad_token": "<pad>", "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2)


def save_hf(model, model_dir, dtype):
    m = model.to(dtype)
    for name, buf in m.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.data = buf.data.float()           # kept fp32, as real checkpoints do
    m.save_pretrained(model_dir, safe_serialization=True)
    write_tokenizer(model_dir)


def quantized_state(fsd, select, global_scale=False):
    """Dequantized copy of fsd (f32) for the modules select(name, t) picks; also returns the
    quantized pieces {name: (packed, scales, gs)}."""
    deq, q = {}, {}
    for k, v in fsd.items():
        v32 = v.float()
        if select(k, v):
            amax = float(v32.abs().max()) if global_scale else None
            packed, s, gs = quantize(v32.numpy(), amax)
            q[k] = (packed, s, gs)
            deq[k] = torch.from_numpy(dequantize(packed, s, gs))
        else:
            deq[k] = v32
    return deq, q


def write_mlx(fsd, q, model_dir, src_dir, cfg_edit):
    """MLX nvfp4 layout: .weight U32 + .scales U8, experts stacked (switch_mlp.fc1/fc2)."""
    os.makedirs(model_dir, exist_ok=True)
    out, stacks = {}, {}
    for k, v in fsd.items():
        parts = k.split(".")
        if "experts" in parts and parts[-3].isdigit():
            fc = "fc1" if parts[-2] == "up_proj" else "fc2"
            base = ".".join(parts[:parts.index("experts")])
            stacks.setdefault((base, fc), {})[int(parts[-3])] = q[k]
            continue
        if k in q:
            packed, s, _ = q[k]
            mod = k[: -len(".weight")]
            out[mod + ".weight"] = torch.from_numpy(to_mlx_u32(packed).astype(np.uint32).view(np.int32)).view(torch.uint32)
            out[mod + ".scales"] = torch.from_numpy(s)
        elif k.endswith("conv1d.weight"):
            out[k] = v.permute(0, 2, 1).contiguous()                  # (C, 1, Kc) -> (C, Kc, 1)
        else:
            out[k] = v
    for (base, fc), d in stacks.items():
        packed = np.stack([d[e][0] for e in sorted(d)])
        scales = np.stack([d[e][1] for e in sorted(d)])
        out[f"{base}.switch_mlp.{fc}.weight"] = torch.from_numpy(to_mlx_u32(packed).view(np.int32)).view(torch.uint32)
        out[f"{base}.switch_mlp.{fc}.scales"] = torch.from_numpy(np.ascontiguousarray(scales))
    out["mtp.layers.0.norm.weight"] = torch.ones(4, dtype=torch.bfloat16)   # must be ignored
    save_file(out, os.path.join(model_dir, "model.safetensors"), metadata={"format": "mlx"})
    shutil.copy(os.path.join(src_dir, "config.json"), model_dir)
    write_config(model_dir, None, cfg_edit)
    write_tokenizer(model_dir)


def write_modelopt(fsd, q, model_dir, src_dir, exclude):
    """ModelOpt NVFP4 layout: .weight U8, .weight_scale F8_E4M3, .weight_scale_2 F32, .input_scale."""
    os.makedirs(model_dir, exist_ok=True)
    out = {}
    for k, v in fsd.items():
        if k in q:
            packed, s, gs = q[k]
            mod = k[: -len(".weight")]
            out[mod + ".weight"] = torch.from_numpy(packed)
            out[mod + ".weight_scale"] = torch.from_numpy(s).view(torch.float8_e4m3fn)
            out[mod + ".weight_scale_2"] = torch.tensor(float(gs), dtype=torch.float32)
            out[mod + ".input_scale"] = torch.tensor(1.0, dtype=torch.float32)
        else:
            out[k] = v
    save_file(out, os.path.join(model_dir, "model.safetensors"))
    shutil.copy(os.path.join(src_dir, "config.json"), model_dir)
    qc = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
          "exclude_modules": exclude}
    write_config(model_dir, None, lambda c: c.update(
        {"quantization_config": dict(qc, quant_method="modelopt", producer={"name": "modelopt"})}))
    with open(os.path.join(model_dir, "hf_quant_config.json"), "w") as f:
        json.dump({"producer": {"name": "modelopt", "version": "0.33"}, "quantization": qc}, f, indent=2)
    write_tokenizer(model_dir)


def mlx_config_edit(pattern):
    def edit(c):
        c.pop("layers_block_type", None)
        c["hybrid_override_pattern"] = pattern
        c["num_hidden_layers"] = len(pattern)
        c["quantization"] = {"group_size": 16, "bits": 4, "mode": "nvfp4"}
        c["quantization_config"] = dict(c["quantization"])
    return edit


# ---- main -----------------------------------------------------------------------------------------

def run(out_dir, name, seed, dense_dtype, modelopt):
    ref_dir = os.path.join(out_dir, "reference")
    os.makedirs(ref_dir, exist_ok=True)
    model, cfg = build_model(name, seed)
    prompt = prompt_ids(cfg.vocab_size)
    tag = {torch.bfloat16: "bf16", torch.float32: "f32"}[dense_dtype]
    dense_dir = os.path.join(out_dir, f"{name}-{tag}")
    shutil.rmtree(dense_dir, ignore_errors=True)
    save_hf(model, dense_dir, dense_dtype)

    # the stored weights, as fp32, in checkpoint names
    stored = internal_to_file_names({k: v.detach().clone() for k, v in model.state_dict().items()})
    fp32 = {k: v.float() for k, v in stored.items()}
    print(f"{name}: {sum(v.numel() for v in fp32.values())} parameters")

    ref = model_with(file_to_internal_names(fp32), cfg)
    save_reference(os.path.join(ref_dir, f"{name}-{tag}.safetensors"), prompt, *reference(ref, prompt),
                   note="stored weights")

    deq, q = quantized_state(stored, is_linear)
    ref = model_with(file_to_internal_names(deq), cfg)
    save_reference(os.path.join(ref_dir, f"{name}-{tag}-q.safetensors"), prompt, *reference(ref, prompt),
                   note="linears + lm_head NVFP4 (no global scale), embedding as stored")

    # MLX keeps the unquantized tensors in bf16 (the correction bias in f32)
    mlx_stored = {k: v.to(torch.bfloat16) if v.dtype == torch.float32 and "correction" not in k else v
                  for k, v in stored.items()}
    mlx_sel = lambda k, t: is_linear(k, t) or k.endswith("embeddings.weight")
    deq, q = quantized_state(mlx_stored, mlx_sel)
    mlx_dir = os.path.join(out_dir, f"{name}-mlx")
    shutil.rmtree(mlx_dir, ignore_errors=True)
    write_mlx(mlx_stored, q, mlx_dir, dense_dir,
              mlx_config_edit(MODEL_CONFIGS[name]["hybrid_override_pattern"]))
    ref = model_with(file_to_internal_names(deq), cfg)
    save_reference(os.path.join(ref_dir, f"{name}-mlx.safetensors"), prompt, *reference(ref, prompt),
                   note="MLX nvfp4, dequantized")

    if modelopt:
        pattern = MODEL_CONFIGS[name]["hybrid_override_pattern"]
        before_attn = [i for i in range(len(pattern) - 1) if pattern[i] == "M" and pattern[i + 1] == "*"]
        excluded = ["lm_head"] + [f"backbone.layers.{i}.mixer.{p}" for i in before_attn
                                  for p in ("in_proj", "out_proj")]
        excluded += [f"backbone.layers.{i}.mixer.{p}_proj" for i, c in enumerate(pattern) if c == "*"
                     for p in "qkvo"]
        sel = lambda k, t: is_linear(k, t) and k[: -len(".weight")] not in excluded
        deq, q = quantized_state(stored, sel, global_scale=True)
        mo_dir = os.path.join(out_dir, f"{name}-modelopt")
        shutil.rmtree(mo_dir, ignore_errors=True)
        write_modelopt(stored, q, mo_dir, dense_dir, excluded + ["backbone.layers.*.mixer.conv1d"])
        ref = model_with(file_to_internal_names(deq), cfg)
        save_reference(os.path.join(ref_dir, f"{name}-modelopt.safetensors"), prompt,
                       *reference(ref, prompt), note="ModelOpt NVFP4, dequantized")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "golden", "models"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    out = os.path.normpath(args.out)
    run(out, "tiny-a", 1, torch.bfloat16, modelopt=True)
    run(out, "tiny-b", 2, torch.float32, modelopt=False)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    print(f"{out}: {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
