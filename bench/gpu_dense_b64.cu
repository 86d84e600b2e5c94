/* gpu_dense_b64: the plain linears (E = 1, NVFP4, tiled layout, bf16) of a decode-batch step of B rows
 * (default 64: the 64-sequence decode) on the 30B-A3B shapes, measured in one run: the 8-row and 64-row tiles of
 * gq_batched_kernel (the kernel alone, the runs found once before timing; before session 24 production ran these,
 * with the runs kernel in every call) and production as the model calls it (launch_tiled: gq_dense_kg_kernel,
 * K over 3 warp groups, where kg_fits; else the row tiles with their runs kernel). Written in session 23 as a
 * bench candidate (bench/gather_dense_kg.cuh, measured in session 24 and moved to gather_batched.cu).
 *
 * Checks first (outputs poisoned; gq_dense_kg_kernel sums K in another order, so: max |production - 8-row| /
 * max |8-row| <= 1e-2 is the pass line, and the bitwise-equal count is printed), on the shapes below and
 * awkward ones (N % 64 != 0, K % 128 = 64, B = 33 and 37, K of one step or half a step: groups without
 * steps). Then the timing table: median ms a call (CUDA events, 7 batches of 20 calls), and the step total
 * weighted by the calls a decode step makes of each shape
 * (23 Mamba layers: in_proj 10,304 x 2,688, out_proj 2,688 x 4,096; 23 shared experts: up 3,712 x 2,688, down
 * 2,688 x 3,712; 6 attention layers: q 4,096 x 2,688, k and v 256 x 2,688, o 2,688 x 4,096).
 * Usage: gpu_dense_b64 (DB_ROWS=B: rows, <= 64; DB_CHECKS=none: timings only). */
#include "kernels/cuda/gather_batched.cu"

extern "C" {
#include "gpu_testutil.h"
#include "testutil.h"
}

typedef struct {
    int N, K;
    uint8_t *tiled;
    float *gs;
} dw_t;

static void make_dense(dw_t *w, int N, int K, tu_rng *r) {
    w->N = N; w->K = K;
    const int64_t cb = (int64_t)N * (K / 2), sb = (int64_t)N * (K / 16);
    uint8_t *h = (uint8_t *)malloc((size_t)cb);
    for (int64_t i = 0; i < cb; i++) h[i] = (uint8_t)tu_rng_below(r, 256);
    uint8_t *codes = (uint8_t *)gt_upload(h, (size_t)cb);
    for (int64_t i = 0; i < sb; i++) h[i] = (uint8_t)(0x28 + tu_rng_below(r, 24));
    uint8_t *scales = (uint8_t *)gt_upload(h, (size_t)sb);
    GT_CHECK(cudaMalloc((void **)&w->tiled, (size_t)gq_tiled_expert_bytes(N, K)));
    if (gq_relayout_tiled(codes, scales, 1, N, K, w->tiled, 0)) { fprintf(stderr, "relayout: %s\n", fp4moe_last_error()); exit(1); }
    const float g = 0.75f;
    w->gs = (float *)gt_upload(&g, sizeof g);
    GT_CHECK(cudaDeviceSynchronize());
    gt_free(codes); gt_free(scales);
    free(h);
}

typedef struct {
    gq_args a;
    int which; /* 0 / 1: the 8- / 64-row tiles (kernel alone), 2: production as called (launch_tiled) */
    const int *runs8, *runs64; /* starts (E + 1) then tile_off (E + 2) of row tile 8 / 64, for 0 / 1 */
} dctx;

static int run_one(void *p) {
    const dctx *c = (const dctx *)p;
    if (c->which == 0) return launch_dtype<__nv_bfloat16, __nv_bfloat16, 4>(&c->a, 8, c->runs8, c->runs8 + 2, 0);
    if (c->which == 1) return launch_dtype<__nv_bfloat16, __nv_bfloat16, 4>(&c->a, 64, c->runs64, c->runs64 + 2, 0);
    return launch_tiled(&c->a, FP4MOE_BF16, 8, 0);
}

static gq_args dense_args(const dw_t *w, const void *x, void *y, const uint32_t *idx, int B, int relu2) {
    gq_args a = {};
    a.codes = w->tiled; a.scales = w->tiled; a.gs = w->gs;
    a.E = 1; a.N = w->N; a.K = w->K;
    a.x = x; a.y = y; a.idx = idx; a.B = B; a.relu2 = relu2; a.tiled = 1;
    return a;
}

static float bf(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }

