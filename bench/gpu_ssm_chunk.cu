/* gpu_ssm_chunk: a candidate for the Mamba-2 prefill scan (issue 12), measured against production's
 * tiled scan on the same inputs in one run. Written and measured in session 19 (2026-12-04): correct
 * (y and state within 3e-7 of production) and 1.8-2.0x SLOWER (H200, ms a layer, production / L = 128 /
 * L = 256: T = 512 0.081 / 0.156 / 0.172, 2,048 0.325 / 0.651 / 0.584, 8,192 1.281 / 2.412 / 2.137). With
 * GC_PARTS=a (the concurrent chunk scans alone): 0.085 / 0.295 / 1.08-1.10 ms, i.e. more grids side by
 * side gain only 10-15% (the scan is bound per SM at its 2-3 resident blocks, not by the grid size), and
 * the fp32 correction (~7 TFLOP/s here) plus the state passing cost more than that. Kept as the measured
 * record; the way forward is the chunked SSD on tensor cores (correction and intra-chunk products as
 * matrix products).
 *
 * Why: the tiled scan (src/kernels/cuda/ops_ssm.cu) is sequential in time and parallel over heads x
 * head_dim x state only: 256 blocks of 4 warps for the whole H200 at the 30B-A3B shape (about 2 warps a
 * scheduler, Nsight Compute: 0.27 eligible), so it runs at ~29% of its FP32 floor at every length.
 * The candidate splits time into chunks of L tokens and makes the chunks independent:
 *   1. every chunk runs production's tiled kernel (unchanged) from a zero state - chunk 0 from the
 *      real one - on its own stream, so nc = ceil(T / L) grids run side by side (the production form
 *      would be one grid with a chunk index; streams are enough to measure the parallelism);
 *      cum[t][h] = the product of dA over the chunk's tokens up to t (same dt / dA formula);
 *   2. state passing, one thread a state entry: S = D_c S + S_c over the chunks (D_c = cum at the
 *      chunk's last token), keeping each chunk's incoming state S_in[c];
 *   3. the correction of chunks c >= 1: y[t][h][p] += cum[t][h] * sum_n C[t][g][n] S_in[c][h][p][n]
 *      (a small GEMM per chunk and head, fp32 on CUDA cores).
 * The same mathematics as the recurrence (the state at t is cum * S_in + the chunk's own part), in
 * another order of the fp32 operations: states and y agree within fp32 rounding, not bitwise (the
 * check prints both errors against production). Extra work: the correction (1/3 of the recurrence's
 * FMAs), the chunk states written and read (nc x 2 MB), the zeroed chunk states.
 *
 * Output: the checks (y and state, max error / max |value|), then ms a layer for production and the
 * candidate at chunk lengths GC_L0 / GC_L1 (default 128 / 256) for T = 512, 2,048, 8,192, alternated.
 * Usage: gpu_ssm_chunk   (GC_PARTS=a: the candidate without state passing and correction, for timing
 * the parts; its checks then fail) */
#include "kernels/cuda/ops_ssm.cu"

extern "C" {
#include "gpu_testutil.h"
#include "testutil.h"
}

#include <math.h>
#include <stdio.h>

#include "ssm_bench.h"
#define GC_STREAMS 16
#ifndef GC_L0
#define GC_L0 128
#endif
#ifndef GC_L1
#define GC_L1 256
#endif

/* cum[t * nh + h] = prod over the tokens s of t's chunk, s <= t, of dA(s, h); a warp per (chunk, head):
 * the lanes compute 32 tokens' dA at once, a multiplicative scan by shuffles, the running product carried
 * from one 32-token piece to the next (a serial chain of one thread over the chunk's loads was ~60 us) */
__global__ void gc_cum_kernel(cuda_ssm_args a, int L, int nc, float *cum) {
    const int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (w >= nc * (int)a.nh) return;
    const int c = w / (int)a.nh, h = w % (int)a.nh;
    const int t0 = c * L, t1 = min((int)a.T, t0 + L);
    const float Ah = a.A[h], bias = a.dt_bias[h];
    float carry = 1.0f;
    for (int b = t0; b < t1; b += 32) {
        const int t = b + lane;
        float v = t < t1 ? ts_dt_dA(a.dt[(int64_t)t * a.dts + h], bias, a.dt_lo, a.dt_hi, Ah).y : 1.0f;
        for (int o = 1; o < 32; o <<= 1) { /* inclusive multiplicative scan */
            const float u = __shfl_up_sync(0xffffffffu, v, o);
            if (lane >= o) v = __fmul_rn(v, u);
        }
        v = __fmul_rn(carry, v);
        if (t < t1) cum[(int64_t)t * a.nh + h] = v;
        carry = __shfl_sync(0xffffffffu, v, 31);
    }
}

