#!/usr/bin/env python3
"""Golden data for the C tokenizer (tests/tokenizer/test_tokenizer.c), made with HF `tokenizers`.

Two modes:

  train   Trains small byte-level / SentencePiece-style BPE tokenizers on a slice of the corpus
          (the first --train-chars characters: never the held-out last 1%) and writes each
          tokenizer.json plus its golden file under --out (default tests/golden/tokenizer/):
            llama3_style   Split(Llama-3 regex, Isolated) + ByteLevel(use_regex=false),
                           ignore_merges, specials <pad> <s> </s> <|im_start|> <|im_end|>,
                           a non-special added token, post-processor Sequence[ByteLevel,
                           Template("<s> $A")], merges as [["a","b"]] lists
            gpt2_style     ByteLevel(use_regex=true) with the GPT-2 regex, <|endoftext|>,
                           merges in the older "a b" string form
            nemotron_style Split(Mistral-Nemo/Nemotron "Tekken" regex, one digit per token) +
                           ByteLevel, added tokens with lstrip/rstrip/single_word/normalized
                           flags, Template("<s> $A </s>")
            sp_style       SentencePiece-like: normalizer Prepend+Replace("▁"), no pre-tokenizer,
                           byte_fallback with <0x00>..<0xFF>, unk, decoder Replace/ByteFallback/
                           Fuse/Strip (the Llama-2 layout)
            v_*            small variants for the Split behaviors (Removed, MergedWithPrevious,
                           MergedWithNext, Contiguous, invert), Digits, ByteLevel
                           add_prefix_space, null decoder, continuing_subword_prefix + fused unk
  golden  Writes goldens for any existing tokenizer.json:
            make_tokenizer_golden.py golden --tokenizer models/nemotron-h-tiny-moe/tokenizer.json
                [--name nemotron-h-tiny-moe] [--out tests/golden/tokenizer] [--corpus ...]

Golden file NAME.golden.json:
  {"tokenizer": path of the tokenizer.json relative to the repo root,
   "hf_tokenizers": version, "vocab_size": get_vocab_size(with_added_tokens=True),
   "encode": [{"text": the string, "add_special": 0|1, "ids": [...],
               "dec_text": decode(ids), only where it differs from the text}, ...],
   "decode": [{"ids": [...], "skip_special": 0|1, "text": decode(ids)}, ...]}
A string holding a NUL is stored as "hex" / "dec_hex" (its UTF-8 bytes in hex) instead of "text" /
"dec_text", so that C JSON readers (which stop at NUL) see it whole. The strings (>= 1000
for the main tokenizers) come from a fixed seed: hand-written edge cases (unicode scripts, emoji
with ZWJ and skin tones, combining marks, whitespace runs, \\r\\n, digits, numbers with commas,
contractions, code, special tokens inline, the empty string), corpus excerpts, and random
unicode soups.
"""
import argparse
import json
import lzma
import os
import random
import sys

import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import processors, trainers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CORPUS = "/work/shared/corpus/gutenberg-en-100M.txt.xz"

LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


# ---- corpus ---------------------------------------------------------------------------------
def read_corpus_head(path, n_chars):
    """The first n_chars characters of the corpus (the held-out part is its last 1%)."""
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt", encoding="utf-8", newline="") as f:
        return f.read(n_chars)


def chunks(text, size=1 << 16):
    i = 0
    while i < len(text):
        j = min(len(text), i + size)
        k = text.rfind("\n", i, j)
        if j < len(text) and k > i:
            j = k + 1
        yield text[i:j]
        i = j


