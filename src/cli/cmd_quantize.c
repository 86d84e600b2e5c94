/* fp4moe quantize: a float checkpoint (bf16/f16/f32 .safetensors file or model directory) -> MLX
 * nvfp4 (spec NVFP4.md section 2, "MLX"): each selected "<m>.weight" of shape (..., N, K) becomes
 * "<m>.weight" U32 (..., N, K/8) + "<m>.scales" U8 (..., N, K/16), quantized by
 * fp4moe_nvfp4_quantize (spec section 3). HF experts "<p>.experts.{e}.up_proj/down_proj.weight"
 * are stacked into "<p>.switch_mlp.fc1/fc2.weight" (E, N, K) and conv1d weights (C, 1, Kc) are
 * written in MLX's (C, Kc, 1) shape (same bytes), as mlx-lm's nemotron_h sanitize does.
 *
 * Default selection (a choice, documented in the usage text): 2-D/3-D, name ends in ".weight",
 * float dtype, last dim a multiple of 16, and not an embedding, norm, conv1d, router gate
 * ("*.gate.weight") or lm_head. mlx-lm also quantizes embeddings and lm_head by default; fp4moe
 * keeps them in the source dtype like NVIDIA's ModelOpt NVFP4 checkpoints (lm_head) because they
 * dominate the output's accuracy and the lookup needs no matmul. --include replaces the name rules
 * (e.g. --include . quantizes every eligible tensor, mlx-lm style) except that router gates stay in
 * float always (no loader reads a quantized router; a note says so); --exclude removes names from the set.
 * Both are PCRE2 patterns searched (unanchored) in the OUTPUT tensor name. mtp.* tensors (the
 * multi-token-prediction head, unused by fp4moe, dropped by mlx-lm) are copied unchanged. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <cjson/cJSON.h>
#include <pcre2.h>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "fp4moe/fp4moe.h"
#include "fp4moe/checkpoint.h"

#define CMD "quantize"
#define CHUNK_BYTES (8 << 20)           /* source bytes quantized per step */
/* scale MiB kept from the codes pass for the scales pass: FP4MOE_QUANTIZE_STASH_MB (default 1024,
 * src/common/env.c; 0: always recompute) */

typedef struct {
    char *name;                        /* output name ("<m>.weight" or the stacked name) */
    const fp4moe_st_tensor **src;      /* 1 tensor, or E expert tensors when stacked */
    int64_t nsrc;
    int stacked;
    fp4moe_st_dtype dtype;             /* source dtype */
    int ndim;
    int64_t shape[FP4MOE_ST_MAX_DIMS]; /* output logical shape */
    int quantize;
    int64_t E, N, K;                   /* E = product of leading dims (quantized items) */
    float *amax;                       /* E tensor amaxes with --global-scale, else NULL */
    uint8_t *stash;                    /* scales kept by the codes pass, or NULL */
    float clipped;                     /* without a global scale: the largest |w| of a block beyond E4M3 x E2M1
                                          (6 x 448 = 2688), clipped to +-2688 by the format; 0 if none */
    int64_t nonfinite, nonfinite_first; /* a copied float tensor: its NaN / Inf values, the first's index */
} item;

typedef struct {
    item *items;
    int64_t n, cap;
    cli_progress progress;
    int64_t done;
    int64_t stashed;                   /* bytes held in items' stashes */
    int64_t stash_cap;
    int64_t gates_kept;                /* router gates --include matched, kept in float */
} plan;

typedef struct { item *it; int what; plan *p; } fill_ctx; /* what: 0 codes, 1 scales, 2 copy */

