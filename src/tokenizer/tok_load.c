/* Loading an HF tokenizer.json (format of tokenizers >= 0.13; fields as serialized by
 * tokenizers/src/{models/bpe/serialization.rs, tokenizer/serialization.rs, normalizers,
 * pre_tokenizers, processors, decoders}) into struct fp4moe_tokenizer. Every refusal names the
 * file and the JSON field. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/error.h"
#include "common/json.h"
#include "tokenizer/tok_internal.h"

#define MAX_NESTING 8

/* GPT-2's pre-tokenizer regex (HF ByteLevel use_regex=true). */
static const char GPT2_REGEX[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/* ---- file and JSON helpers ----------------------------------------------------------------- */
static int read_file(const char *path, char **data, size_t *len) {
    *data = NULL;
    *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return fp4moe_set_error(FP4MOE_EIO, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
        fclose(f);
        return fp4moe_set_error(FP4MOE_EIO, "%s: not a regular file", path);
    }
    char *buf = malloc((size_t)st.st_size + 1);
    if (!buf) {
        fclose(f);
        return fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory (%lld bytes)", path, (long long)st.st_size);
    }
    size_t got = fread(buf, 1, (size_t)st.st_size, f);
    int err = ferror(f);
    fclose(f);
    if (err || got != (size_t)st.st_size) {
        free(buf);
        return fp4moe_set_error(FP4MOE_EIO, "%s: read error (%zu of %lld bytes)", path, got, (long long)st.st_size);
    }
    buf[got] = 0;
    *data = buf;
    *len = got;
    return FP4MOE_OK;
}

/* Parses a JSON file; the message gives the line and column of a syntax error. */
static int parse_json_file(const char *path, cJSON **root) {
    char *data;
    size_t len;
    int rc = read_file(path, &data, &len);
    if (rc) return rc;
    rc = fp4moe_json_parse(data, len, path, root);
    free(data);
    return rc;
}

typedef struct {
    fp4moe_tokenizer *tok;
    const char *file;
} loader;

/* A string field (NULL or absent -> *out = NULL when optional, else an error). */
static int get_str(loader *L, const cJSON *obj, const char *key, const char *where, int optional,
                   const char **out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    *out = NULL;
    if (!v || cJSON_IsNull(v)) {
        if (optional) return FP4MOE_OK;
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: field %s.%s is missing", L->file, where, key);
    }
    if (!cJSON_IsString(v))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: field %s.%s must be a string", L->file, where, key);
    *out = v->valuestring;
    return FP4MOE_OK;
}

/* A boolean field with a default. */
static int get_bool(loader *L, const cJSON *obj, const char *key, const char *where, int dflt, int *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    *out = dflt;
    if (!v || cJSON_IsNull(v)) return FP4MOE_OK;
    if (!cJSON_IsBool(v))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: field %s.%s must be true or false", L->file, where, key);
    *out = cJSON_IsTrue(v);
    return FP4MOE_OK;
}

/* A JSON number that is an integer in [0, INT32_MAX) -> *out, else -1. */
static int json_id(const cJSON *v, int32_t *out) {
    if (!cJSON_IsNumber(v)) return -1;
    double d = v->valuedouble;
    if (!(d >= 0 && d < (double)INT32_MAX) || d != floor(d)) return -1;
    *out = (int32_t)d;
    return 0;
}

static char *arena_str(loader *L, const char *s) {
    char *p = tok_arena_strndup(&L->tok->arena, s, strlen(s));
    if (!p) fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", L->file);
    return p;
}

/* {"String": s} or {"Regex": r} */
static int load_pattern(loader *L, const cJSON *obj, const char *where, tok_pattern *p) {
    const cJSON *pat = cJSON_GetObjectItemCaseSensitive(obj, "pattern");
    const cJSON *s = pat ? cJSON_GetObjectItemCaseSensitive(pat, "String") : NULL;
    const cJSON *r = pat ? cJSON_GetObjectItemCaseSensitive(pat, "Regex") : NULL;
    if (cJSON_IsString(s)) return tok_pattern_literal(p, s->valuestring, (int64_t)strlen(s->valuestring));
    if (cJSON_IsString(r)) {
        char w[512];
        snprintf(w, sizeof w, "%s: field %s.pattern.Regex", L->file, where);
        return tok_pattern_regex(p, r->valuestring, w);
    }
    return fp4moe_set_error(FP4MOE_EFORMAT, "%s: field %s.pattern must be {\"String\": ...} or {\"Regex\": ...}",
                            L->file, where);
}

/* ---- model --------------------------------------------------------------------------------- */
static int load_model(loader *L, const cJSON *model) {
    fp4moe_tokenizer *tok = L->tok;
    int rc;
    if (!cJSON_IsObject(model))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: field model is missing or not an object", L->file);
    const char *type;
    if ((rc = get_str(L, model, "type", "model", 1, &type))) return rc;
    if (type ? strcmp(type, "BPE") != 0 : !cJSON_GetObjectItemCaseSensitive(model, "merges"))
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: model.type \"%s\" is not supported (only BPE)", L->file,
                                type ? type : "(none)");
    const cJSON *dropout = cJSON_GetObjectItemCaseSensitive(model, "dropout");
    if (dropout && !cJSON_IsNull(dropout) && !(cJSON_IsNumber(dropout) && dropout->valuedouble == 0))
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: model.dropout is set (BPE dropout is not supported)", L->file);
    if ((rc = get_bool(L, model, "byte_fallback", "model", 0, &tok->byte_fallback)) ||
        (rc = get_bool(L, model, "ignore_merges", "model", 0, &tok->ignore_merges)) ||
        (rc = get_bool(L, model, "fuse_unk", "model", 0, &tok->fuse_unk)))
        return rc;
    const char *s;
    if ((rc = get_str(L, model, "continuing_subword_prefix", "model", 1, &s))) return rc;
    if (s && *s && !(tok->cont_prefix = arena_str(L, s))) return FP4MOE_ENOMEM;
    if ((rc = get_str(L, model, "end_of_word_suffix", "model", 1, &s))) return rc;
    if (s && *s && !(tok->eow_suffix = arena_str(L, s))) return FP4MOE_ENOMEM;

    /* vocab: {"token": id, ...} */
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    if (!cJSON_IsObject(vocab))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: field model.vocab is missing or not an object", L->file);
    for (const cJSON *e = vocab->child; e; e = e->next) {
        int32_t id;
        if (json_id(e, &id))
            return fp4moe_set_error(FP4MOE_EFORMAT, "%s: model.vocab[\"%s\"] is not an id in [0, 2^31)", L->file,
                                    e->string);
        size_t n = strlen(e->string);
        char *key = tok_arena_strndup(&tok->arena, e->string, n);
        if (!key) return fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory (vocab)", L->file);
        if ((rc = tok_strmap_put(&tok->vocab, key, (int32_t)n, id))) return rc;
        if (id >= tok->n_ids) tok->n_ids = (int64_t)id + 1;
    }
    /* tables are indexed by id: ids must stay near the number of entries (a file of a few bytes
       must not make the loader allocate gigabytes) */
    const int64_t n_vocab = cJSON_GetArraySize(vocab);
    if (tok->byte_fallback) {   /* byte_fallback needs the <0xXX> tokens, else characters are lost */
        int have = 0;
        for (int b = 0; b < 256; b++) {
            char name[8];
            snprintf(name, sizeof name, "<0x%02X>", b);
            have += tok_strmap_get(&tok->vocab, name, 6) >= 0;
        }
        if (!have)
            return fp4moe_set_error(FP4MOE_EFORMAT, "%s: model.byte_fallback is true but model.vocab has none of "
                                    "the byte tokens <0x00>..<0xFF> (unknown characters would be dropped)", L->file);
    }
    if (tok->n_ids > 2 * n_vocab + 1024)
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: model.vocab has %lld entries but an id of %lld: ids must run "
                                "from 0 to about the number of entries", L->file, (long long)n_vocab,
                                (long long)(tok->n_ids - 1));

    const char *unk;
    if ((rc = get_str(L, model, "unk_token", "model", 1, &unk))) return rc;
    tok->unk_id = -1;
    if (unk && (tok->unk_id = tok_strmap_get(&tok->vocab, unk, (int64_t)strlen(unk))) < 0)
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: model.unk_token \"%s\" is not in model.vocab", L->file, unk);

    /* merges: ["a b", ...] (older files) or [["a", "b"], ...]; rank = position */
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    if (merges && !cJSON_IsArray(merges))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: field model.merges must be a list", L->file);
    size_t prefix_len = tok->cont_prefix ? strlen(tok->cont_prefix) : 0;
    tok_buf joined = {0};
    int32_t rank = 0;
    for (const cJSON *m = merges ? merges->child : NULL; m; m = m->next, rank++) {
        const char *a, *b;
        size_t a_len, b_len;
        if (cJSON_IsString(m)) {
            const char *sp = strchr(m->valuestring, ' ');
            if (!sp) {
                rc = fp4moe_set_error(FP4MOE_EFORMAT, "%s: model.merges[%d] \"%s\" is not a pair \"a b\"", L->file,
                                      rank, m->valuestring);
                break;
            }
            a = m->valuestring;
            a_len = (size_t)(sp - a);
            b = sp + 1;
            b_len = strlen(b);
        } else if (cJSON_IsArray(m) && cJSON_GetArraySize(m) == 2 && cJSON_IsString(m->child) &&
                   cJSON_IsString(m->child->next)) {
            a = m->child->valuestring;
            a_len = strlen(a);
            b = m->child->next->valuestring;
            b_len = strlen(b);
        } else {
            rc = fp4moe_set_error(FP4MOE_EFORMAT, "%s: model.merges[%d] is neither \"a b\" nor [\"a\", \"b\"]",
                                  L->file, rank);
            break;
        }
        int32_t ia = tok_strmap_get(&tok->vocab, a, (int64_t)a_len);
        int32_t ib = tok_strmap_get(&tok->vocab, b, (int64_t)b_len);
        if (ia < 0 || ib < 0) {
            rc = fp4moe_set_error(FP4MOE_EFORMAT, "%s: model.merges[%d]: token \"%.*s\" is not in model.vocab",
                                  L->file, rank, (int)(ia < 0 ? a_len : b_len), ia < 0 ? a : b);
            break;
        }
        if (b_len < prefix_len) {
            rc = fp4moe_set_error(FP4MOE_EFORMAT, "%s: model.merges[%d]: \"%s\" is shorter than "
                                  "continuing_subword_prefix", L->file, rank, b);
            break;
        }
        joined.n = 0;
        if ((rc = tok_buf_append(&joined, a, (int64_t)a_len)) ||
            (rc = tok_buf_append(&joined, b + prefix_len, (int64_t)(b_len - prefix_len))))
            break;
        int32_t im = tok_strmap_get(&tok->vocab, joined.p, joined.n);
        if (im < 0) {
            rc = fp4moe_set_error(FP4MOE_EFORMAT, "%s: model.merges[%d]: merged token \"%s\" is not in model.vocab",
                                  L->file, rank, joined.p);
            break;
        }
        if ((rc = tok_pairmap_put(&tok->merges, ia, ib, rank, im))) break;
    }
    tok_buf_free(&joined);
    return rc;
}