# ---- test strings ---------------------------------------------------------------------------
EDGE = [
    "", " ", "  ", "   ", "\t", "\n", "\r\n", "\r", "\n\n\n", " \n ", "\t\t\n\t", "a", "A", ".", "'",
    "Hello, world!", "Hello world", " Hello world", "Hello  world", "Hello   world   ", "  leading", "trailing  ",
    "line one\nline two\r\nline three\rend", "tabs\tinside\tthe\ttext", "mixed \t \n \r\n whitespace",
    "I'm", "don't", "DON'T", "We'LL", "they've", "she'd", "it's", "IT'S", "y'all'd've", "'s 't 're 've 'm 'll 'd",
    "rock 'n' roll", "the dog's bone", "O'Neill", "'quoted'", "\"double quoted\"", "l'été", "'ſ", "'K",
    "0", "7", "42", "123", "1234", "12345", "1234567890", "00000000000000000000", "1,234,567.89", "3.14159",
    "-42", "+7", "1e10", "6.02e23", "0x1F", "0b1011", "2024-01-31", "12:30:45", "$1,000,000", "€99,99", "50%",
    "①②③", "Ⅻ", "٣٤٥", "१२३", "½ ¾", "²³", "a1b2c3", "abc123def456", "version 2.0.1-beta+build.5",
    "def f(x):\n    return x * 2\n", "int main(void) { return 0; }", "for (i = 0; i < n; i++) a[i] += b[i];",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null}}", "<html><body><p>Hi</p></body></html>",
    "SELECT * FROM users WHERE id = 42;", "x = y ** 2 // 3 % 4", "a->b && c || !d", "#include <stdio.h>",
    "https://example.com/path?q=1&r=two#frag", "user.name+tag@example.org", "C:\\Windows\\System32",
    "    indented code", "\tif (x) {\n\t\ty();\n\t}", "```python\nprint('hi')\n```", "~!@#$%^&*()_+`-={}[]|\\:;\"'<>,.?/",
    "....", "!!!???", "---", "***", "___", "…", "— – -", "«guillemets»", "„Anführungszeichen“",
    "café", "naïve", "résumé", "Ångström", "Über", "straße", "ﬁ ligature", "e\u0301", "cafe\u0301",
    "Z\u0324\u0354\u0367\u0311\u0313a\u0308\u0356\u032d\u0308\u0307l\u036e\u0312\u036bg\u030c\u0317\u031ao",
    "\u0301\u0302 lone combining", "a\u20dd", "你好，世界", "中文字符测试", "こんにちは世界", "カタカナ ひらがな 漢字",
    "안녕하세요 세계", "Привет, мир!", "Съешь же ещё этих мягких французских булок", "Γειά σου Κόσμε",
    "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "สวัสดีชาวโลก", "Xin chào thế giới", "Ṫḧïṡ ïṡ ẅëïṛḋ",
    "ᚠᛇᚻ᛫ᛒᛦᚦ", "ꦲꦤꦕꦫꦏ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕄𝕒𝕥𝕙", "𝟘𝟙𝟚", "Ⓐⓑⓒ", "ＡＢＣ１２３", "ｶﾀｶﾅ",
    "😀", "😀😃😄", "I ❤️ NY", "👍🏽", "👍🏻👍🏼👍🏽👍🏾👍🏿", "👨‍👩‍👧‍👦", "👩🏽‍💻", "🏳️‍🌈", "🇫🇷🇩🇪🇯🇵", "1️⃣ #️⃣",
    "🧑‍🤝‍🧑", "text😀text", "emoji 😀 with spaces 🎉 !", "☃ ★ ♠ ♣ ♥ ♦", "✓ ✗ → ← ↑ ↓",
    "\u00a0nbsp\u00a0", "em\u2003space", "ideographic\u3000space", "mongolian\u180eseparator", "nel\u0085char",
    "line\u2028separator", "para\u2029separator", "vt\u000bff\u000c", "zero\u200bwidth", "\ufeffbom",
    "zwj\u200dzwnj\u200c", "\u0000", "nul\u0000inside", "\u0001\u0002\u007f", "\ufffd", "bad\ufffdchar",
    "\ue000 private", "\uffff", "\U0010ffff", "\U0001f600\U0010fffd", "\u00ad soft hyphen", "\u061c\u200e\u200f bidi",
    "a" * 300, "ab" * 150, " " * 64, "\n" * 40, "\t" * 20, "9" * 100, ("word " * 60).strip(),
    "x" + " " * 33 + "y", "!" * 50, "😀" * 30, "é" * 80, "中" * 100,
    "<s>", "</s>", "<s>hello</s>", "<s> hello </s>", "hello<s>world", "<s><s></s></s>", "<s", "s>", "</s >", "< s>",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n", "<|im_start|>", "<|im_end|><|im_start|>",
    "<|im_start", "|im_end|>", "<|endoftext|>", "text<|endoftext|>more text", "<|endoftext|><|endoftext|>",
    "<pad><pad>", "<unk>", "[UNK]", "<0x41>", "<0xE2><0x82>", "▁", "▁▁hello", "hello▁world",
    "Ġ", "Ċ", "ĠĠ", "Ā", "ÿ", "Ã©", "\u0100\u0101\u0143", "Ġthe Ġquick",
]

