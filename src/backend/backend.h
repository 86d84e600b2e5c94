/* Internal: the backend table. The nemotron_h forward (src/model/forward.c) is written once against
 * this struct of operations; src/backend/cpu/backend_cpu.c and src/backend/cuda/backend_cuda.c
 * implement it (the CPU one is the oracle of the other). The granularity is the one the GPU needs
 * for speed: one call per matmul, norm, scan, attention, routing step, over all rows of a step.
 *
 * Memory: every pointer an op takes is BACKEND memory (host memory on the CPU, device memory on
 * CUDA). Two element kinds travel between ops:
 *   "act" buffers: the inputs and outputs of matmuls. CPU: fp32 values already rounded to the
 *                  session's act dtype; CUDA: bf16 bits. be_ops.act_size gives the bytes of one
 *                  element; BE_ACT(be, p, n) is the address of element n.
 *   fp32 buffers:  the residual stream, norms' fp32 copies, SSM input/state/output, router, logits.
 * Rounding: every op rounds exactly where the CPU runtime of issue 4 did (matmul inputs/outputs),
 * so a CPU step of one sequence gives the same bits as the former single-sequence forward.
 *
 * A step (fw_step) is a ragged set of sequences: decode rows (one token each) first, rows
 * [0, nd), then prefill segments of several tokens. Per-sequence state lives in pools owned by the
 * model layer (src/model/batch.c): for Mamba layers a conv and an SSM state per pool slot; for
 * attention layers a paged KV cache (FW_PAGE tokens a page; a slot's page table maps its positions
 * to pages). The ops that touch state (conv1d, scan, attention) get the step and honour sequence
 * boundaries: no row sees another sequence's state or keys.
 *
 * Errors: every op returns FP4MOE_OK or a status with the thread-local message set (naming the op);
 * ops are asynchronous on CUDA (one stream, capturable into a graph), synchronous on the CPU. */
#ifndef FP4MOE_BACKEND_H
#define FP4MOE_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "fp4moe/model.h"

#define FW_PAGE 32                  /* KV tokens per page (one attention key tile on CUDA) */

/* Weights as the forward sees them: backend-placed handles. A linear handle is an op_linear* on the
 * CPU and a cuda_linear* on CUDA; NULL marks an absent module. Vectors are fp32 backend memory. */
typedef struct {
    char type;                      /* FP4MOE_LAYER_* */
    const float *norm;
    const void *in_proj, *out_proj;
    const float *conv_w, *conv_b, *A, *D, *dt_bias, *gnorm;
    const void *q_proj, *k_proj, *v_proj, *o_proj;
    const void *kv_proj;            /* optional (NULL: none): k_proj and v_proj stacked as the 2 experts
                                       of one weight (0: k, 1: v), for linear_gather_x1 with idx {0, 1}:
                                       one call for a one-token step (CUDA) */
    const float *router_w, *router_bias;
    const void *router_w3;          /* optional (NULL: none): router_w as three bf16 planes (3E x H, w = p0 + p1 +
                                       p2 exactly; CUDA: the prefill router GEMM on bf16 tensor cores) */
    const void *experts_up, *experts_down, *shared_up, *shared_down, *latent_in, *latent_out;
    const void *up, *down;
} fw_layer;

typedef struct {
    const void *embed;              /* linear handle of the (V, H) embedding (dense or NVFP4) */
    const void *lm_head;
    const float *norm_f;
    fw_layer *layers;               /* cfg.n_layers */
} fw_weights;

/* One sequence's part of a step: tokens pos0 .. pos0+n-1 of pool slot `slot`, rows row0 .. row0+n-1. */
typedef struct {
    int32_t slot;
    int64_t pos0, n, row0;
} fw_seg;

/* A step. Host fields describe it; d_* are backend copies (uploaded by the model layer before the
 * forward) that device kernels read, so that a decode step's launches do not depend on host values
 * (CUDA graphs replay them). */
