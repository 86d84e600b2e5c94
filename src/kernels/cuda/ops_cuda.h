/* Internal: the CUDA ops of the nemotron_h forward pass (spec NEMOTRON_H.md "Forward pass"), the
 * GPU twins of src/kernels/cpu/ops.h. Every op mirrors its CPU counterpart's formula and, where it
 * is cheap, its order of fp32 operations (the CPU runtime is the oracle: tests/gpu/test_model_gpu.c).
 *
 * Conventions: row-major; a weight is (N, K) = (out, in); "T" tokens, "B" (token, slot) rows.
 * All pointers are DEVICE pointers; `stream` is a cudaStream_t (NULL = legacy default stream).
 * Activations between ops: the residual stream, norms, the SSM and the router are fp32; the inputs
 * and outputs of every matmul are bf16 (the bits as uint16_t in this C interface), which is exactly
 * the CPU runtime's rounding with act_dtype = bf16 (round at each matmul input and output); the
 * lm_head's output, the logits, is fp32 on both (cuda_linear_forward_f32out).
 * Every launcher is asynchronous (no host synchronisation, capturable into a CUDA graph), checks
 * the launch and returns FP4MOE_OK or FP4MOE_ECUDA with a message naming the op; size limits are
 * checked where a kernel assumes them (FP4MOE_EUNSUPPORTED). Positions that change from one decode
 * step to the next (the context length P) are read from device memory (d_pos), so that one
 * captured graph serves every step. */
#ifndef FP4MOE_KERNELS_CUDA_OPS_CUDA_H
#define FP4MOE_KERNELS_CUDA_OPS_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "fp4moe/gather_qmm.h"
#include "fp4moe/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- linear layers --------------------------------------------------------------------------- */

/* E stacked (N, K) weights on the device (E = 1 for a plain linear layer). N == 0: absent. */
typedef struct {
    int64_t E, N, K;
    int nvfp4;                  /* 1: q holds device codes/scales/global scales */
    int tiled;                  /* NVFP4: q.codes holds the tiled layout (gq_relayout_tiled) */
    fp4moe_nvfp4_weights q;
    fp4moe_dtype dtype;         /* dense: FP4MOE_BF16 or FP4MOE_F32 (f16 is uploaded as f32) */
    const void *dense;          /* dense: E*N*K elements, expert-major */
    const float *bias;          /* N floats or NULL */
    const void *wbf16;          /* NVFP4 plain linear (E = 1): its weights dequantized once at load
                                   (bf16 N x K, block scales applied, not the global scale:
                                   cuda_nvfp4_dequant_bf16), which the dense dequant_gemm form
                                   reads instead of dequantizing each call; or NULL */
} cuda_linear;

/* A bf16 buffer for one dequantized plain NVFP4 linear (grown on first use; owned by the session). */
typedef struct {
    void *p;
    size_t bytes;
} gq_dense_scratch;

/* The expert runs of a sorted idx made by the sort that wrote it (cuda_moe_route), so that the
 * expert-batched gather calls on that idx skip their runs kernel (gq_runs_kernel). At buf, the layout of
 * that kernel's scratch: starts[E + 1] (starts[e] = the first sorted row of expert e, starts[E] = B),
 * tile_off[E + 1] (tile_off[e] = the sum over experts e' < e of ceil(rows(e') / mt)) and one work counter,
 * 0 between kernels (the sort zeroes it; a gather kernel that takes items from it sets it back to 0 after
 * its last item, so that the next gather on the same runs finds 0). A gather call uses them only when its
 * idx pointer, B and E are these and its row tile is mt; otherwise it computes its own. */
typedef struct {
    int *buf;                   /* device: 2 cap_e + 3 ints (NULL: no runs are made) */
    int64_t cap_e;              /* experts buf has room for */
    const uint32_t *idx;        /* the sorted idx the runs describe (NULL: none valid) */
    int64_t B, E;
    int mt;                     /* the row tile of tile_off */
    const int *e1_pairs;        /* E = 1 calls on an all-zero idx (plain linears): cuda_ops.e1_runs, for B <= e1_n */
    int64_t e1_n;
    int *done;                  /* device: done_n ints, zero between kernels - the fused MoE kernel's per-row-tile
                                   counters (gq_launch_moe_pair; NULL: no fused MoE) */
    int64_t done_n;
} gq_runs;

/* What the matmul ops need besides their operands (one per session). */
typedef struct {
    void *stream;               /* cudaStream_t */
    void *blas;                 /* cublasHandle_t bound to stream (cuda_blas_create) */
    fp4moe_route route;         /* FP4MOE_ROUTE_AUTO or a forced gather_qmm route */
    const uint32_t *zero_idx;   /* zero_n zeros: the idx of E = 1 NVFP4 linears */
    int64_t zero_n;
    float *f32_x, *f32_y;       /* f32_n floats each: staging for f32 dense weights (and the
                                   f32 x of cuda_linear_forward_f32out) */
    int64_t f32_n;
    gq_dense_scratch *dq;       /* the dense dequant_gemm scratch (gather_qmm_cuda_linear) */
    float *split_ws;            /* split_n floats: the partial products of cuda_matmul_f32's split-K
                                   form (NULL / 0: that form is off) */
    int64_t split_n;
    gq_runs runs;               /* the last cuda_moe_route's expert runs (buf NULL: not made) */
    const int *e1_runs;         /* NULL, or 2 (zero_n + 1) ints, pair i = {0, i}: the expert runs of a plain linear's
                                   rows (E = 1, idx all 0: starts {0, B}, tile offsets {0, tiles}) with no runs kernel
                                   (cuda_e1_runs_table) */
} cuda_ops;