/* state passing: thread per state entry i of nh x hd x S; state holds chunk 0's final state (from the
 * real initial state) and ends with the sequence's; ws[c] holds chunk c's own final state (from zero)
 * and ends with the state entering chunk c */
__global__ void gc_pass_kernel(float *state, float *ws, const float *cum, int64_t n, int hdS, int nh, int T, int L,
                               int nc) {
    const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int h = (int)(i / hdS);
    float s = state[i];
    for (int c = 1; c < nc; c++) {
        const float own = ws[(int64_t)c * n + i];
        ws[(int64_t)c * n + i] = s;
        const int last = min(T, (c + 1) * L) - 1;
        s = fmaf(cum[(int64_t)last * nh + h], s, own); /* chunk c's decay of the incoming state, plus its own */
    }
    state[i] = s;
}

/* The correction of chunk c >= 1 (blockIdx.x = c - 1), head h (blockIdx.y), 128 tokens a pass:
 * y[t][h][p] += cum[t][h] * sum_n C[t][g][n] * S_in[c][h][p][n]. 256 threads, each 4 tokens x 8 p. */
#define GCC_T 128
#define GCC_K 32
__global__ void __launch_bounds__(256) gc_correct_kernel(cuda_ssm_args a, const float *ws, const float *cum, int L) {
    __shared__ float Cs[GCC_T][GCC_K + 1], Ss[HD][GCC_K + 1];
    const int c = blockIdx.x + 1, h = blockIdx.y, g = h / ((int)a.nh / (int)a.G);
    const int tid = threadIdx.x, tt = tid >> 3, pp = tid & 7;
    const int64_t n = (int64_t)a.nh * a.hd * a.S;
    const float *sin = ws + (int64_t)c * n + (int64_t)h * a.hd * a.S;
    const int tc0 = c * L, tc1 = min((int)a.T, tc0 + L);
    const int64_t ystride = a.nh * a.hd;
    for (int t0 = tc0; t0 < tc1; t0 += GCC_T) {
        float acc[4][8];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 8; j++) acc[i][j] = 0.0f;
        for (int k0 = 0; k0 < (int)a.S; k0 += GCC_K) {
            for (int e = tid; e < GCC_T * GCC_K; e += 256) {
                const int r = e / GCC_K, k = e % GCC_K, t = t0 + r;
                Cs[r][k] = t < tc1 ? a.C[(int64_t)t * a.bcs + (int64_t)g * a.S + k0 + k] : 0.0f;
            }
            for (int e = tid; e < HD * GCC_K; e += 256) {
                const int p = e / GCC_K, k = e % GCC_K;
                Ss[p][k] = p < (int)a.hd ? sin[(int64_t)p * a.S + k0 + k] : 0.0f;
            }
            __syncthreads();
#pragma unroll 8
            for (int k = 0; k < GCC_K; k++) {
                float av[4], bv[8];
#pragma unroll
                for (int i = 0; i < 4; i++) av[i] = Cs[4 * tt + i][k];
#pragma unroll
                for (int j = 0; j < 8; j++) bv[j] = Ss[8 * pp + j][k];
#pragma unroll
                for (int i = 0; i < 4; i++)
#pragma unroll
                    for (int j = 0; j < 8; j++) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
            }
            __syncthreads();
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int t = t0 + 4 * tt + i;
            if (t >= tc1) continue;
            const float m = cum[(int64_t)t * a.nh + h];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int p = 8 * pp + j;
                if (p < (int)a.hd) {
                    float *yp = a.y + (int64_t)t * ystride + (int64_t)h * a.hd + p;
                    *yp = __fadd_rn(*yp, __fmul_rn(m, acc[i][j]));
                }
            }
        }
    }
}

typedef struct {
    cudaStream_t main, side[GC_STREAMS];
    cudaEvent_t fork, join[GC_STREAMS];
    float *ws, *cum; /* nc x nh x hd x S floats; T x nh floats */
} gc_ctx;