typedef struct {
    int64_t R;                      /* rows (tokens) in the step */
    int64_t nd;                     /* rows [0, nd) are single-token (decode) segments 0 .. nd-1 */
    int64_t nseg;
    const fw_seg *seg;              /* host: nseg segments, decode ones first, rows in order */
    int64_t n_head;                 /* rows whose logits are computed (lm_head) */
    const int32_t *d_tokens;        /* R token ids */
    const int32_t *d_row_slot;      /* R: pool slot of each row */
    const int32_t *d_row_pos;       /* R: position of each row in its sequence */
    const int32_t *d_head_rows;     /* n_head rows (ascending) */
    const int32_t *d_pages;         /* page table: slot s, page i at [s * max_pages + i] */
    const int32_t *h_pages;         /* the same table in host memory */
    int64_t max_pages;
} fw_step;

/* Where a layer's per-slot state lives (backend memory). */
typedef struct {
    float *conv, *ssm;              /* Mamba: slot s at conv + s * conv_stride, ssm + s * ssm_stride */
    int64_t conv_stride, ssm_stride;
    void *k, *v;                    /* attention: page p, token j at (p * FW_PAGE + j) * kvs elements of
                                     * act_size bytes (the backend's types: CUDA keeps V in fp16), or
                                     * with kv_fp8 rows of op_kv_fp8_row_bytes (CPU) */
    int kv_fp8;                     /* FP4MOE_KV_FP8 (fp4moe_kv_dtype) */
} fw_state;

/* Mamba-2 scan arguments (formula: src/kernels/cpu/ops.h op_ssm_scan), rows of the whole step. */
typedef struct {
    int64_t nh, hd, S, G;
    const float *x;  int64_t xs;    /* R rows (stride xs): nh*hd fp32 */
    const float *B, *C; int64_t bcs;/* R rows (stride bcs): G*S fp32 each */
    const void *dt; int64_t dts;    /* R rows (stride dts) of act: nh raw values */
    const float *dt_bias, *A, *D;   /* nh each */
    float dt_lo, dt_hi;             /* time_step_limit */
    float *y;                       /* R x nh*hd fp32 */
} fw_ssm;

/* Router configuration (spec NEMOTRON_H.md MoE); bias is backend memory or NULL. */
typedef struct {
    int64_t E, k, n_group, topk_group;
    int norm_topk_prob;
    float scaling;
    const float *bias;
    const void *w3;                 /* fw_layer.router_w3 (NULL: none) */
} fw_router;

