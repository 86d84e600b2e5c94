/* gpu_qmv_tiled: the decode matmul (issue 12) on the two NVFP4 weight layouts of the CUDA kernels,
 * in one run: the checkpoint layout (rows of codes, rows of scales) and the tiled layout
 * (gather_cuda.cuh, gq_relayout_tiled; FP4MOE_CUDA_WEIGHT_LAYOUT=tiled), both through the
 * production tensor-core qmv (gq_launch_qmv_mma; gq_args.tiled selects the layout).
 *
 * Written 2026-12-02 as a candidate with its own copy of the kernel; measured on the H200 the same
 * day: bitwise equal, 0.89-0.92x the time at every decode shape (docs/PERFORMANCE.md). The kernels
 * now read the tiled layout themselves, so this program compares the production paths.
 * Why the layout: in a K step each warp of the checkpoint layout reads 64 bytes from each of 16
 * weight rows 1,344 bytes apart (K = 2688) plus 2 scale bytes of each row per lane by four byte
 * loads; in the tiled one a warp's K step is one contiguous 1,152-byte piece (two coalesced 16-byte
 * loads and one 4-byte load a lane).
 *
 * Checks: y of both layouts memcmp-equal (outputs poisoned first) for awkward shapes: N % 16 != 0,
 * K % 128 != 0 (K = 96, 160, 2720), several experts per call and segments of several rows, rows with
 * idx >= E (zeros), E = 1; bf16 and fp32 outputs. Then median us per call at the 30B-A3B decode
 * shapes (6 experts' up and down projections, in_proj, out_proj, lm_head), each call on other
 * weights than the previous one (experts drawn anew / copies of a dense weight in turn) so that L2
 * does not hold them, with the weight bytes per call and GB/s. Prints "check ... PASS/FAIL" lines
 * and a table; exit 1 on a failed check. Usage: gpu_qmv_tiled */
#include "kernels/cuda/gather_qmv.cu"

extern "C" {
#include "gpu_testutil.h"
#include "testutil.h"
}

/* ---- host side ---------------------------------------------------------------------------------- */

typedef struct {
    int E, N, K, copies;              /* copies: dense weights repeated (E = 1) so that L2 misses */
    uint8_t *codes, *scales, *tiled;  /* device; copies x (E x N x ...) */
    float *gs;
    int64_t cbytes, sbytes, tbytes;   /* per copy */
} weights_t;

static void make_weights(weights_t *w, int E, int N, int K, int copies, tu_rng *r) {
    w->E = E; w->N = N; w->K = K; w->copies = copies;
    w->cbytes = (int64_t)E * N * (K / 2);
    w->sbytes = (int64_t)E * N * (K / 16);
    w->tbytes = (int64_t)E * gq_tiled_expert_bytes(N, K);
    uint8_t *h = (uint8_t *)malloc((size_t)(w->cbytes > w->sbytes ? w->cbytes : w->sbytes));
    GT_CHECK(cudaMalloc((void **)&w->codes, (size_t)(w->cbytes * copies)));
    GT_CHECK(cudaMalloc((void **)&w->scales, (size_t)(w->sbytes * copies)));
    GT_CHECK(cudaMalloc((void **)&w->tiled, (size_t)(w->tbytes * copies)));
    uint64_t z = (uint64_t)tu_rng_below(r, 0xffffffffu) << 32 | tu_rng_below(r, 0xffffffffu) | 1u;
    for (int c = 0; c < copies; c++) {
        for (int64_t i = 0; i < w->cbytes; i += 8) { /* xorshift64: random code bytes, fast */
            z ^= z << 13; z ^= z >> 7; z ^= z << 17;
            memcpy(h + i, &z, (size_t)(w->cbytes - i < 8 ? w->cbytes - i : 8));
        }
        GT_CHECK(cudaMemcpy(w->codes + c * w->cbytes, h, (size_t)w->cbytes, cudaMemcpyHostToDevice));
        for (int64_t i = 0; i < w->sbytes; i++) h[i] = (uint8_t)(0x28 + tu_rng_below(r, 24)); /* E4M3 ~0.06 .. 0.9 */
        GT_CHECK(cudaMemcpy(w->scales + c * w->sbytes, h, (size_t)w->sbytes, cudaMemcpyHostToDevice));
        if (gq_relayout_tiled(w->codes + c * w->cbytes, w->scales + c * w->sbytes, E, N, K, w->tiled + c * w->tbytes, 0)) {
            fprintf(stderr, "relayout: %s\n", fp4moe_last_error());
            exit(1);
        }
    }
    float *g = (float *)malloc(sizeof(float) * (size_t)E);
    for (int e = 0; e < E; e++) g[e] = (float)(0.5 + tu_rng_uniform(r));
    w->gs = (float *)gt_upload(g, sizeof(float) * (size_t)E);
    free(g);
    free(h);
    GT_CHECK(cudaDeviceSynchronize());
}

