/* The CPU backend (src/backend/backend.h): the ops of src/kernels/cpu/ on host memory. "act"
 * buffers are fp32 arrays holding values rounded to the act dtype (f32: unrounded), rounded
 * exactly where the single-sequence CPU runtime rounded (each matmul's input and output, the
 * attention output, the MoE combine), so a step of one sequence reproduces its bits. Weights are
 * used in place (the model's op_linear descriptors). Per-sequence ops loop over the step's
 * segments; attention reads the paged KV cache in place: f32 (op_attention_causal_paged) or FP8
 * (op_attention_causal_paged_fp8: a page of a kv head dequantized at a time). */
#include "backend/backend.h"

#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "fp4moe/nvfp4.h"
#include "kernels/cpu/ops.h"
#include "model/model_internal.h"

typedef struct {
    ops_ctx ops;
} cpu_ctx;

static const be_ops CPU_OPS;

/* ---- memory --------------------------------------------------------------------------------- */

static int cpu_alloc(void *bc, size_t bytes, void **p) {
    (void)bc;
    *p = NULL;
    if (posix_memalign(p, 64, bytes ? bytes : 1)) {
        *p = NULL;
        return fp4moe_set_error(FP4MOE_ENOMEM, "cpu: cannot allocate %zu bytes", bytes);
    }
    memset(*p, 0, bytes);
    return FP4MOE_OK;
}
static void cpu_free(void *bc, void *p) { (void)bc; free(p); }
static void cpu_free_detached(void *p) { free(p); }
static int cpu_copy(void *bc, void *dst, const void *src, size_t bytes) {
    (void)bc;
    if (bytes) memmove(dst, src, bytes);
    return FP4MOE_OK;
}
static int cpu_zero(void *bc, void *p, size_t bytes) {
    (void)bc;
    memset(p, 0, bytes);
    return FP4MOE_OK;
}
static int cpu_sync(void *bc) { (void)bc; return FP4MOE_OK; }
static int cpu_run(void *bc, const fw_step *st, int (*fn)(void *), void *arg) {
    (void)bc; (void)st;
    return fn(arg);
}
static void cpu_invalidate(void *bc) { (void)bc; }

/* ---- row-wise ops ----------------------------------------------------------------------------- */

static fp4moe_dtype act_of(void *bc) { return ((cpu_ctx *)bc)->ops.act; }

static int cpu_embed(void *bc, const void *Ev, const int32_t *tokens, int64_t T, float *h) {
    (void)bc;
    const op_linear *e = Ev;
    const int64_t H = e->K;
    for (int64_t t = 0; t < T; t++) {
        const int64_t id = tokens[t];
        if (!e->nvfp4) {
            const uint8_t *row = (const uint8_t *)e->dense[0] + id * H * fp4moe_dtype_size(e->dtype);
            fp4moe_to_f32(row, e->dtype, H, h + t * H);
            continue;
        }
        const float gs = e->q.global_scale ? e->q.global_scale[0] : 1.0f;
        const int st = fp4moe_nvfp4_dequantize(e->q.codes + id * (H / 2),
                                               e->q.scales + id * (H / FP4MOE_NVFP4_BLOCK), 1, H, gs,
                                               FP4MOE_F32, h + t * H);
        if (st) return st;
    }
    return FP4MOE_OK;
}

static int cpu_residual_add(void *bc, float *h, const void *av, const void *bv, int64_t n);

static int cpu_rmsnorm(void *bc, float *x, const void *a, const void *b, const float *w, int64_t T, int64_t H,
                       float eps, void *y, float *y32) {
    if (a) cpu_residual_add(bc, x, a, b, T * H);
    op_rmsnorm(x, w, T, H, eps, y);
    op_round_act(act_of(bc), y, T * H);
    if (y32) memcpy(y32, y, (size_t)(T * H) * sizeof(float));
    return FP4MOE_OK;
}

static int cpu_rmsnorm_rows(void *bc, const float *x, const int32_t *rows, int64_t n, const float *w,
                            int64_t H, float eps, void *yv) {
    float *y = yv;
    for (int64_t i = 0; i < n; i++) op_rmsnorm(x + (int64_t)rows[i] * H, w, 1, H, eps, y + i * H);
    op_round_act(act_of(bc), y, n * H);
    return FP4MOE_OK;
}