/* ---- added tokens -------------------------------------------------------------------------- */
/* HF TokenizerImpl deserialization calls add_tokens(all of them): a token keeps the id its content
 * already has (added before, or in the model vocab), else it gets the next free id; the JSON "id"
 * is only compared (HF warns). We do the same so that ids match HF's. */
static int load_added(loader *L, const cJSON *arr) {
    fp4moe_tokenizer *tok = L->tok;
    int rc = FP4MOE_OK;
    if (!arr || cJSON_IsNull(arr)) return FP4MOE_OK;
    if (!cJSON_IsArray(arr))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: field added_tokens must be a list", L->file);
    int64_t n = cJSON_GetArraySize(arr);
    tok->added = calloc((size_t)(n ? n : 1), sizeof *tok->added);
    if (!tok->added) return fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory (added tokens)", L->file);
    int64_t vocab_count = tok->vocab.n;
    int32_t max_added = -1;
    int64_t i = 0;
    for (const cJSON *t = arr->child; t; t = t->next, i++) {
        char where[64];
        snprintf(where, sizeof where, "added_tokens[%lld]", (long long)i);
        const char *content;
        int single_word, lstrip, rstrip, normalized, special;
        if ((rc = get_str(L, t, "content", where, 0, &content))) return rc;
        if ((rc = get_bool(L, t, "special", where, 0, &special)) ||
            (rc = get_bool(L, t, "single_word", where, 0, &single_word)) ||
            (rc = get_bool(L, t, "lstrip", where, 0, &lstrip)) ||
            (rc = get_bool(L, t, "rstrip", where, 0, &rstrip)) ||
            (rc = get_bool(L, t, "normalized", where, !special, &normalized)))
            return rc;
        int32_t json_id_v;
        if (json_id(cJSON_GetObjectItemCaseSensitive(t, "id"), &json_id_v))
            return fp4moe_set_error(FP4MOE_EFORMAT, "%s: field %s.id is missing or not an id", L->file, where);
        size_t len = strlen(content);
        if (len == 0) continue;   /* HF ignores empty added tokens */
        int32_t id = tok_strmap_get(&tok->added_map, content, (int64_t)len);
        int64_t slot = -1;
        if (id >= 0) {
            for (int64_t k = 0; k < tok->n_added; k++)
                if (tok->added[k].id == id) slot = k;
        } else {
            id = tok_strmap_get(&tok->vocab, content, (int64_t)len);
            if (id < 0)
                id = max_added < 0 ? (int32_t)vocab_count
                     : (max_added >= vocab_count || vocab_count == 0) ? max_added + 1 : (int32_t)vocab_count;
        }
        if (slot < 0) {
            slot = tok->n_added++;
            char *c = tok_arena_strndup(&tok->arena, content, len);
            if (!c) return fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory (added tokens)", L->file);
            tok->added[slot].content = c;
            tok->added[slot].len = (int32_t)len;
            tok->added[slot].id = id;
            if ((rc = tok_strmap_put(&tok->added_map, c, (int32_t)len, id))) return rc;
        }
        if (id != json_id_v)
            return fp4moe_set_error(FP4MOE_EFORMAT, "%s: %s (\"%s\") declares id %d, but it gets id %d (%s): the "
                                    "file is inconsistent", L->file, where, content, json_id_v, id,
                                    tok_strmap_get(&tok->vocab, content, (int64_t)len) == id
                                        ? "its content is that vocab entry"
                                        : "the next free id after the vocab and the earlier added tokens");
        tok_added *a = &tok->added[slot];
        a->special = (uint8_t)(a->special | special);
        a->normalized = (uint8_t)normalized;
        a->lstrip = (uint8_t)lstrip;
        a->rstrip = (uint8_t)rstrip;
        a->single_word = (uint8_t)single_word;
        if (id > max_added) max_added = id;
        if (id >= tok->n_ids) tok->n_ids = (int64_t)id + 1;
    }
    return FP4MOE_OK;
}

