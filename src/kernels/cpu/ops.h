/* Internal: the dense CPU ops of the nemotron_h forward pass (spec NEMOTRON_H.md "Forward pass").
 * Row-major everywhere; a weight is (N, K) = (out, in); activations are fp32 arrays; "T" is a
 * number of tokens, "B" a number of (token, slot) rows. NVFP4 matmuls go through the public
 * fp4moe_gather_qmm_cpu (spec NVFP4.md section 4), never a second implementation.
 * Parallel with OpenMP where the work is large enough; every function is deterministic. */
#ifndef FP4MOE_KERNELS_CPU_OPS_H
#define FP4MOE_KERNELS_CPU_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "fp4moe/gather_qmm.h"
#include "fp4moe/types.h"

/* ---- linear layers ------------------------------------------------------------------------- */

/* E stacked (N, K) weight matrices (E = 1 for a plain linear layer), NVFP4 or dense, plus an
 * optional bias. N == 0 marks an absent module. */
typedef struct {
    int64_t E, N, K;
    int nvfp4;                      /* 1: q holds the weights; 0: dense */
    fp4moe_nvfp4_weights q;         /* NVFP4 codes/scales/global scale (E, N, K) */
    fp4moe_dtype dtype;             /* dense: element type of dense[e] (f32, f16, bf16) */
    const void *const *dense;       /* dense: E pointers to N x K matrices */
    const float *bias;              /* N floats or NULL */
} op_linear;

/* Per-session settings and scratch of the ops. */
typedef struct {
    fp4moe_dtype act;               /* FP4MOE_F32 or FP4MOE_BF16: matmul input/output rounding */
    fp4moe_route route;             /* FP4MOE_ROUTE_AUTO or a forced gather_qmm route */
    int q8;                         /* 1: NVFP4 matmuls in W4A8 (fp4moe_gather_qmm_cpu_w4a8) */
    void *buf;                      /* grow-only scratch owned by the ops (free with ops_ctx_free) */
    size_t cap;
} ops_ctx;

void ops_ctx_free(ops_ctx *c);

/* y (T x N) = x (T x K) @ W[0]^T (+ bias). x is first rounded to c->act, y is rounded to c->act.
 * NVFP4: fp4moe_gather_qmm_cpu with E = 1 and idx all 0 (sorted); dense: OpenBLAS sgemm on
 * fp32 panels of W (bf16/f16 converted panel by panel, never as a whole).
 * Errors: those of gather_qmm, FP4MOE_ENOMEM. */
int op_linear_forward(ops_ctx *c, const op_linear *w, const float *x, int64_t T, float *y);

/* As op_linear_forward, but y stays fp32 (fp32 accumulation, never rounded to c->act; x is still
 * rounded): the lm_head, whose logits are fp32 on every device so that values one bf16 step
 * apart neither tie nor swap. NVFP4: gather_qmm in f32 on the rounded x. */
int op_linear_forward_f32out(ops_ctx *c, const op_linear *w, const float *x, int64_t T, float *y);

/* Expert matmul on rows sorted by expert: y[b] = x[b] @ W[idx[b]]^T for b < B (idx
 * non-decreasing, idx[b] < E), rounding as op_linear_forward. NVFP4: gather_qmm (sorted, so the
 * expert-batched route serves B >= 64); dense: one sgemm per run of equal idx. */
/* v = the experts [lo, hi) of w (expert lo becomes expert 0; the bytes are shared, not copied);
 * v may be w. For expert parallelism (a rank's share, src/model/ep.h). */
void op_linear_experts(const op_linear *w, int64_t lo, int64_t hi, op_linear *v);

int op_linear_gather(ops_ctx *c, const op_linear *w, const float *x, const uint32_t *idx,
                     int64_t B, float *y);

/* y (T x N, row stride ldy) = x (T x K) @ W^T, all fp32, no rounding: dot products for a few rows
 * (decode), OpenBLAS sgemm for many (prefill). Used for the fp32 router. */
void op_matmul_f32(const float *x, int64_t T, const float *W, int64_t N, int64_t K, float *y,
                   int64_t ldy);

