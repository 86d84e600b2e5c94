/* The nemotron_h forward pass (spec NEMOTRON_H.md "Forward pass"):
 *   h = embed[token];  for each layer: h = h + mixer(rmsnorm(h) * norm.weight)
 *   logits = lm_head(rmsnorm(h) * norm_f.weight)
 * and the session that carries the caches from one call to the next. */
#include "fp4moe/model.h"

#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "fp4moe/nvfp4.h"
#include "model/model_cuda.h"
#include "model/model_internal.h"

/* ---- scratch arena ------------------------------------------------------------------------ */

void *arena_alloc(arena *a, size_t bytes) {
    bytes = (bytes + 63) & ~(size_t)63;
    arena_block *b = a->cur;
    while (b && b->cap - b->used < bytes + 64) b = b->next;     /* +64: room to align */
    if (!b) {
        size_t cap = bytes + 64 > (8u << 20) ? bytes + 64 : (8u << 20);
        b = malloc(sizeof *b + cap);
        if (!b) {
            fp4moe_set_error(FP4MOE_ENOMEM, "forward: cannot allocate %zu bytes of scratch", cap);
            return NULL;
        }
        b->cap = cap;
        b->used = 0;
        b->next = NULL;
        arena_block **tail = &a->head;                            /* append: keep order */
        while (*tail) tail = &(*tail)->next;
        *tail = b;
    }
    a->cur = b;
    uintptr_t base = (uintptr_t)b->data + b->used;
    uintptr_t p = (base + 63) & ~(uintptr_t)63;
    b->used += (size_t)(p - base) + bytes;
    return (void *)p;
}

void arena_reset(arena *a) {
    for (arena_block *b = a->head; b; b = b->next) b->used = 0;
    a->cur = a->head;
}

void arena_free(arena *a) {
    while (a->head) {
        arena_block *b = a->head;
        a->head = b->next;
        free(b);
    }
    a->cur = NULL;
}

/* ---- session ------------------------------------------------------------------------------ */

void fp4moe_session_options_default(fp4moe_session_options *o) {
    memset(o, 0, sizeof *o);
    o->act_dtype = FP4MOE_F32;
    o->route = FP4MOE_ROUTE_AUTO;
    o->max_chunk = 256;
}

static int64_t conv_dim(const fp4moe_config *c) {
    return c->mamba_heads * c->mamba_head_dim + 2 * c->mamba_groups * c->ssm_state;
}

static int alloc_layer_state(const fp4moe_config *c, char type, layer_state *ls) {
    if (type != FP4MOE_LAYER_MAMBA) return FP4MOE_OK;
    const size_t nconv = (size_t)((c->conv_kernel - 1) * conv_dim(c));
    const size_t nssm = (size_t)(c->mamba_heads * c->mamba_head_dim * c->ssm_state);
    ls->conv_state = calloc(nconv ? nconv : 1, sizeof(float));
    ls->ssm_state = calloc(nssm, sizeof(float));
    if (!ls->conv_state || !ls->ssm_state)
        return fp4moe_set_error(FP4MOE_ENOMEM, "session: cannot allocate the Mamba state");
    return FP4MOE_OK;
}

int fp4moe_session_new(const fp4moe_model *m, const fp4moe_session_options *opts,
                       fp4moe_session **out) {
    if (!m || !out) return fp4moe_set_error(FP4MOE_EINVAL, "session_new: NULL argument");
    *out = NULL;
    fp4moe_session_options o;
    if (opts) o = *opts;
    else fp4moe_session_options_default(&o);
    if (o.act_dtype != FP4MOE_F32 && o.act_dtype != FP4MOE_BF16)
        return fp4moe_set_error(FP4MOE_EINVAL, "session_new: activation dtype %s (supported: f32, bf16)",
                                fp4moe_dtype_name(o.act_dtype));
    if (o.max_chunk < 1)
        return fp4moe_set_error(FP4MOE_EINVAL, "session_new: max_chunk=%lld < 1", (long long)o.max_chunk);
    fp4moe_session *s = calloc(1, sizeof *s);
    if (!s) return fp4moe_set_error(FP4MOE_ENOMEM, "session_new: out of memory");
    s->m = m;
    s->opt = o;
    s->ops.act = o.act_dtype;
    s->ops.route = o.route;
    s->ls = calloc((size_t)m->cfg.n_layers, sizeof *s->ls);
    int st = s->ls ? FP4MOE_OK : fp4moe_set_error(FP4MOE_ENOMEM, "session_new: out of memory");
    for (int64_t l = 0; !st && l < m->cfg.n_layers; l++)
        st = alloc_layer_state(&m->cfg, m->cfg.layer_types[l], &s->ls[l]);
    if (!st) st = session_device_init(s);              /* CUDA sessions: model_cuda.h */
    if (st) {
        fp4moe_session_free(s);
        return st;
    }
    *out = s;
    return FP4MOE_OK;
}