/* ---- normalizer ---------------------------------------------------------------------------- */
static int add_norm(loader *L, const cJSON *obj, const char *where, int depth) {
    fp4moe_tokenizer *tok = L->tok;
    int rc;
    if (!obj || cJSON_IsNull(obj)) return FP4MOE_OK;
    const char *type;
    if ((rc = get_str(L, obj, "type", where, 0, &type))) return rc;
    if (strcmp(type, "Sequence") == 0) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(obj, "normalizers");
        if (depth >= MAX_NESTING)
            return fp4moe_set_error(FP4MOE_EFORMAT, "%s: field %s.normalizers is nested deeper than %d levels", L->file, where, MAX_NESTING);
        if (!cJSON_IsArray(list))
            return fp4moe_set_error(FP4MOE_EFORMAT, "%s: field %s.normalizers must be a list", L->file, where);
        int i = 0;
        for (const cJSON *n = list->child; n; n = n->next, i++) {
            char w[256];
            snprintf(w, sizeof w, "%s.normalizers[%d]", where, i);
            if ((rc = add_norm(L, n, w, depth + 1))) return rc;
        }
        return FP4MOE_OK;
    }
    tok_norm nm;
    memset(&nm, 0, sizeof nm);
    const char *content;
    if (strcmp(type, "Prepend") == 0) {
        nm.type = TOK_NORM_PREPEND;
        if ((rc = get_str(L, obj, "prepend", where, 0, &content))) return rc;
    } else if (strcmp(type, "Replace") == 0) {
        nm.type = TOK_NORM_REPLACE;
        if ((rc = get_str(L, obj, "content", where, 0, &content))) return rc;
        if ((rc = load_pattern(L, obj, where, &nm.pattern))) return rc;
    } else {
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED,
                                "%s: %s.type \"%s\" is not supported (normalizers: null, Sequence, Prepend, Replace)",
                                L->file, where, type);
    }
    nm.content_len = (int64_t)strlen(content);
    nm.content = malloc((size_t)nm.content_len + 1);
    tok_norm *grown = realloc(tok->norm, (size_t)(tok->n_norm + 1) * sizeof *grown);
    if (!nm.content || !grown) {
        free(nm.content);
        tok_pattern_free(&nm.pattern);
        if (grown) tok->norm = grown;
        return fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", L->file);
    }
    memcpy(nm.content, content, (size_t)nm.content_len + 1);
    tok->norm = grown;
    tok->norm[tok->n_norm++] = nm;
    return FP4MOE_OK;
}

