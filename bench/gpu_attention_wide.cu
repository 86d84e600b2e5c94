/* gpu_attention_wide: a candidate tensor-core prefill attention kernel (issue 11), measured against
 * the production one (src/kernels/cuda/ops_attention.cu, attn_prefill_mma_kernel) on the same inputs
 * in one run. Not in the production path: once this run shows it correct and faster at every size,
 * it replaces the production kernel there (with the fault-injection points) and this file goes.
 *
 * The candidate: FW_WARPS warps of 32 query rows each (two m16 row tiles, FlashAttention-2's layout),
 * Q copied into shared memory once and read by ldmatrix, so that every K and V fragment read from
 * shared memory feeds two mma instead of one. The production kernel (one row tile a warp) reads
 * 32 KB of shared memory (K and V of a 64-key step) per 0.5 MFLOP a warp: at the SM's 128 B/clock
 * that is 256 clocks against ~208 clocks of mma.sync work, so it is bound by shared-memory
 * bandwidth (measured 2026-12-01: 49.0 ms a layer at 32k tokens, 180 TFLOP/s; torch's flash 25.2).
 * Variants by macro (bench/build-variants.sh): FW_WARPS (4: 128-row blocks; 2: 64), FW_KEYS (64 or
 * 32 keys a step; ptxas: head_dim 128 at 64 keys uses 255 registers with 96 bytes of spill, at 32
 * keys 250 without).
 *
 * Checks: every output row of the candidate within 1e-2 x the row's max |ref| of the production
 * kernel's (itself tested against fp64 by tests/gpu/test_attention_gpu.c) for awkward (P, T), GQA
 * 16:1 / 4:1 / 1:1, head_dim 64 and 128; outputs poisoned before each call. Then median ms of both
 * kernels at the 30B-A3B shape (32 query heads, 2 KV heads, head_dim 128) for T = 512 .. 32,768.
 * Prints "check ... PASS/FAIL" lines and a table "T production_ms candidate_ms ratio"; exit 1 on a
 * failed check. Usage: gpu_attention_wide */
#include "kernels/cuda/ops_attention.cu"

extern "C" {
#include "gpu_testutil.h"
#include "testutil.h"
}

#ifndef FW_WARPS
#define FW_WARPS 4
#endif
#ifndef FW_KEYS
#define FW_KEYS 64
#endif
#define FW_ROWS (32 * FW_WARPS)