static const char *k_help =
    "Quantizes a bf16/f16/f32 checkpoint to MLX nvfp4 (group 16, E4M3 block scales).\n"
    "IN is a .safetensors file (OUT: a file) or a model directory (sharded ok; OUT: a directory\n"
    "that gets the weights, config.json with \"quantization\": {\"group_size\": 16, \"bits\": 4,\n"
    "\"mode\": \"nvfp4\"} (mirrored as \"quantization_config\") and copies of the other files).\n"
    "Quantized by default: every 2-D/3-D '*.weight' of float dtype whose last dim is a multiple of 16,\n"
    "except embeddings, norms, conv1d, the router gate (*.gate.weight) and lm_head (mlx-lm also\n"
    "quantizes embeddings and lm_head: use --include . for its set). Router gates stay in float even\n"
    "when --include matches them (fp4moe and mlx-lm read the router dense).\n"
    "Experts 'P.experts.{e}.up_proj/down_proj.weight' are stacked into 'P.switch_mlp.fc1/fc2.weight'\n"
    "and conv1d weights (C, 1, Kc) get MLX's shape (C, Kc, 1), as mlx-lm does.\n"
    "--include/--exclude are PCRE2 patterns searched in the output tensor names; --include replaces\n"
    "the default name rules, --exclude removes from the set. Other tensors are copied unchanged.";

/* ---- selection -------------------------------------------------------------------------------------- */

static int ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && !memcmp(s + a - b, suffix, b);
}

/* The MoE router's weight (nemotron_h: "<layer>.mixer.gate.weight", E x H): never quantized, whatever
 * --include says - the loaders (fp4moe's, mlx-lm's) read it dense, so a quantized one could not be loaded. */
static int is_router_gate(const char *name) { return ends_with(name, ".gate.weight"); }

/* The default name rules (see the file comment). */
static int default_selected(const char *name) {
    static const char *never[] = {"embed", "norm", "conv1d", "lm_head", "router"};
    for (size_t i = 0; i < sizeof never / sizeof never[0]; i++)
        if (strstr(name, never[i])) return 0;
    return !is_router_gate(name);
}

static int regex_search(pcre2_code *re, const char *s) {
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    if (!md) return 0;
    int rc = pcre2_match(re, (PCRE2_SPTR)s, PCRE2_ZERO_TERMINATED, 0, 0, md, NULL);
    pcre2_match_data_free(md);
    return rc >= 0;
}

static int compile_regex(const char *pattern, const char *flag, pcre2_code **out) {
    *out = NULL;
    if (!pattern) return CLI_OK;
    int err;
    PCRE2_SIZE off;
    *out = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED, 0, &err, &off, NULL);
    if (!*out) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return cli_usage_error(CMD, "%s '%s': bad regular expression at offset %zu: %s", flag, pattern,
                               (size_t)off, (const char *)msg);
    }
    return CLI_OK;
}

/* Structural conditions: what MLX's nvfp4 layout can hold. */
static int eligible(const item *it) {
    fp4moe_dtype dt;
    return (it->ndim == 2 || it->ndim == 3) && ends_with(it->name, ".weight") &&
           fp4moe_st_dtype_to(it->dtype, &dt) == FP4MOE_OK && it->shape[it->ndim - 1] > 0 &&
           it->shape[it->ndim - 1] % FP4MOE_NVFP4_BLOCK == 0 && strncmp(it->name, "mtp.", 4) != 0;
}

/* ---- plan: which output tensors, from which sources ---------------------------------------------- */

static item *new_item(plan *p) {
    if (p->n == p->cap) {
        int64_t cap = p->cap ? 2 * p->cap : 256;
        item *q = realloc(p->items, sizeof *q * (size_t)cap);
        if (!q) return NULL;
        p->items = q;
        p->cap = cap;
    }
    item *it = &p->items[p->n++];
    memset(it, 0, sizeof *it);
    return it;
}

static void free_plan(plan *p) {
    for (int64_t i = 0; i < p->n; i++) {
        free(p->items[i].name);
        free(p->items[i].src);
        free(p->items[i].amax);
        free(p->items[i].stash);
    }
    free(p->items);
}

/* Parses "<prefix>.experts.<e>.<up_proj|down_proj>.weight" (not mtp.*): returns 1 and sets the
 * stacked name ("<prefix>.switch_mlp.fc1.weight" / fc2) and e; 0 for another name; an error for an expert
 * projection whose index is not a plain decimal below 1,000,000 ("00", "-1", "1e3", "99999999999"): stacked, it
 * would take another expert's slot or none, and left unstacked it would be a stray tensor no loader reads. */