/* ---- pre-tokenizer ------------------------------------------------------------------------- */
static int push_pre(loader *L, tok_pre *p) {
    fp4moe_tokenizer *tok = L->tok;
    if (tok->n_pre >= TOK_MAX_PRE) {
        tok_pattern_free(&p->pattern);
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: more than %d pre-tokenizer steps", L->file, TOK_MAX_PRE);
    }
    tok_pre *grown = realloc(tok->pre, (size_t)(tok->n_pre + 1) * sizeof *grown);
    if (!grown) {
        tok_pattern_free(&p->pattern);
        return fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", L->file);
    }
    tok->pre = grown;
    tok->pre[tok->n_pre++] = *p;
    return FP4MOE_OK;
}

static int add_pre(loader *L, const cJSON *obj, const char *where, int depth) {
    fp4moe_tokenizer *tok = L->tok;
    int rc;
    if (!obj || cJSON_IsNull(obj)) return FP4MOE_OK;
    const char *type;
    if ((rc = get_str(L, obj, "type", where, 0, &type))) return rc;
    if (tok->byte_level)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: %s (%s) follows a ByteLevel pre-tokenizer; only a "
                                "final ByteLevel is supported", L->file, where, type);
    tok_pre p;
    memset(&p, 0, sizeof p);
    if (strcmp(type, "Sequence") == 0) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(obj, "pretokenizers");
        if (depth >= MAX_NESTING)
            return fp4moe_set_error(FP4MOE_EFORMAT, "%s: field %s.pretokenizers is nested deeper than %d levels", L->file, where, MAX_NESTING);
        if (!cJSON_IsArray(list))
            return fp4moe_set_error(FP4MOE_EFORMAT, "%s: field %s.pretokenizers must be a list", L->file, where);
        int i = 0;
        for (const cJSON *n = list->child; n; n = n->next, i++) {
            char w[256];
            snprintf(w, sizeof w, "%s.pretokenizers[%d]", where, i);
            if ((rc = add_pre(L, n, w, depth + 1))) return rc;
        }
        return FP4MOE_OK;
    }
    if (strcmp(type, "Split") == 0) {
        static const char *names[] = {"Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"};
        const char *behavior;
        if ((rc = get_str(L, obj, "behavior", where, 0, &behavior)) ||
            (rc = get_bool(L, obj, "invert", where, 0, &p.invert)))
            return rc;
        int b = -1;
        for (int i = 0; i < 5; i++)
            if (strcmp(behavior, names[i]) == 0) b = i;
        if (b < 0)
            return fp4moe_set_error(FP4MOE_EFORMAT, "%s: %s.behavior \"%s\" is not one of Removed, Isolated, "
                                    "MergedWithPrevious, MergedWithNext, Contiguous", L->file, where, behavior);
        p.type = TOK_PRE_SPLIT;
        p.behavior = (tok_split_behavior)b;
        p.has_pattern = 1;
        if ((rc = load_pattern(L, obj, where, &p.pattern))) return rc;
        return push_pre(L, &p);
    }
    if (strcmp(type, "Digits") == 0) {   /* char::is_numeric runs (or single digits), isolated */
        int individual;
        if ((rc = get_bool(L, obj, "individual_digits", where, 0, &individual))) return rc;
        p.type = TOK_PRE_SPLIT;
        p.behavior = TOK_SPLIT_ISOLATED;
        p.has_pattern = 1;
        if ((rc = tok_pattern_regex(&p.pattern, individual ? "\\p{N}" : "\\p{N}+", L->file))) return rc;
        return push_pre(L, &p);
    }
    if (strcmp(type, "ByteLevel") == 0) {
        int use_regex;
        if ((rc = get_bool(L, obj, "add_prefix_space", where, 1, &p.add_prefix_space)) ||
            (rc = get_bool(L, obj, "use_regex", where, 1, &use_regex)))
            return rc;
        p.type = TOK_PRE_BYTELEVEL;
        p.behavior = TOK_SPLIT_ISOLATED;
        p.has_pattern = use_regex;
        if (use_regex && (rc = tok_pattern_regex(&p.pattern, GPT2_REGEX, L->file))) return rc;
        if ((rc = push_pre(L, &p))) return rc;
        tok->byte_level = 1;
        return FP4MOE_OK;
    }
    return fp4moe_set_error(FP4MOE_EUNSUPPORTED,
                            "%s: %s.type \"%s\" is not supported (pre-tokenizers: null, Sequence, Split, Digits, "
                            "ByteLevel)", L->file, where, type);
}