/* The table of cuda_ops.e1_runs for up to n rows: 2 (n + 1) ints of device memory, pair i = {0, i}, written on
 * stream (the caller frees it with cudaFree). Errors: FP4MOE_ENOMEM, FP4MOE_ECUDA. */
int cuda_e1_runs_table(void *stream, int64_t n, int **out);

/* cuBLAS handle on `stream` with a caller-owned workspace (so that graph capture never makes cuBLAS
 * allocate); default math (no TF32). Errors: FP4MOE_ECUDA. */
int cuda_blas_create(void *stream, void *workspace, size_t workspace_bytes, void **blas);
void cuda_blas_destroy(void *blas);

/* y (T x N, bf16) = x (T x K, bf16) @ W[0]^T (+ bias), fp32 accumulation, rounded once.
 * NVFP4: fp4moe_gather_qmm_cuda with E = 1 and idx all 0 (sorted; T <= o->zero_n).
 * Dense bf16: cublasGemmEx (bf16 in/out, fp32 compute). Dense f32: x widened to f32, cublasGemmEx
 * in f32, rounded to bf16 (T*K and T*N <= o->f32_n). Bias: added in fp32, rounded again to bf16
 * (the CPU adds it to the fp32 output without the second rounding; nemotron_h has no biases).
 * relu2: then y = bf16(relu(y)^2) (cuda_relu2's arithmetic), in the NVFP4 kernels' epilogue where
 * they can, else by cuda_relu2.
 * Errors: those of gather_qmm, FP4MOE_ECUDA, FP4MOE_EUNSUPPORTED (staging too small). */
int cuda_linear_forward(const cuda_ops *o, const cuda_linear *w, const uint16_t *x, int64_t T, int relu2,
                        uint16_t *y);

/* The tiled NVFP4 layout of the CUDA kernels (src/kernels/cuda/gather_cuda.cuh): bytes of one
 * expert of (N, K) weights, and E stacked (N, K) weights in the checkpoint layout (device codes
 * E*N*K/2 bytes, scales E*N*K/16, 16-byte aligned) into it at out (asynchronous on stream).
 * K % 32 == 0, else FP4MOE_EUNSUPPORTED. */
int64_t cuda_nvfp4_tiled_expert_bytes(int64_t N, int64_t K);
int cuda_nvfp4_relayout_tiled(void *stream, const uint8_t *codes, const uint8_t *scales, int64_t E, int64_t N,
                              int64_t K, void *out);

/* One plain NVFP4 weight (N, K) dequantized to bf16 at out (N x K, row-major): out[n][k] =
 * E2M1(code) x E4M3(block scale), exact in bf16 (spec NVFP4.md "Dequantization"; the global scale is
 * left to the GEMM's alpha, as in dequant_gemm). codes / scales: the checkpoint layout, or the tiled
 * layout when tiled (then scales is not read). Asynchronous on stream. K % 16 == 0, else
 * FP4MOE_EUNSUPPORTED; launch errors FP4MOE_ECUDA. */
int cuda_nvfp4_dequant_bf16(void *stream, const uint8_t *codes, const uint8_t *scales, int tiled, int64_t N,
                            int64_t K, void *out);

/* tiled (the three functions below): 1 when w->codes holds the tiled layout of gq_relayout_tiled
 * (src/kernels/cuda/gather_cuda.cuh; w->scales is then not read); the kernels give the same bits
 * as on the checkpoint layout (sorted f16/bf16 qmv-route calls of 33-63 rows take the 8-row-tile kernel
 * on both layouts: the fp32 qmv kernel cannot read the tiled one). Calls no kernel can take
 * on it (unsorted and > 32 rows, f32 x, K % 64 != 0 on the expert-batched kernel) fail with
 * FP4MOE_EUNSUPPORTED. */
/* fp4moe_gather_qmm_cuda_route with an epilogue: relu2 != 0 asks for y = relu(y)^2 (f16/bf16 y,
 * each rounded: the relu2 op's arithmetic); *fused tells whether the chosen kernel did it
 * (dequant_gemm's cuBLAS GEMM and f32 do not: the caller then applies it). */
/* runs (may be NULL): expert runs made beforehand (gq_runs; used where they match the call). */
int gather_qmm_cuda_ex(const fp4moe_nvfp4_weights *w, int tiled, const void *x, fp4moe_dtype dtype,
                       const uint32_t *idx, int64_t B, int sorted, fp4moe_route route, int relu2, void *y,
                       void *stream, int *fused, const gq_runs *runs);

