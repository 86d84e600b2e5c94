/* gpu_gather_wg: variants of the expert-batched gather_qmm kernel on Hopper's warpgroup matrix
 * instruction (issue 12), measured against the production kernels on the same inputs in one run.
 *
 * History: written 2026-12-03 as the candidate of the wgmma kernel; on the H200 the same day it was
 * bitwise equal to the mma.sync kernel at 8-, 32- and 64-row tiles (both layouts), 0.75-0.78x its
 * time at 2,048 and 8,192 tokens (64-row tiles), 1.02x at 512 and 1.12-1.32x at 128 tokens; the
 * descriptor reading "leading byte offset = the K-direction stride" passed, the other failed. The
 * 64-row tiles of bf16 calls now run it in production (gq_batched_wg_kernel in gather_batched.cu).
 *
 * What this program measures now: the same kernel with WK_MT-row tiles (default 128: runs of
 * 2,048+ tokens are 96+ rows an expert, so 64-row tiles decode each weight tile 2+ times), checked
 * against production (outputs poisoned first; bitwise equality is expected, 1e-2 of max|y| is the
 * pass line) on awkward shapes, then timed next to production's batched route and dequant_gemm on
 * the 30B-A3B MoE shapes (up 2688 -> 1856 with relu^2, down 1856 -> 2688, E = 128, top-6) at 128 ..
 * 8,192 tokens. Variants by macro: WK_MT (64 or 128), WK_MINB (blocks an SM in the launch bounds).
 * Usage: gpu_gather_wg */
#include "kernels/cuda/gather_batched.cu"
#include "kernels/cuda/wgmma_rs.cuh"

extern "C" {
#include "gpu_testutil.h"
#include "testutil.h"
}

#ifndef WK_MT
#define WK_MT 128
#endif
#ifndef WK_MINB
#define WK_MINB (WK_MT > 64 ? 1 : 2)
#endif
#define WK_WAIT_STEP() wg_wait<0>()
#define WK_THREADS 256
#define WK_NTILE 128 /* features per block item: 2 warpgroups x 64 */

template <int MT> struct wk_cfg {
    static constexpr int KS = MT * 32;        /* bytes of one k16 step's B tile: MT/8 groups x 256 */
    static constexpr int XBYTES = 8 * KS;     /* one 128-K step of x: MT x 128 bf16 */
    static constexpr int SMEM = 2 * XBYTES + BT_STAGES * WK_THREADS * (int)sizeof(bt_slot);
};

/* byte offset of (k16 step ks, core matrix c8 (slots 0-7 / 8-15), row n) in an x buffer; LBO / SBO
 * of the descriptor: the K-direction (c8) stride 128 and the N-direction (n / 8) stride 256 */
__device__ __forceinline__ uint32_t wk_xoff(int KS, int ks, int c8, int n) {
    return (uint32_t)(ks * KS + (n >> 3) * 256 + c8 * 128 + (n & 7) * 16);
}

/* x staging: thread (t = tid % 4, nlo = tid / 4 % 8, q = tid / 32 % 4, nhi = tid / 128) moves the
 * pieces of rows 16 i + 8 nhi + nlo at K offset 32 t + 8 q of every step (a warp's 4-byte stores:
 * 8 rows x 4 t, 32 banks). */
template <int MT> struct wk_xstage {
    static constexpr int NP = MT >= 16 ? MT / 16 : 1;
    const __nv_bfloat16 *src[NP];
    uint4 v[NP];
    int kc, n[NP];
    __device__ __forceinline__ void init(const __nv_bfloat16 *x, int64_t row0, int rows, int rows_pad, int K) {
        const int tid = threadIdx.x, t = tid & 3, nlo = (tid >> 2) & 7, q = (tid >> 5) & 3, nhi = tid >> 7;
        kc = 32 * t + 8 * q;
#pragma unroll
        for (int i = 0; i < NP; i++) {
            const int r = i * 16 + nhi * 8 + nlo;
            n[i] = r;
            const int rr = r < rows ? r : rows - 1;
            src[i] = (r < rows_pad && r < MT) ? x + (row0 + rr) * K + kc : nullptr;
        }
    }
    __device__ __forceinline__ void load(int k0, int K) {
        const bool kok = k0 + kc < K;
#pragma unroll
        for (int i = 0; i < NP; i++) {
            v[i] = make_uint4(0, 0, 0, 0);
            if (src[i] && kok) v[i] = __ldg(reinterpret_cast<const uint4 *>(src[i] + k0));
        }
    }
    __device__ __forceinline__ void store(uint8_t *xs) const {
        const int t = threadIdx.x & 3, q = (threadIdx.x >> 5) & 3;
#pragma unroll
        for (int i = 0; i < NP; i++) {
            if (src[i]) {
                const uint4 w = v[i];
                const int nn = n[i];
                *reinterpret_cast<uint32_t *>(xs + wk_xoff(MT * 32, 2 * q, 0, nn) + 4 * t) = __byte_perm(w.x, w.z, 0x5410);
                *reinterpret_cast<uint32_t *>(xs + wk_xoff(MT * 32, 2 * q, 1, nn) + 4 * t) = __byte_perm(w.x, w.z, 0x7632);
                *reinterpret_cast<uint32_t *>(xs + wk_xoff(MT * 32, 2 * q + 1, 0, nn) + 4 * t) = __byte_perm(w.y, w.w, 0x5410);
                *reinterpret_cast<uint32_t *>(xs + wk_xoff(MT * 32, 2 * q + 1, 1, nn) + 4 * t) = __byte_perm(w.y, w.w, 0x7632);
            }
        }
    }
};

