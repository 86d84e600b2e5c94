/* gpu_moe_decode: one decode token's routed experts of the Nemotron-3-Nano-30B-A3B MoE layer (6 rows, 6 distinct
 * experts, up 2,688 -> 1,856 with relu^2, down 1,856 -> 2,688, NVFP4 in the tiled layout, bf16 x) as the model's decode
 * step runs them: gather_qmm_cuda_x1 (every row reads the token's x row), then gather_qmm_cuda_ex on h - two
 * tensor-core qmv launches. Like the model, the sequence of calls is captured into a CUDA graph (programmatic
 * dependent launch between the kernels, as in a decode step) and replayed, and the calls rotate over L layers'
 * distinct weights (L x 8 experts x 2 projections, ~45 MB a layer: the weights are not in L2 from the previous call,
 * as in the model, where every layer has its own). Printed: us per up + down pair (graph replay of 96 pairs, median of
 * 9 replays, median of 3 rounds), the same with one layer's weights (L2-resident), the same calls without a graph
 * (gpu_bench's "back to back": no programmatic dependent launch), and the floor (the 6 experts' NVFP4 bytes at the
 * measured device copy rate). The issue-12 target "decode (6 rows) <= 14 us back to back" is the first row's number.
 * (Session 37 measured a one-launch form of the pair here - gq_qmv_moe_kernel, bench/patches/moe-x1-fused.diff -
 * and dropped it: 1.15-1.33x the two launches.)
 * Usage: gpu_moe_decode [L [ROWS [MODE]]] (L layers, default 8; ROWS experts of the token, default 6; MODE 0 the pair,
 * 1 the up projection only, 2 the down projection only: the time against the bytes says what a call costs besides
 * its bytes; 3 / 4 / 5 the shared expert's dense pair / up / down instead (E = 1, one row, 2,688 -> 3,712 with
 * relu^2, 3,712 -> 2,688: the dense decode linears' qmv, as the model's plain linears launch it); 6 the routed pair
 * of ROWS rows, then the shared expert's dense pair (a decode MoE layer's four projections as the model runs them);
 * 7 the routed pair of ROWS + 2 rows (the same bytes as 6: the shared expert as two more experts of the routed shape
 * - its up projection's 3,712 features as two experts of 1,856, its down projection's K = 3,712 as two experts of
 * K = 1,856 whose outputs the combine would add - two launches instead of four). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "gpu_testutil.h"
#include "testutil.h"
#include "kernels/cuda/ops_cuda.h"

#define H 2688
#define I 1856
#define IS 3712 /* the shared expert's intermediate size */
#define EL 8 /* experts a layer (6 of them routed): only the routed ones' bytes matter */
#define TOPK 6
#define MAXR (TOPK + 2) /* mode 7's rows */
#define PAIRS 96

static int g_rows = TOPK; /* rows of the token (experts), argv[2] */
static int g_mode = 0;    /* argv[3]: see the usage above */