static int parse_expert(const char *name, char *stacked, size_t cap, int64_t *e) {
    if (!strncmp(name, "mtp.", 4)) return 0;
    const char *x = strstr(name, ".experts.");
    if (!x) return 0;
    const char *d = x + 9, *end = strchr(d, '.');
    if (!end) return 0;
    const char *fc = !strcmp(end, ".up_proj.weight") ? "fc1" : !strcmp(end, ".down_proj.weight") ? "fc2" : NULL;
    if (!fc) return 0;
    long long v = 0;
    int ok = end > d && end - d <= 6 && (d[0] != '0' || end - d == 1);
    for (const char *c = d; ok && c < end; c++) {
        ok = *c >= '0' && *c <= '9';
        v = v * 10 + (*c - '0');
    }
    if (!ok)
        return fp4moe_set_error(FP4MOE_EFORMAT, "tensor '%s': expert index '%.*s' is not a plain decimal number "
                                "below 1000000 (the experts are stacked by it)", name, (int)(end - d), d);
    if ((size_t)snprintf(stacked, cap, "%.*s.switch_mlp.%s.weight", (int)(x - name), name, fc) >= cap) return 0;
    *e = v;
    return 1;
}

static int build_plan(const fp4moe_st_model *m, pcre2_code *inc, pcre2_code *exc, plan *p) {
    const int64_t n = fp4moe_st_model_count(m);
    for (int64_t i = 0; i < n; i++) {
        const fp4moe_st_tensor *t = fp4moe_st_model_at(m, i);
        char stacked[1024];
        int64_t e = 0;
        const int r = parse_expert(t->name, stacked, sizeof stacked, &e);
        if (r < 0) return r;
        if (r) {
            item *g = NULL;
            for (int64_t j = 0; j < p->n && !g; j++)
                if (p->items[j].stacked && !strcmp(p->items[j].name, stacked)) g = &p->items[j];
            if (!g) {
                if (!(g = new_item(p)) || !(g->name = strdup(stacked)))
                    return fp4moe_set_error(FP4MOE_ENOMEM, "out of memory");
                g->stacked = 1;
            }
            if (e >= g->nsrc) { /* grow the expert table to e + 1 slots */
                const fp4moe_st_tensor **s = realloc(g->src, sizeof *s * (size_t)(e + 1));
                if (!s) return fp4moe_set_error(FP4MOE_ENOMEM, "out of memory");
                for (int64_t k = g->nsrc; k <= e; k++) s[k] = NULL;
                g->src = s;
                g->nsrc = e + 1;
            }
            if (g->src[e])
                return fp4moe_set_error(FP4MOE_EFORMAT, "expert %lld of '%s' is given twice: '%s' and '%s'",
                                        (long long)e, stacked, g->src[e]->name, t->name);
            g->src[e] = t;
            continue;
        }
        item *it = new_item(p);
        if (!it || !(it->name = strdup(t->name)) || !(it->src = malloc(sizeof *it->src)))
            return fp4moe_set_error(FP4MOE_ENOMEM, "out of memory");
        it->src[0] = t;
        it->nsrc = 1;
    }
    for (int64_t i = 0; i < p->n; i++) {
        item *it = &p->items[i];
        const fp4moe_st_tensor *t0 = it->src[0];
        if (it->stacked) {
            for (int64_t e = 0; e < it->nsrc; e++) {
                const fp4moe_st_tensor *t = it->src[e];
                if (!t)
                    return fp4moe_set_error(FP4MOE_EFORMAT, "expert %lld of '%s' is missing (have up to %lld)",
                                            (long long)e, it->name, (long long)it->nsrc - 1);
                if (t->dtype != t0->dtype || t->ndim != 2 || t0->ndim != 2 || t->shape[0] != t0->shape[0] ||
                    t->shape[1] != t0->shape[1])
                    return fp4moe_set_error(FP4MOE_EFORMAT, "%s: expert tensor '%s' (%s, %d dims) differs in "
                                            "dtype or shape from '%s'; cannot stack into '%s'",
                                            t->file, t->name, fp4moe_st_dtype_name(t->dtype), t->ndim,
                                            t0->name, it->name);
            }
            it->ndim = 3;
            it->shape[0] = it->nsrc;
            it->shape[1] = t0->shape[0];
            it->shape[2] = t0->shape[1];
        } else {
            it->ndim = t0->ndim;
            memcpy(it->shape, t0->shape, sizeof it->shape);
            /* HF conv1d (C, 1, Kc) -> MLX (C, Kc, 1), as mlx-lm's sanitize: the same bytes */
            if (strstr(it->name, "conv1d.weight") && it->ndim == 3 && it->shape[1] == 1 && it->shape[2] != 1) {
                it->shape[1] = it->shape[2];
                it->shape[2] = 1;
            }
        }
        it->dtype = t0->dtype;
        if (!eligible(it)) continue;
        int sel = inc ? regex_search(inc, it->name) : default_selected(it->name);
        if (exc && regex_search(exc, it->name)) sel = 0;
        if (sel && is_router_gate(it->name)) { /* --include matched it: kept in float, said once */
            if (!p->gates_kept++)
                fprintf(stderr, "%s: note: router gates ('*.gate.weight', the first: %s) are kept in float even when "
                        "--include matches them: neither fp4moe nor mlx-lm loads a quantized router\n", CMD, it->name);
            continue;
        }
        if (!sel) continue;
        it->quantize = 1;
        it->K = it->shape[it->ndim - 1];
        it->N = it->shape[it->ndim - 2];
        it->E = it->ndim == 3 ? it->shape[0] : 1;
    }
    return FP4MOE_OK;
}

