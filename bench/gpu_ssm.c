/* gpu_ssm: the Mamba-2 prefill scan (cuda_ssm_scan) of one Nemotron-3-Nano-30B-A3B layer on the GPU,
 * every kernel through cuda_ssm_scan_kernel: seq (the first one), tiled (the recurrent prefill kernel),
 * ssd (the chunked SSD on tensor cores, with its C B^T workspace) and ssd-nows (the same without a
 * workspace: C B^T inside the scan kernel).
 *
 * Shape: 64 heads x head_dim 64, state 128, 8 groups; operands laid out as in the model
 * (src/model/model_cuda.c mamba_enqueue: x, B, C inside the conv output rows of 6144 floats, raw bf16
 * dt inside the in_proj rows of 10304 values). Random data. For T = 1 (decode), 64, 128, 256, 512, 2048,
 * 8192: median milliseconds of one call (CUDA events around batches of calls, interleaved modes), the
 * 23 layers' total, the speedup over seq, and the FP32 floor of the recurrence: 3 FP32 instructions
 * (FMUL dx*B, FFMA state, FFMA y) per (token, head, p, n) at 128 lanes x SMs x the SM clock. Also
 * prints the largest difference of each kernel against seq at T = 512 (y relative to max|y|; tiled's
 * states must be identical, the SSD's within 1e-5) and a hash of each kernel's y and state bits (variant builds
 * that must keep the bits print the same).
 * Usage: gpu_ssm [--quick | --one MODE T]   (--quick: T = 512 only, fewer repetitions; --one: after the
 * check, one call of kernel MODE (seq, tiled, ssd, ssd-nows) at T tokens and nothing else - for a profiler:
 * `ncu -k regex:ssm_ssd_kernel --launch-skip 2 --launch-count 1 gpu_ssm --one ssd 2048`). GPU_SSM_KEEP_GOING=1:
 * times also a build that fails the check (a knock-out build, whose results are wrong). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_testutil.h"
#include "kernels/cuda/ops_cuda.h"
#include "ssm_bench.h"
#include "testutil.h"

#define LAYERS 23

static const char *const k_modes[] = {"seq", "tiled", "ssd", "ssd-nows"};
#define N_MODES 4

static int cmp_float(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

typedef struct {
    float *xbc, *dt_bias, *A, *D, *state, *y, *ws;
    int64_t ws_floats;
    uint16_t *zx;
} bufs;

static cuda_ssm_args args_for(const bufs *b, int64_t T) {
    const cuda_ssm_args a = {
        .T = T, .nh = NH, .hd = HD, .S = NS, .G = NG,
        .x = b->xbc, .xs = CD, .B = b->xbc + DI, .C = b->xbc + DI + NG * NS, .bcs = CD,
        .dt = b->zx + DI + CD, .dts = NP, .dt_bias = b->dt_bias, .A = b->A, .D = b->D,
        .dt_lo = 1e-3f, .dt_hi = INFINITY, .state = b->state, .y = b->y, .ws = b->ws, .ws_floats = b->ws_floats,
    };
    return a;
}

static void scan(const bufs *b, int64_t T, const char *mode) {
    cuda_ssm_args a = args_for(b, T);
    if (!strcmp(mode, "ssd-nows")) a.ws = NULL; /* C B^T inside the scan kernel */
    const int kernel = !strcmp(mode, "seq") ? CUDA_SSM_SEQ : !strncmp(mode, "ssd", 3) ? CUDA_SSM_SSD : CUDA_SSM_TILED;
    if (cuda_ssm_scan_kernel(NULL, &a, kernel)) {
        fprintf(stderr, "cuda_ssm_scan (%s, T=%lld): %s\n", mode, (long long)T, fp4moe_last_error());
        exit(1);
    }
}

