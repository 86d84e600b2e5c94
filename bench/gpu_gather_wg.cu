/* gpu_gather_wg: variants of the expert-batched gather_qmm kernel on Hopper's warpgroup matrix
 * instruction (issue 12), measured against the production kernels on the same inputs in one run.
 *
 * History: written 2026-12-03 as the candidate of the wgmma kernel; on the H200 the same day it was
 * bitwise equal to the mma.sync kernel at 8-, 32- and 64-row tiles (both layouts), 0.75-0.78x its
 * time at 2,048 and 8,192 tokens (64-row tiles), 1.02x at 512 and 1.12-1.32x at 128 tokens; the
 * descriptor reading "leading byte offset = the K-direction stride" passed, the other failed. The
 * 64-row tiles of bf16 calls now run it in production (gq_batched_wg_kernel in gather_batched.cu).
 *
 * What this program measures now: that kernel with WK_MT-row tiles (default 64, production's own with its 4
 * warpgroups a block since session 39; 128 with -DGW_WGS=2: runs of 2,048+ tokens are 96+ rows an expert, so 64-row
 * tiles decode each weight tile 2+ times), checked
 * against production (outputs poisoned first; bitwise equality is expected, 1e-2 of max|y| is the
 * pass line) on awkward shapes, then timed next to production's batched route and dequant_gemm on
 * the 30B-A3B MoE shapes (up 2688 -> 1856 with relu^2, down 1856 -> 2688, E = 128, top-6) at 128 ..
 * 8,192 tokens. Variants by macro: WK_MT (64 or 128), WK_MINB (blocks an SM in the launch bounds);
 * WK_WS=1: the candidate is the warp-specialised kernel of bench/gather_ws.cuh instead (tiled layout
 * only: the checks and timings of the checkpoint layout are left out; its macros WS_NC, WS_STAGES,
 * WS_MINB). WK_SS=1: the candidate is bench/gather_ss.cuh's kernel (decoded weights in shared memory,
 * wgmma SS form, 128-row items; tiled layout only; session 21; measured in session 22: not faster).
 * (WK_BULK=1, session 22's cp.async.bulk form of the w32 kernel, measured and dropped: bench/patches/w32bulk.diff
 * puts it back.) WK_MMA32=1: the candidate is gq_batched_kernel with 32-row tiles (16 features a warp), the
 * kernel that production's gq_batched_w32_kernel (32 features a warp, written as bench/gather_f32w.cuh
 * in session 17, measured 0.88x at 512 tokens and moved to production in session 18) replaced;
 * tiled layout only. The timing table has uniform and skewed routing (Zipf exponent 0.5) at each size
 * (session 19); WK_ROUTE_FILE=bench/moe_route_synth30b_2048.txt puts the synthetic model's own counts (one layer,
 * scaled to the size) in place of the Zipf row (session 46: the model is far more skewed; route_lens). WK_XPERM=1: the candidate is bench/gather_xperm.cuh's w32 kernel staging x by cp.async from an
 * x its producer wrote permuted (session 28; tiled layout only; XP_XBUF=2 XP_MINB=4 for 4 blocks an SM, XP_MT=40
 * for 40-row items). Usage: gpu_gather_wg (WK_CHECKS=small: only the small checks, for compute-sanitizer;
 * WK_CHECKS=none: no checks, WK_TOKENS=T[,T...]: only the timings of those sizes, e.g. for Nsight Compute; 16384
 * and 32768 (and 4096) are timed only when listed: where dequant_gemm overtakes the batched route; WK_TILED_ONLY=1: the
 * tiled layout only, production's).
 * WK_BIG=1 (session 40): the candidate is bench/gather_big.cuh's warp-specialised big-tile kernel (items of 128 rows x
 * BG_NF features, a producer warpgroup decoding the weights into shared memory, two consumer warpgroups on wgmma SS;
 * tiled layout only).
 * The production column (tiled layout): the model's MoE step, gather_qmm_cuda_moe_rows (x of B / 6 token rows
 * through a random row map), where it takes the big tiles (from 192 rows an expert: 4,096+ tokens; session 47);
 * below that production's two calls as before (the model runs the fused 32-row pair up to 1,024 tokens).
 * WK_FUSED=1 (session 36): the candidate is production's fused MoE kernel (gq_launch_moe_pair: the up and down
 * projections in one launch), checked as a pair (h and y bitwise) and timed against production's two calls, both
 * with the runs made per call (the production column) and made once (the last columns: as the router's sort makes
 * them). */
#include <errno.h>

#include "kernels/cuda/gather_batched.cu"
#include "kernels/cuda/ops_cuda.h"