static int cmpf(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static void make_proj(cudaStream_t st, int64_t E, int64_t N, int64_t K, tu_rng *r, int L, fp4moe_nvfp4_weights *out,
                      int up) {
    tu_weights tw;
    if (tu_weights_random(&tw, E, N, K, 1, r)) { fprintf(stderr, "tu_weights_random failed\n"); exit(1); }
    uint8_t *dc = gt_upload(tw.codes, (size_t)(E * N * K / 2)), *ds = gt_upload(tw.scales, (size_t)(E * N * K / 16));
    const size_t tb = (size_t)(E * cuda_nvfp4_tiled_expert_bytes(N, K));
    uint8_t *t0 = gt_upload(NULL, tb);
    if (cuda_nvfp4_relayout_tiled(st, dc, ds, E, N, K, t0)) { fprintf(stderr, "relayout: %s\n", fp4moe_last_error()); exit(1); }
    float *gs = gt_upload(tw.gs, (size_t)E * 4);
    GT_CHECK(cudaStreamSynchronize(st));
    for (int l = 0; l < L; l++) {
        fp4moe_nvfp4_weights w = tw.w;
        uint8_t *t = l == 0 ? t0 : gt_upload(NULL, tb);
        if (l) GT_CHECK(cudaMemcpy(t, t0, tb, cudaMemcpyDeviceToDevice));
        w.codes = t;
        w.scales = ds; /* unused with the tiled layout */
        w.global_scale = gs;
        if (up) out[2 * l] = w; else out[2 * l + 1] = w;
    }
    gt_free(dc);
    tu_weights_free(&tw);
}

/* 96 pairs (or mode 6's quadruples) over layers l % L: w the routed experts' up / down of each layer, ws the shared
 * expert's (E = 1; the dense calls read row 0 of expert 0: idx {0}, as a plain linear's one row) */
static int enqueue(cudaStream_t st, const fp4moe_nvfp4_weights *w, const fp4moe_nvfp4_weights *ws, int L,
                   const void *dx, const uint32_t *didx, const uint32_t *dzero, void *dh, void *dy, void *dhs,
                   gq_runs *runs) {
    const int rows = g_mode == 7 ? g_rows + 2 : g_rows, routed = g_mode <= 2 || g_mode >= 6,
              dense = g_mode >= 3 && g_mode <= 6, up = g_mode != 2 && g_mode != 5, down = g_mode != 1 && g_mode != 4;
    for (int i = 0; i < PAIRS; i++) {
        const int l = i % L;
        int f = 0, st_ = FP4MOE_OK;
        if (routed && up) st_ = gather_qmm_cuda_x1(&w[2 * l], 1, dx, didx, rows, FP4MOE_ROUTE_AUTO, 1, dh, st);
        if (!st_ && routed && down)
            st_ = gather_qmm_cuda_ex(&w[2 * l + 1], 1, dh, FP4MOE_BF16, didx, rows, 1, FP4MOE_ROUTE_AUTO, 0, dy, st, &f,
                                     runs);
        if (!st_ && dense && up)
            st_ = gather_qmm_cuda_ex(&ws[2 * l], 1, dx, FP4MOE_BF16, dzero, 1, 1, FP4MOE_ROUTE_AUTO, 1, dhs, st, &f,
                                     NULL);
        if (!st_ && dense && down)
            st_ = gather_qmm_cuda_ex(&ws[2 * l + 1], 1, dhs, FP4MOE_BF16, dzero, 1, 1, FP4MOE_ROUTE_AUTO, 0, dy, st, &f,
                                     NULL);
        if (st_) { fprintf(stderr, "gpu_moe_decode: %s\n", fp4moe_last_error()); return 1; }
    }
    return 0;
}

typedef struct {
    const fp4moe_nvfp4_weights *w, *ws;
    const void *dx;
    const uint32_t *didx, *dzero;
    void *dh, *dy, *dhs;
    gq_runs *runs;
} bufs;
#define ENQ(b, L) enqueue(st, (b)->w, (b)->ws, L, (b)->dx, (b)->didx, (b)->dzero, (b)->dh, (b)->dy, (b)->dhs, (b)->runs)

/* us a pair: graph (1) replays of the 96 pairs, or (0) the 96 pairs enqueued directly; median of 9 */
static float pair_us(cudaStream_t st, const bufs *bf, int L, int graph) {
    cudaGraph_t g = NULL;
    cudaGraphExec_t ge = NULL;
    if (graph) {
        GT_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        if (ENQ(bf, L)) exit(1);
        GT_CHECK(cudaStreamEndCapture(st, &g));
        GT_CHECK(cudaGraphInstantiate(&ge, g, 0));
        GT_CHECK(cudaGraphLaunch(ge, st));
    } else if (ENQ(bf, L)) {
        exit(1);
    }
    cudaEvent_t a, b;
    GT_CHECK(cudaEventCreate(&a));
    GT_CHECK(cudaEventCreate(&b));
    float t[9];
    for (int rep = 0; rep < 9; rep++) {
        GT_CHECK(cudaEventRecord(a, st));
        if (graph) GT_CHECK(cudaGraphLaunch(ge, st));
        else if (ENQ(bf, L)) exit(1);
        GT_CHECK(cudaEventRecord(b, st));
        GT_CHECK(cudaEventSynchronize(b));
        GT_CHECK(cudaEventElapsedTime(&t[rep], a, b));
    }
    qsort(t, 9, sizeof *t, cmpf);
    if (graph) {
        GT_CHECK(cudaGraphExecDestroy(ge));
        GT_CHECK(cudaGraphDestroy(g));
    }
    GT_CHECK(cudaEventDestroy(a));
    GT_CHECK(cudaEventDestroy(b));
    return t[4] * 1e3f / PAIRS;
}

int main(int argc, char **argv) {
    gt_require_gpu("gpu_moe_decode");
    const int L = argc > 1 ? atoi(argv[1]) : 8;
    g_rows = argc > 2 ? atoi(argv[2]) : TOPK;
    g_mode = argc > 3 ? atoi(argv[3]) : 0;
    if (L < 1 || L > 64 || g_rows < 1 || g_rows > TOPK || g_mode < 0 || g_mode > 7) {
        fprintf(stderr, "usage: gpu_moe_decode [L: 1..64 [ROWS: 1..6 [MODE: 0 up + down, 1 up, 2 down, 3-5 the same of "
                        "the dense shared expert, 6 the pair + the shared expert, 7 the pair with the shared expert as "
                        "two more rows]]]\n");
        return 2;
    }
    cudaStream_t st;
    GT_CHECK(cudaStreamCreate(&st));
    tu_rng r;
    tu_rng_seed(&r, 2026);
    fp4moe_nvfp4_weights *w = calloc((size_t)(2 * L), sizeof *w), *ws = calloc((size_t)(2 * L), sizeof *ws);
    if (g_mode <= 2 || g_mode >= 6) {
        make_proj(st, EL, I, H, &r, L, w, 1);
        make_proj(st, EL, H, I, &r, L, w, 0);
    }
    if (g_mode >= 3 && g_mode <= 6) {
        make_proj(st, 1, IS, H, &r, L, ws, 1);
        make_proj(st, 1, H, IS, &r, L, ws, 0);
    }
    /* sorted, as the router's sort gives them; mode 7: all 8 (6 routed + the shared expert's two halves) */
    const uint32_t idx[MAXR] = {0, 1, 3, 4, 6, 7, 2, 5}, idx7[MAXR] = {0, 1, 2, 3, 4, 5, 6, 7}, zero[1] = {0};
    uint32_t *didx = gt_upload(g_mode == 7 ? idx7 : idx, sizeof idx), *dzero = gt_upload(zero, sizeof zero);
    uint16_t *x = tu_random_x(FP4MOE_BF16, 1, H, &r);
    void *dx = gt_upload(x, H * 2);
    void *h = gt_upload(NULL, MAXR * I * 2), *y = gt_upload(NULL, MAXR * H * 2), *hs = gt_upload(NULL, IS * 2);
    gq_runs runs = {0};
    const bufs b = {w, ws, dx, didx, dzero, h, y, hs, &runs};
    const double bw = gt_copy_rate((size_t)512 << 20); /* for the floor */
    const int up = g_mode != 2 && g_mode != 5, down = g_mode != 1 && g_mode != 4;
    const double routed = g_mode <= 2 || g_mode >= 6 ? (g_mode == 7 ? g_rows + 2 : g_rows) : 0,
                 dense = g_mode >= 3 && g_mode <= 6 ? 1 : 0;
    const double bytes = routed * ((up ? cuda_nvfp4_tiled_expert_bytes(I, H) : 0) +
                                   (down ? cuda_nvfp4_tiled_expert_bytes(H, I) : 0)) +
                         dense * ((up ? cuda_nvfp4_tiled_expert_bytes(IS, H) : 0) +
                                  (down ? cuda_nvfp4_tiled_expert_bytes(H, IS) : 0));
    static const char *what[8] = {"the routed pair", "the routed up", "the routed down", "the shared expert's dense pair",
                                  "the shared up", "the shared down", "the routed pair, then the shared expert's pair",
                                  "the routed pair with the shared expert as two more rows"};
    printf("mode %d: %s; routed rows %.0f\n", g_mode, what[g_mode], routed);
    const double floor_us = bytes / bw * 1e6;
    printf("| weights | graph replay (as a decode step), us a pair | without a graph, us a pair | floor us (%.1f MB at "
           "%.2f TB/s) | graph: of floor |\n", bytes / 1e6, bw / 1e12);
    printf("|---|---:|---:|---:|---:|\n");
    for (int pass = 0; pass < 2; pass++) {
        const int LL = pass ? 1 : L;
        float tg[3], tp[3];
        for (int rd = 0; rd < 3; rd++) { /* alternated rounds */
            tg[rd] = pair_us(st, &b, LL, 1);
            tp[rd] = pair_us(st, &b, LL, 0);
        }
        qsort(tg, 3, sizeof(float), cmpf);
        qsort(tp, 3, sizeof(float), cmpf);
        printf("| %d layer%s (%s) | %.2f | %.2f | %.2f | %.0f%% |\n", LL, LL > 1 ? "s" : "",
               LL > 1 ? "not in L2, as in the model" : "L2-resident", tg[1], tp[1], floor_us, 100.0 * floor_us / tg[1]);
    }
    free(x); free(w); free(ws);
    gt_free(h); gt_free(y); gt_free(hs); gt_free(dx); gt_free(didx); gt_free(dzero);
    return 0;
}
