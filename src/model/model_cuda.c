/* The nemotron_h forward pass on CUDA (issue 6): the weights uploaded (or generated) once into one
 * device allocation, a session with device buffers for max_chunk tokens and the caches, the
 * forward of a chunk as a sequence of launches on one stream (no host synchronisation inside a
 * forward, no allocation per token), decode captured once as a CUDA graph and replayed, and
 * optional device timers by layer kind. Same structure and rounding points as the CPU runtime
 * (src/model/nemotron_h.c, mamba2.c, attention.c, moe.c) with act_dtype = bf16: every matmul
 * reads and writes bf16, everything else is fp32. Ops: src/kernels/cuda/ops_cuda.h; NVFP4 matmuls
 * go through fp4moe_gather_qmm_cuda. Builds without CUDA compile model_cuda_stub.c instead. */
#ifdef FP4MOE_HAVE_CUDA

#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "common/error.h"
#include "fp4moe/nvfp4.h"
#include "kernels/cuda/ops_cuda.h"
#include "model/model_cuda.h"
#include "model/model_internal.h"
#include "model/synthetic.h"

#define CUDA_TRY(call, what)                                                                       \
    do {                                                                                           \
        const cudaError_t ct_e_ = (call);                                                          \
        if (ct_e_ != cudaSuccess)                                                                  \
            return fp4moe_set_error(FP4MOE_ECUDA, "cuda: %s: %s", (what), cudaGetErrorString(ct_e_)); \
    } while (0)

#define TRY(expr)                                                                                  \
    do {                                                                                           \
        const int try_st_ = (expr);                                                                \
        if (try_st_) return try_st_;                                                               \
    } while (0)

#define BLAS_WORKSPACE (32u << 20)
#define KV_MIN_ROWS 1024

/* ---- device weights --------------------------------------------------------------------------- */

typedef struct {
    char type;
    const float *norm;
    cuda_linear in_proj, out_proj;
    const float *conv_w, *conv_b, *A, *D, *dt_bias, *gnorm;
    cuda_linear q_proj, k_proj, v_proj, o_proj;
    const float *router_w, *router_bias;
    cuda_linear experts_up, experts_down, shared_up, shared_down, latent_in, latent_out;
    cuda_linear up, down;
} gpu_layer;

struct gpu_model {
    void *base;                     /* one cudaMalloc for every weight */
    size_t bytes;
    cuda_linear embed, lm_head;     /* embed: dense of its checkpoint dtype (bf16/f16/f32) or NVFP4 */
    const float *norm_f;
    gpu_layer *layers;
};

/* Places the weights in the device arena in two passes over the same traversal: the first only
 * counts bytes, the second copies (upload) or generates (synthetic) them. */
typedef struct {
    int fill;                       /* 0: count; 1: write */
    int synth;                      /* generate NVFP4 codes/scales and the embedding on the device */
    uint64_t seed;
    char *base;
    size_t used;
    cudaStream_t stream;
    fp4moe_progress_fn progress;
    void *ctx;
    int64_t total;
} placer;

static void report(placer *p, size_t bytes) {
    (void)bytes;
    if (p->fill && p->progress) p->progress(p->ctx, (int64_t)p->used, p->total);
}

/* Reserves `bytes` (256-byte aligned); *d is the device address in the fill pass, NULL before. */
static void reserve(placer *p, size_t bytes, void **d) {
    const size_t off = (p->used + 255) & ~(size_t)255;
    p->used = off + bytes;
    *d = p->fill ? p->base + off : NULL;
}

#define COPY_PIECE ((size_t)64 << 20)

/* Reserves and, in the fill pass, copies `bytes` from host memory (in pieces, for the progress). */
static int put(placer *p, const void *host, size_t bytes, void **d) {
    reserve(p, bytes, d);
    if (!p->fill || !bytes) return FP4MOE_OK;
    for (size_t o = 0; o < bytes; o += COPY_PIECE) {
        const size_t n = bytes - o < COPY_PIECE ? bytes - o : COPY_PIECE;
        CUDA_TRY(cudaMemcpy((char *)*d + o, (const char *)host + o, n, cudaMemcpyHostToDevice),
                 "upload of the weights");
        if (p->progress) p->progress(p->ctx, (int64_t)(p->used - bytes + o + n), p->total);
    }
    return FP4MOE_OK;
}

static int put_f32(placer *p, const float *host, int64_t n, const float **d) {
    *d = NULL;
    if (!host) return FP4MOE_OK;
    void *dv;
    TRY(put(p, host, (size_t)n * sizeof(float), &dv));
    *d = dv;
    return FP4MOE_OK;
}

/* Dense weights: bf16 and f32 as they are, f16 widened to f32 (cuBLAS takes one type for A and B). */
static int put_dense(placer *p, const op_linear *h, cuda_linear *d) {
    const size_t per = (size_t)(h->N * h->K);
    const fp4moe_dtype dt = h->dtype == FP4MOE_BF16 ? FP4MOE_BF16 : FP4MOE_F32;
    const size_t esz = fp4moe_dtype_size(dt);
    void *dv;
    reserve(p, (size_t)h->E * per * esz, &dv);
    d->dtype = dt;
    d->dense = dv;
    if (!p->fill) return FP4MOE_OK;
    float *tmp = h->dtype == FP4MOE_F16 ? malloc(per * sizeof(float)) : NULL;
    if (h->dtype == FP4MOE_F16 && !tmp)
        return fp4moe_set_error(FP4MOE_ENOMEM, "upload: cannot allocate %zu bytes of staging", per * 4);
    int st = FP4MOE_OK;
    for (int64_t e = 0; !st && e < h->E; e++) {
        const void *src = h->dense[e];
        if (tmp) {
            fp4moe_to_f32(src, FP4MOE_F16, (int64_t)per, tmp);
            src = tmp;
        }
        const cudaError_t ce = cudaMemcpy((char *)dv + (size_t)e * per * esz, src, per * esz,
                                          cudaMemcpyHostToDevice);
        if (ce != cudaSuccess)
            st = fp4moe_set_error(FP4MOE_ECUDA, "cuda: upload of the weights: %s", cudaGetErrorString(ce));
    }
    free(tmp);
    report(p, 0);
    return st;
}

/* Encode factor of a synthetic module: with a global scale the block scales use the E4M3 range. */
static float synth_enc(const op_linear *h) {
    return h->q.global_scale ? 2688.0f / (SYN_SIGMA * SYN_AMAX_SIGMAS) : 1.0f;
}