/* The candidate for one sequence of a.T tokens, chunks of L tokens (a.state updated, a.y written). */
static void gc_scan(gc_ctx *x, const cuda_ssm_args *a, int L) {
    const int T = (int)a->T, nc = (T + L - 1) / L, nh = (int)a->nh;
    const int64_t n = a->nh * a->hd * a->S;
    if (nc > 1) GT_CHECK(cudaMemsetAsync(x->ws + n, 0, (size_t)(nc - 1) * n * 4, x->main));
    gc_cum_kernel<<<(nc * nh + 7) / 8, 256, 0, x->main>>>(*a, L, nc, x->cum);
    GT_CHECK(cudaEventRecord(x->fork, x->main));
    for (int c = 0; c < nc; c++) {
        cudaStream_t s = x->side[c % GC_STREAMS];
        if (c < GC_STREAMS) GT_CHECK(cudaStreamWaitEvent(s, x->fork, 0));
        cuda_ssm_args ac = *a;
        const int t0 = c * L;
        ac.T = min(T, t0 + L) - t0;
        ac.x = a->x + (int64_t)t0 * a->xs;
        ac.B = a->B + (int64_t)t0 * a->bcs;
        ac.C = a->C + (int64_t)t0 * a->bcs;
        ac.dt = a->dt + (int64_t)t0 * a->dts;
        ac.y = a->y + (int64_t)t0 * a->nh * a->hd;
        ac.state = c == 0 ? a->state : x->ws + (int64_t)c * n;
        if (cuda_ssm_scan_kernel(s, &ac, CUDA_SSM_TILED)) {
            fprintf(stderr, "gpu_ssm_chunk: chunk %d: %s\n", c, fp4moe_last_error());
            exit(1);
        }
    }
    for (int i = 0; i < GC_STREAMS && i < nc; i++) {
        GT_CHECK(cudaEventRecord(x->join[i], x->side[i]));
        GT_CHECK(cudaStreamWaitEvent(x->main, x->join[i], 0));
    }
    static const char *parts = getenv("GC_PARTS"); /* "a": only the chunks' scans (timing the parts; checks fail) */
    if (nc > 1 && !(parts && !strcmp(parts, "a"))) {
        gc_pass_kernel<<<(unsigned)((n + 255) / 256), 256, 0, x->main>>>(a->state, x->ws, x->cum, n,
                                                                         (int)(a->hd * a->S), nh, T, L, nc);
        gc_correct_kernel<<<dim3((unsigned)(nc - 1), (unsigned)nh), 256, 0, x->main>>>(*a, x->ws, x->cum, L);
    }
    GT_CHECK(cudaGetLastError());
}

typedef struct {
    float *xbc, *dt_bias, *A, *D, *state, *y;
    uint16_t *zx;
} bufs;

static cuda_ssm_args args_for(const bufs *b, int64_t T) {
    cuda_ssm_args a = {};
    a.T = T; a.nh = NH; a.hd = HD; a.S = NS; a.G = NG;
    a.x = b->xbc; a.xs = CD; a.B = b->xbc + DI; a.C = b->xbc + DI + NG * NS; a.bcs = CD;
    a.dt = b->zx + DI + CD; a.dts = NP; a.dt_bias = b->dt_bias; a.A = b->A; a.D = b->D;
    a.dt_lo = 1e-3f; a.dt_hi = INFINITY; a.state = b->state; a.y = b->y;
    return a;
}

static double rel_err(const float *ref, const float *v, int64_t n) {
    double mx = 0, e = 0;
    for (int64_t i = 0; i < n; i++) {
        mx = fmax(mx, fabs(ref[i]));
        e = fmax(e, fabs((double)v[i] - ref[i]));
        if (isnan(v[i])) e = INFINITY;
    }
    return mx > 0 ? e / mx : e;
}