/* ---- producing the data ----------------------------------------------------------------------------- */

/* Source pointer of expert e (rows N x K) of a quantized item. */
static const uint8_t *expert_src(const item *it, int64_t e, size_t esize) {
    if (it->stacked) return it->src[e]->data;
    return (const uint8_t *)it->src[0]->data + (size_t)e * (size_t)it->N * (size_t)it->K * esize;
}

/* Tensor amax of expert e (NaN ignored), reading through an aligned copy when needed. */
static int expert_amax(const item *it, int64_t e, float *out) {
    fp4moe_dtype dt;
    fp4moe_st_dtype_to(it->dtype, &dt);
    const size_t es = fp4moe_dtype_size(dt);
    const uint8_t *src = expert_src(it, e, es);
    const int64_t n = it->N * it->K, step = CHUNK_BYTES / (int64_t)es;
    float m = 0.0f;
    void *buf = ((uintptr_t)src % es) ? malloc(CHUNK_BYTES) : NULL;
    if (((uintptr_t)src % es) && !buf) return fp4moe_set_error(FP4MOE_ENOMEM, "out of memory");
    for (int64_t i = 0; i < n; i += step) {
        const int64_t k = n - i < step ? n - i : step;
        const void *p = src + (size_t)i * es;
        if (buf) p = memcpy(buf, p, (size_t)k * es);
        m = fmaxf(m, fp4moe_amax(p, dt, k));
    }
    free(buf);
    if (!isfinite(m))
        return fp4moe_set_error(FP4MOE_EFORMAT, "tensor '%s' (expert %lld) holds an infinite value; "
                                "cannot compute a global scale", it->name, (long long)e);
    *out = m;
    return FP4MOE_OK;
}

/* NaN / Inf values of a float tensor t (element dtype dt): counted through an aligned copy when t's data are not
 * aligned; *first: the first one's index (of this tensor) when the count is > 0. */
static int64_t count_nonfinite_any(const fp4moe_st_tensor *t, fp4moe_dtype dt, int64_t *first) {
    const size_t es = fp4moe_dtype_size(dt);
    const int64_t n = t->nbytes / (int64_t)es;
    if ((uintptr_t)t->data % es == 0) return fp4moe_count_nonfinite(t->data, dt, n, first);
    enum { CH = 8192 };
    float buf[CH]; /* CH elements of up to 4 bytes */
    int64_t total = 0;
    for (int64_t i = 0; i < n; i += CH) {
        const int64_t k = n - i < CH ? n - i : CH;
        memcpy(buf, (const uint8_t *)t->data + (size_t)i * es, (size_t)k * es);
        int64_t f = -1;
        const int64_t c = fp4moe_count_nonfinite(buf, dt, k, &f);
        if (c && !total) *first = i + f;
        total += c;
    }
    return total;
}