typedef struct be_ops {
    const char *name;
    size_t act_size;                /* bytes of one act element: 4 (CPU fp32), 2 (CUDA bf16) */
    int device_memory;              /* 1: backend memory is not host memory (CUDA): the host reads and
                                       writes it only through upload / download */
    /* ---- memory (sizes in bytes) ---- */
    int (*alloc)(void *bc, size_t bytes, void **p);           /* zeroed */
    void (*free)(void *bc, void *p);
    void (*free_detached)(void *p); /* frees alloc'd memory without bc (memory that outlives it) */
    int (*upload)(void *bc, void *dst, const void *src, size_t bytes);   /* host -> backend, in order */
    int (*download)(void *bc, void *dst, const void *src, size_t bytes); /* backend -> host, in order */
    int (*copy)(void *bc, void *dst, const void *src, size_t bytes);     /* backend -> backend */
    int (*zero)(void *bc, void *p, size_t bytes);
    int (*sync)(void *bc);          /* waits for everything issued; reports asynchronous errors */
    /* Runs fn(arg) (the forward of `st`): CPU calls it; CUDA replays or captures a graph for
     * decode-only steps, else launches eagerly. */
    int (*run)(void *bc, const fw_step *st, int (*fn)(void *arg), void *arg);
    /* drops captured graphs (buffers they use moved) */
    void (*invalidate)(void *bc);
    /* ---- ops ---- */
    int (*embed)(void *bc, const void *E, const int32_t *tokens, int64_t R, float *h);
    /* x += a (+ b) when a is not NULL (act rows: a residual add, as residual_add); then y (act) =
     * rmsnorm(x) * w, rows of H; y32 (optional) the same rounded values as fp32 */
    int (*rmsnorm)(void *bc, float *x, const void *a, const void *b, const float *w, int64_t T, int64_t H,
                   float eps, void *y, float *y32);
    /* y (act) = rmsnorm(x[rows[i]]) * w for i < n (the lm_head's input rows) */
    int (*rmsnorm_rows)(void *bc, const float *x, const int32_t *rows, int64_t n, const float *w,
                        int64_t H, float eps, void *y);
    /* y (act, T x N) = x (act) @ W^T; relu2: then y = relu(y)^2 (each rounded to act, as relu2
     * after it: the CUDA kernels do it in their epilogue) */
    int (*linear)(void *bc, const void *W, const void *x, int64_t T, int relu2, void *y);
    int (*linear_f32out)(void *bc, const void *W, const void *x, int64_t T, float *y);
    /* y[b] = x[b] @ W[idx[b]]^T (gather_qmm on NVFP4 experts); relu2 as for linear */
    int (*linear_gather)(void *bc, const void *W, const void *x, const uint32_t *idx, int64_t B, int relu2,
                         void *y);
    /* Optional (NULL: not offered): linear_gather where all B rows are x's ONE row (one token's routed
     * experts), without gathering copies of it; the same results. FP4MOE_EUNSUPPORTED where the
     * backend cannot (the caller then gathers the rows and calls linear_gather). */
    int (*linear_gather_x1)(void *bc, const void *W, const void *x, const uint32_t *idx, int64_t B, int relu2,
                            void *y);
    /* Optional (NULL: not offered): linear_gather on the rows x[row_of[b] / k] (x: T rows of K), the
     * same results as gather_rows into a copy and linear_gather on it, without the copy.
     * FP4MOE_EUNSUPPORTED where the backend cannot (the caller then gathers the rows). */
    int (*linear_gather_rows)(void *bc, const void *W, const void *x, int64_t T, const uint32_t *row_of, int64_t k,
                              const uint32_t *idx, int64_t B, int relu2, void *y);
    /* Optional (NULL: not offered): a MoE layer's routed up and down projections in one step - hs = linear_gather_rows(
     * Wup, x, row_of, relu2 1), then ys = linear_gather(Wdown, hs) - ys with those two calls' result, bit for bit (hs
     * is scratch: the backend may keep the up projection's output elsewhere and leave hs as it was).
     * FP4MOE_EUNSUPPORTED where the backend cannot (the caller then makes the two calls). */
    int (*experts_rows)(void *bc, const void *Wup, const void *Wdown, const void *x, int64_t T, const uint32_t *row_of,
                        int64_t k, const uint32_t *idx, int64_t B, void *hs, void *ys);
    /* The routing of a MoE layer: logits (T x E fp32) = x (T x H fp32) @ W^T (router weights, E x H
     * fp32); ids, wts (T x k) = the router's top-k (fw_router); then the stable sort of the T * k
     * (token, slot) rows by expert: row_of, idx (sorted experts), pos_of (B = T * k each). x_act: x in
     * the activation dtype holding the same values (the norm's output), or NULL. */
    int (*moe_route)(void *bc, const fw_router *r, const float *x, const void *x_act, int64_t T, const float *W, int64_t H,
                     float *logits, int32_t *ids, float *wts, uint32_t *row_of, uint32_t *idx,
                     uint32_t *pos_of);
    int (*gather_rows)(void *bc, const void *x, int64_t H, const uint32_t *row_of, int64_t B,
                       int64_t k, void *xs);
    /* Expert parallelism: the stable sort by expert of B rows whose (global) experts ids[b] lie in
     * [lo, lo + E): row_of, idx (LOCAL ids: expert - lo, non-decreasing), pos_of as moe_route's sort.
     * An id outside the range is clamped into it (memory-safe; the exchange never sends one). */
    int (*sort_local)(void *bc, const uint32_t *ids, int64_t B, int64_t lo, int64_t E, uint32_t *row_of,
                      uint32_t *idx, uint32_t *pos_of);
    int (*moe_combine)(void *bc, const void *ys, int64_t H, const uint32_t *pos_of, const float *wts,
                       int64_t T, int64_t k, void *out);
    /* h += a (+ b): h + (a + b) in fp32 */
    int (*residual_add)(void *bc, float *h, const void *a, const void *b, int64_t n);
    /* y (R x C fp32) = silu(causal conv1d of x (R rows of stride xs, act)) per sequence, with the
     * conv state of each segment's slot in st->conv (updated) */
    int (*conv1d_silu)(void *bc, const fw_step *s, const void *x, int64_t xs, int64_t C, const float *w,
                       const float *b, int64_t Kc, const fw_state *st, float *y);
    int (*ssm_scan)(void *bc, const fw_step *s, const fw_ssm *a, const fw_state *st);
    int (*rmsnorm_gated)(void *bc, const float *y, const void *z, int64_t zs, const float *w,
                         int64_t T, int64_t D, int64_t G, float eps, void *out);
    /* appends k, v (R x nkv*dh act) to each row's slot at its position, then causal GQA attention of
     * q (R x nq*dh act) over each row's sequence: out (R x nq*dh act) */
    int (*attention)(void *bc, const fw_step *s, const void *q, const void *k, const void *v,
                     const fw_state *st, int64_t nq, int64_t nkv, int64_t dh, void *out);
    /* out[r] = argmax of row r of x (n rows of V fp32), lowest id on ties, NaN never wins */
    int (*argmax_rows)(void *bc, const float *x, int64_t n, int64_t V, int32_t *out);
    /* profiling mark (fp4moe_prof_kind) ending a segment of work; may be NULL */
    int (*mark)(void *bc, int kind);
    /* Overlap (optional; NULL: not offered). side_begin asks that the ops issued from now until
     * side_end run on a second queue: after everything issued before side_begin, beside what is
     * issued after side_end; side_join makes what is issued after it wait for them. w: the nw
     * linears those ops use, rows: their rows. *on = 0: declined (profiling, too many rows, a weight
     * the second queue cannot run, the option off): the ops then stay in order and side_end /
     * side_join are not called. After side_begin with *on = 1, side_end and side_join are always
     * called (also on an error), in that order. The results never depend on it. */
    int (*side_begin)(void *bc, int64_t rows, const void *const *w, int nw, int *on);
    int (*side_end)(void *bc);
    int (*side_join)(void *bc);
} be_ops;