SCRIPTS = [
    (0x41, 0x5A), (0x61, 0x7A), (0x30, 0x39), (0x20, 0x2F), (0xC0, 0x17F), (0x300, 0x36F), (0x370, 0x3FF),
    (0x400, 0x4FF), (0x590, 0x5FF), (0x600, 0x6FF), (0x900, 0x97F), (0xE00, 0xE7F), (0x1100, 0x11FF),
    (0x2000, 0x206F), (0x20A0, 0x20BF), (0x2190, 0x21FF), (0x2600, 0x26FF), (0x3040, 0x30FF),
    (0x4E00, 0x4FFF), (0xAC00, 0xAD00), (0xFF00, 0xFFEF), (0x1F300, 0x1F64F), (0x1F900, 0x1F9FF),
    (0x1D400, 0x1D4FF), (0x10000, 0x1007F),
]
WS = [" ", "  ", "\t", "\n", "\r\n", "\u00a0", "\u3000", "\u2003", "\n\n", "   "]
GLUE = ["\u200d", "\ufe0f", "\U0001f3fd", "\u0301", "'s", "'LL", ",", ".", "...", "1,000", "42", "007"]


def random_soup(rng, specials):
    parts = []
    for _ in range(rng.randint(1, 12)):
        r = rng.random()
        if r < 0.45:
            lo, hi = rng.choice(SCRIPTS)
            parts.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 8))))
        elif r < 0.7:
            parts.append(rng.choice(WS))
        elif r < 0.85:
            parts.append(rng.choice(GLUE))
        elif specials:
            parts.append(rng.choice(specials))
        else:
            parts.append(str(rng.randint(0, 10 ** rng.randint(1, 9))))
    return "".join(parts)


def corpus_excerpt(rng, text):
    n = rng.choice([1, 2, 5, 10, 30, 80, 200, 500])
    i = rng.randrange(0, len(text) - n)
    return text[i:i + n]


def make_strings(corpus, specials, n_corpus, n_soup, seed=1234):
    rng = random.Random(seed)
    out = list(EDGE)
    for s in specials:   # this tokenizer's own added tokens, inline and at the ends
        out += [s, " " + s + " ", "x" + s + "y", s + s, "Hello " + s + "world", s + "\n" + s, "  " + s + "  ."]
    out += [corpus_excerpt(rng, corpus) for _ in range(n_corpus)]
    out += [random_soup(rng, specials) for _ in range(n_soup)]
    out.append(corpus[:4000])   # one long text
    seen, uniq = set(), []
    for s in out:
        if s not in seen:
            seen.add(s)
            uniq.append(s)
    return uniq


# ---- goldens --------------------------------------------------------------------------------
def text_field(prefix, s):
    """{"text": s}, or {"hex": UTF-8 as hex} when s holds a NUL (which C JSON readers cut at)."""
    return {prefix + "hex": s.encode("utf-8").hex()} if "\0" in s else {prefix + "text": s}