extern "C" {
#include "gpu_testutil.h"
#include "testutil.h"
}

#ifndef WK_MT
#define WK_MT 64 /* 128: 1 block of 2 warpgroups an SM (-DGW_WGS=2), 230-246 registers */
#endif
#ifndef WK_MINB
#define WK_MINB (WK_MT > 64 || GW_WGS > 2 ? 1 : 2)
#endif

#ifndef WK_WS
#define WK_WS 0
#endif
#ifndef WK_MMA32
#define WK_MMA32 0
#endif
#ifndef WK_SS
#define WK_SS 0
#endif
#ifndef WK_BIG
#define WK_BIG 0
#endif
#ifndef WK_XPERM
#define WK_XPERM 0
#endif
#ifndef WK_FUSED
#define WK_FUSED 0
#endif
#if WK_FUSED
#undef WK_MT
#define WK_MT 32
/* the single-call checks and columns: production's 32-row tiles (the fused MoE kernel, gq_launch_moe_pair, is checked
 * and timed as a pair: check_pair, run_pair) */
static int wk_launch(const gq_args *a, cudaStream_t st) { return launch_tiled(a, FP4MOE_BF16, 32, st); }
static int *fx_done; /* the fused kernel's per-tile counters (kept zero by it) */
#define FX_DONE_INTS 4096
/* up then down in one launch: the runs of idx (row tile 32) made once, then the fused kernel */
static int fx_pair(const gq_args *u0, const gq_args *d0, cudaStream_t st) {
    if (!fx_done) {
        GT_CHECK(cudaMalloc((void **)&fx_done, FX_DONE_INTS * sizeof(int)));
        GT_CHECK(cudaMemset(fx_done, 0, FX_DONE_INTS * sizeof(int)));
    }
    int *buf = NULL;
    if (gq_scratch_alloc((void **)&buf, (2 * (size_t)u0->E + 3) * sizeof(int), st)) return 1;
    gq_args u = *u0, d = *d0;
    const int mt = gq_batched_row_tile(&u, FP4MOE_BF16);
    u.runs = d.runs = buf;
    u.runs_mt = d.runs_mt = mt;
    int rc = gq_launch_runs(&u, mt, buf, buf + u.E + 1, st);
    if (!rc) rc = gq_launch_moe_pair(&u, &d, fx_done, FX_DONE_INTS, st);
    gq_scratch_free(buf, st);
    return rc;
}
#define WK_TL0 1 /* tiled layout only */
#elif WK_MMA32
#undef WK_MT
#define WK_MT 32
/* the candidate: gq_batched_kernel's 32-row tiles (16 features a warp), which the 32-features-a-warp
 * kernel replaced for bf16 on tiled weights in session 18 (production at 512 tokens) */
static int wk_launch(const gq_args *a, cudaStream_t st) {
    int *buf = NULL;
    if (gq_scratch_alloc((void **)&buf, (2 * (size_t)a->E + 3) * sizeof(int), st)) return 1;
    int *starts = buf, *tile_off = buf + a->E + 1;
    int rc = gq_launch_runs(a, 32, starts, tile_off, st);
    if (!rc) rc = a->tiled ? launch<__nv_bfloat16, __nv_bfloat16, 32, true, 4, true>(a, starts, tile_off, st)
                           : launch<__nv_bfloat16, __nv_bfloat16, 32, true, 4>(a, starts, tile_off, st);
    gq_scratch_free(buf, st);
    return rc;
}
#define WK_TL0 1 /* tiled layout only */
#elif WK_XPERM
#include "gather_xperm.cuh"
#undef WK_MT
#define WK_MT XP_MT
/* the checks' form of the candidate: x (natural) permuted into a scratch copy first; with wk_check_yperm the
 * output goes permuted into a scratch and is permuted back into a->y (so both forms are compared with
 * production bit for bit). The timings call xp_launch directly on an x permuted once (run_pair). */