template <int DH>
__global__ void __launch_bounds__(FW_WARPS * 32)
attn_prefill_wide_kernel(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int32_t *pages, int P,
                        int T, int nq, int nkv, float scale_log2, uint16_t *out) {
    constexpr int LD = DH + 8, KS = DH / 16, NT = DH / 8, NJ = FW_KEYS / 8, STAGE = 2 * FW_KEYS * LD;
    extern __shared__ __align__(16) uint16_t fw_smem[]; /* Q, then stage s: K at s * STAGE, V after it */
    uint16_t *const Qs = fw_smem, *const stages = fw_smem + FW_ROWS * LD;
    const int h = blockIdx.x, t0 = (gridDim.y - 1 - blockIdx.y) * FW_ROWS, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, tq = lane & 3;
    const int kh = h / (nq / nkv);
    const int64_t kvs = (int64_t)nkv * DH, qstride = (int64_t)nq * DH;
    const int wr0 = t0 + warp * 32;                    /* this warp's first token: rows wr0 .. wr0 + 31 */
    const int nkeys = P + min(t0 + FW_ROWS, T);
    const bool active = wr0 < T;                       /* some row of this warp is a token */
    const int jstart = 0;
    /* Q rows (zero beyond T) into shared memory, in the first cp.async group */
    for (int i = tid; i < FW_ROWS * (DH / 8); i += FW_WARPS * 32) {
        const int rr = i / (DH / 8), c = (i % (DH / 8)) * 8, t = t0 + rr;
        const uint16_t *src = q + (int64_t)(t < T ? t : 0) * qstride + (int64_t)h * DH + c;
        const unsigned dq = (unsigned)__cvta_generic_to_shared(Qs + rr * LD + c);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dq), "l"(src), "r"(t < T ? 16 : 0));
    }
    /* the next step's K and V are copied (cp.async) while this step is computed; rows past the last
     * key (also a whole page past it) are zero-filled, so that P V never meets stale values */
    auto load_step = [&](int stage, int j0) {
        uint16_t *Ks = stages + stage * STAGE, *Vs = Ks + FW_KEYS * LD;
        for (int i = tid; i < FW_KEYS * (DH / 8); i += FW_WARPS * 32) {
            const int jj = i / (DH / 8), c = (i % (DH / 8)) * 8, key = j0 + jj;
            const bool v = key < nkeys;
            const int64_t off = v ? ((int64_t)pages[key / ATT_TILE] * ATT_TILE + key % ATT_TILE) * kvs + (int64_t)kh * DH + c : 0;
            const unsigned dk = (unsigned)__cvta_generic_to_shared(Ks + jj * LD + c);
            const unsigned dv = (unsigned)__cvta_generic_to_shared(Vs + jj * LD + c);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dk), "l"(kc + off), "r"(v ? 16 : 0));
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dv), "l"(vc + off), "r"(v ? 16 : 0));
        }
    };
    if (jstart < nkeys) load_step(0, jstart);
    asm volatile("cp.async.commit_group;");
    float o[2][NT][4];
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int i = 0; i < NT; i++) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.0f;
    float m[2][2] = {{-INFINITY, -INFINITY}, {-INFINITY, -INFINITY}}, l[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
    /* ldmatrix addresses of this lane: Q rows (A fragments: row lane % 16, dims + (lane / 16) * 8),
     * K rows (B: key lane % 8, dims + (lane / 8) * 8), V rows (B by .trans) */
    const uint16_t *qrow = Qs + (warp * 32 + (lane & 15)) * LD + (lane >> 4) * 8;
    const int koff = (lane & 7) * LD + (lane >> 3) * 8;
    const int voff = (((lane >> 3) & 1) * 8 + (lane & 7)) * LD + (lane >> 4) * 8;
    for (int j0 = jstart, it = 0; j0 < nkeys; j0 += FW_KEYS, it++) {
        const int stage = it & 1;
        if (j0 + FW_KEYS < nkeys) load_step(stage ^ 1, j0 + FW_KEYS);
        asm volatile("cp.async.commit_group;");
        asm volatile("cp.async.wait_group 1;");        /* this step (and Q; the next may be in flight) */
        __syncthreads();
        if (active && j0 <= P + wr0 + 31) {            /* some row of this warp sees a key of the step */
            const uint16_t *Ks = stages + stage * STAGE, *Vs = Ks + FW_KEYS * LD;
            float sc[2][NJ][4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int j = 0; j < NJ; j++) sc[mt][j][0] = sc[mt][j][1] = sc[mt][j][2] = sc[mt][j][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < KS; kk += 2) {       /* S = Q K^T, two k-steps of 16 dims at a time */
                uint32_t qa[2][2][4];
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    fa_ldmatrix_x4(qa[mt][0], qrow + mt * 16 * LD + kk * 16);
                    fa_ldmatrix_x4(qa[mt][1], qrow + mt * 16 * LD + kk * 16 + 16);
                }
#pragma unroll
                for (int j = 0; j < NJ; j++) {
                    uint32_t b[4];
                    fa_ldmatrix_x4(b, Ks + j * 8 * LD + koff + kk * 16);
#pragma unroll
                    for (int mt = 0; mt < 2; mt++) {
                        fa_mma(sc[mt][j], qa[mt][0][0], qa[mt][0][1], qa[mt][0][2], qa[mt][0][3], b[0], b[1]);
                        fa_mma(sc[mt][j], qa[mt][1][0], qa[mt][1][1], qa[mt][1][2], qa[mt][1][3], b[2], b[3]);
                    }
                }
            }
            const bool full = j0 + FW_KEYS - 1 <= P + wr0; /* every key visible to every row of the warp */
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                float mx0 = -INFINITY, mx1 = -INFINITY;
                if (full) {
#pragma unroll
                    for (int j = 0; j < NJ; j++) {
                        sc[mt][j][0] *= scale_log2;
                        sc[mt][j][1] *= scale_log2;
                        sc[mt][j][2] *= scale_log2;
                        sc[mt][j][3] *= scale_log2;
                        mx0 = fmaxf(mx0, fmaxf(sc[mt][j][0], sc[mt][j][1]));
                        mx1 = fmaxf(mx1, fmaxf(sc[mt][j][2], sc[mt][j][3]));
                    }
                } else {                               /* the diagonal: mask, scale, row maxima */
                    const int pa = P + wr0 + mt * 16 + g, pb = pa + 8; /* keys <= pos are visible */
#pragma unroll
                    for (int j = 0; j < NJ; j++)
#pragma unroll
                        for (int e = 0; e < 2; e++) {
                            const int key = j0 + j * 8 + 2 * tq + e;
                            const bool va = key <= pa, vb = key <= pb;
                            sc[mt][j][e] = va ? sc[mt][j][e] * scale_log2 : -INFINITY;
                            sc[mt][j][2 + e] = vb ? sc[mt][j][2 + e] * scale_log2 : -INFINITY;
                            mx0 = fmaxf(mx0, sc[mt][j][e]);
                            mx1 = fmaxf(mx1, sc[mt][j][2 + e]);
                        }
                }
                fa_softmax_tile<NJ, NT>(sc[mt], mx0, mx1, m[mt][0], m[mt][1], l[mt][0], l[mt][1], o[mt]);
            }
#pragma unroll
            for (int k2 = 0; k2 < NJ / 2; k2++) {      /* O += P V, keys 16*k2 .. 16*k2+15 */
                uint32_t ah[2][4];
#pragma unroll
                for (int mt = 0; mt < 2; mt++)
#pragma unroll
                    for (int hh = 0; hh < 4; hh++)     /* A: rows g / g+8 (hh odd), keys +8 (hh >= 2) */
                        ah[mt][hh] = fa_pack_f16(sc[mt][2 * k2 + hh / 2][2 * (hh & 1)], sc[mt][2 * k2 + hh / 2][2 * (hh & 1) + 1]);
#pragma unroll
                for (int i = 0; i < NT; i += 2) {
                    uint32_t b[4];
                    dm_ldmatrix_x4_trans(b, Vs + k2 * 16 * LD + voff + i * 8);
#pragma unroll
                    for (int mt = 0; mt < 2; mt++) {
                        fa_mma_f16(o[mt][i], ah[mt][0], ah[mt][1], ah[mt][2], ah[mt][3], b[0], b[1]);
                        fa_mma_f16(o[mt][i + 1], ah[mt][0], ah[mt][1], ah[mt][2], ah[mt][3], b[2], b[3]);
                    }
                }
            }
        }
        __syncthreads();                               /* every warp is done with this stage */
    }
    asm volatile("cp.async.wait_group 0;");