/* gather_qmm_cuda_ex (sorted idx, bf16) for B rows that are all the same row: y[b] = x[0] @
 * W[idx[b]]^T (x: ONE row of K bf16), as gather_qmm_cuda_ex on B copies of that row gives - the same
 * kernel and bits, without the copies (one decode token's routed experts). relu2: the epilogue,
 * always fused. Runs where that call would take the tensor-core qmv (route auto or qmv, B < 64,
 * gq_qmv_mma_fits); elsewhere FP4MOE_EUNSUPPORTED, and the caller gathers the rows. Other errors: as
 * gather_qmm_cuda_ex (checked for one row). */
int gather_qmm_cuda_x1(const fp4moe_nvfp4_weights *w, int tiled, const void *x, const uint32_t *idx, int64_t B,
                       fp4moe_route route, int relu2, void *y, void *stream);

/* gather_qmm_cuda_ex (sorted idx, bf16) on rows gathered through a map, without the gathered copy:
 * y[b] = x[xrow[b] / xdiv] @ W[idx[b]]^T for b < B, where x holds T rows of K bf16 (row stride K) - as
 * gather_qmm_cuda_ex on the B rows xs[b] = x[xrow[b] / xdiv] gives: the same kernel and bits (one
 * MoE layer's up projection: xrow = the sort's row_of, xdiv = top-k). Every xrow[b] / xdiv must be
 * < T (the caller's promise; the sort's row_of of T * top-k rows is). relu2: the epilogue, always
 * fused. Runs where that call would take the expert-batched kernel (route batched, or route qmv as
 * "qmv, tiled by 8 rows"; auto as it resolves for B and E); elsewhere (the tensor-core qmv of
 * decode-sized calls, dequant_gemm) FP4MOE_EUNSUPPORTED, and the caller gathers the rows. K % 8 != 0:
 * FP4MOE_EUNSUPPORTED. Other errors: as gather_qmm_cuda_ex; T < 1, xdiv < 1, a NULL or misaligned
 * xrow: FP4MOE_EINVAL. */
int gather_qmm_cuda_rows(const fp4moe_nvfp4_weights *w, int tiled, const void *x, int64_t T, const uint32_t *xrow,
                         int64_t xdiv, const uint32_t *idx, int64_t B, fp4moe_route route, int relu2, void *y,
                         void *stream, const gq_runs *runs);
/* gather_qmm_cuda_rows of the up projection wu (relu^2, into h) and gather_qmm_cuda of the down projection wd (h -> y)
 * on the same sorted idx, in one step: where the route is the expert-batched one and the experts' runs are long
 * (GQ_BIG_ROWS_PER_EXPERT rows an expert on average; FP4MOE_CUDA_MOE_BIG=1 or all, 1 the default; gq_moe_big_fits)
 * on 128 x 256 tiles (gq_launch_moe_big: y bitwise the same; h holds only the rows of runs' remainders of <= 64 rows
 * (=1; =all: none) - a scratch of the kernel's order takes the rest of the up projection's output); else in one launch (gq_launch_moe_pair: FP4MOE_CUDA_MOE_FUSED=1, both on the
 * expert-batched route's 32-row tiles, runs matching idx with done counters: h and y written); FP4MOE_EUNSUPPORTED
 * elsewhere. */
int gather_qmm_cuda_moe_rows(const fp4moe_nvfp4_weights *wu, int tiled_u, const fp4moe_nvfp4_weights *wd, int tiled_d,
                             const void *x, int64_t T, const uint32_t *xrow, int64_t xdiv, const uint32_t *idx,
                             int64_t B, fp4moe_route route, void *h, void *y, void *stream, const gq_runs *runs);

/* The row tile (8, 32 or 64) of the expert-batched kernel for a bf16 call of B sorted rows over E > 1
 * experts (gq_batched_row_tile): the mt of the runs cuda_moe_route makes. */
int gather_qmm_cuda_row_tile(int64_t B, int64_t E);

/* The route fp4moe_gather_qmm_cuda's automatic choice takes for B rows over E experts (sorted: idx sorted), with
 * the environment as it is now (FP4MOE_GATHER_ROUTE, FP4MOE_GATHER_EXPERT_BATCHED): qmv, batched or dequant_gemm
 * (thresholds and their measurements: choose_route in gather_qmm_cuda.cu). Host-only: no device needed. */
fp4moe_route gather_qmm_cuda_auto_route(int64_t B, int64_t E, int sorted);

/* gather_qmm_cuda_ex for a plain NVFP4 linear: w->E == 1 and zero_idx[0..B) all 0 (the caller's
 * promise). Where the route resolves to dequant_gemm (auto: B >= 256 rows; or forced) and x is bf16,
 * the dense form runs (gq_dense_dequant_gemm: the weights dequantized into *dq - or, when wbf16 is
 * not NULL, its copy made once by cuda_nvfp4_dequant_bf16, the same bits - then one cuBLAS GEMM on
 * `blas`, which must be bound to `stream`; d_zero: a device 0.0f): no runs and no host
 * synchronisation, so it neither stalls the host nor breaks a graph capture. Otherwise exactly
 * gather_qmm_cuda_ex (e1_runs: NULL, or cuda_ops.e1_runs of B rows or more - the expert-batched kernels then read
 * the runs {0, B} from it instead of launching the runs kernel). Errors: as gather_qmm_cuda_ex. */