void fp4moe_session_free(fp4moe_session *s) {
    if (!s) return;
    gpu_session_free(s->gpu);
    for (int64_t l = 0; s->ls && l < s->m->cfg.n_layers; l++) {
        free(s->ls[l].conv_state);
        free(s->ls[l].ssm_state);
        free(s->ls[l].k_cache);
        free(s->ls[l].v_cache);
    }
    free(s->ls);
    arena_free(&s->scratch);
    ops_ctx_free(&s->ops);
    free(s);
}

void fp4moe_session_reset(fp4moe_session *s) {
    if (s->gpu) {
        gpu_session_reset(s);
        return;
    }
    const fp4moe_config *c = &s->m->cfg;
    for (int64_t l = 0; l < c->n_layers; l++) {
        if (c->layer_types[l] != FP4MOE_LAYER_MAMBA) continue;
        memset(s->ls[l].conv_state, 0, (size_t)((c->conv_kernel - 1) * conv_dim(c)) * sizeof(float));
        memset(s->ls[l].ssm_state, 0,
               (size_t)(c->mamba_heads * c->mamba_head_dim * c->ssm_state) * sizeof(float));
    }
    s->pos = 0;   /* the KV rows beyond pos are dead; the buffers are kept */
}

int64_t fp4moe_session_pos(const fp4moe_session *s) { return s->pos; }

/* ---- forward ------------------------------------------------------------------------------ */

/* h[t] = embed[tokens[t]] (fp32): a dense row converted, or an NVFP4 row dequantized. */
static int embed_tokens(const fp4moe_model *m, const int32_t *tokens, int64_t T, float *h) {
    const op_linear *e = &m->embed;
    const int64_t H = e->K;
    for (int64_t t = 0; t < T; t++) {
        const int64_t id = tokens[t];
        if (!e->nvfp4) {
            const uint8_t *row = (const uint8_t *)e->dense[0] + id * H * fp4moe_dtype_size(e->dtype);
            fp4moe_to_f32(row, e->dtype, H, h + t * H);
            continue;
        }
        const float gs = e->q.global_scale ? e->q.global_scale[0] : 1.0f;
        int st = fp4moe_nvfp4_dequantize(e->q.codes + id * (H / 2),
                                         e->q.scales + id * (H / FP4MOE_NVFP4_BLOCK), 1, H, gs,
                                         FP4MOE_F32, h + t * H);
        if (st) return st;
    }
    return FP4MOE_OK;
}

static int interrupted(const fp4moe_session *s) {
    return s->opt.interrupt && *s->opt.interrupt;
}

/* One layer: h += mixer(rmsnorm(h) * norm). */
static int layer_forward(fp4moe_session *s, int64_t l, float *h, int64_t T) {
    const fp4moe_model *m = s->m;
    const layer_weights *w = &m->layers[l];
    const int64_t H = m->cfg.hidden;
    float *x = arena_alloc(&s->scratch, (size_t)(T * H) * sizeof(float));
    float *out = arena_alloc(&s->scratch, (size_t)(T * H) * sizeof(float));
    if (!x || !out) return FP4MOE_ENOMEM;
    op_rmsnorm(h, w->norm, T, H, m->cfg.eps, x);
    int st;
    switch (w->type) {
    case FP4MOE_LAYER_MAMBA: st = mamba2_forward(s, l, x, T, out); break;
    case FP4MOE_LAYER_ATTENTION: st = attention_forward(s, l, x, T, out); break;
    case FP4MOE_LAYER_MOE: st = moe_forward(s, l, x, T, out); break;
    default: st = mlp_forward(s, &w->up, &w->down, x, T, out);
    }
    if (st) return fp4moe_error_context(st, "layer %lld (%s)", (long long)l,
                                        fp4moe_layer_type_name(w->type));
    op_add(h, out, T * H);
    return FP4MOE_OK;
}

