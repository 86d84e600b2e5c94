/* The CUDA backend (src/backend/backend.h): the weights uploaded (or generated) once into one device
 * allocation and exposed to the forward as fw_weights; the backend ops as launches of
 * src/kernels/cuda/ on one stream (with FP4MOE_CUDA_SIDE_STREAM=1 the shared expert of decode steps on a
 * second one, cu_side_begin; no host synchronisation inside a forward, no allocation per
 * step); decode-only steps captured once per row count as a CUDA graph and replayed; optional
 * device timers by layer kind. "act" buffers are bf16: every matmul reads and writes bf16,
 * everything else is fp32, the CPU backend's rounding with act_dtype = bf16. NVFP4 matmuls go
 * through fp4moe_gather_qmm_cuda. Builds without CUDA compile backend_cuda_stub.c instead. */
#ifdef FP4MOE_HAVE_CUDA

#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "common/env.h"
#include "kernels/cuda/cuda_check.h"
#include "common/error.h"
#include "fp4moe/nvfp4.h"
#include "kernels/cuda/ops_cuda.h"
#include "backend/backend.h"
#include "backend/cuda/placement.h"
#include "model/model_internal.h"
#include "kernels/synthetic.h"


#define TRY(expr)                                                                                  \
    do {                                                                                           \
        const int try_st_ = (expr);                                                                \
        if (try_st_) return try_st_;                                                               \
    } while (0)

#define BLAS_WORKSPACE (32u << 20)
#ifndef FP4MOE_KV_PAIR
#define FP4MOE_KV_PAIR 1 /* 0: k_proj and v_proj placed apart, two calls a step (a measured variant) */
#endif
#define KV_MIN_ROWS 1024

/* ---- device weights --------------------------------------------------------------------------- */

typedef struct {
    char type;
    const float *norm;
    cuda_linear in_proj, out_proj;
    const float *conv_w, *conv_b, *A, *D, *dt_bias, *gnorm;
    cuda_linear q_proj, k_proj, v_proj, o_proj;
    cuda_linear kv_proj;            /* k_proj and v_proj stacked (put_kv_pair), or N = 0 */
    const float *router_w, *router_bias;
    const uint16_t *router_w3;      /* router_w as three bf16 planes (cuda_split_bf16x3) */
    cuda_linear experts_up, experts_down, shared_up, shared_down, latent_in, latent_out;
    cuda_linear up, down;
} gpu_layer;