/* One 128-K step of a warpgroup: 8 wgmma (k16 steps 0..7) on N rows, one commit group. */
template <int N, int MT>
__device__ __forceinline__ void wk_step(float (&d)[N / 2], const uint32_t (&w0)[4], const uint32_t (&w1)[4],
                                        const uint32_t (&sa)[2], const uint32_t (&sb)[2], uint32_t xbuf) {
    constexpr uint32_t LBO = 128, SBO = 256;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        uint32_t pa[4], pb[4];
        bt_dec4<__nv_bfloat16>::pairs(w0[q], pa);
        bt_dec4<__nv_bfloat16>::pairs(w1[q], pb);
        const uint32_t s0 = sa[q >> 1], s1 = sb[q >> 1];
        const uint32_t ra0 = cu_mul_bf16x2(pa[0], s0), ra1 = cu_mul_bf16x2(pa[1], s0);
        const uint32_t ra2 = cu_mul_bf16x2(pa[2], s0), ra3 = cu_mul_bf16x2(pa[3], s0);
        const uint32_t rb0 = cu_mul_bf16x2(pb[0], s1), rb1 = cu_mul_bf16x2(pb[1], s1);
        const uint32_t rb2 = cu_mul_bf16x2(pb[2], s1), rb3 = cu_mul_bf16x2(pb[3], s1);
        wg_fence();
        wg_rs<N, false>::mma(d, ra0, rb0, ra1, rb1, wg_desc(xbuf + (2 * q) * (MT * 32), LBO, SBO), 1);
        wg_rs<N, false>::mma(d, ra2, rb2, ra3, rb3, wg_desc(xbuf + (2 * q + 1) * (MT * 32), LBO, SBO), 1);
    }
    wg_commit();
}

/* One item's K loop and epilogue with N = the rows of the item rounded up to 8 (a function per N, so
 * that each has one accumulator set and its own wgmma pipeline). */