int gather_qmm_cuda_linear(const fp4moe_nvfp4_weights *w, int tiled, const void *x, fp4moe_dtype dtype,
                           const uint32_t *zero_idx, int64_t B, fp4moe_route route, int relu2, void *y,
                           void *stream, void *blas, gq_dense_scratch *dq, const void *wbf16, const float *d_zero,
                           const int *e1_runs, int *fused);

/* gather_qmm (sorted idx) with bf16 x and fp32 y: the expert-batched tensor-core kernel, whose
 * per-row arithmetic does not depend on the other rows (src/kernels/cuda/gather_qmm_cuda.cu). */
int gather_qmm_cuda_bf16_f32out(const fp4moe_nvfp4_weights *w, int tiled, const void *x, const uint32_t *idx,
                                int64_t B, float *y, void *stream);

/* As cuda_linear_forward, but y (T x N) is fp32: fp32 accumulation, never rounded to bf16 (the
 * lm_head: logits are fp32, as op_linear_forward_f32out on the CPU). NVFP4: the expert-batched
 * tensor-core kernel on the bf16 x with an fp32 epilogue (gather_qmm_cuda_bf16_f32out); dense bf16:
 * cublasGemmEx with bf16 inputs and an fp32 output; dense f32: x widened, cublasGemmEx in f32
 * (T*K <= o->f32_n). Bias added in fp32. Errors: as cuda_linear_forward. */
int cuda_linear_forward_f32out(const cuda_ops *o, const cuda_linear *w, const uint16_t *x, int64_t T,
                               float *y);

/* Expert matmul on rows sorted by expert: y[b] = x[b] @ W[idx[b]]^T, b < B (bf16 in and out).
 * NVFP4: fp4moe_gather_qmm_cuda (sorted = 1: the expert-batched route from 64 rows). Dense
 * experts: a plain fp32 CUDA-core kernel (correct, not fast: unquantized experts are for checks). */
int cuda_linear_gather(const cuda_ops *o, const cuda_linear *w, const uint16_t *x,
                       const uint32_t *idx, int64_t B, int relu2, uint16_t *y);

/* cuda_linear_gather where all B rows are x's ONE row (gather_qmm_cuda_x1: one decode token's
 * routed experts, no gathered copies; the same bits). NVFP4 experts without bias only; elsewhere
 * FP4MOE_EUNSUPPORTED (the caller gathers the rows and calls cuda_linear_gather). */
int cuda_linear_gather_x1(const cuda_ops *o, const cuda_linear *w, const uint16_t *x, const uint32_t *idx,
                          int64_t B, int relu2, uint16_t *y);

/* The routed experts' up and down projections of a MoE layer in one step where the CUDA kernels can (NVFP4 experts
 * without bias; gather_qmm_cuda_moe_rows: 128 x 256 tiles for long runs, else gq_launch_moe_pair where both run the
 * expert-batched route's 32-row tiles on the runs of idx made by cuda_moe_route with its done counters): hs (B x up
 * N, bf16; scratch - not written on the 128 x 256 tiles) = relu^2(x[row_of[b] / k] @ up^T), then ys (B x down N,
 * bf16) = hs @ down^T - ys bitwise cuda_linear_gather_rows(up, relu2 1) then cuda_linear_gather(down). Elsewhere
 * FP4MOE_EUNSUPPORTED (the caller makes the two calls); FP4MOE_EINVAL on bad arguments, FP4MOE_ECUDA on a launch
 * failure. */
int cuda_experts_rows(const cuda_ops *o, const cuda_linear *up, const cuda_linear *down, const uint16_t *x, int64_t T,
                      const uint32_t *row_of, int64_t k, const uint32_t *idx, int64_t B, uint16_t *hs, uint16_t *ys);
/* ints of the fused MoE kernel's done counters for B rows of E experts (gq_runs.done) */
int64_t cuda_moe_done_ints(int64_t B, int64_t E);

/* cuda_linear_gather on the rows x[row_of[b] / k] (T rows of x; gather_qmm_cuda_rows: no gathered
 * copy, the same bits as cuda_gather_rows then cuda_linear_gather). NVFP4 experts without bias, where
 * the expert-batched kernel runs; elsewhere FP4MOE_EUNSUPPORTED (the caller gathers the rows). */
int cuda_linear_gather_rows(const cuda_ops *o, const cuda_linear *w, const uint16_t *x, int64_t T,
                            const uint32_t *row_of, int64_t k, const uint32_t *idx, int64_t B, int relu2,
                            uint16_t *y);

#ifndef MM_SPLIT_ROWS
#define MM_SPLIT_ROWS 8192 /* cuda_matmul_f32's split-K form: parts x rows at most (scratch: this x N floats;
                              0: the form off, a measured variant) */