int main(int argc, char **argv) {
    gt_require_gpu("gpu_ssm");
    const int quick = argc > 1 && !strcmp(argv[1], "--quick");
    const int one = argc > 3 && !strcmp(argv[1], "--one");
    const int64_t Tone = one ? atoll(argv[3]) : 0;
    if (one && (Tone < 1 || Tone > 65536)) {
        fprintf(stderr, "gpu_ssm: --one MODE T: T from 1 to 65536\n");
        return 2;
    }
    const int64_t Tmax = quick ? 512 : one && Tone > 512 ? Tone : one ? 512 : 8192;
    tu_rng r;
    tu_rng_seed(&r, 42);

    /* host data */
    ssm_bench_host hd;
    ssm_bench_host_make(&hd, Tmax, &r);
    const float *h_xbc = hd.xbc, *h_st = hd.st;
    const uint16_t *h_zx = hd.zx;
    const size_t nst = (size_t)NH * HD * NS;

    bufs b;
    b.xbc = gt_upload(h_xbc, (size_t)Tmax * CD * 4);
    b.zx = gt_upload(h_zx, (size_t)Tmax * NP * 2);
    b.dt_bias = gt_upload(hd.bias, sizeof hd.bias);
    b.A = gt_upload(hd.A, sizeof hd.A);
    b.D = gt_upload(hd.D, sizeof hd.D);
    b.state = gt_upload(h_st, nst * 4);
    b.y = gt_upload(NULL, (size_t)Tmax * DI * 4);
    b.ws_floats = cuda_ssm_ws_floats(Tmax, NG);
    b.ws = gt_upload(NULL, (size_t)b.ws_floats * 4);

    int dev = 0, sms = 0, khz = 0;
    GT_CHECK(cudaGetDevice(&dev));
    GT_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    GT_CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev));
    printf("gpu_ssm: %d SMs, %.0f MHz (max clock); shape nh %d hd %d S %d G %d, %d layers\n", sms,
           khz / 1e3, NH, HD, NS, NG, LAYERS);

    /* correctness of tiled against seq at T = min(512, Tmax), from the same state */
    {
        const int64_t T = 512, ny = T * DI;
        float *y0 = malloc((size_t)ny * 4), *y1 = malloc((size_t)ny * 4), *s0 = malloc(nst * 4),
              *s1 = malloc(nst * 4);
        for (int m = 1; m < N_MODES; m++) {
            GT_CHECK(cudaMemcpy(b.state, h_st, nst * 4, cudaMemcpyHostToDevice));
            scan(&b, T, "seq");
            GT_CHECK(cudaDeviceSynchronize());
            gt_download(y0, b.y, (size_t)ny * 4);
            gt_download(s0, b.state, nst * 4);
            GT_CHECK(cudaMemcpy(b.state, h_st, nst * 4, cudaMemcpyHostToDevice));
            scan(&b, T, k_modes[m]);
            GT_CHECK(cudaDeviceSynchronize());
            gt_download(y1, b.y, (size_t)ny * 4);
            gt_download(s1, b.state, nst * 4);
            double mx = 0, e = 0;
            for (int64_t i = 0; i < ny; i++) {
                mx = fmax(mx, fabs(y0[i]));
                e = fmax(e, fabs((double)y1[i] - y0[i]));
                if (isnan(y1[i])) e = INFINITY;
            }
            const int same = !memcmp(s0, s1, nst * 4);
            double smx = 0, se = 0;
            for (size_t i = 0; i < nst; i++) {
                smx = fmax(smx, fabs(s0[i]));
                se = fmax(se, fabs((double)s1[i] - s0[i]));
                if (isnan(s1[i])) se = INFINITY;
            }
            /* tiled: the same states bit for bit; ssd (another order of the fp32 operations): within 1e-5 */
            const int ssd = !strncmp(k_modes[m], "ssd", 3);
            uint64_t bits = 1469598103934665603ull; /* FNV-1a of y and the state: variant builds compare bits */
            for (int64_t i = 0; i < ny; i++) bits = (bits ^ ((const uint32_t *)y1)[i]) * 1099511628211ull;
            for (size_t i = 0; i < nst; i++) bits = (bits ^ ((const uint32_t *)s1)[i]) * 1099511628211ull;
            printf("check T=512 %-8s vs seq: y max err / max|y| = %.2e, final state %s (max err / max %.2e), bits "
                   "%016llx\n",
                   k_modes[m], e / mx, same ? "identical" : "different", se / smx, (unsigned long long)bits);
            if ((!ssd && !same) || !(e / mx < 1e-5) || !(se / smx < 1e-5)) {
                fprintf(stderr, "gpu_ssm: %s disagrees with seq\n", k_modes[m]);
                if (!getenv("GPU_SSM_KEEP_GOING")) return 1; /* knock-out builds: times only */
            }
        }
        free(y0); free(y1); free(s0); free(s1);
    }

    if (one) {
        scan(&b, Tone, argv[2]);
        GT_CHECK(cudaDeviceSynchronize());
        printf("gpu_ssm: one %s call at T=%lld done\n", argv[2], (long long)Tone);
        return 0;
    }
    const int64_t Ts[] = {1, 64, 128, 256, 512, 2048, 8192};
    cudaEvent_t e0, e1;
    GT_CHECK(cudaEventCreate(&e0));
    GT_CHECK(cudaEventCreate(&e1));
    printf("\n%-6s %-8s %10s %12s %8s %10s %9s\n", "T", "kernel", "ms/layer", "ms/23 layers", "vs seq",
           "floor ms", "fraction");
    for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
        const int64_t T = Ts[ti];
        if (T > Tmax) continue;
        const int reps = T == 1 ? 200 : (int)(quick ? 4 : 1 + 4096 / T), batches = quick ? 5 : 9;
        float med[N_MODES];
        float *samples = malloc(sizeof(float) * N_MODES * batches);
        for (int m = 0; m < N_MODES; m++) scan(&b, T, k_modes[m]); /* warm-up */
        for (int bt = 0; bt < batches; bt++)
            for (int m = 0; m < N_MODES; m++) {
                GT_CHECK(cudaEventRecord(e0, NULL));
                for (int k = 0; k < reps; k++) scan(&b, T, k_modes[m]);
                GT_CHECK(cudaEventRecord(e1, NULL));
                GT_CHECK(cudaEventSynchronize(e1));
                float ms = 0;
                GT_CHECK(cudaEventElapsedTime(&ms, e0, e1));
                samples[m * batches + bt] = ms / reps;
            }
        const double floor_ms = 3.0 * (double)T * NH * HD * NS / ((double)sms * 128 * khz * 1e3) * 1e3;
        for (int m = 0; m < N_MODES; m++) {
            qsort(samples + m * batches, (size_t)batches, sizeof(float), cmp_float);
            med[m] = samples[m * batches + batches / 2];
            printf("%-6lld %-8s %10.4f %12.3f %7.2fx %10.4f %9.3f\n", (long long)T, k_modes[m], med[m],
                   med[m] * LAYERS, med[0] / med[m], floor_ms, floor_ms / med[m]);
        }
        free(samples);
    }
    gt_free(b.xbc); gt_free(b.zx); gt_free(b.dt_bias); gt_free(b.A); gt_free(b.D); gt_free(b.state);
    gt_free(b.y); gt_free(b.ws);
    ssm_bench_host_free(&hd);
    return 0;
}