/* ---- post-processor ------------------------------------------------------------------------ */
/* Applies one processor's "single" template around the current prefix/suffix. */
static int wrap_template(loader *L, const tok_ivec *pre, const tok_ivec *suf) {
    fp4moe_tokenizer *tok = L->tok;
    tok_ivec p = {0};
    int rc = FP4MOE_OK;
    for (int64_t i = 0; i < pre->n && !rc; i++) rc = tok_ivec_push(&p, pre->p[i]);
    for (int64_t i = 0; i < tok->post_prefix.n && !rc; i++) rc = tok_ivec_push(&p, tok->post_prefix.p[i]);
    for (int64_t i = 0; i < suf->n && !rc; i++) rc = tok_ivec_push(&tok->post_suffix, suf->p[i]);
    if (rc) {
        tok_ivec_free(&p);
        return rc;
    }
    tok_ivec_free(&tok->post_prefix);
    tok->post_prefix = p;
    return FP4MOE_OK;
}

/* ["<s>", 1] (Roberta/Bert cls/sep) -> id */
static int pair_id(loader *L, const cJSON *obj, const char *key, const char *where, int32_t *id) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!cJSON_IsArray(v) || cJSON_GetArraySize(v) != 2 || json_id(cJSON_GetArrayItem(v, 1), id))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: field %s.%s must be [\"token\", id]", L->file, where, key);
    return FP4MOE_OK;
}

static int load_post(loader *L, const cJSON *obj, const char *where, int depth) {
    int rc;
    if (!obj || cJSON_IsNull(obj)) return FP4MOE_OK;
    const char *type;
    if ((rc = get_str(L, obj, "type", where, 0, &type))) return rc;
    tok_ivec pre = {0}, suf = {0};
    if (strcmp(type, "ByteLevel") == 0) return FP4MOE_OK;   /* offsets only */
    if (strcmp(type, "Sequence") == 0) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(obj, "processors");
        if (depth >= MAX_NESTING)
            return fp4moe_set_error(FP4MOE_EFORMAT, "%s: field %s.processors is nested deeper than %d levels", L->file, where, MAX_NESTING);
        if (!cJSON_IsArray(list))
            return fp4moe_set_error(FP4MOE_EFORMAT, "%s: field %s.processors must be a list", L->file, where);
        int i = 0;
        for (const cJSON *n = list->child; n; n = n->next, i++) {
            char w[256];
            snprintf(w, sizeof w, "%s.processors[%d]", where, i);
            if ((rc = load_post(L, n, w, depth + 1))) return rc;
        }
        return FP4MOE_OK;
    }
    if (strcmp(type, "RobertaProcessing") == 0 || strcmp(type, "BertProcessing") == 0) {
        int32_t cls, sep;
        if ((rc = pair_id(L, obj, "cls", where, &cls)) || (rc = pair_id(L, obj, "sep", where, &sep))) return rc;
        rc = tok_ivec_push(&pre, cls);
        if (!rc) rc = tok_ivec_push(&suf, sep);
    } else if (strcmp(type, "TemplateProcessing") == 0) {
        const cJSON *single = cJSON_GetObjectItemCaseSensitive(obj, "single");
        const cJSON *specials = cJSON_GetObjectItemCaseSensitive(obj, "special_tokens");
        if (!cJSON_IsArray(single))
            return fp4moe_set_error(FP4MOE_EFORMAT, "%s: field %s.single must be a list", L->file, where);
        int seen_seq = 0, i = 0;
        for (const cJSON *piece = single->child; piece && !rc; piece = piece->next, i++) {
            const cJSON *sp = cJSON_GetObjectItemCaseSensitive(piece, "SpecialToken");
            const cJSON *sq = cJSON_GetObjectItemCaseSensitive(piece, "Sequence");
            if (sq) {
                seen_seq++;
                continue;
            }
            const cJSON *name = sp ? cJSON_GetObjectItemCaseSensitive(sp, "id") : NULL;
            const cJSON *def = cJSON_IsString(name) ? cJSON_GetObjectItemCaseSensitive(specials, name->valuestring) : NULL;
            const cJSON *ids = def ? cJSON_GetObjectItemCaseSensitive(def, "ids") : NULL;
            if (!cJSON_IsArray(ids)) {
                rc = fp4moe_set_error(FP4MOE_EFORMAT, "%s: %s.single[%d] names no entry of %s.special_tokens with ids",
                                      L->file, where, i, where);
                break;
            }
            for (const cJSON *x = ids->child; x && !rc; x = x->next) {
                int32_t id;
                if (json_id(x, &id)) {
                    rc = fp4moe_set_error(FP4MOE_EFORMAT, "%s: %s.special_tokens[\"%s\"].ids holds a non-id", L->file,
                                          where, name->valuestring);
                    break;
                }
                rc = tok_ivec_push(seen_seq ? &suf : &pre, id);
            }
        }
        if (!rc && seen_seq != 1)
            rc = fp4moe_set_error(FP4MOE_EFORMAT, "%s: %s.single must hold exactly one Sequence", L->file, where);
    } else {
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED,
                                "%s: %s.type \"%s\" is not supported (post-processors: null, TemplateProcessing, "
                                "ByteLevel, RobertaProcessing, BertProcessing, Sequence)", L->file, where, type);
    }
    if (!rc) rc = wrap_template(L, &pre, &suf);
    tok_ivec_free(&pre);
    tok_ivec_free(&suf);
    return rc;
}