def write_golden(tok_path, name, out_dir, strings, seed=99, n_decode=300):
    tok = Tokenizer.from_file(tok_path)
    rng = random.Random(seed)
    enc = []
    for i, s in enumerate(strings):
        add_special = 1 if i % 7 == 3 else 0
        ids = tok.encode(s, add_special_tokens=bool(add_special)).ids
        case = text_field("", s)
        case.update({"add_special": add_special, "ids": ids})
        back = tok.decode(ids, skip_special_tokens=False)
        if back != s:   # HF does not round-trip this one (unk, normalizer, specials added): its decode
            case.update(text_field("dec_", back))
        enc.append(case)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    special_ids = sorted(tok.get_added_tokens_decoder().keys())
    dec = []
    for i in range(n_decode):
        n = rng.randint(1, 24)
        if i % 3 == 0 and special_ids:   # sprinkle added tokens
            ids = [rng.choice(special_ids) if rng.random() < 0.3 else rng.randrange(vocab_size) for _ in range(n)]
        else:
            ids = [rng.randrange(vocab_size) for _ in range(n)]
        ids = [x for x in ids if tok.id_to_token(x) is not None]
        skip = i % 2
        case = {"ids": ids, "skip_special": skip}
        case.update(text_field("", tok.decode(ids, skip_special_tokens=bool(skip))))
        dec.append(case)
    rel = os.path.relpath(os.path.abspath(tok_path), REPO)
    golden = {"tokenizer": rel, "hf_tokenizers": tokenizers.__version__, "vocab_size": vocab_size,
              "encode": enc, "decode": dec}
    path = os.path.join(out_dir, name + ".golden.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(golden, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    n_ids = sum(len(e["ids"]) for e in enc)
    print(f"{path}: {len(enc)} encode cases ({n_ids} ids), {len(dec)} decode cases, "
          f"{os.path.getsize(path) // 1024} KiB")


def specials_of(tok_path):
    with open(tok_path, encoding="utf-8") as f:
        j = json.load(f)
    return [t["content"] for t in j.get("added_tokens") or []]


# ---- training -------------------------------------------------------------------------------
def train(tok, text, vocab, specials, limit_alphabet=None, byte_alphabet=True):
    kw = dict(vocab_size=vocab, min_frequency=2, special_tokens=specials, show_progress=False)
    if byte_alphabet:
        kw["initial_alphabet"] = pre_tokenizers.ByteLevel.alphabet()
    if limit_alphabet:
        kw["limit_alphabet"] = limit_alphabet
    tok.train_from_iterator(chunks(text), trainer=trainers.BpeTrainer(**kw))
    return tok


def save(tok, out_dir, name, edit=None):
    path = os.path.join(out_dir, name + ".json")
    j = json.loads(tok.to_str())
    if edit:
        edit(j)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(j, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    Tokenizer.from_file(path)   # HF must load what we wrote
    print(f"{path}: {os.path.getsize(path) // 1024} KiB")
    return path


def merges_as_strings(j):
    j["model"]["merges"] = [a + " " + b for a, b in j["model"]["merges"]]


def byte_level(prefix=False, regex=False):
    return pre_tokenizers.ByteLevel(add_prefix_space=prefix, trim_offsets=True, use_regex=regex)


def build_llama3(text):
    t = Tokenizer(models.BPE(ignore_merges=True))
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_REGEX), "isolated"), byte_level()])
    t.decoder = decoders.ByteLevel()
    train(t, text, 4000, ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    t.add_tokens([AddedToken("<think>", normalized=False, special=False)])
    t.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False),
                                            processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])])
    return t


def build_gpt2(text):
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = byte_level(regex=True)
    t.decoder = decoders.ByteLevel()
    t.post_processor = processors.ByteLevel(trim_offsets=True)
    return train(t, text, 2000, ["<|endoftext|>"])


def build_nemotron(text):
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(TEKKEN_REGEX), "isolated"), byte_level()])
    t.decoder = decoders.ByteLevel()
    train(t, text, 3000, ["<unk>", "<s>", "</s>", "<SPECIAL_3>", "<SPECIAL_4>", "<SPECIAL_10>"])
    t.add_tokens([AddedToken("[INST]", lstrip=True, rstrip=True, normalized=False),
                  AddedToken("[/INST]", rstrip=True, normalized=True),
                  AddedToken("foo", single_word=True, normalized=False),
                  AddedToken("<tool>", lstrip=True, normalized=True)])
    t.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    return t


def build_sp(text):
    """SentencePiece-style BPE (Llama-2 layout). Trained with a temporary Metaspace-like split so
    that merges do not span words; saved without a pre-tokenizer, as Llama-2's tokenizer.json."""
    t = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
    train(t, text, 2000, ["<unk>", "<s>", "</s>"], limit_alphabet=120, byte_alphabet=False)
    t.pre_tokenizer = None
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])

    def add_bytes(j):   # <0x00>..<0xFF> at ids 3..258 as in Llama-2, the rest shifted
        vocab = j["model"]["vocab"]
        order = sorted(vocab, key=vocab.get)
        fallback = [f"<0x{b:02X}>" for b in range(256)]
        order = order[:3] + fallback + [s for s in order[3:] if s not in fallback]
        j["model"]["vocab"] = {s: i for i, s in enumerate(order)}
        for a in j["added_tokens"]:
            a["id"] = j["model"]["vocab"][a["content"]]
    return t, add_bytes