int main(void) {
    gt_require_gpu("gpu_ssm_chunk");
    const int64_t Tmax = 8192, nst = (int64_t)NH * HD * NS;
    tu_rng r;
    tu_rng_seed(&r, 42);
    ssm_bench_host hd; /* the inputs of bench/gpu_ssm (the same seed) */
    ssm_bench_host_make(&hd, Tmax, &r);
    const float *h_st = hd.st;
    bufs b;
    b.xbc = (float *)gt_upload(hd.xbc, (size_t)Tmax * CD * 4);
    b.zx = (uint16_t *)gt_upload(hd.zx, (size_t)Tmax * NP * 2);
    b.dt_bias = (float *)gt_upload(hd.bias, sizeof hd.bias);
    b.A = (float *)gt_upload(hd.A, sizeof hd.A);
    b.D = (float *)gt_upload(hd.D, sizeof hd.D);
    b.state = (float *)gt_upload(h_st, (size_t)nst * 4);
    b.y = (float *)gt_upload(NULL, (size_t)Tmax * DI * 4);
    gc_ctx x;
    GT_CHECK(cudaStreamCreateWithFlags(&x.main, cudaStreamNonBlocking));
    for (int i = 0; i < GC_STREAMS; i++) {
        GT_CHECK(cudaStreamCreateWithFlags(&x.side[i], cudaStreamNonBlocking));
        GT_CHECK(cudaEventCreateWithFlags(&x.join[i], cudaEventDisableTiming));
    }
    GT_CHECK(cudaEventCreateWithFlags(&x.fork, cudaEventDisableTiming));
    const int Lmin = GC_L0 < GC_L1 ? GC_L0 : GC_L1;
    x.ws = (float *)gt_upload(NULL, (size_t)((Tmax + Lmin - 1) / Lmin) * nst * 4);
    x.cum = (float *)gt_upload(NULL, (size_t)Tmax * NH * 4);

    const int Ls[2] = {GC_L0, GC_L1};
    const int64_t Ts[3] = {512, 2048, 8192};
    int ok = 1;
    /* checks: the candidate against production's tiled scan, from the same state */
    for (int ti = 0; ti < 3; ti++)
        for (int li = 0; li < 2; li++) {
            const int64_t T = Ts[ti], ny = T * DI;
            float *y0 = (float *)malloc((size_t)ny * 4), *y1 = (float *)malloc((size_t)ny * 4);
            float *s0 = (float *)malloc((size_t)nst * 4), *s1 = (float *)malloc((size_t)nst * 4);
            const cuda_ssm_args a = args_for(&b, T);
            GT_CHECK(cudaMemcpy(b.state, h_st, (size_t)nst * 4, cudaMemcpyHostToDevice));
            if (cuda_ssm_scan_kernel(x.main, &a, CUDA_SSM_TILED)) return 1;
            GT_CHECK(cudaStreamSynchronize(x.main));
            gt_download(y0, b.y, (size_t)ny * 4);
            gt_download(s0, b.state, (size_t)nst * 4);
            gt_poison(b.y, (size_t)ny * 4);
            GT_CHECK(cudaMemcpy(b.state, h_st, (size_t)nst * 4, cudaMemcpyHostToDevice));
            gc_scan(&x, &a, Ls[li]);
            GT_CHECK(cudaStreamSynchronize(x.main));
            gt_download(y1, b.y, (size_t)ny * 4);
            gt_download(s1, b.state, (size_t)nst * 4);
            const double ey = rel_err(y0, y1, ny), es = rel_err(s0, s1, nst);
            const int pass = ey < 1e-4 && es < 1e-4;
            ok &= pass;
            printf("check T=%lld L=%d: y max err / max|y| %.2e, state %.2e %s\n", (long long)T, Ls[li], ey, es,
                   pass ? "PASS" : "FAIL");
            free(y0); free(y1); free(s0); free(s1);
        }
    /* timing: production and the candidates alternated, median of 7 batches of 4 calls */
    cudaEvent_t e0, e1;
    GT_CHECK(cudaEventCreate(&e0));
    GT_CHECK(cudaEventCreate(&e1));
    printf("| T | production tiled ms | chunked L=%d ms | chunked L=%d ms |\n|---:|---:|---:|---:|\n", GC_L0, GC_L1);
    for (int ti = 0; ti < 3; ti++) {
        const cuda_ssm_args a = args_for(&b, Ts[ti]);
        float med[3];
        for (int m = 0; m < 3; m++) {
            float smp[7];
            for (int bt = 0; bt < 7; bt++) {
                GT_CHECK(cudaEventRecord(e0, x.main));
                for (int k = 0; k < 4; k++) {
                    if (m == 0) {
                        if (cuda_ssm_scan_kernel(x.main, &a, CUDA_SSM_TILED)) return 1;
                    } else {
                        gc_scan(&x, &a, Ls[m - 1]);
                    }
                }
                GT_CHECK(cudaEventRecord(e1, x.main));
                GT_CHECK(cudaEventSynchronize(e1));
                float ms = 0;
                GT_CHECK(cudaEventElapsedTime(&ms, e0, e1));
                smp[bt] = ms / 4;
            }
            for (int i = 1; i < 7; i++) /* insertion sort, median */
                for (int j = i; j > 0 && smp[j] < smp[j - 1]; j--) { const float t = smp[j]; smp[j] = smp[j - 1]; smp[j - 1] = t; }
            med[m] = smp[3];
        }
        printf("| %lld | %.4f | %.4f | %.4f |\n", (long long)Ts[ti], med[0], med[1], med[2]);
    }
    ssm_bench_host_free(&hd);
    return ok ? 0 : 1;
}