/* candidate vs production (8-row tiles) on one shape; 1: pass */
static int check(int N, int K, int B, int relu2, tu_rng *r) {
    dw_t w;
    make_dense(&w, N, K, r);
    void *x = gt_rand_dev((int64_t)B * K, 1.0f, r, 0);
    uint32_t *idx = (uint32_t *)gt_upload(NULL, sizeof(uint32_t) * (size_t)B);
    GT_CHECK(cudaMemset(idx, 0, sizeof(uint32_t) * (size_t)B));
    const size_t yb = (size_t)B * N * 2;
    void *y0 = gt_upload(NULL, yb), *y1 = gt_upload(NULL, yb);
    gt_poison(y0, yb);
    gt_poison(y1, yb);
    int *runs = (int *)gt_upload(NULL, 5 * sizeof(int));
    const gq_args a0 = dense_args(&w, x, y0, idx, B, relu2);
    if (gq_launch_runs(&a0, 8, runs, runs + 2, 0)) { fprintf(stderr, "runs: %s\n", fp4moe_last_error()); exit(1); }
    dctx c0 = {a0, 0, runs, nullptr}, c1 = {dense_args(&w, x, y1, idx, B, relu2), 2, nullptr, nullptr};
    const int e0 = run_one(&c0), e1 = run_one(&c1);
    const cudaError_t ce = cudaDeviceSynchronize();
    if (e0 || e1 || ce != cudaSuccess) {
        printf("check N=%d K=%d B=%d: launch failed (%s / %s)\n", N, K, B, fp4moe_last_error(), cudaGetErrorString(ce));
        exit(2);
    }
    uint16_t *h0 = (uint16_t *)malloc(yb), *h1 = (uint16_t *)malloc(yb);
    gt_download(h0, y0, yb);
    gt_download(h1, y1, yb);
    double mx = 0, err = 0;
    int64_t same = 0, n = (int64_t)B * N;
    for (int64_t i = 0; i < n; i++) {
        const double p = bf(h0[i]), c = bf(h1[i]);
        mx = fmax(mx, fabs(p));
        err = c == c && p == p ? fmax(err, fabs(p - c)) : 1e30;
        same += h0[i] == h1[i];
    }
    const double rel = mx > 0 ? err / mx : err;
    const int ok = rel <= 1e-2;
    printf("check N=%-5d K=%-4d B=%-2d relu2=%d (%s): rel %.2e, bitwise %lld/%lld %s\n", N, K, B, relu2,
           kg_fits(&c1.a, FP4MOE_BF16, false) ? "kg" : "row tiles", rel, (long long)same, (long long)n, ok ? "PASS" : "FAIL");
    free(h0); free(h1); gt_free(runs);
    gt_free(x); gt_free(idx); gt_free(y0); gt_free(y1); gt_free(w.tiled); gt_free(w.gs);
    return ok;
}

int main(void) {
    gt_require_gpu("gpu_dense_b64");
    tu_rng r;
    tu_rng_seed(&r, 23);
    const char *rs = getenv("DB_ROWS"), *ck = getenv("DB_CHECKS");
    const int B = rs ? atoi(rs) : 64;
    if (B < 1 || B > 64) { fprintf(stderr, "DB_ROWS: 1..64\n"); return 2; }
    struct { int N, K, calls; const char *what; } sh[] = {
        {10304, 2688, 23, "Mamba in_proj"}, {2688, 4096, 23, "Mamba out_proj"}, {3712, 2688, 23, "shared up"},
        {2688, 3712, 23, "shared down"},    {4096, 2688, 6, "attention q"},     {256, 2688, 12, "attention k, v"},
        {2688, 4096, 6, "attention o"}};
    const int nsh = (int)(sizeof sh / sizeof sh[0]);
    int ok = 1;
    if (!ck || strcmp(ck, "none")) {
        ok &= check(2104, 320, 37, 1, &r); /* N % 64 = 56, K % 128 = 64, a part n8 tile, relu^2 */
        ok &= check(2048, 2112, 33, 0, &r);
        ok &= check(2064, 128, 40, 0, &r); /* one K step: groups 1.. have none */
        ok &= check(2048, 64, 64, 1, &r);  /* half a step */
        ok &= check(200, 320, 37, 1, &r);  /* N < KG_MIN_N: the row tiles (bitwise equal) */
        for (int i = 0; i < nsh; i++) ok &= check(sh[i].N, sh[i].K, B, 0, &r);
    }
    printf("| shape (N x K), B = %d | calls a step | 8-row tiles ms | 64-row tiles ms | production ms | production / best "
           "tiles |\n|---|---:|---:|---:|---:|---:|\n", B);
    double tot[3] = {0, 0, 0}, best = 0;
    /* the runs of an all-zero idx (starts (E + 1 = 2) then tile_off (E + 2 = 3)) for row tiles 8 and 64 */
    int *runs = (int *)gt_upload(NULL, 2 * 5 * sizeof(int));
    for (int i = 0; i < nsh; i++) {
        dw_t w;
        make_dense(&w, sh[i].N, sh[i].K, &r);
        void *x = gt_rand_dev((int64_t)B * sh[i].K, 1.0f, &r, 0);
        uint32_t *idx = (uint32_t *)gt_upload(NULL, sizeof(uint32_t) * (size_t)B);
        GT_CHECK(cudaMemset(idx, 0, sizeof(uint32_t) * (size_t)B));
        void *y = gt_upload(NULL, (size_t)B * sh[i].N * 2);
        const gq_args a = dense_args(&w, x, y, idx, B, 0);
        if (gq_launch_runs(&a, 8, runs, runs + 2, 0) || gq_launch_runs(&a, 64, runs + 5, runs + 7, 0)) {
            fprintf(stderr, "runs: %s\n", fp4moe_last_error());
            return 1;
        }
        float ms[3];
        for (int m = 0; m < 3; m++) {
            dctx c = {a, m, runs, runs + 5};
            ms[m] = gt_time_ms(run_one, &c, 7, 20);
            tot[m] += ms[m] * sh[i].calls;
        }
        const float bp = ms[0] < ms[1] ? ms[0] : ms[1];
        best += bp * sh[i].calls;
        printf("| %s %d x %d | %d | %.4f | %.4f | %.4f | %.2f |\n", sh[i].what, sh[i].N, sh[i].K, sh[i].calls, ms[0], ms[1],
               ms[2], ms[2] / bp);
        gt_free(x); gt_free(idx); gt_free(y); gt_free(w.tiled); gt_free(w.gs);
    }
    printf("| a decode step's plain linears | | %.3f | %.3f | %.3f | %.2f (best tiles %.3f) |\n", tot[0], tot[1], tot[2],
           tot[2] / best, best);
    gt_free(runs);
    return ok ? 0 : 1;
}