#pragma unroll
    for (int mt = 0; mt < 2; mt++) {
        float l0 = l[mt][0], l1 = l[mt][1];
        l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
        l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
        const float i0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, i1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
        const int ra = wr0 + mt * 16 + g, rb = ra + 8;
#pragma unroll
        for (int i = 0; i < NT; i++) {
            const int d = i * 8 + 2 * tq;
            if (ra < T) *(uint32_t *)(out + (int64_t)ra * qstride + (int64_t)h * DH + d) = fa_pack(o[mt][i][0] * i0, o[mt][i][1] * i0);
            if (rb < T) *(uint32_t *)(out + (int64_t)rb * qstride + (int64_t)h * DH + d) = fa_pack(o[mt][i][2] * i1, o[mt][i][3] * i1);
        }
    }
}

template <int DH>
static int launch_wide(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int32_t *pages, int P, int T,
                       int nq, int nkv, uint16_t *out) {
    static unsigned long long done = 0;
    const size_t smem = ((size_t)FW_ROWS + (size_t)2 * 2 * FW_KEYS) * (DH + 8) * sizeof(uint16_t);
    TRY_OPS(fa_allow_smem(attn_prefill_wide_kernel<DH>, smem, &done));
    const float scale_log2 = 1.4426950408889634f / sqrtf((float)DH);
    const dim3 grid((unsigned)nq, ops_blocks(T, FW_ROWS));
    attn_prefill_wide_kernel<DH><<<grid, FW_WARPS * 32, smem>>>(q, kc, vc, pages, P, T, nq, nkv, scale_log2, out);
    OPS_LAUNCH_CHECK("attention (prefill, candidate)");
    return FP4MOE_OK;
}