struct gpu_model {
    int device;                     /* the CUDA device holding the weights (current at the upload) */
    void *base;                     /* one cudaMalloc for every weight */
    size_t bytes;
    cuda_linear embed, lm_head;     /* embed: dense of its checkpoint dtype (bf16/f16/f32) or NVFP4 */
    const float *norm_f;
    gpu_layer *layers;
    fw_weights fw;                  /* the same placement as the forward sees it */
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
    int dense_copy;                 /* bf16 copies of the plain NVFP4 linears (FP4MOE_CUDA_DENSE_BF16) */
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
        FP4MOE_CUDA_TRY("cuda", cudaMemcpy((char *)*d + o, (const char *)host + o, n, cudaMemcpyHostToDevice),
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

/* Three bf16 planes (cuda_split_bf16x3) of the n fp32 weights dw that put_f32 placed from host (none when host is
 * NULL), computed on the device in the fill pass. */
static int put_planes3(placer *p, const float *host, const float *dw, int64_t n, const uint16_t **d) {
    *d = NULL;
    if (!host || n <= 0) return FP4MOE_OK;
    void *dv;
    reserve(p, (size_t)n * 3 * sizeof(uint16_t), &dv);
    if (!p->fill) return FP4MOE_OK;
    TRY(cuda_split_bf16x3(p->stream, dw, n, dv));
    FP4MOE_CUDA_TRY("cuda", cudaStreamSynchronize(p->stream), "the router weights' bf16 planes");
    *d = dv;
    report(p, (size_t)n * 6);
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

/* The tiled layout (FP4MOE_CUDA_WEIGHT_LAYOUT=tiled; src/kernels/cuda/gather_cuda.cuh): the codes and
 * scales go to a temporary device buffer (uploaded or generated there), then into the layout at the
 * reserved place; the checkpoint layout is not kept. */
static int fill_tiled(placer *p, const op_linear *h, uint64_t tensor_id, void *dst);
static int put_tiled(placer *p, const op_linear *h, uint64_t tensor_id, void **tiled) {
    reserve(p, (size_t)(h->E * cuda_nvfp4_tiled_expert_bytes(h->N, h->K)), tiled);
    return p->fill ? fill_tiled(p, h, tensor_id, *tiled) : FP4MOE_OK;
}
/* h's weights (uploaded or generated) in the tiled layout at dst (fill pass) */
static int fill_tiled(placer *p, const op_linear *h, uint64_t tensor_id, void *dst) {
    const size_t n = (size_t)(h->E * h->N * h->K), cb = (n / 2 + 255) & ~(size_t)255;
    uint8_t *tmp = NULL;
    FP4MOE_CUDA_TRY("cuda", cudaMalloc((void **)&tmp, cb + n / 16), "staging of a weight for the tiled layout");
    int st = FP4MOE_OK;
    if (p->synth) {
        st = cuda_synth_nvfp4(p->stream, p->seed, tensor_id, (int64_t)(n / 16), h->K / 16, SYN_SIGMA, synth_enc(h),
                              tmp, tmp + cb);
    } else {
        cudaError_t ce = cudaMemcpy(tmp, h->q.codes, n / 2, cudaMemcpyHostToDevice);
        if (ce == cudaSuccess) ce = cudaMemcpy(tmp + cb, h->q.scales, n / 16, cudaMemcpyHostToDevice);
        if (ce != cudaSuccess) st = fp4moe_set_error(FP4MOE_ECUDA, "cuda: upload of the weights: %s", cudaGetErrorString(ce));
    }
    if (!st) st = cuda_nvfp4_relayout_tiled(p->stream, tmp, tmp + cb, h->E, h->N, h->K, dst);
    const cudaError_t se = cudaStreamSynchronize(p->stream);
    if (!st && se != cudaSuccess) st = FP4MOE_CUDA_STATUS(se, "cuda", "tiled layout of the weights");
    cudaFree(tmp);
    report(p, n / 2 + n / 16);
    return st;
}

/* may_tile: 0 for the embedding (its rows are looked up in the checkpoint layout). copy: a plain NVFP4
 * linear gets a bf16 copy of its dequantized weights when p->dense_copy (cuda_linear.wbf16; not the
 * embedding, nor the lm_head, whose fp32 logits come from cuda_linear_forward_f32out, which has no
 * dequant_gemm form) */
static int put_linear_as(placer *p, const op_linear *h, cuda_linear *d, uint64_t tensor_id, int may_tile, int copy) {
    memset(d, 0, sizeof *d);
    if (!h->N) return FP4MOE_OK;
    d->E = h->E;
    d->N = h->N;
    d->K = h->K;
    d->nvfp4 = h->nvfp4;
    if (h->nvfp4) {
        const size_t n = (size_t)(h->E * h->N * h->K);
        void *codes, *scales, *gs = NULL;
        d->tiled = may_tile && h->K % 64 == 0 && !strcmp(env_get(ENV_CUDA_WEIGHT_LAYOUT), "tiled");
        if (d->tiled) {
            TRY(put_tiled(p, h, tensor_id, &codes));
            scales = codes; /* in the pieces */
        } else if (p->synth) {
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
        if (copy && p->dense_copy && h->E == 1 && h->K % 16 == 0) {
            void *wb;
            reserve(p, n * 2, &wb);
#ifdef FP4MOE_INJECT_FAULT_DENSE_COPY /* deliberate fault (test_model_gpu dense_bf16 must catch it) */
            const int copy_tiled = !d->tiled;
#else
            const int copy_tiled = d->tiled;
#endif
            if (p->fill) TRY(cuda_nvfp4_dequant_bf16(p->stream, codes, scales, copy_tiled, h->N, h->K, wb));
            d->wbf16 = wb;
        }
    } else {
        if (p->synth) return fp4moe_set_error(FP4MOE_EINVAL, "synthetic: dense module");
        TRY(put_dense(p, h, d));
    }
    return put_f32(p, h->bias, h->N, &d->bias);
}

static int put_linear(placer *p, const op_linear *h, cuda_linear *d, uint64_t tensor_id) {
    return put_linear_as(p, h, d, tensor_id, 1, 1);
}

static int put_embedding(placer *p, const fp4moe_model *m, struct gpu_model *g) {
    const op_linear *e = &m->embed;
    cuda_linear *d = &g->embed;
    if (e->nvfp4) return put_linear_as(p, e, d, SYN_EMBED, 0, 0);
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
    return put_linear_as(p, hd, &g->lm_head, SYN_LM_HEAD, 1, 0);
}

/* d = an NVFP4 handle of the weights q (no bias, no dense copy) */
static void nvfp4_handle(cuda_linear *d, fp4moe_nvfp4_weights q, int tiled) {
    memset(d, 0, sizeof *d);
    d->E = q.E;
    d->N = q.N;
    d->K = q.K;
    d->nvfp4 = 1;
    d->tiled = tiled;
    d->q = q;
}

/* k_proj and v_proj as ONE stacked NVFP4 weight of 2 experts (kv: 0 = k, 1 = v; global scales {k's,
 * v's}, 1 where a linear has none) and dk / dv as views of its halves (the same bytes, nothing
 * duplicated; their bf16 dense copies as put_linear_as makes them), so that a one-token step projects
 * both in one gather_qmm_cuda_x1 call (src/model/forward.c kv_proj). Only for two NVFP4 linears of one
 * shape without bias, K % 32 == 0 (the tensor-core qmv); else *ok = 0 and nothing is placed. */
static int put_kv_pair(placer *p, const op_linear *hk, const op_linear *hv, cuda_linear *kv, cuda_linear *dk,
                       cuda_linear *dv, uint64_t id_k, uint64_t id_v, int *ok) {
    *ok = hk->nvfp4 && hv->nvfp4 && hk->E == 1 && hv->E == 1 && hk->N == hv->N && hk->K == hv->K && hk->N > 0 &&
          !hk->bias && !hv->bias && hk->K % 32 == 0;
    if (!*ok) return FP4MOE_OK;
    const int64_t N = hk->N, K = hk->K;
    const size_t n = (size_t)(N * K);
    const int tiled = K % 64 == 0 && !strcmp(env_get(ENV_CUDA_WEIGHT_LAYOUT), "tiled");
    const op_linear *h[2] = {hk, hv};
    const uint64_t id[2] = {id_k, id_v};
    cuda_linear *dd[2] = {dk, dv};
    void *codes, *scales, *gs;
    size_t ce, se; /* one expert's bytes of codes and of scales */
    if (tiled) {
        ce = (size_t)cuda_nvfp4_tiled_expert_bytes(N, K);
        se = 0;
        reserve(p, 2 * ce, &codes);
        scales = codes;
    } else {
        ce = n / 2;
        se = n / 16;
        reserve(p, 2 * ce, &codes);
        reserve(p, 2 * se, &scales);
    }
    reserve(p, 2 * sizeof(float), &gs);
    if (p->fill) {
        const float g2[2] = {hk->q.global_scale ? hk->q.global_scale[0] : 1.0f,
                             hv->q.global_scale ? hv->q.global_scale[0] : 1.0f};
        FP4MOE_CUDA_TRY("cuda", cudaMemcpy(gs, g2, sizeof g2, cudaMemcpyHostToDevice), "upload of the k / v global scales");
        for (int i = 0; i < 2; i++) {
            uint8_t *c = (uint8_t *)codes + i * ce, *sc = (uint8_t *)scales + i * se;
            if (tiled) {
                TRY(fill_tiled(p, h[i], id[i], c));
            } else if (p->synth) {
                TRY(cuda_synth_nvfp4(p->stream, p->seed, id[i], (int64_t)(n / 16), K / 16, SYN_SIGMA, synth_enc(h[i]), c, sc));
                report(p, n / 2 + n / 16);
            } else {
                FP4MOE_CUDA_TRY("cuda", cudaMemcpy(c, h[i]->q.codes, n / 2, cudaMemcpyHostToDevice), "upload of the weights");
                FP4MOE_CUDA_TRY("cuda", cudaMemcpy(sc, h[i]->q.scales, n / 16, cudaMemcpyHostToDevice), "upload of the weights");
                report(p, n / 2 + n / 16);
            }
        }
    }
    nvfp4_handle(kv, (fp4moe_nvfp4_weights){codes, scales, gs, 2, N, K}, tiled);
    for (int i = 0; i < 2; i++) {
        cuda_linear *d = dd[i];
        uint8_t *c = p->fill ? (uint8_t *)codes + i * ce : NULL, *sc = p->fill ? (uint8_t *)scales + i * se : NULL;
        float *g = p->fill ? (float *)gs + i : NULL;
        nvfp4_handle(d, (fp4moe_nvfp4_weights){c, tiled ? c : sc, g, 1, N, K}, tiled);
        if (p->dense_copy && K % 16 == 0) { /* as put_linear_as */
            void *wb;
            reserve(p, n * 2, &wb);
            if (p->fill) TRY(cuda_nvfp4_dequant_bf16(p->stream, c, tiled ? c : sc, tiled, N, K, wb));
            d->wbf16 = wb;
        }
    }
    return FP4MOE_OK;
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
        int pair = 0;
#if FP4MOE_KV_PAIR
        TRY(put_kv_pair(p, &w->k_proj, &w->v_proj, &d->kv_proj, &d->k_proj, &d->v_proj, SYN_LAYER_ID(l, SYN_K),
                        SYN_LAYER_ID(l, SYN_V), &pair));
#endif
        if (!pair) {
            memset(&d->kv_proj, 0, sizeof d->kv_proj);
            TRY(put_linear(p, &w->k_proj, &d->k_proj, SYN_LAYER_ID(l, SYN_K)));
            TRY(put_linear(p, &w->v_proj, &d->v_proj, SYN_LAYER_ID(l, SYN_V)));
        }
        return put_linear(p, &w->o_proj, &d->o_proj, SYN_LAYER_ID(l, SYN_O));
    case FP4MOE_LAYER_MOE:
        TRY(put_f32(p, w->router_w, c->n_experts * H, &d->router_w));
        TRY(put_planes3(p, w->router_w, d->router_w, c->n_experts * H, &d->router_w3));
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

static const void *lin(const cuda_linear *w) { return w->N ? (const void *)w : NULL; }

/* g->fw: handles into g's cuda_linears. */
static void build_fw(struct gpu_model *g, int64_t L) {
    g->fw.embed = &g->embed;
    g->fw.lm_head = &g->lm_head;
    g->fw.norm_f = g->norm_f;
    for (int64_t l = 0; l < L; l++) {
        const gpu_layer *d = &g->layers[l];
        g->fw.layers[l] = (fw_layer){
            .type = d->type, .norm = d->norm,
            .in_proj = lin(&d->in_proj), .out_proj = lin(&d->out_proj), .conv_w = d->conv_w,
            .conv_b = d->conv_b, .A = d->A, .D = d->D, .dt_bias = d->dt_bias, .gnorm = d->gnorm,
            .q_proj = lin(&d->q_proj), .k_proj = lin(&d->k_proj), .v_proj = lin(&d->v_proj), .kv_proj = lin(&d->kv_proj),
            .o_proj = lin(&d->o_proj), .router_w = d->router_w, .router_bias = d->router_bias,
            .router_w3 = d->router_w3,
            .experts_up = lin(&d->experts_up), .experts_down = lin(&d->experts_down),
            .shared_up = lin(&d->shared_up), .shared_down = lin(&d->shared_down),
            .latent_in = lin(&d->latent_in), .latent_out = lin(&d->latent_out),
            .up = lin(&d->up), .down = lin(&d->down),
        };
    }
}

const fw_weights *be_cuda_weights(const fp4moe_model *m) { return m->gpu ? &m->gpu->fw : NULL; }

/* A view of the experts [lo, hi) of stacked expert weights v (local ids; the device bytes shared). */
static void expert_view(const cuda_linear *v, int64_t lo, int64_t hi, cuda_linear *out) {
    *out = *v;
    out->E = hi - lo;
    if (v->nvfp4) {
        out->q.E = hi - lo;
        if (v->tiled) { /* the experts' pieces, codes and scales together */
            out->q.codes += (size_t)(lo * cuda_nvfp4_tiled_expert_bytes(v->N, v->K));
            out->q.scales = out->q.codes;
        } else {
            out->q.codes += (size_t)(lo * v->N * v->K / 2);
            out->q.scales += (size_t)(lo * v->N * v->K / 16);
        }
#ifndef FP4MOE_INJECT_FAULT_EP_VIEW_GS /* deliberate fault (tests must catch it): global scales not offset */
        if (v->q.global_scale) out->q.global_scale += lo;
#endif
    } else if (v->dense) {
        out->dense = (const char *)v->dense + (size_t)(lo * v->N * v->K) * (v->dtype == FP4MOE_F32 ? 4 : 2);
    }
}

int be_cuda_weights_experts(const fp4moe_model *m, int64_t lo, int64_t hi, fw_weights *out, fw_layer *layers,
                            void *views) {
    if (!m->gpu) return fp4moe_set_error(FP4MOE_EINVAL, "cuda: the model's weights are not on the GPU");
    const fw_weights *w = &m->gpu->fw;
    cuda_linear *v = views;
    *out = *w;
    out->layers = layers;
    for (int64_t l = 0; l < m->cfg.n_layers; l++) {
        layers[l] = w->layers[l];
        if (w->layers[l].experts_up) {
            expert_view(w->layers[l].experts_up, lo, hi, &v[2 * l]);
            layers[l].experts_up = &v[2 * l];
        }
        if (w->layers[l].experts_down) {
            expert_view(w->layers[l].experts_down, lo, hi, &v[2 * l + 1]);
            layers[l].experts_down = &v[2 * l + 1];
        }
    }
    return FP4MOE_OK;
}

size_t be_cuda_linear_size(void) { return sizeof(cuda_linear); }

void gpu_model_free(struct gpu_model *g) {
    if (!g) return;
    if (g->base) cudaFree(g->base);
    free(g->layers);
    free(g->fw.layers);
    free(g);
}

static int build_gpu_model(fp4moe_model *m, int synth, uint64_t seed, fp4moe_progress_fn progress,
                           void *ctx) {
    TRY(fp4moe_cuda_check());
    struct gpu_model *g = calloc(1, sizeof *g);
    if (g) g->layers = calloc((size_t)m->cfg.n_layers, sizeof *g->layers);
    if (!g || !g->layers) {
        gpu_model_free(g);
        return fp4moe_set_error(FP4MOE_ENOMEM, "cuda: out of host memory for the model");
    }
    if (cudaGetDevice(&g->device) != cudaSuccess) {
        (void)cudaGetLastError();
        g->device = 0;
    }
    const char *copies = env_get(ENV_CUDA_DENSE_BF16);
    placer p = {.synth = synth, .seed = seed, .progress = progress, .ctx = ctx, .dense_copy = strcmp(copies, "0") != 0};
    int st = place_model(&p, m, g);                      /* pass 1: count */
    if (!st && p.dense_copy && !strcmp(copies, "auto")) { /* the copies only where memory is plentiful */
        size_t free_b = 0, total_b = 0;
        if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
            (void)cudaGetLastError();
            free_b = 0;
        }
        if (p.used > free_b / 2) {
            p.dense_copy = 0;
            p.used = 0;
            st = place_model(&p, m, g);
        }
    }
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
    if (!(g->fw.layers = calloc((size_t)m->cfg.n_layers, sizeof *g->fw.layers))) {
        gpu_model_free(g);
        return fp4moe_set_error(FP4MOE_ENOMEM, "cuda: out of host memory for the model");
    }
    build_fw(g, m->cfg.n_layers);
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

/* ---- the backend ------------------------------------------------------------------------------- */

#define MAX_GRAPHS 64

typedef struct {
    int64_t R;                      /* decode rows of the step */
    int seen;                       /* ran eagerly once (warm-up) */
    int failed;                     /* capture failed: eager from now on */
    int n_ev;                       /* profile events the captured forward records */
    cudaGraphExec_t exec;
} graph_slot;

typedef struct {
    struct gpu_model *g;
    const fp4moe_config *cfg;
    int device;                     /* the model's device: current for every call of this backend */
    cudaStream_t stream;
    void *blas, *ws;
    cuda_ops ops;
    gq_dense_scratch dq;            /* dense dequant_gemm scratch (ops.dq) */
    uint32_t *zeros;
    int *e1_runs;                   /* ops.e1_runs (cuda_e1_runs_table of cap rows) */
    float *att_scratch;             /* split-KV decode partials */
    void *argmax_ws;                /* the split argmax's pairs and counters (zeroed; the kernel leaves them so) */
    float *ssm_ws;                  /* the Mamba-2 SSD's C B^T chunks (cuda_ssm_args.ws) for `cap` tokens */
    int64_t ssm_ws_floats;
    graph_slot graphs[MAX_GRAPHS];
    int n_graphs, graph_off, capturing;
    /* the second queue of side_begin (FP4MOE_CUDA_SIDE_STREAM=1): stream and fork / join events;
     * while side ops are issued, stream and ops.stream are `side` (main keeps the session's) */
    cudaStream_t main, side;
    cudaEvent_t ev_fork, ev_join;
    int in_side;
    /* profiling */
    int prof;
    cudaEvent_t *ev;
    int *ev_kind;
    int n_ev, cap_ev;
    double prof_ms[FP4MOE_PROF_KINDS];
} cuda_ctx;

static cudaStream_t S_(void *bc) { return ((cuda_ctx *)bc)->stream; }

static int cu_alloc(void *bc, size_t bytes, void **p) {
    *p = NULL;
    const cudaError_t ce = cudaMalloc(p, bytes ? bytes : 1);
    if (ce != cudaSuccess) {
        *p = NULL;
        (void)cudaGetLastError();
        return fp4moe_set_error(FP4MOE_ENOMEM, "cuda: cannot allocate %zu bytes of device memory: %s", bytes,
                                cudaGetErrorString(ce));
    }
    FP4MOE_CUDA_TRY("cuda", cudaMemsetAsync(*p, 0, bytes, S_(bc)), "memset");
    return FP4MOE_OK;
}
static void cu_free(void *bc, void *p) {
    cudaStreamSynchronize(S_(bc));
    cudaFree(p);
}
static void cu_free_detached(void *p) { cudaFree(p); }
static int cu_upload(void *bc, void *dst, const void *src, size_t bytes) {
    if (!bytes) return FP4MOE_OK;
    FP4MOE_CUDA_TRY("cuda", cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, S_(bc)), "upload");
    return FP4MOE_OK;
}
static int cu_download(void *bc, void *dst, const void *src, size_t bytes) {
    if (!bytes) return FP4MOE_OK;
    FP4MOE_CUDA_TRY("cuda", cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, S_(bc)), "download");
    return FP4MOE_OK;
}
static int cu_copy(void *bc, void *dst, const void *src, size_t bytes) {
    if (!bytes) return FP4MOE_OK;
    FP4MOE_CUDA_TRY("cuda", cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, S_(bc)), "device copy");
    return FP4MOE_OK;
}
static int cu_zero(void *bc, void *p, size_t bytes) {
    if (!bytes) return FP4MOE_OK;
    FP4MOE_CUDA_TRY("cuda", cudaMemsetAsync(p, 0, bytes, S_(bc)), "memset");
    return FP4MOE_OK;
}

/* After a synchronisation: adds the segments of the last forward to the totals. */
static int prof_collect(cuda_ctx *c) {
    for (int i = 1; i < c->n_ev; i++) {
        float ms = 0.0f;
        FP4MOE_CUDA_TRY("cuda", cudaEventElapsedTime(&ms, c->ev[i - 1], c->ev[i]), "profile elapsed time");
        c->prof_ms[c->ev_kind[i]] += ms;
    }
    c->n_ev = 0;
    return FP4MOE_OK;
}

static int cu_sync(void *bcv) {
    cuda_ctx *c = bcv;
    FP4MOE_CUDA_TRY("cuda", cudaStreamSynchronize(c->stream), "forward");
    FP4MOE_CUDA_TRY("cuda", cudaGetLastError(), "forward");
    return c->prof ? prof_collect(c) : FP4MOE_OK;
}

static int cu_mark(void *bcv, int kind) {
    cuda_ctx *c = bcv;
    if (!c->prof) return FP4MOE_OK;
    if (c->n_ev >= c->cap_ev) return fp4moe_set_error(FP4MOE_EINVAL, "cuda profile: too many marks");
    FP4MOE_CUDA_TRY("cuda", cudaEventRecordWithFlags(c->ev[c->n_ev], c->stream,
                                      c->capturing ? cudaEventRecordExternal : cudaEventRecordDefault),
             "profile event");
    c->ev_kind[c->n_ev++] = kind;
    return FP4MOE_OK;
}

static void cu_invalidate(void *bcv) {
    cuda_ctx *c = bcv;
    cudaStreamSynchronize(c->stream);
    for (int i = 0; i < c->n_graphs; i++)
        if (c->graphs[i].exec) cudaGraphExecDestroy(c->graphs[i].exec);
    c->n_graphs = 0;
}

static graph_slot *graph_for(cuda_ctx *c, int64_t R) {
    for (int i = 0; i < c->n_graphs; i++)
        if (c->graphs[i].R == R) return &c->graphs[i];
    if (c->n_graphs == MAX_GRAPHS) return NULL;
    graph_slot *g = &c->graphs[c->n_graphs++];
    memset(g, 0, sizeof *g);
    g->R = R;
    return g;
}

/* Captures fn(arg) into g->exec. A failure (e.g. a gather route that synchronizes) is not an error:
 * that row count runs eagerly from then on. */
static void capture(cuda_ctx *c, graph_slot *g, int (*fn)(void *), void *arg) {
    cudaGraph_t graph = NULL;
    int st = FP4MOE_ECUDA;
    const int n_ev0 = c->n_ev;
    c->capturing = 1;
    if (cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeRelaxed) == cudaSuccess) {
        st = fn(arg);
        if (cudaStreamEndCapture(c->stream, &graph) != cudaSuccess && !st) st = FP4MOE_ECUDA;
    }
    c->capturing = 0;
    g->n_ev = c->n_ev;
    c->n_ev = n_ev0;
    if (!st && graph && cudaGraphInstantiate(&g->exec, graph, 0) != cudaSuccess) g->exec = NULL;
    if (graph) cudaGraphDestroy(graph);
    if (st || !g->exec) {
        g->exec = NULL;
        g->failed = 1;
        (void)cudaGetLastError();
        fp4moe_clear_error();
    }
}

static int cu_run(void *bcv, const fw_step *st, int (*fn)(void *), void *arg) {
    cuda_ctx *c = bcv;
    c->n_ev = 0;
    /* the thread that steps this batch may have another device current (one thread per GPU) */
    FP4MOE_CUDA_TRY("cuda", cudaSetDevice(c->device), "cudaSetDevice");
    if (c->graph_off || st->nd != st->R) return fn(arg);
    graph_slot *g = graph_for(c, st->R);
    if (!g || g->failed) return fn(arg);
    if (!g->exec && g->seen) capture(c, g, fn, arg);
    if (!g->exec) {
        g->seen = 1;
        return fn(arg);
    }
    FP4MOE_CUDA_TRY("cuda", cudaGraphLaunch(g->exec, c->stream), "decode graph launch");
    c->n_ev = g->n_ev;              /* the replay records the events its capture recorded */
    return FP4MOE_OK;
}

/* ---- ops ---------------------------------------------------------------------------------------- */

#define CX(bc) ((cuda_ctx *)(bc))

/* be_ops side_begin / side_end / side_join: the ops in between go to c->side, ordered after the main
 * stream's work by ev_fork and joined back by ev_join (in a graph capture these become the edges of
 * a fork and a join). Offered for decode-sized steps (rows <= SIDE_MAX_ROWS) whose linears are all
 * NVFP4 and take the qmv route: those launch only kernels of their own on the current stream (no
 * cuBLAS, whose handle is bound to the main stream, and no shared scratch). Not while profiling
 * (the marks time one stream). */
#define SIDE_MAX_ROWS 16
static int cu_side_begin(void *bcv, int64_t rows, const void *const *w, int nw, int *on) {
    cuda_ctx *c = bcv;
    *on = 0;
    if (!c->side || c->in_side || c->prof || rows > SIDE_MAX_ROWS || c->ops.route == FP4MOE_ROUTE_DEQUANT_GEMM)
        return FP4MOE_OK;
    for (int i = 0; i < nw; i++) {
        const cuda_linear *l = w[i];
        if (!l || !l->nvfp4 || l->E != 1) return FP4MOE_OK;
    }
    FP4MOE_CUDA_TRY("cuda", cudaEventRecord(c->ev_fork, c->stream), "side stream fork (record)");
    FP4MOE_CUDA_TRY("cuda", cudaStreamWaitEvent(c->side, c->ev_fork, 0), "side stream fork (wait)");
    TRY(cuda_spin(c->side, env_get_int(ENV_CUDA_SIDE_DELAY_US))); /* diagnostic: a missing join shows */
    c->main = c->stream;
    c->stream = c->ops.stream = c->side;
    c->in_side = 1;
    *on = 1;
    return FP4MOE_OK;
}
static int cu_side_end(void *bcv) {
    cuda_ctx *c = bcv;
    if (!c->in_side) return fp4moe_set_error(FP4MOE_EINVAL, "cuda: side_end without side_begin");
    c->stream = c->ops.stream = c->main;
    c->in_side = 0;
    FP4MOE_CUDA_TRY("cuda", cudaEventRecord(c->ev_join, c->side), "side stream join (record)");
    return FP4MOE_OK;
}
static int cu_side_join(void *bcv) {
    cuda_ctx *c = bcv;
#ifdef FP4MOE_INJECT_FAULT_SIDE_JOIN /* deliberate fault (tests must catch it): no join */
    return FP4MOE_OK;
#endif
    FP4MOE_CUDA_TRY("cuda", cudaStreamWaitEvent(c->stream, c->ev_join, 0), "side stream join (wait)");
    return FP4MOE_OK;
}

static int cu_embed(void *bc, const void *E, const int32_t *tokens, int64_t R, float *h) {
    return cuda_embed(S_(bc), E, tokens, R, h);
}
static int cu_rmsnorm(void *bc, float *x, const void *a, const void *b, const float *w, int64_t T, int64_t H,
                      float eps, void *y, float *y32) {
    return cuda_rmsnorm(S_(bc), x, a, b, w, T, H, eps, y, y32);
}
static int cu_rmsnorm_rows(void *bc, const float *x, const int32_t *rows, int64_t n, const float *w,
                           int64_t H, float eps, void *y) {
    return cuda_rmsnorm_rows(S_(bc), x, rows, n, w, H, eps, y);
}
static int cu_linear(void *bc, const void *W, const void *x, int64_t T, int relu2, void *y) {
    return cuda_linear_forward(&CX(bc)->ops, W, x, T, relu2, y);
}
static int cu_linear_f32out(void *bc, const void *W, const void *x, int64_t T, float *y) {
    return cuda_linear_forward_f32out(&CX(bc)->ops, W, x, T, y);
}
static int cu_linear_gather(void *bc, const void *W, const void *x, const uint32_t *idx, int64_t B, int relu2,
                            void *y) {
    return cuda_linear_gather(&CX(bc)->ops, W, x, idx, B, relu2, y);
}
static int cu_linear_gather_x1(void *bc, const void *W, const void *x, const uint32_t *idx, int64_t B, int relu2,
                               void *y) {
    return cuda_linear_gather_x1(&CX(bc)->ops, W, x, idx, B, relu2, y);
}
static int cu_linear_gather_rows(void *bc, const void *W, const void *x, int64_t T, const uint32_t *row_of,
                                 int64_t k, const uint32_t *idx, int64_t B, int relu2, void *y) {
    return cuda_linear_gather_rows(&CX(bc)->ops, W, x, T, row_of, k, idx, B, relu2, y);
}
static int cu_experts_rows(void *bc, const void *Wup, const void *Wdown, const void *x, int64_t T,
                           const uint32_t *row_of, int64_t k, const uint32_t *idx, int64_t B, void *hs, void *ys) {
    return cuda_experts_rows(&CX(bc)->ops, Wup, Wdown, x, T, row_of, k, idx, B, hs, ys);
}
static int cu_moe_route(void *bc, const fw_router *r, const float *x, const void *x_act, int64_t T, const float *W,
                        int64_t H, float *logits, int32_t *ids, float *wts, uint32_t *row_of, uint32_t *idx,
                        uint32_t *pos_of) {
    const cuda_router_cfg rc = {r->E, r->k, r->n_group, r->topk_group, r->norm_topk_prob, r->scaling, r->bias};
    /* x_act: the bf16 activations (act_size 2) */
    cuda_ctx *c = CX(bc);
    return cuda_moe_route(&c->ops, &rc, x, (const uint16_t *)x_act, T, W, (const uint16_t *)r->w3, H, logits, ids,
                          wts, row_of, idx, pos_of, &c->ops.runs);
}
static int cu_gather_rows(void *bc, const void *x, int64_t H, const uint32_t *row_of, int64_t B, int64_t k,
                          void *xs) {
    return cuda_gather_rows(S_(bc), x, H, row_of, B, k, xs);
}
static int cu_sort_local(void *bc, const uint32_t *ids, int64_t B, int64_t lo, int64_t E, uint32_t *row_of,
                         uint32_t *idx, uint32_t *pos_of) {
    CX(bc)->ops.runs.idx = NULL; /* a sort without runs: none valid (gq_runs) */
    return cuda_sort_local(S_(bc), ids, B, lo, E, row_of, idx, pos_of);
}
static int cu_moe_combine(void *bc, const void *ys, int64_t H, const uint32_t *pos_of, const float *wts,
                          int64_t T, int64_t k, void *out) {
    return cuda_moe_combine(S_(bc), ys, H, pos_of, wts, T, k, out);
}
static int cu_residual_add(void *bc, float *h, const void *a, const void *b, int64_t n) {
    return cuda_residual_add(S_(bc), h, a, b, n);
}
static int cu_rmsnorm_gated(void *bc, const float *y, const void *z, int64_t zs, const float *w, int64_t T,
                            int64_t D, int64_t G, float eps, void *out) {
    return cuda_rmsnorm_gated(S_(bc), y, z, zs, w, T, D, G, eps, out);
}
static int cu_argmax_rows(void *bc, const float *x, int64_t n, int64_t V, int32_t *out) {
    return cuda_argmax_rows_f32(S_(bc), x, n, V, out, CX(bc)->argmax_ws);
}

/* Decode rows [0, nd) in one launch each (device-side slots: graph-stable), prefill segments one
 * launch per segment. */
static int cu_conv1d_silu(void *bc, const fw_step *s, const void *xv, int64_t xs, int64_t C, const float *w,
                          const float *b, int64_t Kc, const fw_state *st, float *y) {
    const uint16_t *x = xv;
    TRY(cuda_conv1d_decode(S_(bc), x, xs, s->nd, C, w, b, Kc, s->d_row_slot, st->conv_stride, st->conv, y));
    for (int64_t i = s->nd; i < s->nseg; i++) {
        const fw_seg *g = &s->seg[i];
        TRY(cuda_conv1d_causal(S_(bc), x + g->row0 * xs, xs, g->n, C, w, b, Kc,
                               st->conv + (int64_t)g->slot * st->conv_stride, y + g->row0 * C));
    }
    return FP4MOE_OK;
}

static int cu_ssm_scan(void *bc, const fw_step *s, const fw_ssm *a, const fw_state *st) {
    const uint16_t *dt = a->dt;
    cuda_ssm_args o = {
        .T = 1, .nh = a->nh, .hd = a->hd, .S = a->S, .G = a->G,
        .x = a->x, .xs = a->xs, .B = a->B, .C = a->C, .bcs = a->bcs, .dt = dt, .dts = a->dts,
        .dt_bias = a->dt_bias, .A = a->A, .D = a->D, .dt_lo = a->dt_lo, .dt_hi = a->dt_hi,
        .state = st->ssm, .y = a->y, .row_slot = s->d_row_slot, .state_stride = st->ssm_stride, .nb = s->nd,
    };
    if (s->nd) TRY(cuda_ssm_scan(S_(bc), &o));
    for (int64_t i = s->nd; i < s->nseg; i++) {
        const fw_seg *g = &s->seg[i];
        const int64_t r = g->row0;
        o.T = g->n;
        o.x = a->x + r * a->xs;
        o.B = a->B + r * a->bcs;
        o.C = a->C + r * a->bcs;
        o.dt = dt + r * a->dts;
        o.y = a->y + r * a->nh * a->hd;
        o.state = st->ssm + (int64_t)g->slot * st->ssm_stride;
        o.row_slot = NULL;
        o.nb = 1;
        o.ws = CX(bc)->ssm_ws;
        o.ws_floats = CX(bc)->ssm_ws_floats;
        TRY(cuda_ssm_scan(S_(bc), &o));
    }
    return FP4MOE_OK;
}

static int cu_attention(void *bc, const fw_step *s, const void *qv, const void *k, const void *v,
                        const fw_state *st, int64_t nq, int64_t nkv, int64_t dh, void *outv) {
    const uint16_t *q = qv;
    uint16_t *out = outv;
    const int64_t kvs = nkv * dh, qs = nq * dh;
    TRY(cuda_kv_append(S_(bc), k, v, s->R, kvs, s->d_row_slot, s->d_row_pos, s->d_pages, s->max_pages, st->k,
                       st->v));
    TRY(cuda_attention_decode_split(S_(bc), q, st->k, st->v, s->d_row_slot, s->d_row_pos, s->d_pages,
                                    s->max_pages, s->nd, nq, nkv, dh, CX(bc)->att_scratch, out));
    for (int64_t i = s->nd; i < s->nseg; i++) {
        const fw_seg *g = &s->seg[i];
        TRY(cuda_attention_prefill(S_(bc), q + g->row0 * qs, st->k, st->v,
                                   s->d_pages + (int64_t)g->slot * s->max_pages, g->pos0, g->n, nq, nkv, dh,
                                   out + g->row0 * qs));
    }
    return FP4MOE_OK;
}

static const be_ops CUDA_OPS = {
    .name = "cuda",
    .act_size = 2,
    .device_memory = 1,
    .alloc = cu_alloc,
    .free = cu_free,
    .free_detached = cu_free_detached,
    .upload = cu_upload,
    .download = cu_download,
    .copy = cu_copy,
    .zero = cu_zero,
    .sync = cu_sync,
    .run = cu_run,
    .invalidate = cu_invalidate,
    .embed = cu_embed,
    .rmsnorm = cu_rmsnorm,
    .rmsnorm_rows = cu_rmsnorm_rows,
    .linear = cu_linear,
    .linear_f32out = cu_linear_f32out,
    .linear_gather = cu_linear_gather,
    .linear_gather_x1 = cu_linear_gather_x1,
#ifndef CU_ROWS_MAP
#define CU_ROWS_MAP 1 /* 0: not offered (the forward gathers the rows; for measuring, session 18) */
#endif
    .linear_gather_rows = CU_ROWS_MAP ? cu_linear_gather_rows : NULL,
    .experts_rows = CU_ROWS_MAP ? cu_experts_rows : NULL,
    .moe_route = cu_moe_route,
    .gather_rows = cu_gather_rows,
    .sort_local = cu_sort_local,
    .moe_combine = cu_moe_combine,
    .residual_add = cu_residual_add,
    .conv1d_silu = cu_conv1d_silu,
    .ssm_scan = cu_ssm_scan,
    .rmsnorm_gated = cu_rmsnorm_gated,
    .attention = cu_attention,
    .argmax_rows = cu_argmax_rows,
    .mark = cu_mark,
    .side_begin = cu_side_begin,
    .side_end = cu_side_end,
    .side_join = cu_side_join,
};

/* Rows x width of f32 staging that the model needs (0 when none): max(N, K) of its dense f32
 * linears; K of the lm_head when NVFP4 or f32 (cuda_linear_forward_f32out widens its input). */
static int64_t f32_staging(const struct gpu_model *g, const fp4moe_config *c) {
    const cuda_linear *hd = &g->lm_head;
    int64_t w = !hd->nvfp4 && hd->dtype == FP4MOE_F32 ? hd->K : 0;
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

void be_cuda_free(void *bcv) {
    cuda_ctx *c = bcv;
    if (!c) return;
    if (c->stream) cudaStreamSynchronize(c->stream);
    cu_invalidate(c);
    for (int i = 0; c->ev && i < c->cap_ev; i++)
        if (c->ev[i]) cudaEventDestroy(c->ev[i]);
    free(c->ev);
    free(c->ev_kind);
    cuda_blas_destroy(c->blas);
    cudaFree(c->ws);
    cudaFree(c->zeros);
    cudaFree(c->att_scratch);
    cudaFree(c->argmax_ws);
    cudaFree(c->ssm_ws);
    cudaFree(c->ops.f32_x);
    cudaFree(c->ops.f32_y);
    cudaFree(c->ops.split_ws);
    cudaFree(c->ops.runs.buf);
    cudaFree(c->ops.runs.done);
    cudaFree(c->e1_runs);
    cudaFree(c->dq.p);
    if (c->side) {
        cudaStreamSynchronize(c->side);
        cudaStreamDestroy(c->side);
    }
    if (c->ev_fork) cudaEventDestroy(c->ev_fork);
    if (c->ev_join) cudaEventDestroy(c->ev_join);
    if (c->stream) cudaStreamDestroy(c->stream);
    free(c);
}

int be_cuda_new(const fp4moe_model *m, fp4moe_route route, int64_t cap, int64_t max_decode_rows, int profile,
                const be_ops **ops, void **out) {
    if (!m->gpu)
        return fp4moe_set_error(FP4MOE_EINVAL, "cuda: the model's weights are not on the GPU (load it with "
                                "device cuda)");
    cuda_ctx *c = calloc(1, sizeof *c);
    if (!c) return fp4moe_set_error(FP4MOE_ENOMEM, "cuda backend: out of memory");
    *out = c;                       /* from here on, be_cuda_free releases what was made */
    *ops = &CUDA_OPS;
    c->g = m->gpu;
    c->cfg = &m->cfg;
    c->device = m->gpu->device;
    FP4MOE_CUDA_TRY("cuda", cudaSetDevice(c->device), "cudaSetDevice (the model's device)");
    FP4MOE_CUDA_TRY("cuda", cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking), "stream");
    TRY(cu_alloc(c, BLAS_WORKSPACE, &c->ws));
    TRY(cuda_blas_create(c->stream, c->ws, BLAS_WORKSPACE, &c->blas));
    TRY(cu_alloc(c, (size_t)cap * 4, (void **)&c->zeros));
    TRY(cu_alloc(c, cuda_argmax_ws_bytes(), &c->argmax_ws));
    if (strchr(m->cfg.layer_types, FP4MOE_LAYER_ATTENTION)) {
        const int64_t rows = max_decode_rows < cap ? max_decode_rows : cap;
        TRY(cu_alloc(c, cuda_attention_decode_scratch(rows, m->cfg.attn_heads, m->cfg.head_dim),
                     (void **)&c->att_scratch));
    }
    if (strchr(m->cfg.layer_types, FP4MOE_LAYER_MAMBA) && m->cfg.mamba_groups > 0) {
        c->ssm_ws_floats = cuda_ssm_ws_floats(cap, m->cfg.mamba_groups);
        TRY(cu_alloc(c, (size_t)c->ssm_ws_floats * 4, (void **)&c->ssm_ws));
    }
    const int64_t f32w = f32_staging(c->g, &m->cfg);
    float *fx = NULL, *fy = NULL;
    if (f32w) {
        TRY(cu_alloc(c, (size_t)(cap * f32w) * 4, (void **)&fx));
        c->ops.f32_x = fx;
        TRY(cu_alloc(c, (size_t)(cap * f32w) * 4, (void **)&fy));
    }
    c->ops = (cuda_ops){c->stream, c->blas, route, c->zeros, cap, fx, fy, cap * f32w, &c->dq, NULL, 0, {0}, NULL};
    { /* the plain linears' runs {0, B} for every B <= cap (no runs kernel per call) */
        int *t = NULL;
        TRY(cuda_e1_runs_table(c->stream, cap, &t));
        c->e1_runs = t;
        c->ops.e1_runs = t;
    }
    if (strchr(m->cfg.layer_types, FP4MOE_LAYER_MOE) && m->cfg.n_experts > 0) { /* the router's split-K scratch */
        const int64_t n = (int64_t)MM_SPLIT_ROWS * m->cfg.n_experts;
        TRY(cu_alloc(c, (size_t)n * 4, (void **)&c->ops.split_ws));
        c->ops.split_n = n;
        /* the expert runs the router's sort makes for the gathers (gq_runs; zeroed: its counter starts at 0) */
        TRY(cu_alloc(c, (size_t)(2 * m->cfg.n_experts + 3) * sizeof(int), (void **)&c->ops.runs.buf));
        c->ops.runs.cap_e = m->cfg.n_experts;
        /* the fused MoE kernel's per-row-tile counters (zeroed; the kernel leaves them zero) */
        const int64_t nd = cuda_moe_done_ints(cap * m->cfg.top_k, m->cfg.n_experts);
        TRY(cu_alloc(c, (size_t)nd * sizeof(int), (void **)&c->ops.runs.done));
        c->ops.runs.done_n = nd;
    }
    if (profile) {
        c->prof = 1;
        c->cap_ev = 4 + 2 * (int)m->cfg.n_layers;
        c->ev = calloc((size_t)c->cap_ev, sizeof *c->ev);
        c->ev_kind = calloc((size_t)c->cap_ev, sizeof *c->ev_kind);
        if (!c->ev || !c->ev_kind) return fp4moe_set_error(FP4MOE_ENOMEM, "cuda backend: out of memory");
        for (int i = 0; i < c->cap_ev; i++) FP4MOE_CUDA_TRY("cuda", cudaEventCreate(&c->ev[i]), "profile events");
    }
    c->graph_off = !strcmp(env_get(ENV_CUDA_GRAPH), "0") || route == FP4MOE_ROUTE_DEQUANT_GEMM;
    if (!strcmp(env_get(ENV_CUDA_SIDE_STREAM), "1")) {
        FP4MOE_CUDA_TRY("cuda", cudaStreamCreateWithFlags(&c->side, cudaStreamNonBlocking), "side stream");
        FP4MOE_CUDA_TRY("cuda", cudaEventCreateWithFlags(&c->ev_fork, cudaEventDisableTiming), "side stream events");
        FP4MOE_CUDA_TRY("cuda", cudaEventCreateWithFlags(&c->ev_join, cudaEventDisableTiming), "side stream events");
    }
    FP4MOE_CUDA_TRY("cuda", cudaStreamSynchronize(c->stream), "backend setup");
    return FP4MOE_OK;
}

void be_cuda_graphs_off(void *bcv) {
    cuda_ctx *c = bcv;
    cu_invalidate(c);
    c->graph_off = 1;
}

int be_cuda_profile(void *bcv, double ms[FP4MOE_PROF_KINDS], int reset) {
    cuda_ctx *c = bcv;
    if (!c->prof)
        return fp4moe_set_error(FP4MOE_EINVAL, "session profile: profiling is off (session option profile)");
    for (int k = 0; k < FP4MOE_PROF_KINDS; k++) ms[k] = c->prof_ms[k];
    if (reset) memset(c->prof_ms, 0, sizeof c->prof_ms);
    return FP4MOE_OK;
}

#endif /* FP4MOE_HAVE_CUDA */