static int fill_copy(void *vctx, fp4moe_st_sink *sink, int64_t nbytes) {
    fill_ctx *c = vctx;
    for (int64_t e = 0; e < c->it->nsrc; e++) {
        const fp4moe_st_tensor *t = c->it->src[e];
        int st = cli_check_interrupt();
        if (!st) st = fp4moe_st_sink_write(sink, t->data, t->nbytes);
        if (st) return st;
        c->p->done += t->nbytes;
        cli_progress_update(&c->p->progress, c->p->done, c->it->name);
    }
    (void)nbytes;
    return FP4MOE_OK;
}

/* Quantizes the item chunk by chunk and emits the codes (what 0) or the scales (what 1). The writer
 * emits a module's codes (U32) before its scales (U8, same or later shard), so the codes pass keeps
 * the scales (up to FP4MOE_QUANTIZE_STASH_MB in all) and the scales pass just writes them; beyond the cap the
 * scales pass recomputes the same deterministic quantization. */
static int fill_quant(void *vctx, fp4moe_st_sink *sink, int64_t nbytes) {
    fill_ctx *c = vctx;
    item *it = c->it;
    fp4moe_dtype dt;
    fp4moe_st_dtype_to(it->dtype, &dt);
    const size_t es = fp4moe_dtype_size(dt);
    const int64_t K = it->K, nscales = it->E * it->N * (K / 16);
    if (c->what == 1 && it->stash) {
        int st = fp4moe_st_sink_write(sink, it->stash, nscales);
        free(it->stash);
        it->stash = NULL;
        c->p->stashed -= nscales;
        c->p->done += it->E * it->N * K * (int64_t)es;
        cli_progress_update(&c->p->progress, c->p->done, it->name);
        return st;
    }
    if (c->what == 0 && c->p->stashed + nscales <= c->p->stash_cap && (it->stash = malloc((size_t)nscales)))
        c->p->stashed += nscales;
    const int64_t rows_per = CHUNK_BYTES / (K * (int64_t)es) > 0 ? CHUNK_BYTES / (K * (int64_t)es) : 1;
    uint8_t *codes = malloc((size_t)(rows_per * K / 2)), *scales = malloc((size_t)(rows_per * K / 16));
    void *aligned = malloc((size_t)(rows_per * K) * es);
    int st = FP4MOE_OK;
    if (!codes || !scales || !aligned) st = fp4moe_set_error(FP4MOE_ENOMEM, "out of memory");
    for (int64_t e = 0; e < it->E && !st; e++) {
        const uint8_t *src = expert_src(it, e, es);
        const float amax = it->amax ? it->amax[e] : 0.0f;
        for (int64_t r0 = 0; r0 < it->N && !st; r0 += rows_per) {
            const int64_t r = it->N - r0 < rows_per ? it->N - r0 : rows_per;
            const uint8_t *p = src + (size_t)r0 * (size_t)K * es;
            if ((uintptr_t)p % es) p = memcpy(aligned, p, (size_t)(r * K) * es);
            if ((st = cli_check_interrupt())) break;
            int64_t bad = -1;
            if (fp4moe_count_nonfinite(p, dt, r * K, &bad)) {
                char where[48] = "";
                if (it->E > 1) snprintf(where, sizeof where, "expert %lld, ", (long long)e);
                st = fp4moe_set_error(FP4MOE_EFORMAT, "tensor '%s' holds a NaN or infinite value at %srow %lld, "
                                      "column %lld: refusing to quantize it (NVFP4 has no NaN; the codes would be "
                                      "silently finite)", it->name, where, (long long)(r0 + bad / K),
                                      (long long)(bad % K));
                break;
            }
            st = fp4moe_nvfp4_quantize(p, dt, r, K, amax, codes, scales, NULL);
            if (st) {
                fp4moe_error_context(st, "tensor '%s'", it->name);
                break;
            }
            if (c->what == 0 && !it->amax) /* a saturated scale (448) marks the blocks that may have been clipped */
                for (int64_t b = 0; b < r * K / 16; b++)
                    if ((scales[b] & 0x7F) == 0x7E) {
                        const float m = fp4moe_amax(p + (size_t)(b * 16) * es, dt, 16);
                        if (m > 6.0f * FP4MOE_E4M3_MAX && m > it->clipped) it->clipped = m;
                    }
            if (c->what == 0 && it->stash) memcpy(it->stash + (e * it->N + r0) * (K / 16), scales, (size_t)(r * K / 16));
            st = c->what == 0 ? fp4moe_st_sink_write(sink, codes, r * K / 2)
                              : fp4moe_st_sink_write(sink, scales, r * K / 16);
            c->p->done += r * K * (int64_t)es;
            cli_progress_update(&c->p->progress, c->p->done, it->name);
        }
    }
    free(codes);
    free(scales);
    free(aligned);
    (void)nbytes;
    return st;
}