template <int N, int MT, bool TL>
__device__ __forceinline__ void wk_item(const gq_args &a, int e, int64_t row0, int rows, int nw, uint8_t *smem) {
    typedef wk_cfg<MT> cfg;
    uint8_t *xs0 = smem, *xs1 = smem + cfg::XBYTES;
    const uint32_t xa0 = bt_smem_addr(xs0), xa1 = bt_smem_addr(xs1);
    bt_slot *ring = reinterpret_cast<bt_slot *>(smem + 2 * cfg::XBYTES) + threadIdx.x;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int N_ = a.N, K = a.K, KB = K >> 4, nsteps = (K + BT_KSTEP - 1) / BT_KSTEP;
    const __nv_bfloat16 *x = static_cast<const __nv_bfloat16 *>(a.x);
    __nv_bfloat16 *y = static_cast<__nv_bfloat16 *>(a.y);
    const int64_t we = cu_weight_expert(e, a.E);
    const int64_t wr0 = we * N_ + min(nw + g, N_ - 1), wr1 = we * N_ + min(nw + g + 8, N_ - 1);
    const uint8_t *crow0 = a.codes + wr0 * (K >> 1), *crow1 = a.codes + wr1 * (K >> 1);
    const uint8_t *srow0 = a.scales + wr0 * KB, *srow1 = a.scales + wr1 * KB;
    const uint8_t *tpiece = TL ? gq_tiled_piece(a.codes, we, min(nw >> 4, (N_ - 1) >> 4), 0, N_, K) : nullptr;

    float acc[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; i++) acc[i] = 0.0f;

    wk_xstage<MT> xr;
    xr.init(x, row0, rows, N, K);
#pragma unroll
    for (int p = 0; p < BT_STAGES - 1; p++) {
        if (p < nsteps) {
            if (TL) bt_issue_tiled(ring + p * WK_THREADS, tpiece + (int64_t)p * GQ_TILE_PIECE, lane);
            else bt_issue(ring + p * WK_THREADS, crow0, crow1, srow0, srow1, p, t, KB);
        }
        bt_cp_commit();
    }
    xr.load(0, K);
    xr.store(xs0);
    wg_fence_async_smem();
    __syncthreads();

    for (int s = 0; s < nsteps; s++) {
        uint32_t w0[4], w1[4], sa[2], sb[2];
        bt_cp_wait<BT_STAGES - 2>();
        const bt_slot *sl = ring + (s % BT_STAGES) * WK_THREADS;
        const uint4 c0 = sl->c0, c1 = sl->c1;
        const uint32_t sw0 = TL ? sl->s0 & 0xffffu : sl->s0 >> (16 * (t & 1));
        const uint32_t sw1 = TL ? sl->s0 >> 16 : sl->s1 >> (16 * (t & 1));
        w0[0] = c0.x; w0[1] = c0.y; w0[2] = c0.z; w0[3] = c0.w;
        w1[0] = c1.x; w1[1] = c1.y; w1[2] = c1.z; w1[3] = c1.w;
        const auto pa = bt_dec4<__nv_bfloat16>::scales(sw0), pb = bt_dec4<__nv_bfloat16>::scales(sw1);
        sa[0] = bt_dec4<__nv_bfloat16>::lo2(pa); sa[1] = bt_dec4<__nv_bfloat16>::hi2(pa);
        sb[0] = bt_dec4<__nv_bfloat16>::lo2(pb); sb[1] = bt_dec4<__nv_bfloat16>::hi2(pb);
        const int nxt = s + BT_STAGES - 1;
        if (nxt < nsteps) {
            if (TL) bt_issue_tiled(ring + (nxt % BT_STAGES) * WK_THREADS, tpiece + (int64_t)nxt * GQ_TILE_PIECE, lane);
            else bt_issue(ring + (nxt % BT_STAGES) * WK_THREADS, crow0, crow1, srow0, srow1, nxt, t, KB);
        }
        bt_cp_commit();
        if (s + 1 < nsteps) xr.load((s + 1) * BT_KSTEP, K);
        wk_step<N, MT>(acc, w0, w1, sa, sb, (s & 1) ? xa1 : xa0);
        WK_WAIT_STEP();
        if (s + 1 < nsteps) {
            xr.store((s & 1) ? xs0 : xs1);
            wg_fence_async_smem();
        }
        __syncthreads();
    }
    wg_wait<0>();
#pragma unroll
    for (int i = 0; i < N / 2; i++) asm volatile("" : "+f"(acc[i])::"memory");

    const float mult = cu_expert_gs(a.gs, e) * bt_ops<__nv_bfloat16>::kUndo;
    const int na = nw + g, nb = nw + g + 8;
#pragma unroll
    for (int i = 0; i < N / 8; i++) {
        const int r = i * 8 + 2 * t;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            if (r + h < rows) {
                __nv_bfloat16 *yr = y + (row0 + r + h) * N_;
                if (na < N_) yr[na] = cu_out<__nv_bfloat16>(acc[4 * i + h] * mult, a.relu2);
                if (nb < N_) yr[nb] = cu_out<__nv_bfloat16>(acc[4 * i + 2 + h] * mult, a.relu2);
            }
        }
    }
    __syncthreads(); /* the x buffers and the ring are reused by the next item */
}