static int wk_check_yperm;
static int wk_launch(const gq_args *a, cudaStream_t st) {
    gq_args c = *a;
    void *xp = NULL, *yp = NULL;
    int rc = gq_scratch_alloc(&xp, (size_t)a->B * a->K * 2, st);
    if (!rc && wk_check_yperm) rc = gq_scratch_alloc(&yp, (size_t)a->B * a->N * 2, st);
    if (!rc) {
        xp_permute(a->x, xp, a->B, a->K, 0, st);
        c.x = xp;
        if (yp) c.y = yp;
        rc = xp_launch(&c, wk_check_yperm, st);
        if (!rc && yp) xp_permute(yp, a->y, a->B, a->N, 1, st);
    }
    if (yp) gq_scratch_free(yp, st);
    if (xp) gq_scratch_free(xp, st);
    return rc;
}
#define WK_TL0 1 /* tiled layout only */
#elif WK_BIG
#include "gather_big.cuh"
#undef WK_MT
#define WK_MT 128 /* (the big-tile candidate's row tile) */
static int wk_launch(const gq_args *a, cudaStream_t st) { return bg_launch(a, st); }
#define WK_TL0 1 /* tiled layout only */
#elif WK_SS
#include "gather_ss.cuh"
#undef WK_MT
#define WK_MT 128 /* (the shared-memory candidate's row tile) */
static int wk_launch(const gq_args *a, cudaStream_t st) { return ss_launch(a, st); }
#define WK_TL0 1 /* tiled layout only */
#elif WK_WS
#include "gather_ws.cuh"
#undef WK_MT
#define WK_MT 64 /* (the warp-specialised kernel's row tile) */
static int wk_launch(const gq_args *a, cudaStream_t st) { return ws_launch(a, st); }
#define WK_TL0 1 /* tiled layout only */
#else
#define WK_TL0 0
/* the candidate: production's wgmma kernel (gather_batched.cu) with WK_MT-row tiles */
static int wk_launch(const gq_args *a, cudaStream_t st) {
    int *buf = NULL;
    if (gq_scratch_alloc((void **)&buf, (2 * (size_t)a->E + 3) * sizeof(int), st)) return 1;
    int *starts = buf, *tile_off = buf + a->E + 1;
    int rc = gq_launch_runs(a, WK_MT, starts, tile_off, st);
    if (!rc) rc = a->tiled ? launch_wg<WK_MT, true, WK_MINB>(a, starts, tile_off, st)
                           : launch_wg<WK_MT, false, WK_MINB>(a, starts, tile_off, st);
    gq_scratch_free(buf, st);
    return rc;
}
#endif

/* production, with the row tile forced when mt > 0 */
static int prod_launch(const gq_args *a, int mt, cudaStream_t st) { /* now the wgmma kernel at mt = 64 */
    if (mt <= 0) return gq_launch_batched(a, FP4MOE_BF16, st);
    return launch_tiled(a, FP4MOE_BF16, mt, st);
}

/* production's up then down with the runs of idx made once (as the model's router sort makes them: gq_runs) */
static int prod_pair_runs(gq_args u, gq_args d, cudaStream_t st) {
    int *buf = NULL;
    if (gq_scratch_alloc((void **)&buf, (2 * (size_t)u.E + 3) * sizeof(int), st)) return 1;
    const int mt = gq_batched_row_tile(&u, FP4MOE_BF16);
    int rc = gq_launch_runs(&u, mt, buf, buf + u.E + 1, st);
    u.runs = d.runs = buf;
    u.runs_mt = d.runs_mt = mt;
    if (!rc) rc = gq_launch_batched(&u, FP4MOE_BF16, st);
    if (!rc) rc = gq_launch_batched(&d, FP4MOE_BF16, st);
    gq_scratch_free(buf, st);
    return rc;
}

/* ---- host side ---------------------------------------------------------------------------------- */

/* WK_ROUTE_FILE (e.g. bench/moe_route_synth30b_2048.txt: one line of 128 expert row counts a MoE layer of a 2,048-token
 * prefill, '#' lines skipped): layer WK_ROUTE_LAYER's counts scaled to T tokens (6 T rows; the remainder of the
 * rounding to the largest experts), so that the timing table's second row of each size has the model's skew
 * (session 46: the synthetic model leaves 42-68 experts under 64 rows at 2,048 tokens; the Zipf 0.5 row none) */
#ifndef WK_ROUTE_LAYER
#define WK_ROUTE_LAYER 11
#endif
static int route_lens(const char *path, int T, int lens[128]) {
    FILE *f = fopen(path, "r");
    if (!f) { fprintf(stderr, "WK_ROUTE_FILE %s: %s\n", path, strerror(errno)); return 1; }
    char line[4096];
    int layer = 0, got = 0;
    while (!got && fgets(line, sizeof line, f)) {
        if (line[0] == '#' || line[0] == '\n') continue;
        if (layer++ != WK_ROUTE_LAYER) continue;
        char *p = line;
        long tot = 0;
        for (int e = 0; e < 128; e++) {
            char *end;
            const long v = strtol(p, &end, 10);
            if (end == p || v < 0) { fprintf(stderr, "WK_ROUTE_FILE %s: layer %d: count %d missing or bad\n", path, WK_ROUTE_LAYER, e); fclose(f); return 1; }
            lens[e] = (int)v;
            tot += v;
            p = end;
        }
        if (tot <= 0) { fprintf(stderr, "WK_ROUTE_FILE %s: layer %d: no rows\n", path, WK_ROUTE_LAYER); fclose(f); return 1; }
        long sum = 0;
        int big = 0;
        for (int e = 0; e < 128; e++) {
            lens[e] = (int)((double)lens[e] * 6.0 * T / (double)tot);
            sum += lens[e];
            if (lens[e] > lens[big]) big = e;
        }
        lens[big] += (int)(6L * T - sum);
        got = 1;
    }
    fclose(f);
    if (!got) { fprintf(stderr, "WK_ROUTE_FILE %s: no layer %d\n", path, WK_ROUTE_LAYER); return 1; }
    return 0;
}