static int cpu_relu2(void *bc, void *x, int64_t n) {
    (void)bc;
    op_relu2(x, n);
    return FP4MOE_OK;
}
static int cpu_linear(void *bc, const void *W, const void *x, int64_t T, int relu2, void *y) {
    const int st = op_linear_forward(&((cpu_ctx *)bc)->ops, W, x, T, y);
    return st || !relu2 ? st : cpu_relu2(bc, y, T * ((const op_linear *)W)->N);
}
static int cpu_linear_f32out(void *bc, const void *W, const void *x, int64_t T, float *y) {
    return op_linear_forward_f32out(&((cpu_ctx *)bc)->ops, W, x, T, y);
}
static int cpu_linear_gather(void *bc, const void *W, const void *x, const uint32_t *idx, int64_t B, int relu2,
                             void *y) {
    const int st = op_linear_gather(&((cpu_ctx *)bc)->ops, W, x, idx, B, y);
    return st || !relu2 ? st : cpu_relu2(bc, y, B * ((const op_linear *)W)->N);
}
static int cpu_moe_route(void *bc, const fw_router *r, const float *x, const void *x_act, int64_t T, const float *W,
                         int64_t H, float *logits, int32_t *ids, float *wts, uint32_t *row_of, uint32_t *idx,
                         uint32_t *pos_of) {
    (void)bc;
    (void)x_act;
    op_matmul_f32(x, T, W, r->E, H, logits, r->E);
    const op_router_cfg rc = {r->E, r->k, r->n_group, r->topk_group, r->norm_topk_prob, r->scaling, r->bias};
    const int st = op_router_topk(&rc, logits, T, ids, wts);
    return st ? st : op_sort_by_expert(ids, T * r->k, r->E, row_of, idx, pos_of);
}
static int cpu_sort_local(void *bc, const uint32_t *ids, int64_t B, int64_t lo, int64_t E, uint32_t *row_of,
                          uint32_t *idx, uint32_t *pos_of) {
    (void)bc;
    int32_t *l = malloc((size_t)B * sizeof *l + 1);
    if (!l) return fp4moe_set_error(FP4MOE_ENOMEM, "sort_local: %lld rows", (long long)B);
    for (int64_t b = 0; b < B; b++) {
        const int64_t e = (int64_t)ids[b] - lo;
        l[b] = (int32_t)(e < 0 ? 0 : e >= E ? E - 1 : e);
    }
    const int st = op_sort_by_expert(l, B, E, row_of, idx, pos_of);
    free(l);
    return st;
}

static int cpu_gather_rows(void *bc, const void *xv, int64_t H, const uint32_t *row_of, int64_t B, int64_t k,
                           void *xsv) {
    (void)bc;
    const float *x = xv;
    float *xs = xsv;
    for (int64_t p = 0; p < B; p++)
        memcpy(xs + p * H, x + (int64_t)(row_of[p] / k) * H, (size_t)H * sizeof(float));
    return FP4MOE_OK;
}
static int cpu_moe_combine(void *bc, const void *ys, int64_t H, const uint32_t *pos_of, const float *wts,
                           int64_t T, int64_t k, void *out) {
    op_moe_combine(ys, H, pos_of, wts, T, k, out);
    op_round_act(act_of(bc), out, T * H);
    return FP4MOE_OK;
}
static int cpu_residual_add(void *bc, float *h, const void *av, const void *bv, int64_t n) {
    (void)bc;
    const float *a = av, *b = bv;
    if (b) {
        for (int64_t i = 0; i < n; i++) h[i] += a[i] + b[i];
    } else {
        op_add(h, a, n);
    }
    return FP4MOE_OK;
}
static int cpu_rmsnorm_gated(void *bc, const float *y, const void *z, int64_t zs, const float *w, int64_t T,
                             int64_t D, int64_t G, float eps, void *out) {
    op_rmsnorm_gated(y, D, z, zs, w, T, D, G, eps, out);
    op_round_act(act_of(bc), out, T * D);
    return FP4MOE_OK;
}
static int cpu_argmax_rows(void *bc, const float *x, int64_t n, int64_t V, int32_t *out) {
    (void)bc;
    for (int64_t r = 0; r < n; r++) out[r] = fp4moe_argmax(x + r * V, V);
    return FP4MOE_OK;
}

/* ---- per-sequence ops ------------------------------------------------------------------------- */

/* One sequence's conv1d + silu. */
static void conv_seg(const fw_step *s, int64_t i, const float *x, int64_t xs, int64_t C, const float *w,
                     const float *b, int64_t Kc, const fw_state *st, float *y) {
    const fw_seg *g = &s->seg[i];
    float *state = st->conv + (int64_t)g->slot * st->conv_stride;
    op_conv1d_causal(x + g->row0 * xs, xs, g->n, C, w, b, Kc, state, y + g->row0 * C);
    op_silu(y + g->row0 * C, g->n * C);
}