static int wide(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int32_t *pages, int P, int T, int nq,
                int nkv, int dh, uint16_t *out) {
    return dh == 128 ? launch_wide<128>(q, kc, vc, pages, P, T, nq, nkv, out)
                     : launch_wide<64>(q, kc, vc, pages, P, T, nq, nkv, out);
}

static float h_bf2f(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

typedef struct {
    const uint16_t *q, *k, *v;
    const int32_t *pages;
    int P, T, nq, nkv, dh;
    uint16_t *out;
} call_t;

static int run_prod(void *p) {
    const call_t *c = (const call_t *)p;
    return cuda_attention_prefill(NULL, c->q, c->k, c->v, c->pages, c->P, c->T, c->nq, c->nkv, c->dh, c->out);
}
static int run_wide(void *p) {
    const call_t *c = (const call_t *)p;
    return wide(c->q, c->k, c->v, c->pages, c->P, c->T, c->nq, c->nkv, c->dh, c->out);
}

/* Pages of a sequence of n positions, in a shuffled order over n_pages physical pages. */
static int32_t *shuffled_pages(int64_t n, int64_t n_pages, tu_rng *r) {
    const int64_t np = (n + 31) / 32;
    int32_t *perm = (int32_t *)malloc(sizeof(int32_t) * (size_t)n_pages);
    for (int64_t i = 0; i < n_pages; i++) perm[i] = (int32_t)i;
    for (int64_t i = n_pages - 1; i > 0; i--) {
        const int64_t j = (int64_t)tu_rng_below(r, (uint32_t)(i + 1));
        const int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    int32_t *pg = (int32_t *)gt_upload(perm, sizeof(int32_t) * (size_t)np);
    free(perm);
    return pg;
}

/* The candidate against the production kernel on one (shape, P, T); returns the worst row error. */
static double check_case(int nq, int nkv, int dh, int P, int T, tu_rng *r) {
    const int64_t kvs = (int64_t)nkv * dh, n = P + T, n_pages = (n + 31) / 32 + 5;
    void *k = gt_rand_dev(n_pages * 32 * kvs, 1.0f, r, 0), *v = gt_rand_dev(n_pages * 32 * kvs, 1.0f, r, 1);
    void *q = gt_rand_dev((int64_t)T * nq * dh, 2.0f, r, 0);
    int32_t *pg = shuffled_pages(n, n_pages, r);
    const size_t on = (size_t)T * nq * dh;
    uint16_t *d_ref = (uint16_t *)gt_upload(NULL, on * 2), *d_new = (uint16_t *)gt_upload(NULL, on * 2);
    gt_poison(d_ref, on * 2);
    gt_poison(d_new, on * 2);
    call_t c = {(const uint16_t *)q, (const uint16_t *)k, (const uint16_t *)v, pg, P, T, nq, nkv, dh, d_ref};
    if (run_prod(&c)) { fprintf(stderr, "%s\n", fp4moe_last_error()); exit(1); }
    c.out = d_new;
    if (run_wide(&c)) { fprintf(stderr, "%s\n", fp4moe_last_error()); exit(1); }
    GT_CHECK(cudaDeviceSynchronize());
    uint16_t *a = (uint16_t *)malloc(on * 2), *b = (uint16_t *)malloc(on * 2);
    gt_download(a, d_ref, on * 2);
    gt_download(b, d_new, on * 2);
    double worst = 0;
    const int64_t row = (int64_t)nq * dh;
    for (int64_t t = 0; t < T; t++) {
        double mx = 0, e = 0;
        for (int64_t i = 0; i < row; i++) mx = fmax(mx, fabs(h_bf2f(a[t * row + i])));
        for (int64_t i = 0; i < row; i++) {
            const double d = fabs((double)h_bf2f(a[t * row + i]) - h_bf2f(b[t * row + i]));
            e = d != d ? INFINITY : fmax(e, d);
        }
        worst = fmax(worst, e / (mx + 1e-6));
    }
    free(a); free(b);
    gt_free(k); gt_free(v); gt_free(q); gt_free(pg); gt_free(d_ref); gt_free(d_new);
    return worst;
}

int main(void) {
    gt_require_gpu("gpu_attention_wide");
    tu_rng r;
    tu_rng_seed(&r, 41);
    printf("# candidate prefill attention: %d warps of 32 rows, %d keys a step\n", FW_WARPS, FW_KEYS);
    static const int shapes[][3] = {{32, 2, 128}, {16, 4, 128}, {4, 4, 64}, {8, 2, 64}};
    static const int cases[][2] = {{0, 1}, {0, 127}, {0, 128}, {0, 129}, {100, 29}, {4000, 97}, {31, 1}, {0, 4097}, {77, 300}};
    int bad = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        double worst = 0;
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
            worst = fmax(worst, check_case(shapes[s][0], shapes[s][1], shapes[s][2], cases[i][0], cases[i][1], &r));
        const int ok = worst <= 1e-2;
        bad += !ok;
        printf("check nq=%d nkv=%d dh=%d, (P, T) from (0, 1) to (0, 4097): worst row difference %.3g %s\n",
               shapes[s][0], shapes[s][1], shapes[s][2], worst, ok ? "PASS" : "FAIL");
    }
    printf("| T | production ms | candidate ms | candidate / production |\n|---:|---:|---:|---:|\n");
    static const int Ts[] = {512, 2048, 8192, 32768};
    for (size_t i = 0; i < sizeof Ts / sizeof Ts[0]; i++) {
        const int T = Ts[i], nq = 32, nkv = 2, dh = 128;
        const int64_t kvs = nkv * dh, n_pages = (T + 31) / 32;
        void *k = gt_rand_dev(n_pages * 32 * kvs, 1.0f, &r, 0), *v = gt_rand_dev(n_pages * 32 * kvs, 1.0f, &r, 1);
        void *q = gt_rand_dev((int64_t)T * nq * dh, 2.0f, &r, 0);
        int32_t *pg = shuffled_pages(T, n_pages, &r);
        void *o = gt_upload(NULL, (size_t)T * nq * dh * 2);
        const call_t c = {(const uint16_t *)q, (const uint16_t *)k, (const uint16_t *)v, pg, 0, T, nq, nkv, dh, (uint16_t *)o};
        const int inner = T >= 8192 ? 3 : 10;
        const float a = gt_time_ms(run_prod, (void *)&c, 7, inner), b = gt_time_ms(run_wide, (void *)&c, 7, inner);
        printf("| %d | %.4f | %.4f | %.2f |\n", T, a, b, b / a);
        gt_free(k); gt_free(v); gt_free(q); gt_free(pg); gt_free(o);
    }
    return bad ? 1 : 0;
}