typedef struct {
    int E, N, K;
    uint8_t *codes, *scales, *tiled;
    float *gs;
} wts_t;

static void make_wts(wts_t *w, int E, int N, int K, tu_rng *r) {
    w->E = E; w->N = N; w->K = K;
    const int64_t cb = (int64_t)E * N * (K / 2), sb = (int64_t)E * N * (K / 16), tb = (int64_t)E * gq_tiled_expert_bytes(N, K);
    uint8_t *h = (uint8_t *)malloc((size_t)cb);
    uint64_t z = (uint64_t)tu_rng_below(r, 0xffffffffu) << 32 | tu_rng_below(r, 0xffffffffu) | 1u;
    for (int64_t i = 0; i < cb; i += 8) {
        z ^= z << 13; z ^= z >> 7; z ^= z << 17;
        memcpy(h + i, &z, (size_t)(cb - i < 8 ? cb - i : 8));
    }
    w->codes = (uint8_t *)gt_upload(h, (size_t)cb);
    for (int64_t i = 0; i < sb; i++) h[i] = (uint8_t)(0x28 + tu_rng_below(r, 24));
    w->scales = (uint8_t *)gt_upload(h, (size_t)sb);
    GT_CHECK(cudaMalloc((void **)&w->tiled, (size_t)tb));
    if (gq_relayout_tiled(w->codes, w->scales, E, N, K, w->tiled, 0)) { fprintf(stderr, "relayout: %s\n", fp4moe_last_error()); exit(1); }
    float *g = (float *)malloc(sizeof(float) * (size_t)E);
    for (int e = 0; e < E; e++) g[e] = (float)(0.5 + tu_rng_uniform(r));
    w->gs = (float *)gt_upload(g, sizeof(float) * (size_t)E);
    free(g); free(h);
    GT_CHECK(cudaDeviceSynchronize());
}
static void free_wts(wts_t *w) { gt_free(w->codes); gt_free(w->scales); gt_free(w->tiled); gt_free(w->gs); }

static gq_args args_of(const wts_t *w, bool tiled, const void *x, void *y, const uint32_t *idx, int B, int relu2) {
    gq_args a = {};
    a.codes = tiled ? w->tiled : w->codes;
    a.scales = w->scales;
    a.gs = w->gs;
    a.E = w->E; a.N = w->N; a.K = w->K;
    a.x = x; a.y = y; a.idx = idx; a.B = B; a.relu2 = relu2; a.tiled = tiled;
    return a;
}

static float bf(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }

/* sorted idx of B rows: lens[e] rows of expert e (e < E), then `tail` rows with idx >= E */
static uint32_t *make_idx(int E, const int *lens, int tail, int *B) {
    int n = tail;
    for (int e = 0; e < E; e++) n += lens[e];
    uint32_t *idx = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)(n > 0 ? n : 1));
    int k = 0;
    for (int e = 0; e < E; e++) for (int i = 0; i < lens[e]; i++) idx[k++] = (uint32_t)e;
    for (int i = 0; i < tail; i++) idx[k++] = (uint32_t)(E + i % 3);
    *B = n;
    return idx;
}