template <int MT, bool TL>
__global__ void __launch_bounds__(WK_THREADS, WK_MINB)
wk_kernel(gq_args a, const int *__restrict__ starts, const int *__restrict__ tile_off) {
    cu_pdl_entry();
    extern __shared__ __align__(128) uint8_t smem[];
    const int warp = threadIdx.x >> 5, wg = warp >> 2, wq = warp & 3;
    const int N = a.N;
    const int NT = (N + WK_NTILE - 1) / WK_NTILE;
    const int64_t total = (int64_t)tile_off[a.E] * NT;
    for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
        int lo = 0, hi = a.E;
        while (hi - lo > 1) {
            const int mid = (lo + hi) >> 1;
            if ((int64_t)tile_off[mid] * NT <= item) lo = mid;
            else hi = mid;
        }
        const int e = lo, tiles = tile_off[e + 1] - tile_off[e];
        const int64_t local = item - (int64_t)tile_off[e] * NT;
        const int ntile = (int)(local / tiles), rtile = (int)(local % tiles);
        const int64_t row0 = (int64_t)starts[e] + (int64_t)rtile * MT;
        const int rows = (int)min((int64_t)MT, (int64_t)starts[e + 1] - row0);
        const int ntv = (rows + 7) >> 3;
        const int nw = ntile * WK_NTILE + wg * 64 + wq * 16;
        switch (ntv) {
        case 1: wk_item<8, MT, TL>(a, e, row0, rows, nw, smem); break;
        case 2: wk_item<16, MT, TL>(a, e, row0, rows, nw, smem); break;
        case 3: wk_item<24, MT, TL>(a, e, row0, rows, nw, smem); break;
        case 4: wk_item<32, MT, TL>(a, e, row0, rows, nw, smem); break;
        case 5: wk_item<40, MT, TL>(a, e, row0, rows, nw, smem); break;
        case 6: wk_item<48, MT, TL>(a, e, row0, rows, nw, smem); break;
        case 7: wk_item<56, MT, TL>(a, e, row0, rows, nw, smem); break;
        case 8: wk_item<64, MT, TL>(a, e, row0, rows, nw, smem); break;
        default:
            if constexpr (MT > 64) {
                switch (ntv) {
                case 9: wk_item<72, MT, TL>(a, e, row0, rows, nw, smem); break;
                case 10: wk_item<80, MT, TL>(a, e, row0, rows, nw, smem); break;
                case 11: wk_item<88, MT, TL>(a, e, row0, rows, nw, smem); break;
                case 12: wk_item<96, MT, TL>(a, e, row0, rows, nw, smem); break;
                case 13: wk_item<104, MT, TL>(a, e, row0, rows, nw, smem); break;
                case 14: wk_item<112, MT, TL>(a, e, row0, rows, nw, smem); break;
                case 15: wk_item<120, MT, TL>(a, e, row0, rows, nw, smem); break;
                default: wk_item<128, MT, TL>(a, e, row0, rows, nw, smem); break;
                }
            }
        }
    }
    __nv_bfloat16 *y = static_cast<__nv_bfloat16 *>(a.y);
    const __nv_bfloat16 zero = cu_from_float<__nv_bfloat16>(0.0f);
    const int64_t end = (int64_t)a.B * N;
    for (int64_t i = (int64_t)starts[a.E] * N + (int64_t)blockIdx.x * WK_THREADS + threadIdx.x; i < end;
         i += (int64_t)gridDim.x * WK_THREADS)
        y[i] = zero;
}

template <int MT, bool TL>
static int wk_launch_mt(const gq_args *a, const int *starts, const int *tile_off, cudaStream_t st) {
    typedef wk_cfg<MT> cfg;
    int dev = 0, sms = 0, occ = 0;
    GT_CHECK(cudaGetDevice(&dev));
    GT_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    GT_CHECK(cudaFuncSetAttribute(wk_kernel<MT, TL>, cudaFuncAttributeMaxDynamicSharedMemorySize, cfg::SMEM));
    GT_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, wk_kernel<MT, TL>, WK_THREADS, cfg::SMEM));
    const int64_t NT = (a->N + WK_NTILE - 1) / WK_NTILE;
    const int64_t bound = ((int64_t)a->B / MT + 1 + (a->E < a->B ? a->E : a->B)) * NT;
    int64_t grid = (int64_t)sms * (occ > 0 ? occ : 1);
    if (grid > bound) grid = bound;
    cu_launch(wk_kernel<MT, TL>, (unsigned)grid, WK_THREADS, cfg::SMEM, st, *a, starts, tile_off);
    return cudaGetLastError() == cudaSuccess ? 0 : 1;
}

/* the candidate: production's runs with WK_MT-row tiles */
static int wk_launch(const gq_args *a, cudaStream_t st) {
    int *buf = NULL;
    if (gq_scratch_alloc((void **)&buf, 2 * ((size_t)a->E + 1) * sizeof(int), st)) return 1;
    int *starts = buf, *tile_off = buf + a->E + 1;
    int rc = gq_launch_runs(a, WK_MT, starts, tile_off, st);
    if (!rc) rc = a->tiled ? wk_launch_mt<WK_MT, true>(a, starts, tile_off, st) : wk_launch_mt<WK_MT, false>(a, starts, tile_off, st);
    gq_scratch_free(buf, st);
    return rc;
}

/* production, with the row tile forced when mt > 0 */
static int prod_launch(const gq_args *a, int mt, cudaStream_t st) { /* now the wgmma kernel at mt = 64 */
    if (mt <= 0) return gq_launch_batched(a, FP4MOE_BF16, st);
    return launch_tiled(a, FP4MOE_BF16, mt, st);
}