static int put_linear(placer *p, const op_linear *h, cuda_linear *d, uint64_t tensor_id) {
    memset(d, 0, sizeof *d);
    if (!h->N) return FP4MOE_OK;
    d->E = h->E;
    d->N = h->N;
    d->K = h->K;
    d->nvfp4 = h->nvfp4;
    if (h->nvfp4) {
        const size_t n = (size_t)(h->E * h->N * h->K);
        void *codes, *scales, *gs = NULL;
        if (p->synth) {
            reserve(p, n / 2, &codes);
            reserve(p, n / 16, &scales);
            if (p->fill) {
                TRY(cuda_synth_nvfp4(p->stream, p->seed, tensor_id, (int64_t)(n / 16), h->K / 16,
                                     SYN_SIGMA, synth_enc(h), codes, scales));
                report(p, n / 2 + n / 16);
            }
        } else {
            TRY(put(p, h->q.codes, n / 2, &codes));
            TRY(put(p, h->q.scales, n / 16, &scales));
        }
        if (h->q.global_scale) TRY(put(p, h->q.global_scale, (size_t)h->E * sizeof(float), &gs));
        d->q = (fp4moe_nvfp4_weights){codes, scales, gs, h->E, h->N, h->K};
    } else {
        if (p->synth) return fp4moe_set_error(FP4MOE_EINVAL, "synthetic: dense module");
        TRY(put_dense(p, h, d));
    }
    return put_f32(p, h->bias, h->N, &d->bias);
}

static int put_embedding(placer *p, const fp4moe_model *m, struct gpu_model *g) {
    const op_linear *e = &m->embed;
    cuda_linear *d = &g->embed;
    if (e->nvfp4) return put_linear(p, e, d, SYN_EMBED);
    memset(d, 0, sizeof *d);
    d->E = 1;
    d->N = e->N;
    d->K = e->K;
    d->dtype = e->dtype;            /* bf16, f16 or f32: cuda_embed reads all three */
    const size_t n = (size_t)(e->N * e->K), bytes = n * fp4moe_dtype_size(e->dtype);
    void *dv;
    if (p->synth) {
        reserve(p, bytes, &dv);
        if (p->fill) {
            TRY(cuda_synth_bf16(p->stream, p->seed, SYN_EMBED, (int64_t)n, SYN_SIGMA, dv));
            report(p, bytes);
        }
    } else {
        TRY(put(p, e->dense[0], bytes, &dv));
    }
    d->dense = dv;
    return FP4MOE_OK;
}

/* The lm_head shares the embedding's device copy when the model ties them and that copy is usable
 * as a linear (NVFP4, or dense bf16/f32). */
static int put_head(placer *p, const fp4moe_model *m, struct gpu_model *g) {
    const op_linear *e = &m->embed, *hd = &m->lm_head;
    const int same = hd->nvfp4 ? (e->nvfp4 && hd->q.codes && hd->q.codes == e->q.codes)
                               : (!e->nvfp4 && hd->dense && hd->dense == e->dense);
    if (same && (hd->nvfp4 || hd->dtype != FP4MOE_F16)) {
        g->lm_head = g->embed;
        return FP4MOE_OK;
    }
    return put_linear(p, hd, &g->lm_head, SYN_LM_HEAD);
}

static int put_layer(placer *p, const fp4moe_model *m, int64_t l, gpu_layer *d) {
    const fp4moe_config *c = &m->cfg;
    const layer_weights *w = &m->layers[l];
    const int64_t H = c->hidden, nh = c->mamba_heads, di = nh * c->mamba_head_dim;
    const int64_t cd = di + 2 * c->mamba_groups * c->ssm_state;
    d->type = w->type;
    TRY(put_f32(p, w->norm, H, &d->norm));
    switch (w->type) {
    case FP4MOE_LAYER_MAMBA:
        TRY(put_linear(p, &w->in_proj, &d->in_proj, SYN_LAYER_ID(l, SYN_IN_PROJ)));
        TRY(put_linear(p, &w->out_proj, &d->out_proj, SYN_LAYER_ID(l, SYN_OUT_PROJ)));
        TRY(put_f32(p, w->conv_w, cd * c->conv_kernel, &d->conv_w));
        TRY(put_f32(p, w->conv_b, cd, &d->conv_b));
        TRY(put_f32(p, w->A, nh, &d->A));
        TRY(put_f32(p, w->D, nh, &d->D));
        TRY(put_f32(p, w->dt_bias, nh, &d->dt_bias));
        return put_f32(p, w->gnorm, di, &d->gnorm);
    case FP4MOE_LAYER_ATTENTION:
        TRY(put_linear(p, &w->q_proj, &d->q_proj, SYN_LAYER_ID(l, SYN_Q)));
        TRY(put_linear(p, &w->k_proj, &d->k_proj, SYN_LAYER_ID(l, SYN_K)));
        TRY(put_linear(p, &w->v_proj, &d->v_proj, SYN_LAYER_ID(l, SYN_V)));
        return put_linear(p, &w->o_proj, &d->o_proj, SYN_LAYER_ID(l, SYN_O));
    case FP4MOE_LAYER_MOE:
        TRY(put_f32(p, w->router_w, c->n_experts * H, &d->router_w));
        TRY(put_f32(p, w->router_bias, c->n_experts, &d->router_bias));
        TRY(put_linear(p, &w->experts_up, &d->experts_up, SYN_LAYER_ID(l, SYN_EXPERTS_UP)));
        TRY(put_linear(p, &w->experts_down, &d->experts_down, SYN_LAYER_ID(l, SYN_EXPERTS_DOWN)));
        TRY(put_linear(p, &w->shared_up, &d->shared_up, SYN_LAYER_ID(l, SYN_SHARED_UP)));
        TRY(put_linear(p, &w->shared_down, &d->shared_down, SYN_LAYER_ID(l, SYN_SHARED_DOWN)));
        TRY(put_linear(p, &w->latent_in, &d->latent_in, SYN_LAYER_ID(l, SYN_LATENT_IN)));
        return put_linear(p, &w->latent_out, &d->latent_out, SYN_LAYER_ID(l, SYN_LATENT_OUT));
    default:
        TRY(put_linear(p, &w->up, &d->up, SYN_LAYER_ID(l, SYN_UP)));
        return put_linear(p, &w->down, &d->down, SYN_LAYER_ID(l, SYN_DOWN));
    }
}