static int check(const char *what, const wts_t *w, const int *lens, int tail, bool tiled, int relu2, tu_rng *r) {
    int B;
    uint32_t *hidx = make_idx(w->E, lens, tail, &B);
    void *x = gt_rand_dev((int64_t)B * w->K, 2.0f, r, 0);
    uint32_t *didx = (uint32_t *)gt_upload(hidx, sizeof(uint32_t) * (size_t)B);
    const size_t yb = (size_t)B * w->N * 2;
    void *y0 = gt_upload(NULL, yb), *y1 = gt_upload(NULL, yb);
    gt_poison(y0, yb);
    gt_poison(y1, yb);
    gq_args a0 = args_of(w, tiled, x, y0, didx, B, relu2), a1 = args_of(w, tiled, x, y1, didx, B, relu2);
    /* the reference: production's 64-row tiles (with WK_MMA32: its 32-row tiles, gq_batched_w32_kernel) */
    if (prod_launch(&a0, WK_MMA32 || WK_XPERM ? 32 : 64, 0)) { fprintf(stderr, "%s: production: %s\n", what, fp4moe_last_error()); exit(1); }
    const int bad = wk_launch(&a1, 0);
    const cudaError_t ce = cudaDeviceSynchronize();
    if (ce != cudaSuccess) { fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(ce)); exit(2); }
    uint16_t *h0 = (uint16_t *)malloc(yb), *h1 = (uint16_t *)malloc(yb);
    gt_download(h0, y0, yb);
    gt_download(h1, y1, yb);
    double mx = 0, err = 0;
    int64_t same = 0, n = (int64_t)B * w->N;
    for (int64_t i = 0; i < n; i++) {
        const double p = bf(h0[i]), c = bf(h1[i]);
        mx = fmax(mx, fabs(p));
        err = c == c ? fmax(err, fabs(p - c)) : 1e30;
        same += h0[i] == h1[i];
    }
    const double rel = mx > 0 ? err / mx : err;
#if WK_BIG && BG_XP
    const int ok = !bad && same == n; /* production's products: bit for bit */
#else
    const int ok = !bad && rel <= 1e-2;
#endif
    printf("check mt=%d %-44s %-6s B=%-5d rel %.2e, bitwise %lld/%lld %s\n", WK_MT, what, tiled ? "tiled" : "rows", B,
           rel, (long long)same, (long long)n, ok ? "PASS" : "FAIL");
    free(h0); free(h1); free(hidx);
    gt_free(x); gt_free(didx); gt_free(y0); gt_free(y1);
    return ok;
}

#if WK_FUSED
/* the fused candidate against production's two calls: h and y bitwise (outputs poisoned first) */
static int check_pair(const char *what, const wts_t *up, const wts_t *dn, const int *lens, int tail, tu_rng *r) {
    int B;
    uint32_t *hidx = make_idx(up->E, lens, tail, &B);
    void *x = gt_rand_dev((int64_t)B * up->K, 2.0f, r, 0);
    uint32_t *didx = (uint32_t *)gt_upload(hidx, sizeof(uint32_t) * (size_t)B);
    const size_t hb = (size_t)B * up->N * 2, yb = (size_t)B * dn->N * 2;
    void *h0 = gt_upload(NULL, hb), *h1 = gt_upload(NULL, hb), *y0 = gt_upload(NULL, yb), *y1 = gt_upload(NULL, yb);
    int ok = 1;
    for (int rep = 0; rep < 3; rep++) { /* three calls: the counters must reset themselves */
        gt_poison(h0, hb); gt_poison(h1, hb); gt_poison(y0, yb); gt_poison(y1, yb);
        gq_args u0 = args_of(up, true, x, h0, didx, B, 1), d0 = args_of(dn, true, h0, y0, didx, B, 0);
        gq_args u1 = args_of(up, true, x, h1, didx, B, 1), d1 = args_of(dn, true, h1, y1, didx, B, 0);
        if (prod_launch(&u0, 0, 0) || prod_launch(&d0, 0, 0)) { /* production's own row tile */ fprintf(stderr, "%s: production: %s\n", what, fp4moe_last_error()); exit(1); }
        const int bad = fx_pair(&u1, &d1, 0);
        if (bad) printf("check fused %s: %s\n", what, fp4moe_last_error());
        const cudaError_t ce = cudaDeviceSynchronize();
        if (ce != cudaSuccess) { fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(ce)); exit(2); }
        int64_t diff[2] = {0, 0};
        for (int k = 0; k < 2; k++) {
            const size_t nb = k ? yb : hb;
            uint16_t *a = (uint16_t *)malloc(nb), *b = (uint16_t *)malloc(nb);
            gt_download(a, k ? y0 : h0, nb);
            gt_download(b, k ? y1 : h1, nb);
            for (size_t i = 0; i < nb / 2; i++) diff[k] += a[i] != b[i];
            free(a); free(b);
        }
        const int pass = !bad && !diff[0] && !diff[1];
        printf("check fused %-44s B=%-5d call %d: h %lld, y %lld elements differ %s\n", what, B, rep,
               (long long)diff[0], (long long)diff[1], pass ? "PASS" : "FAIL");
        ok &= pass;
    }
    free(hidx);
    gt_free(x); gt_free(didx); gt_free(h0); gt_free(h1); gt_free(y0); gt_free(y1);
    return ok;
}
#endif