#endif
/* y (T x N, fp32) = x (T x K, fp32) @ W^T (W: N x K fp32), cublasGemmEx with fp32 compute (the
 * fp32 router, as op_matmul_f32). Where that GEMM has few output tiles (T <= MM_SPLIT_ROWS / 8, e.g. a
 * 512-token prefill: 512 x 128 outputs are 8 cuBLAS tiles for 132 SMs), K is split into S equal parts
 * (S <= 16 dividing K, S * T <= MM_SPLIT_ROWS, S * T * N <= o->split_n): S GEMMs in one strided
 * batched call write S partial products into o->split_ws, and one kernel adds them in the order
 * 0..S-1 (deterministic; fp32 sums of K / S products each). Errors: FP4MOE_ECUDA, FP4MOE_EUNSUPPORTED
 * (sizes beyond int). */
int cuda_matmul_f32(const cuda_ops *o, const float *x, int64_t T, const float *W, int64_t N,
                    int64_t K, float *y);

/* The same product for x whose values are bf16 (the normed hidden state: the router's input), on bf16
 * tensor cores, in two steps. W3 (3N x K bf16) holds W as three planes (cuda_split_bf16x3: W = p0 + p1 + p2
 * exactly), so each product x * p is exact in fp32, and one cublasGemmEx (bf16 in, fp32 compute and out) of n
 * rows of x (n x K bf16, uint16_t) gives the three planes' sums P (n x 3N fp32: P0 | P1 | P2 a row) in
 * o->split_ws; n <= cuda_bf16x3_rows(o, N) (split_n / 3N: the rows the scratch holds; 0 without it). The
 * logits are y = P0 + (P1 + P2) (the small ones first), summed by their reader (cuda_moe_route's top-k). The
 * tensor cores accumulate in fp32 (not IEEE round-to-nearest): test_moe_route holds y to the fp32 summation
 * bound against fp64; not cuda_matmul_f32's bits. Errors: FP4MOE_ECUDA, FP4MOE_EUNSUPPORTED (n beyond the
 * scratch, sizes beyond int). */
int64_t cuda_bf16x3_rows(const cuda_ops *o, int64_t N);
int cuda_matmul_bf16x3_planes(const cuda_ops *o, const uint16_t *x, int64_t n, const uint16_t *W3, int64_t N,
                              int64_t K);

/* out (3n bf16, planes of n) = w (n fp32) as three bf16 planes p0 = bf16(w), p1 = bf16(w - p0), p2 = bf16(w -
 * p0 - p1) (round to nearest even; the differences are exact, p0 + p1 + p2 = w exactly but for |w| < ~2^-110 and
 * |w| >= 0x1.ff8p127).
 * Errors: FP4MOE_ECUDA. */
int cuda_split_bf16x3(void *stream, const float *w, int64_t n, uint16_t *out);

/* ---- embedding, norms, elementwise ---------------------------------------------------------------- */

/* h[t] (H fp32) = row tokens[t] of the embedding e (V x H): dense bf16/f16/f32, or NVFP4
 * (e2m1 * e4m3 * gs, as fp4moe_nvfp4_dequantize). e->dtype may be FP4MOE_F16 here. */
int cuda_embed(void *stream, const cuda_linear *e, const int32_t *tokens, int64_t T, float *h);

/* x[t] += a[t] (+ b[t]) when a is not NULL (bf16 rows, cuda_residual_add's arithmetic); then
 * y[t] = bf16(x[t] / sqrt(mean(x[t]^2) + eps) * w), T rows of H (sum of squares in fp64, as
 * op_rmsnorm); y32 (optional, may be NULL) receives the same rounded values as fp32. */
int cuda_rmsnorm(void *stream, float *x, const uint16_t *a, const uint16_t *b, const float *w, int64_t T,
                 int64_t H, float eps, uint16_t *y, float *y32);

/* Gated grouped RMSNorm of Mamba-2 (op_rmsnorm_gated): g = y * silu(z); out = bf16(w * g /
 * rms over each of G groups of D/G channels). y: T x D fp32; z: T rows of stride zs (bf16). */
int cuda_rmsnorm_gated(void *stream, const float *y, const uint16_t *z, int64_t zs, const float *w,
                       int64_t T, int64_t D, int64_t G, float eps, uint16_t *out);

/* A kernel that only waits `us` microseconds on the stream (us <= 0: nothing launched): the
 * diagnostic delay of the side stream (FP4MOE_CUDA_SIDE_DELAY_US). */
int cuda_spin(void *stream, int64_t us);

/* x (T x N bf16) = bf16(max(x, 0)^2) in place (op_relu2 followed by the next matmul's rounding). */
int cuda_relu2(void *stream, uint16_t *x, int64_t n);

/* h[i] += a[i] (+ b[i]) for i < n, fp32: h + (a + b) in that order (moe_forward's out += shared,
 * then layer_forward's h += out). b may be NULL. */
int cuda_residual_add(void *stream, float *h, const uint16_t *a, const uint16_t *b, int64_t n);

/* out[r] = argmax over row r of x (rows x n fp32 logits, device), lowest index on ties, NaN never wins,
 * an all-NaN row gives 0 (fp4moe_argmax's rules). ws: NULL, or cuda_argmax_ws_bytes() of device memory,
 * zeroed before its first use and used by one stream at a time (the kernel leaves it zeroed): with it,
 * calls of <= 8 rows of >= 8,192 logits (a decode step's lm_head rows) read each row with up to 64
 * blocks; otherwise one block a row. The same result either way. Errors: FP4MOE_EUNSUPPORTED for
 * n < 1 or rows or n past INT_MAX; a launch error. */
