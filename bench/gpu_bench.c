/* gpu_bench: the Nemotron-3-Nano MoE layer's gather_qmm on the GPU, per route (issue 3).
 *
 * H = 2688, I = 1856, E = 128, top-6, bf16 activations, random NVFP4 weights with per-expert global
 * scales, random sorted top-6 indices. For 128, 512, 2048, 4096 and 8192 tokens (B = 6 * tokens rows) and
 * each route (batched, dequant_gemm, qmv): up (K 2688 -> N 1856) and down (K 1856 -> N 2688) times
 * (CUDA events, median), the effective weight bandwidth (NVFP4 bytes of the experts that have rows,
 * over the time) and the fraction of the floor (those bytes at the measured device-to-device copy
 * rate, over the time). Then decode: 1 token (6 rows, 6 distinct experts, unsorted), up + down with
 * the automatic route, median latency of single calls (the checkpoint layout, no graph: the model's decode form - tiled
 * layout, one x row for the six experts, a graph with programmatic dependent launch - is bench/gpu_moe_decode's).
 * Usage: gpu_bench [--quick] [--tokens T[,T...]]   (--quick: 512 tokens only, fewer repetitions;
 * --tokens: those token counts only (at most 8), e.g. under a profiler). The kernel versions
 * 3 and 4 were compared here in round 4 (docs/GPU-NOTES.md); only version 4 remains. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_testutil.h"
#include "testutil.h"

#define H 2688
#define I 1856
#define E 128
#define TOPK 6

static int cmp_float(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static float median(float *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_float);
    return n % 2 ? v[n / 2] : 0.5f * (v[n / 2 - 1] + v[n / 2]);
}

typedef struct {
    fp4moe_nvfp4_weights w; /* device */
    double bytes_per_expert;
} proj;

static proj make_proj(int64_t N, int64_t K, tu_rng *r) {
    tu_weights tw;
    if (tu_weights_random(&tw, E, N, K, 1, r) != 0) {
        fprintf(stderr, "tu_weights_random failed\n");
        exit(1);
    }
    proj p;
    p.w = tw.w;
    p.w.codes = gt_upload(tw.codes, (size_t)(E * N * K / 2));
    p.w.scales = gt_upload(tw.scales, (size_t)(E * N * K / 16));
    p.w.global_scale = gt_upload(tw.gs, E * sizeof(float));
    p.bytes_per_expert = (double)N * K * (0.5 + 1.0 / 16);
    tu_weights_free(&tw);
    return p;
}

/* Median milliseconds of one call (after 2 warm-ups), repetitions adapted to ~0.3 s. */
static float time_call(const proj *p, const void *x, const uint32_t *idx, int64_t B, int sorted, fp4moe_route route,
                       void *y, int quick) {
    cudaEvent_t a, b;
    GT_CHECK(cudaEventCreate(&a));
    GT_CHECK(cudaEventCreate(&b));
    float t[64];
    int n = 0, reps = 5;
    for (int i = 0; i < 2 + reps && n < 64; i++) {
        GT_CHECK(cudaEventRecord(a, NULL));
        const int st = fp4moe_gather_qmm_cuda_route(&p->w, x, FP4MOE_BF16, idx, B, sorted, route, y, NULL);
        GT_CHECK(cudaEventRecord(b, NULL));
        if (st != FP4MOE_OK) {
            fprintf(stderr, "gather_qmm_cuda (%s): %s\n", fp4moe_route_name(route), fp4moe_last_error());
            exit(1);
        }
        GT_CHECK(cudaEventSynchronize(b));
        float ms = 0;
        GT_CHECK(cudaEventElapsedTime(&ms, a, b));
        if (i == 1 && !quick) { /* first timed call after one warm-up: choose the repetitions */
            reps = (int)(300.0f / (ms > 1e-3f ? ms : 1e-3f));
            reps = reps < 5 ? 5 : reps > 50 ? 50 : reps;
        }
        if (i >= 2) t[n++] = ms;
    }
    GT_CHECK(cudaEventDestroy(a));
    GT_CHECK(cudaEventDestroy(b));
    return median(t, n);
}