/* small: only the small shapes (for compute-sanitizer) */
static int run_checks(tu_rng *r, int small) {
    int ok = 1;
    wts_t w;
#if WK_FUSED
    {
        wts_t u2, d2;
        make_wts(&u2, 6, 320, 448, r); /* up N % 128 = 64; down N % 128 = 72 */
        make_wts(&d2, 6, 200, 320, r);
        /* (mean runs of 25-48 rows: production's 32-row tiles, which the fused kernel takes) */
        const int l1[6] = {1, 0, 137, 9, 40, 64}, l2[6] = {8, 7, 16, 0, 3, 129};
        ok &= check_pair("E=6 up 448->320, down 320->200, runs 1..137, tail 5", &u2, &d2, l1, 5, r);
        ok &= check_pair("E=6 short runs", &u2, &d2, l2, 0, r);
        /* (bench/patches/moe-wg-fused.diff, the 64-row form: l3 = {200, 0, 300, 90, 1, 129}, tail 3, "E=6 long runs") */
        free_wts(&u2); free_wts(&d2);
        if (!small) {
            make_wts(&u2, 128, 1856, 2688, r);
            make_wts(&d2, 128, 2688, 1856, r);
            int lens[128];
            for (int e = 0; e < 128; e++) lens[e] = (int)tu_rng_below(r, 40);
            ok &= check_pair("30B up + down, E=128, runs 0..39", &u2, &d2, lens, 2, r);
            free_wts(&u2); free_wts(&d2);
        }
        return ok;
    }
#endif
    make_wts(&w, 6, 200, 320, r); /* N % 128 = 72, K % 128 = 64 */
    const int lens1[6] = {1, 0, 137, 9, 300, 64};
    const int lens2[6] = {8, 7, 16, 0, 3, 129};
    for (int tl = WK_TL0 || getenv("WK_TILED_ONLY"); tl < 2; tl++) {
        ok &= check("E=6 N=200 K=320, runs 1..300, tail 5", &w, lens1, 5, tl, 0, r);
        ok &= check("E=6 N=200 K=320, short runs, relu2", &w, lens2, 0, tl, 1, r);
    }
#if WK_XPERM
    wk_check_yperm = 1; /* the same with the output permuted (and permuted back for the comparison) */
    ok &= check("E=6 N=200 K=320, runs 1..300, tail 5, y permuted", &w, lens1, 5, 1, 0, r);
    ok &= check("E=6 N=200 K=320, short runs, relu2, y permuted", &w, lens2, 0, 1, 1, r);
    wk_check_yperm = 0;
#endif
#if WK_BIG && BG_XP
    bg_check_yperm = 1; /* the same with the output permuted (and permuted back for the comparison) */
    ok &= check("E=6 N=200 K=320, runs 1..300, tail 5, y permuted", &w, lens1, 5, 1, 0, r);
    ok &= check("E=6 N=200 K=320, short runs, relu2, y permuted", &w, lens2, 0, 1, 1, r);
    bg_check_yperm = 0;
#endif
    free_wts(&w);
    if (small) return ok;
    make_wts(&w, 128, 1856, 2688, r);
    int lens[128];
    for (int e = 0; e < 128; e++) lens[e] = (int)tu_rng_below(r, 300);
    for (int tl = WK_TL0 || getenv("WK_TILED_ONLY"); tl < 2; tl++) ok &= check("30B up, E=128, runs 0..299", &w, lens, 2, tl, 1, r);
#if WK_XPERM
    wk_check_yperm = 1;
    ok &= check("30B up, E=128, runs 0..299, y permuted", &w, lens, 2, 1, 1, r);
    wk_check_yperm = 0;
#endif
#if WK_BIG && BG_XP
    bg_check_yperm = 1;
    ok &= check("30B up, E=128, runs 0..299, y permuted", &w, lens, 2, 1, 1, r);
    bg_check_yperm = 0;
    free_wts(&w);
    make_wts(&w, 128, 2688, 1856, r); /* the down projection: K % 128 = 64 */
    ok &= check("30B down, E=128, runs 0..299", &w, lens, 2, 1, 0, r);
#endif
    free_wts(&w);
    return ok;
}

typedef struct {
    const wts_t *up, *down;
    bool tiled;
    int which; /* 0 production batched, 1 candidate, 2 dequant_gemm */
    const void *x, *xp; /* xp: x permuted (WK_XPERM's candidate; BG_XP's, K padded to 128) */
    void *h, *y;
    const uint32_t *idx;
    int B;
    void *hp; /* BG_XP: h in the permuted order (K padded, the padding zero) */
    const void *xt;        /* the production MoE step's x: B / 6 token rows, read through xrow (xdiv 6) */
    const uint32_t *xrow;  /* B entries: a random permutation of 0 .. B - 1 */
} tctx;