#define BE_ACT(be, p, n) ((void *)((char *)(p) + (size_t)(n) * (be)->act_size))

/* The CPU backend: ctx for act dtype `act` (f32 or bf16) and gather route `route`. */
int be_cpu_new(fp4moe_dtype act, fp4moe_route route, fp4moe_cpu_act cpu_act, const be_ops **ops, void **bc);
void be_cpu_free(void *bc);
/* The CPU placement of a loaded model's weights (pointers into the model; nothing copied). */
int be_cpu_weights(const fp4moe_model *m, fw_weights *w);
/* Expert parallelism on the CPU: w's routed-expert handles (experts_up / experts_down of every
 * MoE layer) become views of the experts [lo, hi) only (E = hi - lo, expert lo is local expert 0;
 * the weight bytes are shared, not copied: pages of other experts of an mmap'ed checkpoint are
 * never touched). views: 2 x n_layers op_linear slots owned by the caller. */
void be_cpu_weights_experts(fw_weights *w, int64_t n_layers, int64_t lo, int64_t hi, void *views);
/* sizeof(op_linear), for the caller's views. */
size_t be_cpu_linear_size(void);

/* The CUDA backend (src/backend/cuda/backend_cuda.c; a stub without CUDA): ctx for a model whose
 * weights are on the GPU (m->gpu), with room for max_rows rows per step, of which at most
 * max_decode_rows single-token sequences (the batch's max_seqs). */
int be_cuda_new(const fp4moe_model *m, fp4moe_route route, int64_t max_rows, int64_t max_decode_rows,
                int profile, const be_ops **ops, void **bc);
void be_cuda_free(void *bc);
/* The model's device placement as fw_weights (owned by m->gpu). */
const fw_weights *be_cuda_weights(const fp4moe_model *m);
/* Expert parallelism on CUDA: *out = the model's device placement with the routed-expert handles of
 * every MoE layer replaced by views of the experts [lo, hi) (local ids 0 .. hi - lo - 1; the device
 * bytes are shared). layers: cfg.n_layers fw_layer slots, views: 2 x n_layers slots of
 * be_cuda_linear_size() bytes, both owned by the caller and kept while *out is used. */
int be_cuda_weights_experts(const fp4moe_model *m, int64_t lo, int64_t hi, fw_weights *out, fw_layer *layers,
                            void *views);
size_t be_cuda_linear_size(void);
/* Decode steps run eagerly from now on (no graph capture: an expert-parallel rank's MoE layers
 * synchronise with the host and with the other ranks). */
void be_cuda_graphs_off(void *bc);
/* Accumulated device time by fp4moe_prof_kind (profile on). */
int be_cuda_profile(void *bc, double ms[FP4MOE_PROF_KINDS], int reset);

#endif