/* ---- decoder ------------------------------------------------------------------------------- */
/* Flattens Sequences into the list of decoder objects. */
static int flatten_dec(loader *L, const cJSON *obj, const char *where, int depth, const cJSON **out, int *n) {
    const char *type;
    int rc = get_str(L, obj, "type", where, 0, &type);
    if (rc) return rc;
    if (strcmp(type, "Sequence") != 0) {
        if (*n >= 16) return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: more than 16 decoders", L->file);
        out[(*n)++] = obj;
        return FP4MOE_OK;
    }
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(obj, "decoders");
    if (depth >= MAX_NESTING)
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: field %s.decoders is nested deeper than %d levels", L->file, where, MAX_NESTING);
    if (!cJSON_IsArray(list))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: field %s.decoders must be a list", L->file, where);
    int i = 0;
    for (const cJSON *d = list->child; d; d = d->next, i++) {
        char w[256];
        snprintf(w, sizeof w, "%s.decoders[%d]", where, i);
        if ((rc = flatten_dec(L, d, w, depth + 1, out, n))) return rc;
    }
    return FP4MOE_OK;
}

/* Supported: null; ByteLevel; or Replace(String)*, ByteFallback?, Fuse?, Strip(start, stop=0)?
 * with Strip only after Fuse (Strip works per token otherwise). */
static int load_decoder(loader *L, const cJSON *obj) {
    fp4moe_tokenizer *tok = L->tok;
    const cJSON *list[16];
    int n = 0, rc;
    tok->dec = TOK_DEC_JOIN_SPACE;
    if (!obj || cJSON_IsNull(obj)) return FP4MOE_OK;
    if ((rc = flatten_dec(L, obj, "decoder", 0, list, &n))) return rc;
    const char *type;
    if (n == 1 && get_str(L, list[0], "type", "decoder", 0, &type) == 0 && strcmp(type, "ByteLevel") == 0) {
        tok->dec = TOK_DEC_BYTELEVEL;
        return FP4MOE_OK;
    }
    tok->dec = TOK_DEC_CHAIN;
    int stage = 0;   /* 0 Replace*, 1 after ByteFallback, 2 after Fuse, 3 after Strip */
    int fused = 0;
    tok->dec_repl = calloc(16, sizeof *tok->dec_repl);
    if (!tok->dec_repl) return fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", L->file);
    for (int i = 0; i < n; i++) {
        get_str(L, list[i], "type", "decoder", 0, &type);
        if (strcmp(type, "Replace") == 0 && stage == 0) {
            const cJSON *pat = cJSON_GetObjectItemCaseSensitive(list[i], "pattern");
            const cJSON *from = pat ? cJSON_GetObjectItemCaseSensitive(pat, "String") : NULL;
            const char *to;
            if ((rc = get_str(L, list[i], "content", "decoder.Replace", 0, &to))) return rc;
            if (!cJSON_IsString(from))
                return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: decoder Replace with a non-String pattern is not "
                                        "supported", L->file);
            tok_dec_replace *r = &tok->dec_repl[tok->n_dec_repl++];
            if (!(r->from = arena_str(L, from->valuestring)) || !(r->to = arena_str(L, to))) return FP4MOE_ENOMEM;
            r->from_len = (int64_t)strlen(r->from);
            r->to_len = (int64_t)strlen(r->to);
        } else if (strcmp(type, "ByteFallback") == 0 && stage < 1) {
            tok->dec_byte_fallback = 1;
            stage = 1;
        } else if (strcmp(type, "Fuse") == 0 && stage < 2) {
            fused = 1;
            stage = 2;
        } else if (strcmp(type, "Strip") == 0 && fused && stage < 3) {
            const char *content;
            const cJSON *start = cJSON_GetObjectItemCaseSensitive(list[i], "start");
            const cJSON *stop = cJSON_GetObjectItemCaseSensitive(list[i], "stop");
            if ((rc = get_str(L, list[i], "content", "decoder.Strip", 0, &content))) return rc;
            int l = 0;
            if (!*content || (tok_utf8_decode(content, (int64_t)strlen(content), &l), content[l] != 0) ||
                !cJSON_IsNumber(start) || !cJSON_IsNumber(stop) || start->valueint < 0 || stop->valueint != 0)
                return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: decoder Strip must have one content character, "
                                        "start >= 0 and stop 0", L->file);
            tok->strip_char = tok_utf8_decode(content, l, &l);
            tok->strip_start = start->valueint;
            stage = 3;
        } else {
            return fp4moe_set_error(FP4MOE_EUNSUPPORTED,
                                    "%s: decoder \"%s\" (position %d) is not supported: decoders are null, ByteLevel, "
                                    "or Sequence[Replace(String)*, ByteFallback?, Fuse?, Strip(stop=0)?] in this order",
                                    L->file, type, i);
        }
    }
    return FP4MOE_OK;
}