static int run_pair(void *p) {
    const tctx *c = (const tctx *)p;
    gq_args u = args_of(c->up, c->tiled, c->x, c->h, c->idx, c->B, 1);
    gq_args d = args_of(c->down, c->tiled, c->h, c->y, c->idx, c->B, 0);
#if WK_XPERM
    if (c->which == 1) { /* x permuted by its producer (here once, untimed); up writes h permuted for down */
        u.x = c->xp;
        return xp_launch(&u, 1, 0) || xp_launch(&d, 0, 0);
    }
#endif
#if WK_FUSED
    if (c->which == 1) return fx_pair(&u, &d, 0);
#endif
#if WK_BIG && BG_XP
    if (c->which == 1) { /* x permuted by its producer (here once, untimed); up writes h permuted for down */
        u.x = c->xp;
        u.y = c->hp;
        d.x = c->hp;
        return bg_launch_s(&u, bg_xp_pad(u.K), bg_xp_pad(u.N), 0) || bg_launch_s(&d, bg_xp_pad(d.K), d.N, 0);
    }
#endif
    if (c->which == 3) return prod_pair_runs(u, d, 0);
    if (c->which == 0 && c->tiled && c->xrow) { /* the model's MoE step where it takes the big tiles (session 47) */
        const fp4moe_nvfp4_weights wu = {c->up->tiled, c->up->scales, c->up->gs, c->up->E, c->up->N, c->up->K},
                                   wd = {c->down->tiled, c->down->scales, c->down->gs, c->down->E, c->down->N,
                                         c->down->K};
        const int st = gather_qmm_cuda_moe_rows(&wu, 1, &wd, 1, c->xt, c->B / 6, c->xrow, 6, c->idx, c->B,
                                                FP4MOE_ROUTE_AUTO, c->h, c->y, 0, NULL);
        if (st != FP4MOE_EUNSUPPORTED) return st;
        fp4moe_clear_error(); /* below the big tiles' threshold: the two calls, as before */
    }
    if (c->which == 1) return wk_launch(&u, 0) || wk_launch(&d, 0);
    if (c->which == 2) { /* dequant_gemm has no relu^2 epilogue: the caller's kernel, as production */
        return gq_run_dequant_gemm(&u, FP4MOE_BF16, 0) || cuda_relu2(0, (uint16_t *)c->h, (int64_t)c->B * 1856) ||
               gq_run_dequant_gemm(&d, FP4MOE_BF16, 0);
    }
    return prod_launch(&u, 0, 0) || prod_launch(&d, 0, 0);
}