static int place_model(placer *p, const fp4moe_model *m, struct gpu_model *g) {
    TRY(put_embedding(p, m, g));
    for (int64_t l = 0; l < m->cfg.n_layers; l++) {
        const int st = put_layer(p, m, l, &g->layers[l]);
        if (st) return fp4moe_error_context(st, "layer %lld (%s)", (long long)l,
                                            fp4moe_layer_type_name(m->cfg.layer_types[l]));
    }
    TRY(put_f32(p, m->norm_f, m->cfg.hidden, &g->norm_f));
    return put_head(p, m, g);
}

void gpu_model_free(struct gpu_model *g) {
    if (!g) return;
    if (g->base) cudaFree(g->base);
    free(g->layers);
    free(g);
}

static int build_gpu_model(fp4moe_model *m, int synth, uint64_t seed, fp4moe_progress_fn progress,
                           void *ctx) {
    if (!fp4moe_cuda_available())
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda: no CUDA device is visible");
    struct gpu_model *g = calloc(1, sizeof *g);
    if (g) g->layers = calloc((size_t)m->cfg.n_layers, sizeof *g->layers);
    if (!g || !g->layers) {
        gpu_model_free(g);
        return fp4moe_set_error(FP4MOE_ENOMEM, "cuda: out of host memory for the model");
    }
    placer p = {.synth = synth, .seed = seed, .progress = progress, .ctx = ctx};
    int st = place_model(&p, m, g);                      /* pass 1: count */
    if (!st) {
        g->bytes = p.used;
        const cudaError_t ce = cudaMalloc(&g->base, g->bytes ? g->bytes : 1);
        if (ce != cudaSuccess) {
            g->base = NULL;
            (void)cudaGetLastError();
            st = fp4moe_set_error(FP4MOE_ENOMEM, "cuda: cannot allocate %.2f GB of device memory for "
                                  "the weights: %s", (double)g->bytes * 1e-9, cudaGetErrorString(ce));
        }
    }
    if (!st) {                                           /* pass 2: write */
        p.fill = 1;
        p.base = g->base;
        p.used = 0;
        p.total = (int64_t)g->bytes;
        st = place_model(&p, m, g);
        const cudaError_t ce = cudaDeviceSynchronize();  /* the generator kernels */
        if (!st && ce != cudaSuccess)
            st = fp4moe_set_error(FP4MOE_ECUDA, "cuda: weights: %s", cudaGetErrorString(ce));
        if (!st && progress) progress(ctx, p.total, p.total);
    }
    if (st) {
        gpu_model_free(g);
        return st;
    }
    m->gpu = g;
    return FP4MOE_OK;
}

int gpu_model_upload(fp4moe_model *m, fp4moe_progress_fn progress, void *ctx) {
    if (m->no_host_weights)
        return fp4moe_set_error(FP4MOE_EINVAL, "cuda: the model has no host weights to upload");
    if (m->gpu) return FP4MOE_OK;
    return build_gpu_model(m, 0, 0, progress, ctx);
}

int gpu_model_synthetic(fp4moe_model *m, uint64_t seed, fp4moe_progress_fn progress, void *ctx) {
    return build_gpu_model(m, 1, seed, progress, ctx);
}

/* ---- session ---------------------------------------------------------------------------------- */

typedef struct {
    float *conv_state, *ssm_state;  /* Mamba: (Kc-1) x conv_dim, nh x hd x S (fp32) */
    uint16_t *k_cache, *v_cache;    /* attention: kv_cap rows of nkv*dh (bf16) */
} gpu_layer_state;

#define MAX_ALLOCS 64

struct gpu_session {
    struct gpu_model *g;
    int64_t n_layers;
    cudaStream_t stream;
    void *blas;
    cuda_ops ops;
    int64_t cap;                    /* tokens per chunk */
    void *allocs[MAX_ALLOCS];       /* every fixed device buffer (freed together) */
    int n_allocs;
    /* fixed buffers ("cap" = rows of a chunk) */
    int32_t *tokens, *pos, *next;   /* cap, 1 (context length P), 1 (greedy next token) */
    void *argmax_scratch;
    float *h, *xn32;                /* cap x H: residual stream; router input (bf16 values) */
    uint16_t *xn, *out_a, *out_b;   /* cap x H: normed input, mixer output, shared expert output */
    uint16_t *zx, *yb;              /* Mamba: cap x in_proj.N, cap x d_inner */
    float *xbc, *y;                 /* Mamba: cap x conv_dim, cap x d_inner */
    uint16_t *q, *kb, *vb, *att;    /* attention: cap x nq*dh, cap x kvs (x2), cap x nq*dh */
    float *rlogits, *wts;           /* MoE: cap x E, cap x k */
    int32_t *ids;                   /* cap x k */
    uint32_t *row_of, *idx, *pos_of;/* cap x k */
    uint16_t *xs, *hs, *ys;         /* cap*k x Hl, cap*k x I, cap*k x Hl */
    uint16_t *comb, *xl, *shh;      /* cap x Hl, cap x Hl (latent input), cap x Is */
    uint16_t *hm;                   /* dense MLP: cap x intermediate */
    float *lg32;                    /* V: fp32 logits of the last row */
    float *lgall32;                 /* all-row fp32 logits (all_logits), grown on demand */
    int64_t lgall_rows;
    int32_t *h_io;                  /* pinned host: [0] token in, [1] next token out */
    /* caches */
    float *state_base;              /* every Mamba layer's conv + SSM state, one allocation */
    size_t state_bytes;
    gpu_layer_state *ls;
    int64_t kv_cap;
    /* decode graph */
    cudaGraphExec_t exec;
    int graph_off;                  /* FP4MOE_CUDA_GRAPH=0, a route that synchronizes, a failed capture */
    int capturing;
    int64_t decodes;                /* eager decode steps so far (the first one warms up) */
    /* profiling */
    int prof;
    cudaEvent_t *ev;
    int *ev_kind;
    int n_ev, cap_ev, graph_n_ev;
    double prof_ms[FP4MOE_PROF_KINDS];
};

static int dalloc(struct gpu_session *gs, void *pp, int64_t n, size_t esz, const char *what) {
    void **p = pp;
    *p = NULL;
    if (n <= 0) return FP4MOE_OK;
    if (gs->n_allocs == MAX_ALLOCS)
        return fp4moe_set_error(FP4MOE_ENOMEM, "cuda session: more than %d buffers", MAX_ALLOCS);
    if ((uint64_t)n > SIZE_MAX / esz)
        return fp4moe_set_error(FP4MOE_EOVERFLOW, "cuda session: %s of %lld elements", what, (long long)n);
    const size_t bytes = (size_t)n * esz;
    const cudaError_t ce = cudaMalloc(p, bytes);
    if (ce != cudaSuccess) {
        *p = NULL;
        (void)cudaGetLastError();
        return fp4moe_set_error(FP4MOE_ENOMEM, "cuda session: cannot allocate %zu bytes for %s: %s",
                                bytes, what, cudaGetErrorString(ce));
    }
    gs->allocs[gs->n_allocs++] = *p;
    return FP4MOE_OK;
}