/* ---- BOS / EOS ----------------------------------------------------------------------------- */
static int32_t special_by_name(const fp4moe_tokenizer *tok, const cJSON *v) {
    if (cJSON_IsObject(v)) v = cJSON_GetObjectItemCaseSensitive(v, "content");
    if (!cJSON_IsString(v)) return -1;
    return fp4moe_tokenizer_token_to_id(tok, v->valuestring);
}

static int32_t id_or_first(const cJSON *v) {
    int32_t id;
    if (cJSON_IsArray(v)) v = v->child;
    return v && json_id(v, &id) == 0 ? id : -1;
}

/* dir: the directory of tokenizer.json ("" for the current one). Missing files are fine. */
static void load_bos_eos(fp4moe_tokenizer *tok, const char *dir) {
    char path[4096];
    cJSON *root;
    tok->bos_id = tok->eos_id = -1;
    snprintf(path, sizeof path, "%s%stokenizer_config.json", dir, *dir ? "/" : "");
    if (access(path, R_OK) == 0 && parse_json_file(path, &root) == 0) {
        tok->bos_id = special_by_name(tok, cJSON_GetObjectItemCaseSensitive(root, "bos_token"));
        tok->eos_id = special_by_name(tok, cJSON_GetObjectItemCaseSensitive(root, "eos_token"));
        cJSON_Delete(root);
    }
    snprintf(path, sizeof path, "%s%sconfig.json", dir, *dir ? "/" : "");
    if ((tok->bos_id < 0 || tok->eos_id < 0) && access(path, R_OK) == 0 && parse_json_file(path, &root) == 0) {
        if (tok->bos_id < 0) tok->bos_id = id_or_first(cJSON_GetObjectItemCaseSensitive(root, "bos_token_id"));
        if (tok->eos_id < 0) tok->eos_id = id_or_first(cJSON_GetObjectItemCaseSensitive(root, "eos_token_id"));
        cJSON_Delete(root);
    }
    if (tok->bos_id < 0 && tok->post_prefix.n > 0) tok->bos_id = tok->post_prefix.p[0];
    static const char *eos_names[] = {"</s>", "<|endoftext|>", "<|end_of_text|>", "<|im_end|>"};
    for (int i = 0; i < 4 && tok->eos_id < 0; i++) {
        int32_t id = tok_strmap_get(&tok->added_map, eos_names[i], (int64_t)strlen(eos_names[i]));
        if (id >= 0 && tok->id_special[id]) tok->eos_id = id;
    }
    fp4moe_clear_error();
}

/* ---- load ---------------------------------------------------------------------------------- */
static int build_tables(loader *L) {
    fp4moe_tokenizer *tok = L->tok;
    if (tok->n_ids == 0) return fp4moe_set_error(FP4MOE_EFORMAT, "%s: the vocab is empty", L->file);
    tok->id_str = calloc((size_t)tok->n_ids, sizeof *tok->id_str);
    tok->id_len = calloc((size_t)tok->n_ids, sizeof *tok->id_len);
    tok->id_special = calloc((size_t)tok->n_ids, 1);
    if (!tok->id_str || !tok->id_len || !tok->id_special)
        return fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory (id table of %lld)", L->file, (long long)tok->n_ids);
    for (int64_t i = 0; i < tok->vocab.cap; i++) {
        const tok_strmap_entry *e = &tok->vocab.e[i];
        if (!e->key) continue;
        tok->id_str[e->val] = e->key;
        tok->id_len[e->val] = e->len;
    }
    for (int64_t i = 0; i < tok->n_added; i++) {
        const tok_added *a = &tok->added[i];
        tok->id_str[a->id] = a->content;
        tok->id_len[a->id] = a->len;
        if (a->special) tok->id_special[a->id] = 1;
    }
    char name[8];
    for (int b = 0; b < 256; b++) {
        tok_buf one = {0};
        int rc = tok_utf8_append(&one, tok_byte_to_cp((uint8_t)b));
        if (rc) return rc;
        tok->byte_sym[b] = tok_strmap_get(&tok->vocab, one.p, one.n);
        tok_buf_free(&one);
        snprintf(name, sizeof name, "<0x%02X>", b);
        tok->fallback_id[b] = tok_strmap_get(&tok->vocab, name, 6);
    }
    return FP4MOE_OK;
}