/* Several sequences run in parallel, one per thread (the op's own parallel region then runs on
 * that thread alone: the same numbers); a single one gets the op's parallel region. */
static int cpu_conv1d_silu(void *bc, const fw_step *s, const void *xv, int64_t xs, int64_t C, const float *w,
                           const float *b, int64_t Kc, const fw_state *st, float *y) {
    (void)bc;
    if (s->nseg == 1) {
        conv_seg(s, 0, xv, xs, C, w, b, Kc, st, y);
        return FP4MOE_OK;
    }
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < s->nseg; i++) conv_seg(s, i, xv, xs, C, w, b, Kc, st, y);
    return FP4MOE_OK;
}

static void scan_seg(const fw_step *s, int64_t i, const fw_ssm *a, const fw_state *st) {
    const float *dt = a->dt;
    const fw_seg *g = &s->seg[i];
    const int64_t r = g->row0;
    const op_ssm_args o = {
        .T = g->n, .nh = a->nh, .hd = a->hd, .S = a->S, .G = a->G,
        .x = a->x + r * a->xs, .xs = a->xs, .B = a->B + r * a->bcs, .C = a->C + r * a->bcs,
        .bcs = a->bcs, .dt = dt + r * a->dts, .dts = a->dts, .dt_bias = a->dt_bias, .A = a->A,
        .D = a->D, .dt_lo = a->dt_lo, .dt_hi = a->dt_hi,
        .state = st->ssm + (int64_t)g->slot * st->ssm_stride, .y = a->y + r * a->nh * a->hd,
    };
    op_ssm_scan(&o);
}

static int cpu_ssm_scan(void *bc, const fw_step *s, const fw_ssm *a, const fw_state *st) {
    (void)bc;
    if (s->nseg == 1) {
        scan_seg(s, 0, a, st);
        return FP4MOE_OK;
    }
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < s->nseg; i++) scan_seg(s, i, a, st);
    return FP4MOE_OK;
}

/* Row `pos` of slot's KV in the paged pool. */
static int64_t kv_row(const fw_step *s, int32_t slot, int64_t pos) {
    return (int64_t)s->h_pages[(int64_t)slot * s->max_pages + pos / FW_PAGE] * FW_PAGE + pos % FW_PAGE;
}

static int cpu_attention(void *bcv, const fw_step *s, const void *qv, const void *kv, const void *vv,
                         const fw_state *st, int64_t nq, int64_t nkv, int64_t dh, void *outv) {
    cpu_ctx *bc = bcv;
    const float *q = qv, *k = kv, *v = vv;
    float *out = outv, *kc = st->k, *vc = st->v;
    uint8_t *kb = st->k, *vb = st->v;                        /* the FP8 cache: rows of rb bytes */
    const int64_t kvs = nkv * dh, qs = nq * dh;
    const size_t rb = st->kv_fp8 ? op_kv_fp8_row_bytes(nkv, dh) : 0;
    for (int64_t i = 0; i < s->nseg; i++) {
        const fw_seg *g = &s->seg[i];
        for (int64_t t = 0; t < g->n; t++) {
            const int64_t row = kv_row(s, g->slot, g->pos0 + t);
            if (st->kv_fp8) {
                op_kv_fp8_store(k + (g->row0 + t) * kvs, nkv, dh, kb + (size_t)row * rb);
                op_kv_fp8_store(v + (g->row0 + t) * kvs, nkv, dh, vb + (size_t)row * rb);
                continue;
            }
            memcpy(kc + row * kvs, k + (g->row0 + t) * kvs, (size_t)kvs * sizeof(float));
            memcpy(vc + row * kvs, v + (g->row0 + t) * kvs, (size_t)kvs * sizeof(float));
        }
        /* the cache is read in place, page by page (FP8: a page of a kv head dequantized at a time) */
        const int32_t *pt = s->h_pages + (int64_t)g->slot * s->max_pages;
        const int st2 = st->kv_fp8
            ? op_attention_causal_paged_fp8(q + g->row0 * qs, qs, kb, vb, pt, FW_PAGE, g->pos0, g->n, nq, nkv, dh,
                                            out + g->row0 * qs)
            : op_attention_causal_paged(q + g->row0 * qs, qs, kc, vc, pt, FW_PAGE, g->pos0, g->n, nq, nkv, dh,
                                        out + g->row0 * qs);
        if (st2) return st2;
    }
    op_round_act(bc->ops.act, out, s->R * qs);
    return FP4MOE_OK;
}