/* Registers every output tensor with the writer. ctx: one fill_ctx per producer (3 per item). */
static int add_outputs(plan *p, fp4moe_st_writer *w, fill_ctx *ctx, int64_t *total) {
    *total = 0;
    for (int64_t i = 0; i < p->n; i++) {
        item *it = &p->items[i];
        int st;
        if (!it->quantize) {
            int64_t base = 0;
            for (int64_t e = 0; e < it->nsrc; e++) { /* a float tensor copied: its NaN / Inf values are warned of */
                fp4moe_dtype dt;
                if (fp4moe_st_dtype_to(it->src[e]->dtype, &dt) != FP4MOE_OK) break;
                int64_t first = -1;
                const int64_t bad = count_nonfinite_any(it->src[e], dt, &first);
                if (bad && !it->nonfinite) it->nonfinite_first = base + first;
                it->nonfinite += bad;
                base += it->src[e]->nbytes / (int64_t)fp4moe_dtype_size(dt);
            }
            if (!it->stacked) {
                st = fp4moe_st_writer_add(w, it->name, it->dtype, it->ndim, it->shape, it->src[0]->data);
                *total += it->src[0]->nbytes;
            } else {
                ctx[3 * i + 2] = (fill_ctx){it, 2, p};
                st = fp4moe_st_writer_add_fn(w, it->name, it->dtype, it->ndim, it->shape, fill_copy, &ctx[3 * i + 2]);
                *total += it->nsrc * it->src[0]->nbytes;
            }
            if (st) return st;
            continue;
        }
        char name[1100];
        const size_t base = strlen(it->name) - strlen(".weight");
        int64_t shape[FP4MOE_ST_MAX_DIMS];
        memcpy(shape, it->shape, sizeof shape);
        shape[it->ndim - 1] = it->K / 8;
        ctx[3 * i] = (fill_ctx){it, 0, p};
        st = fp4moe_st_writer_add_fn(w, it->name, FP4MOE_ST_U32, it->ndim, shape, fill_quant, &ctx[3 * i]);
        if (st) return st;
        shape[it->ndim - 1] = it->K / 16;
        snprintf(name, sizeof name, "%.*s.scales", (int)base, it->name);
        ctx[3 * i + 1] = (fill_ctx){it, 1, p};
        if ((st = fp4moe_st_writer_add_fn(w, name, FP4MOE_ST_U8, it->ndim, shape, fill_quant, &ctx[3 * i + 1])))
            return st;
        if (it->amax) {
            snprintf(name, sizeof name, "%.*s.global_scale", (int)base, it->name);
            const int64_t gshape[1] = {it->E};
            if ((st = fp4moe_st_writer_add(w, name, FP4MOE_ST_F32, it->ndim == 3 ? 1 : 0, gshape, it->amax)))
                return st;
        }
        fp4moe_dtype dt;
        fp4moe_st_dtype_to(it->dtype, &dt);
        *total += 2 * it->E * it->N * it->K * (int64_t)fp4moe_dtype_size(dt);
    }
    return FP4MOE_OK;
}

/* config.json of the output: the input's with the MLX nvfp4 quantization entry. */