/* ---- host side ---------------------------------------------------------------------------------- */

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
    gq_args a;
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
    if (prod_launch(&a0, 64, 0)) { fprintf(stderr, "%s: production: %s\n", what, fp4moe_last_error()); exit(1); }
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
    const int ok = !bad && rel <= 1e-2;
    printf("check mt=%d %-44s %-6s B=%-5d rel %.2e, bitwise %lld/%lld %s\n", WK_MT, what, tiled ? "tiled" : "rows", B,
           rel, (long long)same, (long long)n, ok ? "PASS" : "FAIL");
    free(h0); free(h1); free(hidx);
    gt_free(x); gt_free(didx); gt_free(y0); gt_free(y1);
    return ok;
}

static int run_checks(tu_rng *r) {
    int ok = 1;
    wts_t w;
    make_wts(&w, 6, 200, 320, r); /* N % 128 = 72, K % 128 = 64 */
    const int lens1[6] = {1, 0, 137, 9, 300, 64};
    const int lens2[6] = {8, 7, 16, 0, 3, 129};
    for (int tl = 0; tl < 2; tl++) {
        ok &= check("E=6 N=200 K=320, runs 1..300, tail 5", &w, lens1, 5, tl, 0, r);
        ok &= check("E=6 N=200 K=320, short runs, relu2", &w, lens2, 0, tl, 1, r);
    }
    free_wts(&w);
    make_wts(&w, 128, 1856, 2688, r);
    int lens[128];
    for (int e = 0; e < 128; e++) lens[e] = (int)tu_rng_below(r, 300);
    for (int tl = 0; tl < 2; tl++) ok &= check("30B up, E=128, runs 0..299", &w, lens, 2, tl, 1, r);
    free_wts(&w);
    return ok;
}

typedef struct {
    const wts_t *up, *down;
    bool tiled;
    int which; /* 0 production batched, 1 candidate, 2 dequant_gemm */
    const void *x;
    void *h, *y;
    const uint32_t *idx;
    int B;
} tctx;

static int run_pair(void *p) {
    const tctx *c = (const tctx *)p;
    gq_args u = args_of(c->up, c->tiled, c->x, c->h, c->idx, c->B, 1);
    gq_args d = args_of(c->down, c->tiled, c->h, c->y, c->idx, c->B, 0);
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
    const int ok = run_checks(&r);
    wts_t up, down;
    make_wts(&up, 128, 1856, 2688, &r);
    make_wts(&down, 128, 2688, 1856, &r);
    printf("| tokens | layout | production batched ms | candidate (WK_MT=%d) ms | dequant_gemm ms | candidate / production |\n", WK_MT);
    printf("|---:|---|---:|---:|---:|---:|\n");
    const int Ts[] = {128, 512, 2048, 8192};
    for (int ti = 0; ti < 4; ti++) {
        const int T = Ts[ti], B = 6 * T;
        int lens[128] = {0};
        for (int i = 0; i < T; i++) { /* top-6 distinct experts a token */
            int ch[6];
            for (int k = 0; k < 6; k++) {
                int e, dup;
                do { e = (int)tu_rng_below(&r, 128); dup = 0; for (int j = 0; j < k; j++) dup |= ch[j] == e; } while (dup);
                ch[k] = e;
                lens[e]++;
            }
        }
        int BB;
        uint32_t *hidx = make_idx(128, lens, 0, &BB);
        uint32_t *didx = (uint32_t *)gt_upload(hidx, sizeof(uint32_t) * (size_t)B);
        void *x = gt_rand_dev((int64_t)B * 2688, 1.0f, &r, 0);
        void *h = gt_upload(NULL, (size_t)B * 1856 * 2), *y = gt_upload(NULL, (size_t)B * 2688 * 2);
        for (int tl = 0; tl < 2; tl++) {
            tctx c0 = {&up, &down, tl != 0, 0, x, h, y, didx, B}, c1 = c0, c2 = c0;
            c1.which = 1;
            c2.which = 2;
            const int inner = T >= 2048 ? 4 : 10;
            const float t0 = gt_time_ms(run_pair, &c0, 7, inner), t1 = gt_time_ms(run_pair, &c1, 7, inner);
            const float t2 = T >= 2048 ? gt_time_ms(run_pair, &c2, 5, 2) : 0.0f;
            printf("| %d | %s | %.4f | %.4f | %.4f | %.2f |\n", T, tl ? "tiled" : "rows", t0, t1, t2, t1 / t0);
        }
        free(hidx);
        gt_free(didx); gt_free(x); gt_free(h); gt_free(y);
    }
    free_wts(&up);
    free_wts(&down);
    return ok ? 0 : 1;
}