int cuda_argmax_rows_f32(void *stream, const float *x, int64_t rows, int64_t n, int32_t *out, void *ws);
size_t cuda_argmax_ws_bytes(void);

/* y[i] = bf16(rmsnorm(x[rows[i]]) * w) for i < n (cuda_rmsnorm on gathered rows; rows: device). */
int cuda_rmsnorm_rows(void *stream, const float *x, const int32_t *rows, int64_t n, const float *w,
                      int64_t H, float eps, uint16_t *y);

/* ---- Mamba-2 ------------------------------------------------------------------------------ */

/* y[t][c] = silu(b[c] + sum_{j<Kc} w[c][j] * in[t-(Kc-1)+j][c]) (fp32), in[<0] from state; then
 * state := the last Kc-1 inputs (op_conv1d_causal + op_silu). x: T rows of stride xs (bf16, C
 * channels used); w: C x Kc; b: C or NULL; state: (Kc-1) x C fp32; y: T x C fp32. Kc <= 8. */
int cuda_conv1d_causal(void *stream, const uint16_t *x, int64_t xs, int64_t T, int64_t C,
                       const float *w, const float *b, int64_t Kc, float *state, float *y);

/* The Mamba-2 selective scan (op_ssm_scan, fp32 state), one function for prefill and decode:
 * T >= SSD_MIN_T (128) tokens with S 64 or 128: the chunked SSD on tensor cores (3xTF32 matrix products,
 * 64-token chunks; FP4MOE_CUDA_SSM=tiled: not taken); other T >= 2: the recurrent tiled kernel (a
 * register-blocked state with cp.async input tiles); T = 1 (decode): seq. All within 1e-4 of the fp64
 * recurrence (tests/gpu/test_ssm_gpu.c); tiled and seq give bit-identical states, however a prefill is
 * split into calls; the SSD's bits depend on the split (its chunks start at each call's first token), so
 * a sequence prefilled in other pieces (solo vs in a batch) agrees to fp32 rounding, not bit for bit. The
 * recurrence:
 *   dt = clamp(softplus(dt_raw + dt_bias), dt_lo, dt_hi); dA = exp(dt * A)   (time_step_limit)
 *   state_h = dA * state_h + dt * x_h (outer) B_g;  y_h = state_h @ C_g + D_h * x_h,  g = h/(nh/G)
 * S <= 256. */
typedef struct {
    int64_t T, nh, hd, S, G;
    const float *x;  int64_t xs;        /* T rows (stride xs): nh*hd fp32 */
    const float *B, *C; int64_t bcs;    /* T rows (stride bcs): G*S fp32 each */
    const uint16_t *dt; int64_t dts;    /* T rows (stride dts): nh raw bf16 values */
    const float *dt_bias, *A, *D;       /* nh each; A = -exp(A_log) */
    float dt_lo, dt_hi;                 /* the config's time_step_limit */
    float *state;                       /* nh x hd x S fp32, updated */
    float *y;                           /* T x nh*hd fp32 */
    /* batched decode (optional): nb single-token sequences (T = 1), row z of x/B/C/dt/y with the
     * state at state + row_slot[z] * state_stride (row_slot: device memory; NULL: one sequence) */
    const int32_t *row_slot;
    int64_t state_stride, nb;
    /* the SSD's workspace (optional): C B^T of every 64-token chunk and group, cuda_ssm_ws_floats(T, G)
     * floats for a call of T tokens at once (fewer: the call in pieces of what fits, at least one chunk);
     * 16-byte aligned. NULL: the scan kernel computes them itself (the same values, slower). */
    float *ws;
    int64_t ws_floats;
} cuda_ssm_args;
/* Floats of the SSD workspace for T tokens and G groups (cuda_ssm_args.ws). */
int64_t cuda_ssm_ws_floats(int64_t T, int64_t G);
int cuda_ssm_scan(void *stream, const cuda_ssm_args *a);
/* The same with the kernel chosen (CUDA_SSM_AUTO: cuda_ssm_scan's choice; SEQ; TILED, which needs S
 * in {16, 32, 64, 128, 256} and a 16-byte aligned state, else SEQ runs; SSD, which needs S 64 or 128,
 * else TILED's rule applies): tests and measurements. */
enum { CUDA_SSM_AUTO = 0, CUDA_SSM_SEQ = 1, CUDA_SSM_TILED = 2, CUDA_SSM_SSD = 3 };
int cuda_ssm_scan_kernel(void *stream, const cuda_ssm_args *a, int kernel);

/* The conv1d + silu of cuda_conv1d_causal for R single-token sequences at once: row r (x: stride xs,
 * bf16) uses and updates the conv state at state + row_slot[r] * state_stride. y: R x C fp32. */
int cuda_conv1d_decode(void *stream, const uint16_t *x, int64_t xs, int64_t R, int64_t C,
                       const float *w, const float *b, int64_t Kc, const int32_t *row_slot,
                       int64_t state_stride, float *state, float *y);

/* ---- attention ------------------------------------------------------------------------------- */

