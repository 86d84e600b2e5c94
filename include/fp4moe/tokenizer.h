/* fp4moe/tokenizer.h: the HF `tokenizer.json` BPE tokenizer (encode text -> token ids, decode ids
 * -> UTF-8 text, and a streaming decoder for generation).
 *
 * Reference: the HF `tokenizers` library (Rust, v0.20-0.23); every output is meant to be
 * identical to `Tokenizer.from_file(path).encode(text, add_special_tokens=...).ids` and to
 * `Tokenizer.decode(ids, skip_special_tokens=...)`. Checked against it by
 * tests/tokenizer/test_tokenizer.c on the goldens of scripts/make_tokenizer_golden.py.
 *
 * The encode pipeline (each stage as in HF):
 *   1. added tokens with normalized=false are cut out of the raw text (leftmost, then longest
 *      match first; lstrip / rstrip / single_word flags honoured);
 *   2. every other piece is normalized (null, Sequence, Prepend, Replace) and the added tokens
 *      with normalized=true are cut out of it;
 *   3. the pre-tokenizer splits each remaining piece into words: Split (Regex or String pattern,
 *      behavior Removed / Isolated / MergedWithPrevious / MergedWithNext / Contiguous, invert),
 *      Digits, ByteLevel (add_prefix_space, use_regex with the GPT-2 regex, and the 256 bytes <->
 *      printable unicode chars map; must be the last step), or a Sequence of these. Regexes run
 *      through PCRE2 (UTF + UCP, JIT when available); \s and \w are rewritten to Oniguruma's
 *      Unicode meaning (HF compiles them with Oniguruma);
 *   4. the BPE model merges each word by rank (lowest rank first, leftmost first on ties), with
 *      ignore_merges, byte_fallback, unk_token / fuse_unk, continuing_subword_prefix and
 *      end_of_word_suffix;
 *   5. with add_special != 0 the post-processor adds its special tokens (TemplateProcessing
 *      "single", RobertaProcessing, BertProcessing, ByteLevel (no ids), or a Sequence).
 * Decoders: ByteLevel; null (tokens joined by " "); or a Sequence of Replace(String)*,
 * ByteFallback?, Fuse?, Strip(start, stop=0)? (the Llama-2 / SentencePiece-style chain).
 * Anything else in a file (a Unicode normalizer such as NFC, a WordPiece model, dropout, ...) is
 * refused at load time with FP4MOE_EUNSUPPORTED and a message naming the file and the field.
 *
 * Input text must be valid UTF-8 (FP4MOE_EINVAL with the byte offset otherwise); decoded text is
 * always valid UTF-8: invalid byte sequences become U+FFFD exactly as HF does (Rust's
 * String::from_utf8_lossy for ByteLevel; one U+FFFD per byte for a bad ByteFallback run).
 * A loaded tokenizer is immutable: encode/decode may run on several threads at once. */
#ifndef FP4MOE_TOKENIZER_H
#define FP4MOE_TOKENIZER_H

#include <stdint.h>
#include "fp4moe/types.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fp4moe_tokenizer fp4moe_tokenizer;

/* Loads a tokenizer. `path` is a tokenizer.json file or a directory holding one. The BOS/EOS ids
 * come from, in this order: tokenizer_config.json next to it ("bos_token"/"eos_token", a string
 * or {"content": ...}), config.json next to it ("bos_token_id"/"eos_token_id", an int or the first
 * of a list), then tokenizer.json itself (BOS: the first special token of the post-processor's
 * template; EOS: a special added token named </s>, <|endoftext|>, <|end_of_text|> or <|im_end|>).
 * Errors: FP4MOE_EINVAL (NULL argument), FP4MOE_EIO (missing/unreadable file), FP4MOE_EFORMAT
 * (malformed JSON, missing or mistyped field, a merge naming a token not in the vocab, a bad
 * regex), FP4MOE_EUNSUPPORTED (unknown model / normalizer / pre-tokenizer / decoder type),
 * FP4MOE_ENOMEM. The message names the file and the JSON field. On error *out is NULL. */
int fp4moe_tokenizer_load(const char *path, fp4moe_tokenizer **out);

/* Frees everything the tokenizer owns; NULL is a no-op. */
void fp4moe_tokenizer_free(fp4moe_tokenizer *tok);

/* Byte offset of the first invalid UTF-8 sequence in text[0..len) (RFC 3629: no overlongs, no surrogates,
 * <= U+10FFFF), or -1 when all of it is valid (also for len <= 0 or a NULL text): what encode refuses. */
int64_t fp4moe_utf8_invalid_at(const char *text, int64_t len);

/* text[0..len) as valid UTF-8 (lossy): every maximal invalid subpart (Unicode 15 ch. 3, "U+FFFD substitution of
 * maximal subparts") becomes U+FFFD (EF BF BD), the rest is copied - the rule of Rust's String::from_utf8_lossy and
 * Python's bytes.decode("utf-8", "replace"). out: room for 3 * len bytes (no terminating NUL is written); returns
 * the bytes written. For text that must go into JSON (RFC 8259 requires UTF-8): file and tensor names, messages. */
int64_t fp4moe_utf8_lossy(const char *text, int64_t len, char *out);

