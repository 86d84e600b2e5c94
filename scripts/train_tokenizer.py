#!/usr/bin/env python3
"""Train the default model's tokenizer: a byte-level BPE with HF `tokenizers`.

Layout follows the tokenizer.json of real HF Llama-3 / Nemotron checkpoints:
  pre_tokenizer = Sequence[ Split(GPT-4-style regex, behavior=isolated),
                            ByteLevel(add_prefix_space=false, use_regex=false) ]
  model         = BPE over the 256 ByteLevel symbols, merges by rank
  decoder       = ByteLevel
  special tokens: <pad>=0, <s>=1, </s>=2 (match config.json pad/bos/eos ids)
No post-processor: encode(text) adds no BOS/EOS (tokenizer_config add_bos_token=false); the model is
trained on a plain token stream.

Data: the corpus (gutenberg-en-100M.txt, UTF-8) minus its last 1% by characters (the held-out part,
never seen by the tokenizer or the model). Split: n_held = len(text) // 100; train = text[:-n_held].

Usage: python3 scripts/train_tokenizer.py --corpus gutenberg-en-100M.txt.xz --out models/nemotron-h-tiny-moe
       [--vocab 8192] [--max-chars N  (train on the first N training characters only)]
"""
import argparse
import json
import lzma
import os
import time

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

# The Llama-3 / tiktoken cl100k-style split pattern (contractions, letters with one leading
# non-letter, numbers in runs of at most 3 digits, punctuation runs, newline runs, spaces).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2


def read_corpus(path):
    """Return the whole corpus as str (.xz or plain UTF-8)."""
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt", encoding="utf-8", newline="") as f:
        return f.read()


def split_train_heldout(text):
    """Last 1% of the characters is held out: n_held = len // 100."""
    n_held = len(text) // 100
    return text[: len(text) - n_held], text[len(text) - n_held:]


def chunks(text, size=1 << 16):
    """Yield pieces of about `size` chars, cut after a newline so no regex match spans a cut."""
    i = 0
    while i < len(text):
        j = min(len(text), i + size)
        if j < len(text):
            k = text.rfind("\n", i, j)
            if k > i:
                j = k + 1
        yield text[i:j]
        i = j


def build_tokenizer():
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--max-chars", type=int, default=0)
    args = ap.parse_args()

    t0 = time.time()
    text = read_corpus(args.corpus)
    train, held = split_train_heldout(text)
    print(f"corpus {len(text)} chars; train {len(train)}; held-out {len(held)} (last 1%)")
    if args.max_chars:
        train = train[: args.max_chars]
        print(f"tokenizer trained on the first {len(train)} training chars only")

    tok = build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(chunks(train), trainer=trainer, length=None)
    assert tok.get_vocab_size() == args.vocab, tok.get_vocab_size()
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    t_train = time.time() - t0

    os.makedirs(args.out, exist_ok=True)
    tok.save(os.path.join(args.out, "tokenizer.json"), pretty=True)
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")

    # Round trip + compression on the held-out text (never used for training).
    ids = tok.encode(held).ids
    assert tok.decode(ids) == held, "round trip failed on held-out text"
    print(f"trained in {t_train:.1f} s; vocab {tok.get_vocab_size()}; held-out: {len(held)} chars -> "
          f"{len(ids)} tokens ({len(held) / len(ids):.3f} chars/token); round trip ok")
    sample = "Once upon a time, there were four little Rabbits, and their names were Flopsy."
    enc = tok.encode(sample)
    print("sample:", enc.tokens)


if __name__ == "__main__":
    main()