int cmd_quantize(int argc, char **argv) {
    const char *input = NULL, *output = NULL, *include = NULL, *exclude = NULL;
    int with_gs = 0, quiet = 0;
    double shard_gb = 5.0;
    const cli_opt opts[] = {
        {"--input", "-i", CLI_STRING, &input, "IN", "a .safetensors file or a model directory (required)"},
        {"--output", "-o", CLI_STRING, &output, "OUT", "output file (for a file) or directory (required)"},
        {"--include", NULL, CLI_STRING, &include, "RE", "quantize only eligible tensors whose name matches RE"},
        {"--exclude", NULL, CLI_STRING, &exclude, "RE", "do not quantize tensors whose name matches RE"},
        {"--global-scale", NULL, CLI_FLAG, &with_gs, NULL,
         "use a per-tensor (per-expert) global scale; stored as '<m>.global_scale' F32 = amax (MLX convention; "
         "mlx-lm 0.x reads it on the stacked experts only, so for an output it loads quantize only the experts with it: "
         "--include 'switch_mlp')"},
        {"--shard-gb", NULL, CLI_DOUBLE, &shard_gb, "GB", "max shard size of a directory output (default 5)"},
        {"--quiet", "-q", CLI_FLAG, &quiet, NULL, "no progress or summary on stderr (notes, warnings and errors stay)"},
    };
    const cli_spec spec = {CMD, "fp4moe quantize --input IN --output OUT [options]", k_help, opts,
                           (int)(sizeof opts / sizeof opts[0]), NULL, 0, NULL};
    int rc = cli_parse(&spec, argc, argv);
    if (rc == CLI_HELP) return FP4MOE_EXIT_OK;
    if (rc) return FP4MOE_EXIT_USAGE;
    if (!input || !output) return cli_usage_error(CMD, "--input and --output are required");
    if (!(shard_gb > 0)) return cli_usage_error(CMD, "--shard-gb must be > 0");
    pcre2_code *inc = NULL, *exc = NULL;
    if (compile_regex(include, "--include", &inc) || compile_regex(exclude, "--exclude", &exc)) {
        pcre2_code_free(inc);
        return FP4MOE_EXIT_USAGE;
    }

    const double t0 = cli_now();
    fp4moe_st_model *m = NULL;
    fp4moe_st_writer *w = NULL;
    plan p = {0};
    fill_ctx *ctx = NULL;
    char *stage = NULL; /* a directory output's staging directory (cli_stage_dir) */
    int st = fp4moe_st_model_open(input, &m);
    rc = FP4MOE_EXIT_FAIL;
    if (st) goto fail;
    const int is_dir = fp4moe_st_model_is_dir(m);
    if ((is_dir && cli_is_dir(output) && cli_same_file(input, output)) ||
        cli_output_overwrites_input(m, input, output)) {
        rc = cli_usage_error(CMD, "%s", is_dir && cli_same_file(input, output) ? "--output must differ from --input"
                                                                          : fp4moe_last_error());
        goto done;
    }
    const fp4moe_qformat fmt = fp4moe_qformat_detect(m);
    if (fmt != FP4MOE_QFMT_PLAIN) {
        st = fp4moe_set_error(FP4MOE_EINVAL, "%s is already quantized (%s); dequantize it first", input,
                              fp4moe_qformat_name(fmt));
        goto fail;
    }
    if (is_dir) { /* a config fp4moe cannot load: said now, not at the output's first load (a helper's trial) */
        char *cj = cli_join(fp4moe_st_model_dir(m), "config.json");
        fp4moe_config cfg;
        if (cj && access(cj, F_OK) == 0 && fp4moe_config_load(fp4moe_st_model_dir(m), &cfg) != FP4MOE_OK) {
            if (strstr(fp4moe_last_error(), "JSON")) { /* not a JSON object: the output's copy cannot take the entry */
                char why[1024];
                snprintf(why, sizeof why, "%s", fp4moe_last_error()); /* (set_error overwrites what it formats from) */
                st = fp4moe_set_error(FP4MOE_EFORMAT, "%s (the output's config.json is this one with the quantization "
                                      "entry added)", why);
                free(cj);
                goto fail;
            }
            fprintf(stderr, "quantize: warning: %s: fp4moe will not load the output (the tensors are quantized "
                    "all the same)\n", fp4moe_last_error());
        } else if (cj && access(cj, F_OK) == 0) {
            fp4moe_config_free(&cfg);
        }
        free(cj);
    }
    if ((st = build_plan(m, inc, exc, &p))) goto fail;
    p.stash_cap = (int64_t)atoll(fp4moe_env_value("FP4MOE_QUANTIZE_STASH_MB")) << 20;
    int64_t nq = 0;
    for (int64_t i = 0; i < p.n; i++) nq += p.items[i].quantize != 0;
    if (nq == 0) { /* the output would claim nvfp4 in config.json and hold no NVFP4 tensor */
        rc = cli_error(CMD, FP4MOE_EXIT_FAIL, "no tensor of %s is to be quantized (%s%s%s%s%s): nothing written", input,
                       include ? "--include '" : "the default rules", include ? include : "",
                       include ? "'" : "", exclude ? ", --exclude " : "", exclude ? exclude : "");
        goto done;
    }
    for (int64_t i = 0; i < p.n; i++) {
        item *it = &p.items[i];
        if (!it->quantize) continue;
        if (!with_gs) continue;
        if (!(it->amax = malloc(sizeof *it->amax * (size_t)it->E))) {
            st = fp4moe_set_error(FP4MOE_ENOMEM, "out of memory");
            goto fail;
        }
        for (int64_t e = 0; e < it->E; e++)
            if ((st = expert_amax(it, e, &it->amax[e]))) goto fail;
    }
    if (!(ctx = calloc((size_t)(3 * p.n + 1), sizeof *ctx)) || (st = fp4moe_st_writer_new(&w))) {
        if (!st) st = fp4moe_set_error(FP4MOE_ENOMEM, "out of memory");
        goto fail;
    }
    int64_t total = 0;
    if ((st = add_outputs(&p, w, ctx, &total))) goto fail;
    if ((st = fp4moe_st_writer_set_metadata(w, "format", "mlx"))) goto fail;
    cli_install_stop_signals();
    cli_progress_start(&p.progress, "quantize", total);
    p.progress.quiet = quiet;
    if (is_dir && cli_is_dir(output))
        fprintf(stderr, "quantize: writing into the existing directory %s (its model files are replaced once the new "
                "ones are complete)\n", output);
    if (is_dir) {
        const char *skip[] = {"config.json", NULL};
        if ((st = cli_stage_dir(output, &stage)) ||
            (st = fp4moe_st_writer_write_model(w, stage, (int64_t)(shard_gb * 1e9))) ||
            (st = cli_copy_config(input, stage, 1)) ||
            (st = cli_copy_model_files(fp4moe_st_model_dir(m), stage, skip)) || (st = cli_check_interrupt()) ||
            (st = cli_stage_commit(stage, output)))
            goto fail;
    } else {
        if ((st = cli_write_file(CMD, w, input, output))) goto fail;
    }
    cli_progress_finish(&p.progress);
    int64_t in_bytes = 0;
    for (int64_t i = 0; i < fp4moe_st_model_count(m); i++) in_bytes += fp4moe_st_model_at(m, i)->nbytes;
    char b1[32], b2[32];
    if (!quiet)
        fprintf(stderr, "quantize: %lld tensors in, %lld out, %lld quantized to nvfp4; %s -> %s in %.1f s\n",
            (long long)fp4moe_st_model_count(m), (long long)fp4moe_st_writer_count(w), (long long)nq,
            cli_format_bytes(in_bytes, b1), cli_format_bytes(fp4moe_st_writer_data_size(w), b2),
            cli_now() - t0);
    for (int64_t i = 0; i < p.n; i++)
        if (p.items[i].nonfinite)
            fprintf(stderr, "quantize: warning: tensor '%s' (copied unchanged) holds %lld NaN / Inf values, the first at "
                    "index %lld: the model's forward will produce NaN (check the source checkpoint)\n", p.items[i].name,
                    (long long)p.items[i].nonfinite, (long long)p.items[i].nonfinite_first);
    for (int64_t i = 0; i < p.n; i++)
        if (p.items[i].clipped > 0.0f)
            fprintf(stderr, "quantize: warning: tensor '%s' has weights up to |w| = %g, beyond the %g that NVFP4 holds "
                    "without a global scale: they were clipped (use --global-scale)\n", p.items[i].name,
                    p.items[i].clipped, 6.0 * FP4MOE_E4M3_MAX);
    rc = FP4MOE_EXIT_OK;
    goto done;
fail:
    if (p.progress.shown && p.progress.tty) fprintf(stderr, "\r\033[K");
    rc = cli_convert_failed(CMD, st, output, stage);
    stage = NULL;
done:
    free(stage);
    fp4moe_st_writer_free(w);
    free(ctx);
    free_plan(&p);
    fp4moe_st_model_close(m);
    pcre2_code_free(inc);
    pcre2_code_free(exc);
    return rc;
}
