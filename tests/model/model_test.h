/* Helpers of the model tests (header-only: every tests/model/test_*.c is its own program): the golden
 * models and transformers' reference outputs of scripts/make_golden.py, the model-level tolerance,
 * and a private temporary directory for corrupted copies of the golden models.
 *
 * THE model-level tolerance (documented here, used by every model test):
 *   |logit - ref| <= rtol * max_v |ref[row][v]|   per row of V logits
 * with rtol = MT_RTOL_F32 = 1e-4 for fp32 activations: the kernel tolerance (spec NVFP4.md section 4,
 * rtol 1e-5) times 10 for the compounding over 6 layers and for a different but exact-in-math
 * summation order (transformers' chunked SSD scan vs the sequential scan here, the combine order
 * of the experts). bf16 activations round every matmul input and output to 8 bits of mantissa:
 * MT_RTOL_BF16 = 5e-2 against the same fp32 reference. */
#ifndef FP4MOE_TESTS_MODEL_TEST_H
#define FP4MOE_TESTS_MODEL_TEST_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <ftw.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fp4moe/fp4moe.h"
#include "fp4moe/model.h"

#define MT_GOLDEN "tests/golden/models"
#define MT_RTOL_F32 1e-4
#define MT_RTOL_BF16 5e-2

/* ---- reference outputs ------------------------------------------------------------------------ */

typedef struct {
    fp4moe_st_file *f;
    const int32_t *prompt;     /* T ids */
    int64_t T;
    const float *logits;       /* T x V */
    int64_t V;
    const int32_t *gen;        /* n greedy ids */
    int64_t n;
    const float *step_logits;  /* n x V: the logits that chose gen[i] */
} mt_ref;

static inline void mt_ref_open(const char *name, mt_ref *r) {
    char path[512];
    snprintf(path, sizeof path, MT_GOLDEN "/reference/%s.safetensors", name);
    memset(r, 0, sizeof *r);
    if (fp4moe_st_open(path, &r->f)) {
        fprintf(stderr, "cannot open %s: %s\n", path, fp4moe_last_error());
        abort();
    }
    const fp4moe_st_tensor *p = fp4moe_st_find(r->f, "prompt"), *l = fp4moe_st_find(r->f, "logits");
    const fp4moe_st_tensor *g = fp4moe_st_find(r->f, "gen_ids"), *s = fp4moe_st_find(r->f, "step_logits");
    if (!p || !l || !g || !s) abort();
    r->prompt = p->data;
    r->T = p->numel;
    r->logits = l->data;
    r->V = l->shape[1];
    r->gen = g->data;
    r->n = g->numel;
    r->step_logits = s->data;
}

static inline void mt_ref_close(mt_ref *r) { fp4moe_st_close(r->f); }

/* Largest |y - ref| / max|ref| over one row; NaN -> INFINITY. */
static inline double mt_row_err(const float *y, const float *ref, int64_t V) {
    double mx = 0.0, err = 0.0;
    for (int64_t v = 0; v < V; v++) mx = fmax(mx, fabs((double)ref[v]));
    for (int64_t v = 0; v < V; v++) {
        const double d = fabs((double)y[v] - (double)ref[v]);
        if (isnan(d)) return INFINITY;
        err = fmax(err, d);
    }
    return err / (mx > 0 ? mx : 1.0);
}

/* Worst row error over rows x V. */
static inline double mt_max_err(const float *y, const float *ref, int64_t rows, int64_t V) {
    double e = 0.0;
    for (int64_t r = 0; r < rows; r++) e = fmax(e, mt_row_err(y + r * V, ref + r * V, V));
    return e;
}

static inline float *mt_poisoned(int64_t n) {
    float *p = malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) p[i] = NAN;
    return p;
}

/* ---- models and sessions ------------------------------------------------------------------------ */

static inline fp4moe_model *mt_load(const char *name, int quantize) {
    char dir[512];
    snprintf(dir, sizeof dir, MT_GOLDEN "/%s", name);
    fp4moe_load_options o;
    fp4moe_load_options_default(&o);
    o.quantize = quantize;
    fp4moe_model *m = NULL;
    if (fp4moe_model_load(dir, &o, &m)) {
        fprintf(stderr, "cannot load %s: %s\n", dir, fp4moe_last_error());
        abort();
    }
    return m;
}

static inline fp4moe_session *mt_session(const fp4moe_model *m, fp4moe_dtype act, fp4moe_route route,
                                         int64_t max_chunk) {
    fp4moe_session_options o;
    fp4moe_session_options_default(&o);
    o.act_dtype = act;
    o.route = route;
    if (max_chunk > 0) o.max_chunk = max_chunk;
    fp4moe_session *s = NULL;
    if (fp4moe_session_new(m, &o, &s)) {
        fprintf(stderr, "session: %s\n", fp4moe_last_error());
        abort();
    }
    return s;
}

static inline void mt_forward(fp4moe_session *s, const int32_t *ids, int64_t T, float *logits, int all) {
    if (fp4moe_session_forward(s, ids, T, logits, all)) {
        fprintf(stderr, "forward: %s\n", fp4moe_last_error());
        abort();
    }
}

/* Greedy continuation of n tokens after the prompt (one prefill, then one decode per token). */
static inline void mt_greedy(fp4moe_session *s, const int32_t *prompt, int64_t T, int64_t V, int64_t n,
                             int32_t *out) {
    float *lg = mt_poisoned(V);
    fp4moe_session_reset(s);
    mt_forward(s, prompt, T, lg, 0);
    for (int64_t i = 0; i < n; i++) {
        out[i] = fp4moe_argmax(lg, V);
        if (i + 1 < n) mt_forward(s, &out[i], 1, lg, 0);
    }
    free(lg);
}

/* ---- temporary directory ------------------------------------------------------------------------ */

static char g_mt_tmp[64];

static inline const char *mt_tmpdir(void) {
    if (!g_mt_tmp[0]) {
        strcpy(g_mt_tmp, "/tmp/fp4moe-model-test-XXXXXX");
        if (!mkdtemp(g_mt_tmp)) abort();
    }
    return g_mt_tmp;
}

static inline int mt_rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb; (void)flag; (void)ftw;
    return remove(p);
}

static inline void mt_rmtree_tmp(void) {
    if (g_mt_tmp[0] && !strncmp(g_mt_tmp, "/tmp/fp4moe-model-test-", 23))
        nftw(g_mt_tmp, mt_rm_cb, 16, FTW_DEPTH | FTW_PHYS);
    g_mt_tmp[0] = '\0';
}

static inline char *mt_read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) abort();
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (fread(buf, 1, (size_t)n, f) != (size_t)n) abort();
    buf[n] = '\0';
    fclose(f);
    return buf;
}

static inline void mt_write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(text, 1, strlen(text), f) != strlen(text)) abort();
    fclose(f);
}

/* Replaces the first occurrence of `from` in s (malloc'd) by `to`; returns a new string. */
static inline char *mt_replace(const char *s, const char *from, const char *to) {
    const char *p = strstr(s, from);
    if (!p) {
        fprintf(stderr, "mt_replace: '%s' not found\n", from);
        abort();
    }
    const size_t a = (size_t)(p - s), nf = strlen(from), nt = strlen(to), ns = strlen(s);
    char *out = malloc(ns - nf + nt + 1);
    memcpy(out, s, a);
    memcpy(out + a, to, nt);
    memcpy(out + a + nt, p + nf, ns - a - nf + 1);
    return out;
}

#endif