/* Encodes `len` bytes of UTF-8 `text` (may hold NUL bytes; text may be NULL when len is 0). add_special != 0
 * adds the post-processor's special tokens (e.g. BOS), as HF add_special_tokens=True: so len 0 gives those
 * tokens alone (e.g. [BOS]), or no ids without add_special.
 * On success *ids is a malloc'ed array of *n_ids int32 token ids in [0, vocab_size) that the
 * caller frees with free() (non-NULL even when *n_ids == 0).
 * Errors: FP4MOE_EINVAL (NULL argument, len < 0, invalid UTF-8 at a byte offset),
 * FP4MOE_ENOMEM, FP4MOE_EFORMAT (PCRE2 match failure, e.g. its JIT stack limit). */
int fp4moe_tokenizer_encode(const fp4moe_tokenizer *tok, const char *text, int64_t len,
                            int add_special, int32_t **ids, int64_t *n_ids);

/* Decodes n ids to UTF-8 text, as HF decode(ids, skip_special_tokens): skip_special != 0 drops
 * special added tokens (BOS, EOS, ...). *text is malloc'ed, NUL-terminated (the terminator is not
 * counted in *text_len), freed by the caller with free().
 * Errors: FP4MOE_EINVAL (NULL argument, n < 0, an id outside [0, vocab_size) or an id no token
 * has; HF silently drops such ids, we report them), FP4MOE_ENOMEM. */
int fp4moe_tokenizer_decode(const fp4moe_tokenizer *tok, const int32_t *ids, int64_t n,
                            int skip_special, char **text, int64_t *text_len);

/* The bytes one token contributes to decoded text (after the ByteLevel byte map / the decoder's
 * per-token Replace), NOT necessarily valid UTF-8 on its own (a token may hold half a character;
 * use the streaming decoder to print). For a ByteFallback token <0xXX> it is that one byte.
 * *piece points into the tokenizer (valid until free). Errors: FP4MOE_EINVAL (bad id/NULL). */
int fp4moe_tokenizer_token_to_piece(const fp4moe_tokenizer *tok, int32_t id, const char **piece,
                                    int64_t *piece_len);

/* The token's string as written in the vocab / added_tokens (e.g. "Ġthe", "<s>"), NUL-terminated,
 * or NULL for an id outside [0, vocab_size) or with no token. */
const char *fp4moe_tokenizer_id_to_token(const fp4moe_tokenizer *tok, int32_t id);

/* The id of a vocab or added-token string (added tokens first, as HF token_to_id), or -1. */
int32_t fp4moe_tokenizer_token_to_id(const fp4moe_tokenizer *tok, const char *token);

/* 1 + the largest id of the vocab and the added tokens (HF get_vocab_size(with_added_tokens=True)
 * when ids have no holes). */
int64_t fp4moe_tokenizer_vocab_size(const fp4moe_tokenizer *tok);

/* BOS / EOS ids (see fp4moe_tokenizer_load for where they come from), -1 when unknown. */
int32_t fp4moe_tokenizer_bos_id(const fp4moe_tokenizer *tok);
int32_t fp4moe_tokenizer_eos_id(const fp4moe_tokenizer *tok);

/* 1 if id is a special added token (skipped by decode with skip_special), else 0. */
int fp4moe_tokenizer_is_special(const fp4moe_tokenizer *tok, int32_t id);

/* Streaming decoder: feed one id at a time (generation); each call returns the text that became
 * final, only whole UTF-8 characters (a character split over several tokens is held back until
 * its last byte arrives; a ByteFallback run is held until the run ends), and flush returns the
 * rest. The concatenation of all outputs equals fp4moe_tokenizer_decode of the same ids.
 * The fields are private; use the functions. Not thread-safe (one stream per sequence). */
typedef struct {
    const fp4moe_tokenizer *tok;
    int skip_special;
    int64_t n_tokens;     /* ids accepted so far (skipped specials not counted) */
    int strip_left;       /* Strip decoder: leading content chars still to drop */
    uint8_t *pending;     /* bytes not yet emitted (incomplete UTF-8 / ByteFallback run) */
    int64_t n_pending, cap_pending;
    char *out;            /* text returned by the last push/flush (owned) */
    int64_t cap_out;
} fp4moe_tokenizer_stream;

/* Initializes s for tok (which must outlive it). Never fails. */
void fp4moe_tokenizer_stream_init(fp4moe_tokenizer_stream *s, const fp4moe_tokenizer *tok,
                                  int skip_special);

/* Pushes one id. *text (NUL-terminated, owned by s, valid until the next call on s) receives
 * *text_len >= 0 bytes of complete UTF-8 text. Errors: FP4MOE_EINVAL (bad id), FP4MOE_ENOMEM. */
int fp4moe_tokenizer_stream_push(fp4moe_tokenizer_stream *s, int32_t id, const char **text,
                                 int64_t *text_len);

/* Ends the sequence: returns whatever is pending (an incomplete character becomes U+FFFD, as in
 * full decode) and resets s for a new sequence. Errors: FP4MOE_ENOMEM. */
int fp4moe_tokenizer_stream_flush(fp4moe_tokenizer_stream *s, const char **text,
                                  int64_t *text_len);

/* Bytes the stream holds back (an incomplete character, a ByteFallback run): 0 when everything pushed so far has
 * been returned. */
int64_t fp4moe_tokenizer_stream_pending(const fp4moe_tokenizer_stream *s);
/* Frees the buffers of s (s itself is the caller's); NULL, or twice: nothing. */
void fp4moe_tokenizer_stream_free(fp4moe_tokenizer_stream *s);

#ifdef __cplusplus
}
#endif
#endif