static int has_layer(const fp4moe_config *c, char type) {
    return strchr(c->layer_types, type) != NULL;
}

static void drop_graph(struct gpu_session *gs) {
    if (gs->exec) cudaGraphExecDestroy(gs->exec);
    gs->exec = NULL;
}

void gpu_session_free(struct gpu_session *gs) {
    if (!gs) return;
    if (gs->stream) cudaStreamSynchronize(gs->stream);
    drop_graph(gs);
    for (int i = 0; gs->ev && i < gs->cap_ev; i++)
        if (gs->ev[i]) cudaEventDestroy(gs->ev[i]);
    free(gs->ev);
    free(gs->ev_kind);
    cuda_blas_destroy(gs->blas);
    for (int64_t l = 0; gs->ls && l < gs->n_layers; l++) {
        cudaFree(gs->ls[l].k_cache);
        cudaFree(gs->ls[l].v_cache);
    }
    free(gs->ls);
    cudaFree(gs->lgall32);
    for (int i = 0; i < gs->n_allocs; i++) cudaFree(gs->allocs[i]);
    if (gs->h_io) cudaFreeHost(gs->h_io);
    if (gs->stream) cudaStreamDestroy(gs->stream);
    free(gs);
}

/* ---- device timers by layer kind ----------------------------------------------------------- */

/* Records the event that ends a segment of `kind` (the first mark of a forward only starts). */
static int prof_mark(struct gpu_session *gs, int kind) {
    if (!gs->prof) return FP4MOE_OK;
    if (gs->n_ev >= gs->cap_ev) return fp4moe_set_error(FP4MOE_EINVAL, "cuda profile: too many marks");
    CUDA_TRY(cudaEventRecordWithFlags(gs->ev[gs->n_ev], gs->stream,
                                      gs->capturing ? cudaEventRecordExternal : cudaEventRecordDefault),
             "profile event");
    gs->ev_kind[gs->n_ev++] = kind;
    return FP4MOE_OK;
}

/* After a synchronisation: adds the n - 1 segments of the last forward to the totals. */
static int prof_collect(struct gpu_session *gs, int n) {
    for (int i = 1; i < n; i++) {
        float ms = 0.0f;
        CUDA_TRY(cudaEventElapsedTime(&ms, gs->ev[i - 1], gs->ev[i]), "profile elapsed time");
        gs->prof_ms[gs->ev_kind[i]] += ms;
    }
    return FP4MOE_OK;
}

int gpu_session_profile(fp4moe_session *s, double ms[FP4MOE_PROF_KINDS], int reset) {
    struct gpu_session *gs = s->gpu;
    if (!gs || !gs->prof)
        return fp4moe_set_error(FP4MOE_EINVAL, "session profile: profiling is off (session option profile)");
    for (int k = 0; k < FP4MOE_PROF_KINDS; k++) ms[k] = gs->prof_ms[k];
    if (reset) memset(gs->prof_ms, 0, sizeof gs->prof_ms);
    return FP4MOE_OK;
}

/* ---- the forward of one chunk (launches only) ------------------------------------------------- */

static int mamba_enqueue(fp4moe_session *s, int64_t l, int64_t T) {
    const fp4moe_config *c = &s->m->cfg;
    struct gpu_session *gs = s->gpu;
    const gpu_layer *d = &gs->g->layers[l];
    const gpu_layer_state *ls = &gs->ls[l];
    const int64_t nh = c->mamba_heads, hd = c->mamba_head_dim, G = c->mamba_groups, S = c->ssm_state;
    const int64_t di = nh * hd, GS = G * S, cd = di + 2 * GS, np = d->in_proj.N;
    TRY(cuda_linear_forward(&gs->ops, &d->in_proj, gs->xn, T, gs->zx));
    TRY(cuda_conv1d_causal(gs->stream, gs->zx + di, np, T, cd, d->conv_w, d->conv_b, c->conv_kernel,
                           ls->conv_state, gs->xbc));
    const cuda_ssm_args a = {
        .T = T, .nh = nh, .hd = hd, .S = S, .G = G,
        .x = gs->xbc, .xs = cd, .B = gs->xbc + di, .C = gs->xbc + di + GS, .bcs = cd,
        .dt = gs->zx + di + cd, .dts = np, .dt_bias = d->dt_bias, .A = d->A, .D = d->D,
        .dt_lo = c->time_step_limit[0], .dt_hi = c->time_step_limit[1], .state = ls->ssm_state, .y = gs->y,
    };
    TRY(cuda_ssm_scan(gs->stream, &a));
    TRY(cuda_rmsnorm_gated(gs->stream, gs->y, gs->zx, np, d->gnorm, T, di, G, c->eps, gs->yb));
    TRY(cuda_linear_forward(&gs->ops, &d->out_proj, gs->yb, T, gs->out_a));
    return cuda_residual_add(gs->stream, gs->h, gs->out_a, NULL, T * c->hidden);
}

static int attention_enqueue(fp4moe_session *s, int64_t l, int64_t T) {
    const fp4moe_config *c = &s->m->cfg;
    struct gpu_session *gs = s->gpu;
    const gpu_layer *d = &gs->g->layers[l];
    const gpu_layer_state *ls = &gs->ls[l];
    const int64_t nq = c->attn_heads, nkv = c->kv_heads, dh = c->head_dim;
    TRY(cuda_linear_forward(&gs->ops, &d->q_proj, gs->xn, T, gs->q));
    TRY(cuda_linear_forward(&gs->ops, &d->k_proj, gs->xn, T, gs->kb));
    TRY(cuda_linear_forward(&gs->ops, &d->v_proj, gs->xn, T, gs->vb));
    TRY(cuda_kv_append(gs->stream, gs->kb, gs->vb, T, nkv * dh, gs->pos, ls->k_cache, ls->v_cache));
    TRY(cuda_attention(gs->stream, gs->q, ls->k_cache, ls->v_cache, gs->pos, T, nq, nkv, dh, gs->att));
    TRY(cuda_linear_forward(&gs->ops, &d->o_proj, gs->att, T, gs->out_a));
    return cuda_residual_add(gs->stream, gs->h, gs->out_a, NULL, T * c->hidden);
}