/* Rounds n fp32 values to the nearest bf16 (as fp32) when act is BF16; no-op for F32. */
void op_round_act(fp4moe_dtype act, float *x, int64_t n);

/* ---- elementwise / norms ---------------------------------------------------------------------- */

/* y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w for t < T rows of H (fp32; y may alias x). */
void op_rmsnorm(const float *x, const float *w, int64_t T, int64_t H, float eps, float *y);

/* Gated grouped RMSNorm of Mamba-2 (transformers Zamba2RMSNormGated, norm_before_gate=False):
 * g = y * silu(z); out = w * g / sqrt(mean over each of G groups of D/G channels (g^2) + eps).
 * y rows have stride ys, z rows stride zs, out is T x D (may alias y when ys == D). */
void op_rmsnorm_gated(const float *y, int64_t ys, const float *z, int64_t zs, const float *w,
                      int64_t T, int64_t D, int64_t G, float eps, float *out);

void op_silu(float *x, int64_t n);        /* x * sigmoid(x) */
void op_relu2(float *x, int64_t n);       /* max(x, 0)^2 */
void op_add(float *y, const float *x, int64_t n); /* y += x */

/* ---- Mamba-2 ------------------------------------------------------------------------------ */

/* Causal depthwise conv1d over time with state (nn.Conv1d(groups=C, padding=Kc-1)[:T]):
 *   y[t][c] = b[c] + sum_{j<Kc} w[c][j] * in[t - (Kc-1) + j][c]
 * where in[<0] comes from state (the previous Kc-1 inputs, oldest first; zeros at the start).
 * x: T rows of stride xs (C channels used); y: T x C; state: (Kc-1) x C, updated to the last Kc-1
 * inputs. b may be NULL. */
void op_conv1d_causal(const float *x, int64_t xs, int64_t T, int64_t C, const float *w,
                      const float *b, int64_t Kc, float *state, float *y);

/* The Mamba-2 selective scan, recurrent form, fp32 state (spec NEMOTRON_H.md, Mamba-2):
 *   dt = clamp(softplus(dt_raw + dt_bias), dt_lo, dt_hi); dA = exp(dt * A)   (time_step_limit)
 *   state_h = dA * state_h + dt * x_h (outer) B_g;  y_h = state_h @ C_g + D_h * x_h,  g = h/(nh/G)
 * Used for prefill (T tokens, sequentially) and decode (T = 1); same function, same numbers. */
typedef struct {
    int64_t T, nh, hd, S, G;
    const float *x;  int64_t xs;    /* T rows (stride xs): nh*hd values */
    const float *B;  const float *C; int64_t bcs; /* T rows (stride bcs): G*S values each */
    const float *dt; int64_t dts;   /* T rows (stride dts): nh raw values */
    const float *dt_bias, *A, *D;   /* nh each; A = -exp(A_log) */
    float dt_lo, dt_hi;             /* the config's time_step_limit */
    float *state;                   /* nh x hd x S, updated */
    float *y;                       /* T x nh*hd */
} op_ssm_args;
void op_ssm_scan(const op_ssm_args *a);

/* ---- attention ---------------------------------------------------------------------------- */

/* The FP8 KV cache's rows (fp4moe_kv_dtype FP4MOE_KV_FP8, include/fp4moe/model.h): one token's
 * nkv x dh values as nkv*dh E4M3 codes (padded to a multiple of 4 bytes), then nkv fp32 scales,
 * s_h = max_i |x[h][i]| / 448 (1 when the head is all zeros, NaN when a value is NaN), code =
 * fp4moe_f32_to_e4m3(x / s_h). op_kv_fp8_row_bytes: the row's bytes; op_kv_fp8_store: x (nkv*dh
 * fp32) -> row; op_kv_fp8_load: row -> x = e4m3(code) * s_h. Per value the round trip errs by at
 * most half an E4M3 step: |x - x'| <= 2^-4 |x| + 2^-10 s_h (the subnormal step is 2^-9 s_h). */