static void free_weights(weights_t *w) {
    gt_free(w->codes); gt_free(w->scales); gt_free(w->tiled); gt_free(w->gs);
}

static gq_args args_of(const weights_t *w, int copy, bool tiled, const void *x, void *y, const uint32_t *idx, int B) {
    gq_args a = {};
    a.codes = tiled ? w->tiled + copy * w->tbytes : w->codes + copy * w->cbytes;
    a.scales = w->scales + copy * w->sbytes;
    a.gs = w->gs;
    a.E = w->E; a.N = w->N; a.K = w->K;
    a.x = x; a.y = y; a.idx = idx; a.B = B; a.relu2 = 0; a.tiled = tiled;
    return a;
}

/* One check: both kernels on (w, idx of B rows), outputs memcmp-equal; returns 1 when they are. */
static int check_case(const char *what, const weights_t *w, const uint32_t *hidx, int B, bool f32out, tu_rng *r) {
    void *x = gt_rand_dev((int64_t)B * w->K, 2.0f, r, 0);
    uint32_t *didx = (uint32_t *)gt_upload(hidx, sizeof(uint32_t) * (size_t)B);
    const size_t yb = (size_t)B * w->N * (f32out ? 4 : 2);
    void *y0 = gt_upload(NULL, yb), *y1 = gt_upload(NULL, yb);
    gt_poison(y0, yb);
    gt_poison(y1, yb);
    gq_args a0 = args_of(w, 0, false, x, y0, didx, B), a1 = args_of(w, 0, true, x, y1, didx, B);
    if (!gq_qmv_mma_fits(&a0)) { fprintf(stderr, "%s: not a qmv-mma shape\n", what); exit(1); }
    if (gq_launch_qmv_mma(&a0, f32out, 0)) { fprintf(stderr, "%s: %s\n", what, fp4moe_last_error()); exit(1); }
    const int bad_launch = gq_launch_qmv_mma(&a1, f32out, 0);
    GT_CHECK(cudaDeviceSynchronize());
    uint8_t *h0 = (uint8_t *)malloc(yb), *h1 = (uint8_t *)malloc(yb);
    gt_download(h0, y0, yb);
    gt_download(h1, y1, yb);
    const int ok = !bad_launch && memcmp(h0, h1, yb) == 0;
    int64_t ndiff = 0;
    for (size_t i = 0; i < yb; i++) ndiff += h0[i] != h1[i];
    printf("check %-44s %s%s\n", what, ok ? "PASS" : "FAIL", ok ? "" : " (bytes differ)");
    if (!ok) fprintf(stderr, "  %lld of %zu bytes differ\n", (long long)ndiff, yb);
    free(h0); free(h1);
    gt_free(x); gt_free(didx); gt_free(y0); gt_free(y1);
    return ok;
}

typedef struct {
    const weights_t *w;
    bool tiled, f32out;
    const void *x;
    void *y;
    const uint32_t *idx; /* nsets x B */
    int B, nsets, i;
} tctx;

static int run_one(void *p) {
    tctx *c = (tctx *)p;
    const int k = c->i++;
    const int copy = k % c->w->copies, set = k % c->nsets;
    gq_args a = args_of(c->w, copy, c->tiled, c->x, c->y, c->idx + (int64_t)set * c->B, c->B);
    return gq_launch_qmv_mma(&a, c->f32out, 0);
}