/* ---- construction ----------------------------------------------------------------------------- */

static const be_ops CPU_OPS = {
    .name = "cpu",
    .act_size = sizeof(float),
    .alloc = cpu_alloc,
    .free = cpu_free,
    .free_detached = cpu_free_detached,
    .upload = cpu_copy,
    .download = cpu_copy,
    .copy = cpu_copy,
    .zero = cpu_zero,
    .sync = cpu_sync,
    .run = cpu_run,
    .invalidate = cpu_invalidate,
    .embed = cpu_embed,
    .rmsnorm = cpu_rmsnorm,
    .rmsnorm_rows = cpu_rmsnorm_rows,
    .linear = cpu_linear,
    .linear_f32out = cpu_linear_f32out,
    .linear_gather = cpu_linear_gather,
    .moe_route = cpu_moe_route,
    .gather_rows = cpu_gather_rows,
    .sort_local = cpu_sort_local,
    .moe_combine = cpu_moe_combine,
    .residual_add = cpu_residual_add,
    .conv1d_silu = cpu_conv1d_silu,
    .ssm_scan = cpu_ssm_scan,
    .rmsnorm_gated = cpu_rmsnorm_gated,
    .attention = cpu_attention,
    .argmax_rows = cpu_argmax_rows,
    .mark = NULL,
};

int be_cpu_new(fp4moe_dtype act, fp4moe_route route, fp4moe_cpu_act cpu_act, const be_ops **ops, void **bc) {
    cpu_ctx *c = calloc(1, sizeof *c);
    if (!c) return fp4moe_set_error(FP4MOE_ENOMEM, "cpu backend: out of memory");
    c->ops.act = act;
    c->ops.route = route;
    c->ops.q8 = cpu_act == FP4MOE_CPU_ACT_Q8;
    *ops = &CPU_OPS;
    *bc = c;
    return FP4MOE_OK;
}

void be_cpu_free(void *bcv) {
    cpu_ctx *c = bcv;
    if (!c) return;
    ops_ctx_free(&c->ops);
    free(c);
}

static const void *lin(const op_linear *w) { return w->N ? (const void *)w : NULL; }

int be_cpu_weights(const fp4moe_model *m, fw_weights *w) {
    const int64_t L = m->cfg.n_layers;
    memset(w, 0, sizeof *w);
    w->layers = calloc((size_t)L, sizeof *w->layers);
    if (!w->layers) return fp4moe_set_error(FP4MOE_ENOMEM, "cpu backend: out of memory");
    w->embed = &m->embed;
    w->lm_head = &m->lm_head;
    w->norm_f = m->norm_f;
    for (int64_t l = 0; l < L; l++) {
        const layer_weights *s = &m->layers[l];
        w->layers[l] = (fw_layer){
            .type = s->type, .norm = s->norm,
            .in_proj = lin(&s->in_proj), .out_proj = lin(&s->out_proj), .conv_w = s->conv_w,
            .conv_b = s->conv_b, .A = s->A, .D = s->D, .dt_bias = s->dt_bias, .gnorm = s->gnorm,
            .q_proj = lin(&s->q_proj), .k_proj = lin(&s->k_proj), .v_proj = lin(&s->v_proj),
            .o_proj = lin(&s->o_proj), .router_w = s->router_w, .router_bias = s->router_bias,
            .experts_up = lin(&s->experts_up), .experts_down = lin(&s->experts_down),
            .shared_up = lin(&s->shared_up), .shared_down = lin(&s->shared_down),
            .latent_in = lin(&s->latent_in), .latent_out = lin(&s->latent_out),
            .up = lin(&s->up), .down = lin(&s->down),
        };
    }
    return FP4MOE_OK;
}

static const op_linear *expert_view(const op_linear *w, int64_t lo, int64_t hi, op_linear *v) {
    if (!w) return NULL;
    op_linear_experts(w, lo, hi, v);
    return v;
}

void be_cpu_weights_experts(fw_weights *w, int64_t n_layers, int64_t lo, int64_t hi, void *views) {
    op_linear *v = views;
    for (int64_t l = 0; l < n_layers; l++) {
        fw_layer *d = &w->layers[l];
        if (d->type != FP4MOE_LAYER_MOE) continue;
        d->experts_up = expert_view(d->experts_up, lo, hi, &v[2 * l]);
        d->experts_down = expert_view(d->experts_down, lo, hi, &v[2 * l + 1]);
    }
}

size_t be_cpu_linear_size(void) { return sizeof(op_linear); }
