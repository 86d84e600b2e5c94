/* libFuzzer harness: tokenizer.json loading (fp4moe_tokenizer_load, through a file in /dev/shm:
 * the API loads from paths), then, when it loads, encoding of fixed texts and of the input's own
 * bytes, decoding (all ids up to 512 and the encoded ones, with and without specials) and the
 * streaming decoder. Checks: every id stays in [0, vocab); the stream's output equals decode's.
 * Built and run by fuzz/run_tokenizer.sh. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fp4moe/tokenizer.h"

static char g_path[256];

static void check_text(const fp4moe_tokenizer *tok, const char *s, size_t n) {
    int32_t *ids = NULL;
    int64_t k = 0;
    if (fp4moe_tokenizer_encode(tok, s, (int64_t)n, 1, &ids, &k)) return;
    const int64_t V = fp4moe_tokenizer_vocab_size(tok);
    for (int64_t i = 0; i < k; i++)
        if (ids[i] < 0 || ids[i] >= V) __builtin_trap();
    char *text = NULL;
    int64_t tl = 0;
    if (!fp4moe_tokenizer_decode(tok, ids, k, 0, &text, &tl)) {
        fp4moe_tokenizer_stream st;
        fp4moe_tokenizer_stream_init(&st, tok, 0);
        size_t at = 0;
        int ok = 1;
        for (int64_t i = 0; i < k && ok; i++) {
            const char *t;
            int64_t l;
            if (fp4moe_tokenizer_stream_push(&st, ids[i], &t, &l)) { ok = 0; break; }
            if (at + (size_t)l > (size_t)tl || memcmp(text + at, t, (size_t)l)) __builtin_trap();
            at += (size_t)l;
        }
        const char *t;
        int64_t l;
        if (ok && !fp4moe_tokenizer_stream_flush(&st, &t, &l)) {
            if (at + (size_t)l != (size_t)tl || memcmp(text + at, t, (size_t)l)) __builtin_trap();
        }
        fp4moe_tokenizer_stream_free(&st);
        free(text);
    }
    free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!g_path[0]) snprintf(g_path, sizeof g_path, "/dev/shm/fp4moe-fuzz-tok-%d.json", (int)getpid());
    FILE *f = fopen(g_path, "wb");
    if (!f) return 0;
    fwrite(data, 1, size, f);
    fclose(f);
    fp4moe_tokenizer *tok = NULL;
    if (fp4moe_tokenizer_load(g_path, &tok)) {
        if (tok || !fp4moe_last_error()[0]) __builtin_trap();   /* errors say something */
        return 0;
    }
    static const char *texts[] = {"Hello world", "  The quick brown fox 1234 jumps!\n\n", "\xC3\xBC\xE2\x82\xAC\xF0\x9F\x98\x80 <s></s>", ""};
    for (int i = 0; i < 4; i++) check_text(tok, texts[i], strlen(texts[i]));
    check_text(tok, (const char *)data, size < 256 ? size : 256);
    const int64_t V = fp4moe_tokenizer_vocab_size(tok);
    for (int32_t id = 0; id < V && id < 512; id++) {
        char *t = NULL;
        int64_t l;
        if (!fp4moe_tokenizer_decode(tok, &id, 1, 1, &t, &l)) free(t);
        (void)fp4moe_tokenizer_id_to_token(tok, id);
    }
    fp4moe_tokenizer_free(tok);
    return 0;
}