/* Router -> sort -> gather -> gather_qmm up -> relu^2 -> gather_qmm down -> combine (moe.c). */
static int moe_enqueue(fp4moe_session *s, int64_t l, int64_t T) {
    const fp4moe_config *c = &s->m->cfg;
    struct gpu_session *gs = s->gpu;
    const gpu_layer *d = &gs->g->layers[l];
    const int64_t H = c->hidden, E = c->n_experts, k = c->top_k, B = T * k;
    const int64_t Hl = c->moe_latent ? c->moe_latent : H;
    TRY(cuda_matmul_f32(&gs->ops, gs->xn32, T, d->router_w, E, H, gs->rlogits));
    const cuda_router_cfg rc = {E, k, c->n_group, c->topk_group, c->norm_topk_prob, c->routed_scaling,
                                d->router_bias};
    TRY(cuda_router_topk(gs->stream, &rc, gs->rlogits, T, gs->ids, gs->wts));
    TRY(cuda_sort_by_expert(gs->stream, gs->ids, B, E, gs->row_of, gs->idx, gs->pos_of));
    const uint16_t *xin = gs->xn;
    if (c->moe_latent) {
        TRY(cuda_linear_forward(&gs->ops, &d->latent_in, gs->xn, T, gs->xl));
        xin = gs->xl;
    }
    TRY(cuda_gather_rows(gs->stream, xin, Hl, gs->row_of, B, k, gs->xs));
    TRY(cuda_linear_gather(&gs->ops, &d->experts_up, gs->xs, gs->idx, B, gs->hs));
    TRY(cuda_relu2(gs->stream, gs->hs, B * d->experts_up.N));
    TRY(cuda_linear_gather(&gs->ops, &d->experts_down, gs->hs, gs->idx, B, gs->ys));
    TRY(cuda_moe_combine(gs->stream, gs->ys, Hl, gs->pos_of, gs->wts, T, k, gs->comb));
    const uint16_t *routed = gs->comb;
    if (c->moe_latent) {
        TRY(cuda_linear_forward(&gs->ops, &d->latent_out, gs->comb, T, gs->out_a));
        routed = gs->out_a;
    }
    TRY(prof_mark(gs, FP4MOE_PROF_MOE_ROUTED));
    const uint16_t *shared = NULL;
    if (d->shared_up.N) {
        TRY(cuda_linear_forward(&gs->ops, &d->shared_up, gs->xn, T, gs->shh));
        TRY(cuda_relu2(gs->stream, gs->shh, T * d->shared_up.N));
        TRY(cuda_linear_forward(&gs->ops, &d->shared_down, gs->shh, T, gs->out_b));
        shared = gs->out_b;
    }
    TRY(cuda_residual_add(gs->stream, gs->h, routed, shared, T * H));
    return prof_mark(gs, FP4MOE_PROF_MOE_SHARED);
}

static int mlp_enqueue(fp4moe_session *s, int64_t l, int64_t T) {
    struct gpu_session *gs = s->gpu;
    const gpu_layer *d = &gs->g->layers[l];
    TRY(cuda_linear_forward(&gs->ops, &d->up, gs->xn, T, gs->hm));
    TRY(cuda_relu2(gs->stream, gs->hm, T * d->up.N));
    TRY(cuda_linear_forward(&gs->ops, &d->down, gs->hm, T, gs->out_a));
    return cuda_residual_add(gs->stream, gs->h, gs->out_a, NULL, T * s->m->cfg.hidden);
}

/* One layer: h += mixer(rmsnorm(h) * norm) (layer_forward in nemotron_h.c). */
static int layer_enqueue(fp4moe_session *s, int64_t l, int64_t T) {
    const fp4moe_config *c = &s->m->cfg;
    struct gpu_session *gs = s->gpu;
    const gpu_layer *d = &gs->g->layers[l];
    int st = cuda_rmsnorm(gs->stream, gs->h, d->norm, T, c->hidden, c->eps, gs->xn,
                          d->type == FP4MOE_LAYER_MOE ? gs->xn32 : NULL);
    switch (d->type) {
    case FP4MOE_LAYER_MAMBA:
        if (!st) st = mamba_enqueue(s, l, T);
        if (!st) st = prof_mark(gs, FP4MOE_PROF_MAMBA);
        break;
    case FP4MOE_LAYER_ATTENTION:
        if (!st) st = attention_enqueue(s, l, T);
        if (!st) st = prof_mark(gs, FP4MOE_PROF_ATTENTION);
        break;
    case FP4MOE_LAYER_MOE:
        if (!st) st = moe_enqueue(s, l, T);
        break;
    default:
        if (!st) st = mlp_enqueue(s, l, T);
        if (!st) st = prof_mark(gs, FP4MOE_PROF_OTHER);
    }
    return st ? fp4moe_error_context(st, "layer %lld (%s)", (long long)l, fp4moe_layer_type_name(d->type))
              : FP4MOE_OK;
}

/* The forward of T tokens already in gs->tokens, after *gs->pos positions: embedding, layers,
 * then (head_rows > 0) the final norm and lm_head of the last head_rows tokens into lg
 * (head_rows x V, fp32: the logits are not rounded to bf16) and (next != NULL) the argmax of the
 * last row; *gs->pos += T. */
static int enqueue_chunk(fp4moe_session *s, int64_t T, int64_t head_rows, float *lg, int32_t *next) {
    const fp4moe_config *c = &s->m->cfg;
    struct gpu_session *gs = s->gpu;
    const struct gpu_model *g = gs->g;
    gs->n_ev = 0;
    TRY(prof_mark(gs, FP4MOE_PROF_OTHER));
    TRY(cuda_embed(gs->stream, &g->embed, gs->tokens, T, gs->h));
    TRY(prof_mark(gs, FP4MOE_PROF_OTHER));
    for (int64_t l = 0; l < c->n_layers; l++) TRY(layer_enqueue(s, l, T));
    if (head_rows > 0) {
        const int64_t H = c->hidden, V = c->vocab;
        TRY(cuda_rmsnorm(gs->stream, gs->h + (T - head_rows) * H, g->norm_f, head_rows, H, c->eps, gs->xn,
                         NULL));
        const int st = cuda_linear_forward_f32out(&gs->ops, &g->lm_head, gs->xn, head_rows, lg);
        if (st) return fp4moe_error_context(st, "lm_head");
        if (next) TRY(cuda_argmax_f32(gs->stream, lg + (head_rows - 1) * V, V, gs->argmax_scratch, next));
        TRY(prof_mark(gs, FP4MOE_PROF_LM_HEAD));
    }
    return cuda_pos_advance(gs->stream, gs->pos, T);
}