int main(int argc, char **argv) {
    int quick = 0, only[8], n_only = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) {
            quick = 1;
        } else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) {
            for (char *p = argv[++i]; *p;) {
                char *end;
                const long v = strtol(p, &end, 10);
                if (end == p || v < 1 || v > 8192 || n_only == 8 || (*end && *end != ',')) {
                    fprintf(stderr, "gpu_bench: --tokens takes 1 to 8 counts of 1..8192 separated by commas\n");
                    return 2;
                }
                only[n_only++] = (int)v;
                p = *end == ',' ? end + 1 : end;
            }
        } else {
            fprintf(stderr, "usage: gpu_bench [--quick] [--tokens T[,T...]]\n");
            return 2;
        }
    }
    gt_require_gpu("gpu_bench");
    struct cudaDeviceProp prop;
    GT_CHECK(cudaGetDeviceProperties(&prop, 0));
    const double bw = gt_copy_rate((size_t)1 << 31);
    printf("device: %s, %d SMs; device-to-device copy: %.2f TB/s (read + write)\n", prop.name,
           prop.multiProcessorCount, bw / 1e12);

    tu_rng r;
    tu_rng_seed(&r, 2024);
    const proj up = make_proj(I, H, &r), down = make_proj(H, I, &r);
    const int tokens_all[] = {128, 512, 2048, 4096, 8192};
    const int ntok = n_only ? n_only : quick ? 1 : 5;
    const int64_t Bmax = (int64_t)TOPK * (quick && !n_only ? 512 : 8192);
    void *xh = tu_random_x(FP4MOE_BF16, Bmax, H, &r);
    void *dx = gt_upload(xh, (size_t)Bmax * H * 2), *dy = gt_upload(NULL, (size_t)Bmax * H * 2);
    free(xh);
    /* the down projection's input: the first I columns' worth of the same random values */
    void *dx2 = dx;

    float t512[3] = {0, 0, 0};
    printf("\n| tokens | rows | route | up ms | down ms | up+down ms | weight GB/s | floor ms | of floor |\n");
    printf("|---|---|---|---|---|---|---|---|---|\n");
    for (int ti = 0; ti < ntok; ti++) {
        const int tokens = n_only ? only[ti] : quick ? 512 : tokens_all[ti];
        const int64_t B = (int64_t)TOPK * tokens;
        uint32_t *idx = tu_make_idx(TU_IDX_TOPK_SORTED, B, E, TOPK, &r);
        int used = 0;
        for (int64_t b = 0; b < B; b++) used += b == 0 || idx[b] != idx[b - 1];
        uint32_t *didx = gt_upload(idx, (size_t)B * 4);
        const double bytes = used * (up.bytes_per_expert + down.bytes_per_expert);
        const double floor_ms = bytes / bw * 1e3;
        /* the routes (the tuning variants of rounds 3-5 were measured against these: docs/GPU-NOTES.md) */
        const struct { fp4moe_route route; const char *knob, *value, *label; } v[] = {
            {FP4MOE_ROUTE_BATCHED, NULL, NULL, "batched"},
            {FP4MOE_ROUTE_DEQUANT_GEMM, NULL, NULL, "dequant_gemm"},
            {FP4MOE_ROUTE_QMV, NULL, NULL, "qmv"},
            {FP4MOE_ROUTE_AUTO, NULL, NULL, "auto (the default choice)"},
        };
        for (int ri = 0; ri < (int)(sizeof v / sizeof v[0]); ri++) {
            if (v[ri].knob) setenv(v[ri].knob, v[ri].value, 1);
            const float tu = time_call(&up, dx, didx, B, 1, v[ri].route, dy, quick);
            const float td = time_call(&down, dx2, didx, B, 1, v[ri].route, dy, quick);
            if (v[ri].knob) unsetenv(v[ri].knob);
            const float tt = tu + td;
            if (tokens == 512 && !v[ri].knob && v[ri].route != FP4MOE_ROUTE_AUTO) t512[v[ri].route == FP4MOE_ROUTE_BATCHED ? 0 : v[ri].route == FP4MOE_ROUTE_DEQUANT_GEMM ? 1 : 2] = tt;
            printf("| %d | %lld | %s | %.4f | %.4f | %.4f | %.0f | %.4f | %.0f%% |\n", tokens, (long long)B,
                   v[ri].label, tu, td, tt, bytes / (tt * 1e-3) / 1e9, floor_ms, 100.0 * floor_ms / tt);
            fflush(stdout);
        }
        gt_free(didx);
        free(idx);
    }
    printf("\n512 tokens: batched is %.1fx faster than qmv, %.1fx faster than dequant_gemm\n", t512[2] / t512[0],
           t512[1] / t512[0]);

    /* decode: one token, 6 distinct experts, unsorted, automatic route; single-call latency */
    {
        uint32_t idx[TOPK];
        for (int k = 0; k < TOPK; k++) {
            int dup;
            do {
                idx[k] = tu_rng_below(&r, E);
                dup = 0;
                for (int j = 0; j < k; j++) dup |= idx[j] == idx[k];
            } while (dup);
        }
        uint32_t *didx = gt_upload(idx, sizeof idx);
        cudaEvent_t a, b;
        GT_CHECK(cudaEventCreate(&a));
        GT_CHECK(cudaEventCreate(&b));
        float t[200];
        const int reps = quick ? 50 : 200;
        for (int i = 0; i < reps + 10; i++) {
            GT_CHECK(cudaEventRecord(a, NULL));
            int st = fp4moe_gather_qmm_cuda(&up.w, dx, FP4MOE_BF16, didx, TOPK, 0, dy, NULL);
            if (st == FP4MOE_OK) st = fp4moe_gather_qmm_cuda(&down.w, dx2, FP4MOE_BF16, didx, TOPK, 0, dy, NULL);
            GT_CHECK(cudaEventRecord(b, NULL));
            if (st != FP4MOE_OK) {
                fprintf(stderr, "decode: %s\n", fp4moe_last_error());
                return 1;
            }
            GT_CHECK(cudaEventSynchronize(b));
            if (i >= 10) GT_CHECK(cudaEventElapsedTime(&t[i - 10], a, b));
        }
        const double dbytes = TOPK * (up.bytes_per_expert + down.bytes_per_expert);
        const float med = median(t, reps);
        /* back to back: 100 up+down pairs between two events (the host enqueues ahead, as in a
         * model's layer loop); the mean per pair is the GPU time without host launch gaps */
        float tb = 0;
        GT_CHECK(cudaEventRecord(a, NULL));
        for (int i = 0; i < 100; i++) {
            int st = fp4moe_gather_qmm_cuda(&up.w, dx, FP4MOE_BF16, didx, TOPK, 0, dy, NULL);
            if (st == FP4MOE_OK) st = fp4moe_gather_qmm_cuda(&down.w, dx2, FP4MOE_BF16, didx, TOPK, 0, dy, NULL);
            if (st != FP4MOE_OK) return 1;
        }
        GT_CHECK(cudaEventRecord(b, NULL));
        GT_CHECK(cudaEventSynchronize(b));
        GT_CHECK(cudaEventElapsedTime(&tb, a, b));
        tb /= 100;
        printf("decode (1 token, 6 rows, up+down, auto route): single call median %.1f us (min %.1f); back to back "
               "%.1f us per up+down; weights %.1f MB, floor %.1f us (%.0f%% of floor back to back)\n",
               med * 1e3, t[0] * 1e3, tb * 1e3, dbytes / 1e6, dbytes / bw * 1e6, 100.0 * (dbytes / bw) / (tb * 1e-3));
        gt_free(didx);
    }
    gt_free(dx);
    gt_free(dy);
    return 0;
}