int fp4moe_tokenizer_load(const char *path, fp4moe_tokenizer **out) {
    if (out) *out = NULL;
    if (!path || !out) return fp4moe_set_error(FP4MOE_EINVAL, "fp4moe_tokenizer_load: NULL argument");
    fp4moe_tokenizer *tok = calloc(1, sizeof *tok);
    if (!tok) return fp4moe_set_error(FP4MOE_ENOMEM, "fp4moe_tokenizer_load: out of memory");
    tok->bos_id = tok->eos_id = tok->unk_id = -1;

    /* a directory -> DIR/tokenizer.json */
    struct stat st;
    size_t plen = strlen(path);
    int is_dir = stat(path, &st) == 0 && S_ISDIR(st.st_mode);
    tok->path = malloc(plen + sizeof "/tokenizer.json");
    char *dir = malloc(plen + 2);
    if (!tok->path || !dir) {
        free(dir);
        fp4moe_tokenizer_free(tok);
        return fp4moe_set_error(FP4MOE_ENOMEM, "fp4moe_tokenizer_load: out of memory");
    }
    if (is_dir) {
        snprintf(tok->path, plen + sizeof "/tokenizer.json", "%s/tokenizer.json", path);
        memcpy(dir, path, plen + 1);
    } else {
        memcpy(tok->path, path, plen + 1);
        const char *slash = strrchr(path, '/');
        size_t dl = slash ? (size_t)(slash - path) : 0;
        memcpy(dir, path, dl);
        dir[dl] = 0;
        if (slash && dl == 0) strcpy(dir, "/");
    }

    loader L = {tok, tok->path};
    cJSON *root = NULL;
    int rc = parse_json_file(tok->path, &root);
    if (!rc && !cJSON_IsObject(root)) rc = fp4moe_set_error(FP4MOE_EFORMAT, "%s: the top level is not a JSON object", L.file);
    if (!rc) rc = load_model(&L, cJSON_GetObjectItemCaseSensitive(root, "model"));
    if (!rc) rc = load_added(&L, cJSON_GetObjectItemCaseSensitive(root, "added_tokens"));
    if (!rc) rc = add_norm(&L, cJSON_GetObjectItemCaseSensitive(root, "normalizer"), "normalizer", 0);
    if (!rc) rc = add_pre(&L, cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"), "pre_tokenizer", 0);
    if (!rc) rc = load_post(&L, cJSON_GetObjectItemCaseSensitive(root, "post_processor"), "post_processor", 0);
    if (!rc) rc = load_decoder(&L, cJSON_GetObjectItemCaseSensitive(root, "decoder"));
    if (!rc) rc = build_tables(&L);
    if (!rc) rc = tok_build_tries(tok);
    if (!rc) rc = tok_build_pieces(tok);
    for (int64_t i = 0; !rc && i < tok->post_prefix.n + tok->post_suffix.n; i++) {
        int32_t id = i < tok->post_prefix.n ? tok->post_prefix.p[i] : tok->post_suffix.p[i - tok->post_prefix.n];
        if (id >= tok->n_ids || !tok->id_str[id])
            rc = fp4moe_set_error(FP4MOE_EFORMAT, "%s: post_processor adds id %d, which is not a token", L.file, id);
    }
    cJSON_Delete(root);
    if (!rc) load_bos_eos(tok, dir);
    free(dir);
    if (rc) {
        fp4moe_tokenizer_free(tok);
        return rc;
    }
    *out = tok;
    return FP4MOE_OK;
}

void fp4moe_tokenizer_free(fp4moe_tokenizer *tok) {
    if (!tok) return;
    free(tok->path);
    tok_arena_free(&tok->arena);
    free(tok->id_str);
    free(tok->id_len);
    free(tok->id_special);
    free(tok->piece);
    free(tok->piece_len);
    free(tok->piece_byte);
    tok_strmap_free(&tok->vocab);
    tok_pairmap_free(&tok->merges);
    free(tok->added);
    tok_strmap_free(&tok->added_map);
    free(tok->trie_raw.node);
    free(tok->trie_norm.node);
    if (tok->word_char_re) pcre2_code_free(tok->word_char_re);
    for (int i = 0; i < tok->n_norm; i++) {
        tok_pattern_free(&tok->norm[i].pattern);
        free(tok->norm[i].content);
    }
    free(tok->norm);
    for (int i = 0; i < tok->n_pre; i++) tok_pattern_free(&tok->pre[i].pattern);
    free(tok->pre);
    tok_ivec_free(&tok->post_prefix);
    tok_ivec_free(&tok->post_suffix);
    free(tok->dec_repl);
    free(tok);
}

/* ---- small queries ------------------------------------------------------------------------- */
const char *fp4moe_tokenizer_id_to_token(const fp4moe_tokenizer *tok, int32_t id) {
    if (!tok || id < 0 || id >= tok->n_ids) return NULL;
    return tok->id_str[id];
}

int32_t fp4moe_tokenizer_token_to_id(const fp4moe_tokenizer *tok, const char *token) {
    if (!tok || !token) return -1;
    int64_t n = (int64_t)strlen(token);
    int32_t id = tok_strmap_get(&tok->added_map, token, n);
    return id >= 0 ? id : tok_strmap_get(&tok->vocab, token, n);
}

int64_t fp4moe_tokenizer_vocab_size(const fp4moe_tokenizer *tok) { return tok ? tok->n_ids : 0; }
int32_t fp4moe_tokenizer_bos_id(const fp4moe_tokenizer *tok) { return tok ? tok->bos_id : -1; }
int32_t fp4moe_tokenizer_eos_id(const fp4moe_tokenizer *tok) { return tok ? tok->eos_id : -1; }

int fp4moe_tokenizer_is_special(const fp4moe_tokenizer *tok, int32_t id) {
    return tok && id >= 0 && id < tok->n_ids && tok->id_special[id];
}