/* One decode step (token in gs->tokens[0]): logits of the row in lg32, argmax in gs->next. The
 * same launches are captured into the decode graph. */
static int decode_enqueue(fp4moe_session *s) {
    struct gpu_session *gs = s->gpu;
    return enqueue_chunk(s, 1, 1, gs->lg32, gs->next);
}

/* Captures decode_enqueue into gs->exec. A failure (e.g. a gather route that synchronizes) is not
 * an error: graphs are switched off for the session and decode runs launch by launch. */
static void capture_decode(fp4moe_session *s) {
    struct gpu_session *gs = s->gpu;
    cudaGraph_t graph = NULL;
    int st = FP4MOE_ECUDA;
    gs->capturing = 1;
    if (cudaStreamBeginCapture(gs->stream, cudaStreamCaptureModeRelaxed) == cudaSuccess) {
        st = decode_enqueue(s);
        if (cudaStreamEndCapture(gs->stream, &graph) != cudaSuccess && !st) st = FP4MOE_ECUDA;
    }
    gs->capturing = 0;
    gs->graph_n_ev = gs->n_ev;
    if (!st && graph && cudaGraphInstantiate(&gs->exec, graph, 0) != cudaSuccess) gs->exec = NULL;
    if (graph) cudaGraphDestroy(graph);
    if (st || !gs->exec) {
        gs->exec = NULL;
        gs->graph_off = 1;
        (void)cudaGetLastError();
        fp4moe_clear_error();
    }
}

static int decode_step(fp4moe_session *s, int32_t token, float *logits, int32_t *next) {
    struct gpu_session *gs = s->gpu;
    const int64_t V = s->m->cfg.vocab;
    gs->h_io[0] = token;
    CUDA_TRY(cudaMemcpyAsync(gs->tokens, gs->h_io, sizeof(int32_t), cudaMemcpyHostToDevice, gs->stream),
             "token upload");
    if (!gs->exec && !gs->graph_off && gs->decodes >= 1) capture_decode(s);
    int n_ev;
    if (gs->exec) {
        CUDA_TRY(cudaGraphLaunch(gs->exec, gs->stream), "decode graph launch");
        n_ev = gs->graph_n_ev;
    } else {
        TRY(decode_enqueue(s));
        gs->decodes++;
        n_ev = gs->n_ev;
    }
    if (logits)
        CUDA_TRY(cudaMemcpyAsync(logits, gs->lg32, (size_t)V * sizeof(float), cudaMemcpyDeviceToHost,
                                 gs->stream), "logits download");
    if (next)
        CUDA_TRY(cudaMemcpyAsync(gs->h_io + 1, gs->next, sizeof(int32_t), cudaMemcpyDeviceToHost,
                                 gs->stream), "token download");
    CUDA_TRY(cudaStreamSynchronize(gs->stream), "decode step");
    if (next) *next = gs->h_io[1];
    if (gs->prof) TRY(prof_collect(gs, n_ev));
    s->pos += 1;
    return FP4MOE_OK;
}

/* Room for `rows` rows of all-position logits. */
static int ensure_lgall(struct gpu_session *gs, int64_t rows, int64_t V) {
    if (rows <= gs->lgall_rows) return FP4MOE_OK;
    CUDA_TRY(cudaStreamSynchronize(gs->stream), "logits buffer");
    cudaFree(gs->lgall32);
    gs->lgall32 = NULL;
    gs->lgall_rows = 0;
    if (cudaMalloc((void **)&gs->lgall32, (size_t)(rows * V) * 4) != cudaSuccess) {
        (void)cudaGetLastError();
        return fp4moe_set_error(FP4MOE_ENOMEM, "cuda session: no device memory for %lld rows of logits",
                                (long long)rows);
    }
    gs->lgall_rows = rows;
    return FP4MOE_OK;
}

static int prefill(fp4moe_session *s, const int32_t *tokens, int64_t T, float *logits, int all_logits,
                   int32_t *next) {
    struct gpu_session *gs = s->gpu;
    const int64_t V = s->m->cfg.vocab;
    for (int64_t t0 = 0; t0 < T; t0 += gs->cap) {
        if (s->opt.interrupt && *s->opt.interrupt)
            return fp4moe_set_error(FP4MOE_EINTERRUPTED, "forward: interrupted");
        const int64_t n = T - t0 < gs->cap ? T - t0 : gs->cap;
        const int last = t0 + n == T, all = logits && all_logits;
        int64_t rows = 0;
        float *lg = gs->lg32;
        if (all) {
            TRY(ensure_lgall(gs, n, V));
            rows = n;
            lg = gs->lgall32;
        } else if (last && (logits || next)) {
            rows = 1;
        }
        CUDA_TRY(cudaMemcpyAsync(gs->tokens, tokens + t0, (size_t)n * sizeof(int32_t),
                                 cudaMemcpyHostToDevice, gs->stream), "token upload");
        TRY(enqueue_chunk(s, n, rows, lg, last && next ? gs->next : NULL));
        if (all) {
            CUDA_TRY(cudaMemcpyAsync(logits + t0 * V, gs->lgall32, (size_t)(n * V) * sizeof(float),
                                     cudaMemcpyDeviceToHost, gs->stream), "logits download");
        } else if (last && logits) {
            CUDA_TRY(cudaMemcpyAsync(logits, gs->lg32, (size_t)V * sizeof(float), cudaMemcpyDeviceToHost,
                                     gs->stream), "logits download");
        }
        if (last && next)
            CUDA_TRY(cudaMemcpyAsync(gs->h_io + 1, gs->next, sizeof(int32_t), cudaMemcpyDeviceToHost,
                                     gs->stream), "token download");
        if (last || gs->prof) {
            CUDA_TRY(cudaStreamSynchronize(gs->stream), "forward");
            if (gs->prof) TRY(prof_collect(gs, gs->n_ev));
        }
        s->pos += n;
    }
    if (next) *next = gs->h_io[1];
    return FP4MOE_OK;
}

/* KV caches for `need` positions: grown to a power of two (or max_context) with the rows kept;
 * the decode graph, which holds the old addresses, is dropped. */