int main(void) {
    gt_require_gpu("gpu_qmv_tiled");
    tu_rng r;
    tu_rng_seed(&r, 77);
    int bad = 0;
    /* ---- checks: awkward shapes, bitwise equality ---- */
    {
        weights_t w;
        make_weights(&w, 5, 40, 96, 1, &r); /* N % 16 != 0, one partial K step */
        const uint32_t idx[13] = {0, 0, 0, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2}; /* segments of 3, 1, 9 (cut at 8) rows */
        bad += !check_case("E=5 N=40 K=96, 13 rows in 4 segments", &w, idx, 13, false, &r);
        const uint32_t idx2[6] = {1, 3, 4, 9, 9, 70}; /* idx >= E: zeros */
        bad += !check_case("E=5 N=40 K=96, rows out of range", &w, idx2, 6, false, &r);
        free_weights(&w);
        make_weights(&w, 3, 72, 160, 1, &r);
        const uint32_t idx3[4] = {0, 1, 1, 2};
        bad += !check_case("E=3 N=72 K=160", &w, idx3, 4, false, &r);
        bad += !check_case("E=3 N=72 K=160, fp32 out", &w, idx3, 4, true, &r);
        free_weights(&w);
        make_weights(&w, 1, 100, 2720, 1, &r); /* K % 128 = 32 */
        const uint32_t idx4[1] = {0};
        bad += !check_case("E=1 N=100 K=2720", &w, idx4, 1, false, &r);
        free_weights(&w);
        make_weights(&w, 128, 1856, 2688, 1, &r);
        const uint32_t idx5[6] = {3, 17, 40, 41, 99, 127};
        bad += !check_case("30B up: E=128 N=1856 K=2688, 6 experts", &w, idx5, 6, false, &r);
        free_weights(&w);
    }
    /* ---- timing at the decode shapes ---- */
    struct { const char *name; int E, N, K, B, copies; bool f32out; } cases[] = {
        {"MoE up, 6 experts (E=128, 1856 x 2688)", 128, 1856, 2688, 6, 1, false},
        {"MoE down, 6 experts (E=128, 2688 x 1856)", 128, 2688, 1856, 6, 1, false},
        {"Mamba in_proj (10304 x 2688), 4 copies", 1, 10304, 2688, 1, 4, false},
        {"Mamba out_proj (2688 x 4096), 12 copies", 1, 2688, 4096, 1, 12, false},
        {"lm_head (131072 x 2688, fp32 out)", 1, 131072, 2688, 1, 1, true},
    };
    printf("| case | MB per call | checkpoint layout us | tiled us | tiled / checkpoint | checkpoint GB/s | tiled GB/s |\n");
    printf("|---|---:|---:|---:|---:|---:|---:|\n");
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        weights_t w;
        make_weights(&w, cases[ci].E, cases[ci].N, cases[ci].K, cases[ci].copies, &r);
        const int B = cases[ci].B, nsets = 64;
        uint32_t *hidx = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)(nsets * B));
        for (int s = 0; s < nsets; s++) { /* B distinct experts, sorted */
            uint32_t *p = hidx + s * B;
            for (int b = 0; b < B; b++) {
                uint32_t e;
                int dup;
                do {
                    e = cases[ci].E > 1 ? tu_rng_below(&r, (uint32_t)cases[ci].E) : 0;
                    dup = 0;
                    for (int j = 0; j < b; j++) dup |= p[j] == e;
                } while (dup && cases[ci].E >= B);
                p[b] = e;
            }
            for (int i = 1; i < B; i++)
                for (int j = i; j > 0 && p[j] < p[j - 1]; j--) { const uint32_t t = p[j]; p[j] = p[j - 1]; p[j - 1] = t; }
        }
        uint32_t *didx = (uint32_t *)gt_upload(hidx, sizeof(uint32_t) * (size_t)(nsets * B));
        void *x = gt_rand_dev((int64_t)B * w.K, 2.0f, &r, 0);
        void *y = gt_upload(NULL, (size_t)B * w.N * 4);
        tctx c0 = {&w, false, cases[ci].f32out, x, y, didx, B, nsets, 0}, c1 = c0;
        c1.tiled = true;
        const float t0 = gt_time_ms(run_one, &c0, 9, 20), t1 = gt_time_ms(run_one, &c1, 9, 20);
        const double mb = (double)(cases[ci].E > 1 ? B : 1) * w.N * (w.K / 2 + w.K / 16) / 1e6;
        printf("| %s | %.1f | %.1f | %.1f | %.2f | %.0f | %.0f |\n", cases[ci].name, mb, 1e3 * t0, 1e3 * t1, t1 / t0,
               mb / t0, mb / t1);
        free(hidx);
        gt_free(didx); gt_free(x); gt_free(y);
        free_weights(&w);
    }
    return bad ? 1 : 0;
}