/* logits (rows x V, fp32, not rounded to the act dtype) of the last `rows` tokens of h (T x H). */
static int head_forward(fp4moe_session *s, const float *h, int64_t T, int64_t rows, float *logits) {
    const fp4moe_model *m = s->m;
    const int64_t H = m->cfg.hidden;
    float *x = arena_alloc(&s->scratch, (size_t)(rows * H) * sizeof(float));
    if (!x) return FP4MOE_ENOMEM;
    op_rmsnorm(h + (T - rows) * H, m->norm_f, rows, H, m->cfg.eps, x);
    int st = op_linear_forward_f32out(&s->ops, &m->lm_head, x, rows, logits);
    return st ? fp4moe_error_context(st, "lm_head") : FP4MOE_OK;
}

/* One chunk of T <= max_chunk tokens. */
static int chunk_forward(fp4moe_session *s, const int32_t *tokens, int64_t T, float *logits,
                         int all_logits) {
    const fp4moe_model *m = s->m;
    arena_reset(&s->scratch);
    float *h = arena_alloc(&s->scratch, (size_t)(T * m->cfg.hidden) * sizeof(float));
    if (!h) return FP4MOE_ENOMEM;
    int st = embed_tokens(m, tokens, T, h);
    for (int64_t l = 0; !st && l < m->cfg.n_layers; l++) {
        if (interrupted(s)) return fp4moe_set_error(FP4MOE_EINTERRUPTED, "forward: interrupted");
        st = layer_forward(s, l, h, T);
    }
    if (!st && logits) st = head_forward(s, h, T, all_logits ? T : 1, logits);
    if (!st) s->pos += T;
    return st;
}

int session_check_input(const fp4moe_session *s, const int32_t *tokens, int64_t T) {
    if (!s || !tokens) return fp4moe_set_error(FP4MOE_EINVAL, "forward: NULL argument");
    if (T < 1) return fp4moe_set_error(FP4MOE_EINVAL, "forward: T=%lld < 1", (long long)T);
    const fp4moe_config *c = &s->m->cfg;
    for (int64_t t = 0; t < T; t++)
        if (tokens[t] < 0 || tokens[t] >= c->vocab)
            return fp4moe_set_error(FP4MOE_EINVAL, "forward: token %lld is id %d, outside [0, %lld)",
                                    (long long)t, tokens[t], (long long)c->vocab);
    if (s->opt.max_context > 0 && s->pos + T > s->opt.max_context)
        return fp4moe_set_error(FP4MOE_EOVERFLOW, "forward: %lld + %lld tokens exceed the context "
                                "limit %lld", (long long)s->pos, (long long)T,
                                (long long)s->opt.max_context);
    return FP4MOE_OK;
}

int fp4moe_session_forward(fp4moe_session *s, const int32_t *tokens, int64_t T, float *logits,
                           int all_logits) {
    int st = session_check_input(s, tokens, T);
    if (st) return st;
    if (s->gpu) return gpu_session_forward(s, tokens, T, logits, all_logits, NULL);
    const int64_t V = s->m->cfg.vocab;
    for (int64_t t0 = 0; t0 < T; t0 += s->opt.max_chunk) {
        if (interrupted(s)) return fp4moe_set_error(FP4MOE_EINTERRUPTED, "forward: interrupted");
        const int64_t n = T - t0 < s->opt.max_chunk ? T - t0 : s->opt.max_chunk;
        float *lg = NULL;
        if (logits && all_logits) lg = logits + t0 * V;
        else if (logits && t0 + n == T) lg = logits;
        if ((st = chunk_forward(s, tokens + t0, n, lg, all_logits))) return st;
    }
    return FP4MOE_OK;
}