size_t op_kv_fp8_row_bytes(int64_t nkv, int64_t dh);
void op_kv_fp8_store(const float *x, int64_t nkv, int64_t dh, uint8_t *row);
void op_kv_fp8_load(const uint8_t *row, int64_t nkv, int64_t dh, float *x);

/* Causal GQA attention without positional encoding for T new queries after P cached positions:
 *   out[t][h] = softmax_j<=P+t (q[t][h] . k[j][h/(nq/nkv)] / sqrt(dh)) @ v
 * q: T rows of stride qs (nq*dh used); k, v: P+T rows of nkv*dh; out: T x nq*dh. fp32.
 * Errors: FP4MOE_ENOMEM. */
int op_attention_causal(const float *q, int64_t qs, const float *k, const float *v, int64_t P,
                        int64_t T, int64_t nq, int64_t nkv, int64_t dh, float *out);
/* The same over a paged cache, read in place: key/value j is row pages[j / page] * page + j % page
 * of k and v (rows of nkv*dh floats); the same arithmetic in the same order (bitwise equal to
 * op_attention_causal on the keys gathered). Memory: one score row of P+T floats per thread.
 * Errors: FP4MOE_EINVAL (pages NULL, page < 1), FP4MOE_ENOMEM. */
int op_attention_causal_paged(const float *q, int64_t qs, const float *k, const float *v, const int32_t *pages,
                              int64_t page, int64_t P, int64_t T, int64_t nq, int64_t nkv, int64_t dh, float *out);
/* The same over a paged FP8 cache (rows of op_kv_fp8_row_bytes(nkv, dh) bytes, as op_kv_fp8_store
 * writes them), read in place: each page's keys and values of a kv head dequantized once (as
 * op_kv_fp8_load does) into a page-sized buffer and used by the nq/nkv query heads of that kv head;
 * per head the same arithmetic in the same order as op_attention_causal on the dequantized rows
 * (bitwise equal to it). Memory per thread: nq/nkv score rows of P+T floats and one page of dh
 * floats; no copy of the context. Errors: FP4MOE_EINVAL (pages NULL, page < 1), FP4MOE_EUNSUPPORTED
 * (more than 64 query heads a kv head), FP4MOE_ENOMEM. */
int op_attention_causal_paged_fp8(const float *q, int64_t qs, const uint8_t *k, const uint8_t *v,
                                  const int32_t *pages, int64_t page, int64_t P, int64_t T, int64_t nq, int64_t nkv,
                                  int64_t dh, float *out);

/* ---- MoE routing -------------------------------------------------------------------------- */

typedef struct {
    int64_t E, k, n_group, topk_group;
    int norm_topk_prob;
    float scaling;                  /* routed_scaling_factor */
    const float *bias;              /* E: e_score_correction_bias, used for choice only */
} op_router_cfg;

/* Router (spec NEMOTRON_H.md MoE, fp32): s = sigmoid(logits); choice = s + bias; with n_group > 1
 * only the topk_group groups with the best sum-of-top-2 choice scores stay; top-k by choice (ties:
 * lower expert id first); w = s[top] (/ (sum + 1e-20) when norm) * scaling.
 * logits: T x E; ids, wts: T x k (ids in choice order). Errors: FP4MOE_ENOMEM. */
int op_router_topk(const op_router_cfg *r, const float *logits, int64_t T, int32_t *ids,
                   float *wts);

/* Stable counting sort of B rows by expert id ids[b] < E: sorted position p holds original row
 * row_of[p], with expert idx[p] (non-decreasing); pos_of[row] is the inverse. Errors: ENOMEM. */
int op_sort_by_expert(const int32_t *ids, int64_t B, int64_t E, uint32_t *row_of, uint32_t *idx,
                      uint32_t *pos_of);

/* out[t] (H) = sum_{j<k} wts[t][j] * ys[pos_of[t*k + j]] in fp32, slots in order j = 0..k-1.
 * ys: B x H rows in sorted order. out is overwritten. */
void op_moe_combine(const float *ys, int64_t H, const uint32_t *pos_of, const float *wts,
                    int64_t T, int64_t k, float *out);

#endif