static int ensure_kv(fp4moe_session *s, int64_t need) {
    const fp4moe_config *c = &s->m->cfg;
    struct gpu_session *gs = s->gpu;
    if (need <= gs->kv_cap || !has_layer(c, FP4MOE_LAYER_ATTENTION)) return FP4MOE_OK;
    int64_t cap = s->opt.max_context > 0 ? s->opt.max_context : KV_MIN_ROWS;
    while (cap < need) cap *= 2;
    const size_t row = (size_t)(c->kv_heads * c->head_dim) * sizeof(uint16_t);
    CUDA_TRY(cudaStreamSynchronize(gs->stream), "kv cache");
    drop_graph(gs);
    for (int64_t l = 0; l < c->n_layers; l++) {
        if (c->layer_types[l] != FP4MOE_LAYER_ATTENTION) continue;
        gpu_layer_state *ls = &gs->ls[l];
        uint16_t *kv[2] = {NULL, NULL};
        for (int i = 0; i < 2; i++)
            if (cudaMalloc((void **)&kv[i], (size_t)cap * row) != cudaSuccess) {
                (void)cudaGetLastError();
                cudaFree(kv[0]);
                return fp4moe_set_error(FP4MOE_ENOMEM, "cuda session: no device memory for a KV cache "
                                        "of %lld tokens", (long long)cap);
            }
        /* the rows kept are copied on the session's stream (a non-blocking stream is not ordered
         * after a cudaMemcpy on the legacy stream) and complete before the old caches are freed */
        if (s->pos > 0 && ls->k_cache) {
            CUDA_TRY(cudaMemcpyAsync(kv[0], ls->k_cache, (size_t)s->pos * row, cudaMemcpyDeviceToDevice,
                                     gs->stream), "kv copy");
            CUDA_TRY(cudaMemcpyAsync(kv[1], ls->v_cache, (size_t)s->pos * row, cudaMemcpyDeviceToDevice,
                                     gs->stream), "kv copy");
            CUDA_TRY(cudaStreamSynchronize(gs->stream), "kv copy");
        }
        cudaFree(ls->k_cache);
        cudaFree(ls->v_cache);
        ls->k_cache = kv[0];
        ls->v_cache = kv[1];
    }
    gs->kv_cap = cap;
    return FP4MOE_OK;
}

int gpu_session_forward(fp4moe_session *s, const int32_t *tokens, int64_t T, float *logits, int all_logits,
                        int32_t *next) {
    TRY(ensure_kv(s, s->pos + T));
    if (T == 1) return decode_step(s, tokens[0], logits, next);
    return prefill(s, tokens, T, logits, all_logits, next);
}

void gpu_session_reset(fp4moe_session *s) {
    struct gpu_session *gs = s->gpu;
    if (!gs) return;
    cudaMemsetAsync(gs->pos, 0, sizeof(int32_t), gs->stream);
    if (gs->state_base) cudaMemsetAsync(gs->state_base, 0, gs->state_bytes, gs->stream);
    cudaStreamSynchronize(gs->stream);
    s->pos = 0; /* the KV rows beyond 0 are dead; the caches are kept */
}

/* ---- session creation -------------------------------------------------------------------------- */

/* Rows x width of f32 staging that the model needs (0 when none): max(N, K) of its dense f32
 * linears; K of the lm_head when NVFP4 or f32 (cuda_linear_forward_f32out widens its input). */
static int64_t f32_staging(const struct gpu_model *g, const fp4moe_config *c) {
    const cuda_linear *hd = &g->lm_head;
    int64_t w = hd->nvfp4 || hd->dtype == FP4MOE_F32 ? hd->K : 0;
    for (int64_t l = 0; l < c->n_layers; l++) {
        const gpu_layer *d = &g->layers[l];
        const cuda_linear *lins[] = {&d->in_proj, &d->out_proj, &d->q_proj, &d->k_proj, &d->v_proj,
                                     &d->o_proj, &d->shared_up, &d->shared_down, &d->latent_in,
                                     &d->latent_out, &d->up, &d->down};
        for (size_t i = 0; i < sizeof lins / sizeof lins[0]; i++)
            if (lins[i]->N && !lins[i]->nvfp4 && lins[i]->dtype == FP4MOE_F32) {
                const int64_t m = lins[i]->N > lins[i]->K ? lins[i]->N : lins[i]->K;
                w = m > w ? m : w;
            }
    }
    return w;
}