VARIANTS = {
    # name: (pre_tokenizer, decoder or "null", model kwargs, byte alphabet)
    "v_removed_prefix": (lambda: pre_tokenizers.Sequence([pre_tokenizers.Split(" ", "removed"),
                                                          byte_level(prefix=True)]), "bytelevel", {}, True),
    "v_merged_prev_digits": (lambda: pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\s+"), "merged_with_previous"),
                                                              pre_tokenizers.Digits(individual_digits=False),
                                                              byte_level()]), "bytelevel", {}, True),
    "v_merged_next_invert": (lambda: pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"[aeiou]+|\d"), "merged_with_next",
                                                                                   invert=True),
                                                              pre_tokenizers.Digits(individual_digits=True),
                                                              byte_level()]), "bytelevel", {}, True),
    "v_contiguous": (lambda: pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{L}"), "contiguous"),
                                                      byte_level(prefix=True, regex=True)]), "null", {}, True),
    "v_removed_invert_wordpiece": (lambda: pre_tokenizers.Split(Regex(r"\w+|[^\w\s]+"), "removed", invert=True),
                                   "null", {"continuing_subword_prefix": "##", "unk_token": "[UNK]", "fuse_unk": True},
                                   False),
}


def build_variant(name, text):
    pre, dec, kw, byte_alpha = VARIANTS[name]
    t = Tokenizer(models.BPE(**kw))
    t.pre_tokenizer = pre()
    if dec == "bytelevel":
        t.decoder = decoders.ByteLevel()
    specials = ["[UNK]", "<s>", "</s>"] if "unk_token" in kw else ["<s>", "</s>"]
    train(t, text, 1000, specials, limit_alphabet=None if byte_alpha else 80, byte_alphabet=byte_alpha)
    t.add_tokens([AddedToken("<sep>", lstrip=True, rstrip=True, normalized=False, special=False)])
    if name == "v_contiguous":
        t.post_processor = processors.RobertaProcessing(("</s>", t.token_to_id("</s>")), ("<s>", t.token_to_id("<s>")))
    return t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    tr = sub.add_parser("train")
    tr.add_argument("--corpus", default=DEFAULT_CORPUS)
    tr.add_argument("--out", default=os.path.join(REPO, "tests/golden/tokenizer"))
    tr.add_argument("--train-chars", type=int, default=3_000_000)
    go = sub.add_parser("golden")
    go.add_argument("--tokenizer", required=True)
    go.add_argument("--name")
    go.add_argument("--corpus", default=DEFAULT_CORPUS)
    go.add_argument("--out", default=os.path.join(REPO, "tests/golden/tokenizer"))
    args = ap.parse_args()

    os.makedirs(args.out, exist_ok=True)
    if args.mode == "golden":
        text = read_corpus_head(args.corpus, 1_000_000)
        name = args.name or os.path.basename(os.path.dirname(os.path.abspath(args.tokenizer)))
        write_golden(args.tokenizer, name, args.out, make_strings(text, specials_of(args.tokenizer), 500, 400))
        return

    text = read_corpus_head(args.corpus, args.train_chars)
    print(f"training on the first {len(text)} characters of {args.corpus}")
    built = [("llama3_style", build_llama3(text), None),
             ("gpt2_style", build_gpt2(text), merges_as_strings),
             ("nemotron_style", build_nemotron(text), None)]
    sp, sp_edit = build_sp(text)
    built.append(("sp_style", sp, sp_edit))
    for name, t, edit in built:
        path = save(t, args.out, name, edit)
        write_golden(path, name, args.out, make_strings(text, specials_of(path), 500, 420))
    small = text[:1_000_000]
    for name in VARIANTS:
        path = save(build_variant(name, small), args.out, name)
        write_golden(path, name, args.out, make_strings(text, specials_of(path), 100, 100), n_decode=100)


if __name__ == "__main__":
    sys.exit(main())