/* The KV cache is paged (src/backend/backend.h): pages of 32 tokens; position p of slot s is row
 * pages[s * max_pages + p / 32] * 32 + p % 32 of the caches: rows of kvs elements, K in bf16, V in
 * fp16 (the type of the P V tensor-core product; bf16 values inside [2^-14, 65504] are exact in
 * it, larger ones saturate at +-65504, smaller ones round to fp16's subnormal steps of 2^-24). */

/* Row r of k and v (R rows of kvs bf16) to position row_pos[r] of slot row_slot[r] (device arrays);
 * v is stored converted to fp16 (round to nearest even, saturated). */
int cuda_kv_append(void *stream, const uint16_t *k, const uint16_t *v, int64_t R, int64_t kvs,
                   const int32_t *row_slot, const int32_t *row_pos, const int32_t *pages,
                   int64_t max_pages, uint16_t *k_cache, uint16_t *v_cache);

/* Causal GQA attention without positional encoding (op_attention_causal), fp32 scores, online
 * softmax (flash-attention style tiles of 32 or 64 keys = one or two pages):
 *   out[t][h] = bf16(softmax_{j <= P+t}(q[t][h] . k[j][h/(nq/nkv)] / sqrt(dh)) @ v)
 * prefill: T queries of ONE sequence after P cached positions, `pages` its page table row (device),
 * the caches already holding positions 0 .. P+T-1. decode: R single-token rows, row r of its own
 * sequence (slot row_slot[r], P = row_pos[r]). q, out: rows of nq*dh bf16. dh <= 256. Prefill
 * with dh 64 / 128 and q 16-byte aligned runs on tensor cores (Q copied in 16-byte pieces): dh 128
 * with an even nq / nkv on Hopper's wgmma (128-key steps; FP4MOE_CUDA_ATTENTION=mma: on mma.sync
 * like dh 64); other head sizes or an unaligned q take the CUDA-core kernel (same function, slower).
 * The kernels agree with the fp64 reference within the attention tolerance (tests/gpu/
 * test_attention_gpu.c: 1e-2 of a row's largest value; measured 3.8e-3), not bitwise with each other. */
int cuda_attention_prefill(void *stream, const uint16_t *q, const uint16_t *k_cache,
                           const uint16_t *v_cache, const int32_t *pages, int64_t P, int64_t T,
                           int64_t nq, int64_t nkv, int64_t dh, uint16_t *out);
int cuda_attention_decode(void *stream, const uint16_t *q, const uint16_t *k_cache,
                          const uint16_t *v_cache, const int32_t *row_slot, const int32_t *row_pos,
                          const int32_t *pages, int64_t max_pages, int64_t R, int64_t nq, int64_t nkv,
                          int64_t dh, uint16_t *out);

/* Decode as flash-decoding: each (kv head, row) is split into up to CUDA_ATT_SPLITS key ranges of
 * whole pages, at least 16 pages each (4 for rows of <= 1,024 tokens; by the row's length alone,
 * so a row gets the same numbers alone or in a batch; splits without a page exit at once), the
 * nq/nkv query heads of a kv head are the rows of tensor-core tiles over every K/V page (GQA
 * without repeating K/V; S in fp32, P V with P as two fp16 parts), fp32 online softmax, then one
 * combine. head_dim 64 or 128 with nq/nkv <= 16; other shapes run cuda_attention_decode.
 * scratch: cuda_attention_decode_scratch(R, nq, dh) bytes of device memory. */
#define CUDA_ATT_SPLITS 256
int cuda_attention_decode_split(void *stream, const uint16_t *q, const uint16_t *k_cache,
                                const uint16_t *v_cache, const int32_t *row_slot, const int32_t *row_pos,
                                const int32_t *pages, int64_t max_pages, int64_t R, int64_t nq, int64_t nkv,
                                int64_t dh, float *scratch, uint16_t *out);
size_t cuda_attention_decode_scratch(int64_t R, int64_t nq, int64_t dh);

/* ---- MoE routing ------------------------------------------------------------------------------ */

typedef struct {
    int64_t E, k, n_group, topk_group;
    int norm_topk_prob;
    float scaling;              /* routed_scaling_factor */
    const float *bias;          /* E (device): e_score_correction_bias, for choice only; or NULL */
} cuda_router_cfg;

/* op_router_topk on the device, one warp per token: s = sigmoid(logits); choice = s + bias;
 * n_group > 1: only the topk_group groups with the best sum-of-top-2 choice stay; top-k by choice
 * (ties: lower expert id); w = s[top] (/ (sum + 1e-20) when norm) * scaling. logits: T x E fp32;
 * ids, wts: T x k. E <= 4096, k <= E. */
int cuda_router_topk(void *stream, const cuda_router_cfg *r, const float *logits, int64_t T,
                     int32_t *ids, float *wts);

/* Stable counting sort of B rows by expert (op_sort_by_expert), one block, no host round trip:
 * sorted position p holds original row row_of[p] with expert idx[p] (non-decreasing);
 * pos_of[row] = p. ids in [0, E), E <= 6143, B < 2^31. */