static int session_buffers(fp4moe_session *s) {
    const fp4moe_config *c = &s->m->cfg;
    struct gpu_session *gs = s->gpu;
    const int64_t cap = gs->cap, H = c->hidden, V = c->vocab;
    const int64_t di = c->mamba_heads * c->mamba_head_dim, GS = c->mamba_groups * c->ssm_state;
    const int64_t cd = di + 2 * GS, np = 2 * di + 2 * GS + c->mamba_heads;
    const int64_t q = c->attn_heads * c->head_dim, kvs = c->kv_heads * c->head_dim;
    const int64_t E = c->n_experts, k = c->top_k, Hl = c->moe_latent ? c->moe_latent : H;
    const int64_t B = cap * k, I = c->moe_inter, Is = c->n_shared ? c->shared_inter : 0;
    int64_t big;
    if (fp4moe_mul_overflow(B, Hl > I ? Hl : I, &big) || fp4moe_mul_overflow(cap, V, &big) ||
        fp4moe_mul_overflow(cap, np, &big))
        return fp4moe_set_error(FP4MOE_EOVERFLOW, "cuda session: buffers for max_chunk=%lld overflow",
                                (long long)cap);
    void *ws;
    TRY(dalloc(gs, &ws, BLAS_WORKSPACE, 1, "the cuBLAS workspace"));
    TRY(cuda_blas_create(gs->stream, ws, BLAS_WORKSPACE, &gs->blas));
    TRY(dalloc(gs, &gs->tokens, cap, 4, "token ids"));
    TRY(dalloc(gs, &gs->pos, 1, 4, "the position"));
    TRY(dalloc(gs, &gs->next, 1, 4, "the next token"));
    TRY(dalloc(gs, &gs->argmax_scratch, CUDA_ARGMAX_SCRATCH, 1, "argmax scratch"));
    TRY(dalloc(gs, &gs->h, cap * H, 4, "the residual stream"));
    TRY(dalloc(gs, &gs->xn, cap * H, 2, "normed activations"));
    TRY(dalloc(gs, &gs->out_a, cap * H, 2, "mixer outputs"));
    TRY(dalloc(gs, &gs->out_b, cap * H, 2, "shared expert outputs"));
    uint32_t *zeros;
    TRY(dalloc(gs, &zeros, cap, 4, "linear idx"));
    CUDA_TRY(cudaMemsetAsync(zeros, 0, (size_t)cap * 4, gs->stream), "memset");
    if (has_layer(c, FP4MOE_LAYER_MAMBA)) {
        TRY(dalloc(gs, &gs->zx, cap * np, 2, "in_proj outputs"));
        TRY(dalloc(gs, &gs->xbc, cap * cd, 4, "conv outputs"));
        TRY(dalloc(gs, &gs->y, cap * di, 4, "scan outputs"));
        TRY(dalloc(gs, &gs->yb, cap * di, 2, "gated norm outputs"));
    }
    if (has_layer(c, FP4MOE_LAYER_ATTENTION)) {
        TRY(dalloc(gs, &gs->q, cap * q, 2, "queries"));
        TRY(dalloc(gs, &gs->kb, cap * kvs, 2, "keys"));
        TRY(dalloc(gs, &gs->vb, cap * kvs, 2, "values"));
        TRY(dalloc(gs, &gs->att, cap * q, 2, "attention outputs"));
    }
    if (has_layer(c, FP4MOE_LAYER_MOE)) {
        TRY(dalloc(gs, &gs->xn32, cap * H, 4, "router inputs"));
        TRY(dalloc(gs, &gs->rlogits, cap * E, 4, "router logits"));
        TRY(dalloc(gs, &gs->wts, B, 4, "router weights"));
        TRY(dalloc(gs, &gs->ids, B, 4, "router ids"));
        TRY(dalloc(gs, &gs->row_of, B, 4, "sort rows"));
        TRY(dalloc(gs, &gs->idx, B, 4, "sorted experts"));
        TRY(dalloc(gs, &gs->pos_of, B, 4, "sort positions"));
        TRY(dalloc(gs, &gs->xs, B * Hl, 2, "expert inputs"));
        TRY(dalloc(gs, &gs->hs, B * I, 2, "expert hidden"));
        TRY(dalloc(gs, &gs->ys, B * Hl, 2, "expert outputs"));
        TRY(dalloc(gs, &gs->comb, cap * Hl, 2, "combined outputs"));
        if (c->moe_latent) TRY(dalloc(gs, &gs->xl, cap * Hl, 2, "latent inputs"));
        TRY(dalloc(gs, &gs->shh, cap * Is, 2, "shared expert hidden"));
    }
    if (has_layer(c, FP4MOE_LAYER_MLP)) TRY(dalloc(gs, &gs->hm, cap * c->mlp_inter, 2, "MLP hidden"));
    TRY(dalloc(gs, &gs->lg32, V, 4, "logits"));
    const int64_t f32w = f32_staging(gs->g, c);
    TRY(dalloc(gs, &gs->ops.f32_x, cap * f32w, 4, "f32 staging"));
    TRY(dalloc(gs, &gs->ops.f32_y, cap * f32w, 4, "f32 staging"));
    gs->ops = (cuda_ops){gs->stream, gs->blas, s->opt.route, zeros, cap, gs->ops.f32_x, gs->ops.f32_y,
                         cap * f32w};
    /* Mamba states: one allocation, carved per layer */
    const int64_t nconv = (c->conv_kernel - 1) * cd, nssm = di * c->ssm_state;
    int64_t nm = 0;
    for (int64_t l = 0; l < c->n_layers; l++) nm += c->layer_types[l] == FP4MOE_LAYER_MAMBA;
    gs->state_bytes = (size_t)(nm * (nconv + nssm)) * sizeof(float);
    TRY(dalloc(gs, &gs->state_base, nm * (nconv + nssm), 4, "Mamba states"));
    float *p = gs->state_base;
    for (int64_t l = 0; l < c->n_layers; l++) {
        if (c->layer_types[l] != FP4MOE_LAYER_MAMBA) continue;
        gs->ls[l].conv_state = p;
        gs->ls[l].ssm_state = p + nconv;
        p += nconv + nssm;
    }
    CUDA_TRY(cudaMallocHost((void **)&gs->h_io, 2 * sizeof(int32_t)), "pinned host buffer");
    return FP4MOE_OK;
}

static int session_profiling(fp4moe_session *s) {
    struct gpu_session *gs = s->gpu;
    const fp4moe_config *c = &s->m->cfg;
    gs->prof = 1;
    gs->cap_ev = 4 + 2 * (int)c->n_layers;
    gs->ev = calloc((size_t)gs->cap_ev, sizeof *gs->ev);
    gs->ev_kind = calloc((size_t)gs->cap_ev, sizeof *gs->ev_kind);
    if (!gs->ev || !gs->ev_kind) return fp4moe_set_error(FP4MOE_ENOMEM, "cuda session: out of memory");
    for (int i = 0; i < gs->cap_ev; i++) CUDA_TRY(cudaEventCreate(&gs->ev[i]), "profile events");
    return FP4MOE_OK;
}

int gpu_session_new(fp4moe_session *s) {
    const fp4moe_model *m = s->m;
    const fp4moe_config *c = &m->cfg;
    if (!m->gpu)
        return fp4moe_set_error(FP4MOE_EINVAL, "session: device cuda needs a model whose weights are on "
                                "the GPU (load it with device cuda)");
    if (s->opt.act_dtype != FP4MOE_BF16)
        return fp4moe_set_error(FP4MOE_EINVAL, "session: CUDA sessions compute with bf16 activations "
                                "(act_dtype bf16, --dtype bf16); %s asked",
                                fp4moe_dtype_name(s->opt.act_dtype));
    struct gpu_session *gs = calloc(1, sizeof *gs);
    if (!gs) return fp4moe_set_error(FP4MOE_ENOMEM, "cuda session: out of memory");
    s->gpu = gs; /* from here on, fp4moe_session_free releases what was made */
    gs->g = m->gpu;
    gs->n_layers = c->n_layers;
    gs->cap = s->opt.max_chunk;
    if (s->opt.max_context > 0 && gs->cap > s->opt.max_context) gs->cap = s->opt.max_context;
    gs->ls = calloc((size_t)c->n_layers, sizeof *gs->ls);
    if (!gs->ls) return fp4moe_set_error(FP4MOE_ENOMEM, "cuda session: out of memory");
    CUDA_TRY(cudaStreamCreateWithFlags(&gs->stream, cudaStreamNonBlocking), "stream");
    TRY(session_buffers(s));
    if (s->opt.profile) TRY(session_profiling(s));
    const char *env = getenv("FP4MOE_CUDA_GRAPH");
    gs->graph_off = (env && !strcmp(env, "0")) || s->opt.route == FP4MOE_ROUTE_DEQUANT_GEMM;
    gpu_session_reset(s);
    CUDA_TRY(cudaGetLastError(), "session setup");
    return FP4MOE_OK;
}

#endif /* FP4MOE_HAVE_CUDA */