int main(void) {
    gt_require_gpu("gpu_gather_wg");
    tu_rng r;
    tu_rng_seed(&r, 5);
    /* WK_CHECKS=small: the small checks only, then exit (for compute-sanitizer's memcheck / racecheck) */
    const char *ck = getenv("WK_CHECKS");
    const int small = ck && !strcmp(ck, "small");
    /* WK_CHECKS=none: no checks (for Nsight Compute runs of the timings); WK_TOKENS=T: only that size */
    const int ok = ck && !strcmp(ck, "none") ? 1 : run_checks(&r, small);
    const char *tk = getenv("WK_TOKENS");
    /* a comma-separated list of sizes, e.g. WK_TOKENS=128,512 */
    const char *only_T = tk && *tk ? tk : NULL;
    if (small) return ok ? 0 : 1;
    wts_t up, down;
    make_wts(&up, 128, 1856, 2688, &r);
    make_wts(&down, 128, 2688, 1856, &r);
    printf("| tokens | layout | production batched ms | candidate (WK_MT=%d) ms | dequant_gemm ms | candidate / production "
           "| production, runs once ms | candidate / that |\n", WK_MT);
    printf("|---:|---|---:|---:|---:|---:|---:|---:|\n");
    const int Ts[] = {128, 512, 1024, 2048, 4096, 8192, 16384, 32768}; /* 1,024, 4,096 and the last two only when
                                                                          * WK_TOKENS lists them */
    /* routing: uniform over the experts (skew 0), or skewed: expert e drawn with weight (e + 1)^-skew
     * (a Zipf law; 0.5 gives the 512-token w32 tile count that matches the synthetic model's gather
     * time, 1.2x the uniform one, docs/GPU-NOTES.md session 19) */
    const double skews[] = {0.0, 0.5};
    const char *route_file = getenv("WK_ROUTE_FILE");
    for (int ti = 0; ti < 16; ti++) {
        const int T = Ts[ti / 2], B = 6 * T;
        if ((T > 8192 || T == 4096 || T == 1024) && !only_T) continue;
        double skew = skews[ti % 2];
        double cw[128], tot = 0;
        for (int e = 0; e < 128; e++) cw[e] = tot += pow(e + 1.0, -skew);
        int lens[128] = {0}, maxlen = 0, tiles32 = 0;
        for (int i = 0; i < T; i++) { /* top-6 distinct experts a token */
            int ch[6];
            for (int k = 0; k < 6; k++) {
                int e, dup;
                do {
                    const double u = tu_rng_uniform(&r) * tot;
                    e = 0;
                    while (e < 127 && cw[e] <= u) e++;
                    dup = 0;
                    for (int j = 0; j < k; j++) dup |= ch[j] == e;
                } while (dup);
                ch[k] = e;
                lens[e]++;
            }
        }
        if (route_file && ti % 2 == 1) { /* the skewed row: the model's own counts instead (WK_ROUTE_FILE) */
            if (route_lens(route_file, T, lens)) return 1;
            skew = -1.0;
        }
        for (int e = 0; e < 128; e++) { maxlen = lens[e] > maxlen ? lens[e] : maxlen; tiles32 += (lens[e] + 31) / 32; }
        if (only_T) { /* (after the routing draws: the same routing as a full run) */
            int listed = 0;
            for (const char *p = only_T; p && *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL) listed |= atoi(p) == T;
            if (!listed) continue;
        }
        int BB;
        uint32_t *hidx = make_idx(128, lens, 0, &BB);
        uint32_t *didx = (uint32_t *)gt_upload(hidx, sizeof(uint32_t) * (size_t)B);
        void *x = gt_rand_dev((int64_t)B * 2688, 1.0f, &r, 0);
        void *h = gt_upload(NULL, (size_t)B * 1856 * 2), *y = gt_upload(NULL, (size_t)B * 2688 * 2);
        void *xt = gt_rand_dev((int64_t)T * 2688, 1.0f, &r, 0);
        uint32_t *perm = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)B);
        for (int i = 0; i < B; i++) perm[i] = (uint32_t)i;
        for (int i = B - 1; i > 0; i--) {
            const uint32_t j = tu_rng_below(&r, (uint32_t)(i + 1)), t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
        uint32_t *xrow = (uint32_t *)gt_upload(perm, sizeof(uint32_t) * (size_t)B);
        free(perm);
        void *xp = NULL;
#if WK_XPERM
        xp = gt_upload(NULL, (size_t)B * 2688 * 2);
        xp_permute(x, xp, B, 2688, 0, 0);
        GT_CHECK(cudaDeviceSynchronize());
#endif
#if WK_BIG && BG_XP
        void *hp = gt_upload(NULL, (size_t)B * bg_xp_pad(1856) * 2);
        GT_CHECK(cudaMemset(hp, 0, (size_t)B * bg_xp_pad(1856) * 2)); /* its K padding stays zero */
        xp = gt_upload(NULL, (size_t)B * bg_xp_pad(2688) * 2);
        bg_xp_permute(x, xp, B, 2688, 0, 0);
        GT_CHECK(cudaDeviceSynchronize());
#else
        void *hp = NULL;
#endif
        for (int tl = WK_TL0 || getenv("WK_TILED_ONLY"); tl < 2; tl++) {
            tctx c0 = {&up, &down, tl != 0, 0, x, xp, h, y, didx, B, hp, xt, xrow}, c1 = c0, c2 = c0, c3 = c0;
            c1.which = 1;
            c2.which = 2;
            c3.which = 3;
            const int inner = T >= 2048 ? 4 : 10;
            const float t0 = gt_time_ms(run_pair, &c0, 7, inner), t1 = gt_time_ms(run_pair, &c1, 7, inner);
            const float t2 = T >= 2048 ? gt_time_ms(run_pair, &c2, 5, 2) : 0.0f;
            const float t3 = gt_time_ms(run_pair, &c3, 7, inner);
            const float t1b = gt_time_ms(run_pair, &c1, 7, inner); /* the candidate again: drift */
            printf("| %d | %s, %s %.1f (max run %d, %d 32-row tiles) | %.4f | %.4f / %.4f | %.4f | %.2f | %.4f | %.3f |\n",
                   T, tl ? "tiled" : "rows", skew < 0 ? "model layer" : "skew", skew < 0 ? (double)WK_ROUTE_LAYER : skew,
                   maxlen, tiles32, t0, t1, t1b, t2, t1 / t0, t3, t1b / t3);
        }
        free(hidx);
        gt_free(didx); gt_free(x); gt_free(h); gt_free(y); gt_free(xt); gt_free(xrow);
        if (xp) gt_free(xp);
        if (hp) gt_free(hp);
    }
    free_wts(&up);
    free_wts(&down);
    return ok ? 0 : 1;
}