int cuda_sort_by_expert(void *stream, const int32_t *ids, int64_t B, int64_t E, uint32_t *row_of,
                        uint32_t *idx, uint32_t *pos_of);

/* The whole routing of a MoE layer: logits (T x E, fp32) = x (T x H fp32) @ W^T (W: E x H fp32),
 * then cuda_router_topk, then cuda_sort_by_expert of the T * k rows (same results and errors as
 * those). T <= 16 (decode-sized steps): two launches (the logits in a fixed dot-product order of
 * its own, not cuBLAS's; then the top-k and sort in one block); larger T: cuBLAS + the two kernels,
 * the logits by cuda_matmul_bf16x3_planes where xb (x's values as bf16, T x H) and W3 (W's three bf16
 * planes, 3E x H) are given and o->split_ws holds a row of planes (in parts of cuda_bf16x3_rows rows; the
 * top-k kernel sums the planes and writes the logits), else by cuda_matmul_f32. */
/* runs (may be NULL; runs->buf NULL: none made): where the sort is a block sort (T * k > 32 rows) and
 * runs->cap_e >= E, it also writes the expert runs of idx for the row tile gather_qmm_cuda_row_tile(T * k, E)
 * and sets runs->idx / B / E / mt; otherwise runs->idx = NULL. */
int cuda_moe_route(const cuda_ops *o, const cuda_router_cfg *r, const float *x, const uint16_t *xb, int64_t T,
                   const float *W, const uint16_t *W3, int64_t H, float *logits, int32_t *ids, float *wts,
                   uint32_t *row_of, uint32_t *idx, uint32_t *pos_of, gq_runs *runs);

/* xs[p] = x[row_of[p] / k] for p < B: rows of H bf16 gathered into expert order. */
/* The stable sort by expert of B rows with global experts ids[b] in [lo, lo + E) (clamped into it):
 * row_of, idx (local ids), pos_of as cuda_sort_by_expert (expert parallelism: an owner's received
 * rows). Errors: as cuda_sort_by_expert, FP4MOE_EINVAL (E < 1 with rows). */
int cuda_sort_local(void *stream, const uint32_t *ids, int64_t B, int64_t lo, int64_t E, uint32_t *row_of,
                    uint32_t *idx, uint32_t *pos_of);
int cuda_gather_rows(void *stream, const uint16_t *x, int64_t H, const uint32_t *row_of, int64_t B,
                     int64_t k, uint16_t *xs);

/* out[t] = bf16(sum_{j<k} wts[t][j] * ys[pos_of[t*k+j]]) in fp32, slots in order j = 0..k-1
 * (op_moe_combine + op_round_act). ys: B x H bf16 in sorted order; out: T x H bf16. */
int cuda_moe_combine(void *stream, const uint16_t *ys, int64_t H, const uint32_t *pos_of,
                     const float *wts, int64_t T, int64_t k, uint16_t *out);

/* ---- synthetic weights (src/model/synthetic.h holds the per-element formulas) ------------------ */

/* n_blocks NVFP4 blocks of tensor `tensor_id` (block i = 16 consecutive weights of the flattened
 * tensor, rows of blocks_per_row = K/16 blocks): codes (8 bytes per block) and E4M3 scales (1 byte
 * per block), from the counter-based generator syn_nvfp4_block — the same bits as on the CPU. */
int cuda_synth_nvfp4(void *stream, uint64_t seed, uint64_t tensor_id, int64_t n_blocks,
                     int64_t blocks_per_row, float sigma, float enc, uint8_t *codes, uint8_t *scales);

/* n bf16 values sigma * N(0,1)-like of tensor `tensor_id` (syn_bf16). */
int cuda_synth_bf16(void *stream, uint64_t seed, uint64_t tensor_id, int64_t n, float sigma,
                    uint16_t *out);

#ifdef __cplusplus
}
#endif

/* ---- device-side helpers shared by the ops_*.cu files ---------------------------------------- */
#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/error.h"
#include "kernels/cuda/cuda_check.h"

/* After a launch: FP4MOE_ECUDA naming the op when the launch failed (kernels/cuda/cuda_check.h). */
#define OPS_LAUNCH_CHECK(what) FP4MOE_CUDA_LAUNCH("cuda op", what)

__device__ __forceinline__ float ops_bf16_to_f32(uint16_t b) {
    return __uint_as_float((uint32_t)b << 16);
}
/* Round to nearest even (NaN stays NaN), as fp4moe_f32_to_bf16. */
__device__ __forceinline__ uint16_t ops_f32_to_bf16(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}
/* The bf16 rounding of v, as fp32. */
__device__ __forceinline__ float ops_round_bf16(float v) {
    return ops_bf16_to_f32(ops_f32_to_bf16(v));
}

__device__ __forceinline__ float ops_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float ops_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ double ops_warp_sum_f64(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* silu(v) = v / (1 + exp(-v)), as the CPU's silu1 (no fused multiply-add). */
__device__ __forceinline__ float ops_silu(float v) {
    return __fdiv_rn(v, __fadd_rn(1.0f, expf(-v)));
}

static inline unsigned ops_blocks(int64_t n, int per) { return (unsigned)((n + per - 1) / per); }
#endif

#endif
