/* CUDA ops of the Mamba-2 mixer: the causal depthwise conv1d with state (+ silu) and the selective
 * scan with fp32 state. Formulas: spec NEMOTRON_H.md "Mamba-2", src/kernels/cpu/ops_ssm.c (dt
 * clamped to the config's time_step_limit on both the prefill and the decode path). Contracts: ops_cuda.h.
 *
 * Prefill of >= SSD_MIN_T tokens (state sizes 64 and 128) takes the chunked SSD matrix form on tensor
 * cores (ssm_ssd_kernel below: 3xTF32, so that the fp32 state keeps its precision; measured 0.93x the
 * tiled kernel's time at 128 tokens, 0.76x at 512, 0.63x at 2,048, 0.61x at 8,192 on the H200,
 * docs/PERFORMANCE.md session 20). The recurrent form,
 * sequential in time and parallel over heads x head_dim x state, has two kernels (docs/GPU-NOTES.md
 * "Mamba-2 prefill scan"):
 *   - seq: lanes split one p's S state entries and reduce y with shuffles every step; tokens staged
 *     in time chunks with a synchronous load phase (the kernel of the first end-to-end run; decode);
 *   - tiled (prefill below SSD_MIN_T, other state sizes, FP4MOE_CUDA_SSM=tiled): each thread holds a
 *     PR x NR register tile of the state (PR rows p, NR columns n), so that every B/C value read
 *     from shared memory serves PR rows and every x value NR columns; y partial sums of TT steps
 *     are reduced across lanes at once (a transposing reduce-scatter: PR*TT values over NL lanes);
 *     time tiles of LT tokens are copied with cp.async one tile ahead (double-buffered), so the
 *     global loads overlap the recurrence.
 * Both update the state with the same fp32 operations in the same order (bit-identical states); y
 * differs only in the order of the sum over n. cuda_ssm_scan uses the SSD for T >= SSD_MIN_T (S 64 /
 * 128; FP4MOE_CUDA_SSM=tiled: never), tiled for other T >= 2 and seq for T = 1; cuda_ssm_scan_kernel
 * picks one (tests, bench/gpu_ssm.c). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/ops_cuda.h"
#include "common/env.h"
#include "kernels/cuda/cuda_launch.cuh"

#define CONV_KMAX 8
#define CONV_THREADS 128
#define CONV_TOKENS 16    /* tokens per thread */

/* ---- causal conv1d ----------------------------------------------------------------------------- */

/* Thread (channel c, CONV_TOKENS consecutive tokens); reads the state for positions before 0. The
 * Kc inputs of a token are a window in registers, slid by one input per token (each input loaded
 * once; __restrict__: y never overlaps x or the state), the sum in the same order as the CPU's.
 * KC: the kernel width as a constant (4: nemotron_h's conv_kernel; 0: any Kc <= CONV_KMAX, read at
 * run time) - the same operations, without the predicated taps of the general form (which made the
 * kernel issue-bound: 25 us a layer at 512 tokens under Nsight Compute, 67% issue slots). */
template <int KC>
__global__ void conv1d_kernel(const uint16_t *__restrict__ x, int64_t xs, int T, int C, const float *__restrict__ w,
                              const float *__restrict__ b, int Kc_rt, const float *__restrict__ state,
                              float *__restrict__ y) {
    cu_pdl_entry();
    constexpr int KM = KC ? KC : CONV_KMAX;
    const int Kc = KC ? KC : Kc_rt;
    const int c = blockIdx.x * CONV_THREADS + threadIdx.x;
    if (c >= C) return;
    const int P = Kc - 1, t0 = blockIdx.y * CONV_TOKENS;
    float wc[KM], win[KM];
#pragma unroll
    for (int j = 0; j < KM; j++) {
        wc[j] = j < Kc ? w[(int64_t)c * Kc + j] : 0.0f;
        const int src = t0 - P + j; /* win[j] = input at t0 - P + j for j < P; < 0: from the state */
        win[j] = j >= P ? 0.0f
                        : (src >= 0 ? ops_bf16_to_f32(x[(int64_t)src * xs + c]) : state[(int64_t)(P + src) * C + c]);
    }
#ifdef FP4MOE_INJECT_FAULT_CONV1D /* deliberate fault (tests must catch it): the width-4 forms drop the bias */
    const float bc = b && KC != 4 ? b[c] : 0.0f;
#else
    const float bc = b ? b[c] : 0.0f;
#endif
    /* all CONV_TOKENS inputs loaded before any use: one memory round trip, not one per token */
    float xin[CONV_TOKENS];
#pragma unroll
    for (int tt = 0; tt < CONV_TOKENS; tt++)
        xin[tt] = t0 + tt < T ? ops_bf16_to_f32(x[(int64_t)(t0 + tt) * xs + c]) : 0.0f;
#pragma unroll
    for (int tt = 0; tt < CONV_TOKENS; tt++) {
        const int t = t0 + tt;
#pragma unroll
        for (int j = 0; j < KM; j++)
            if (j == P) win[j] = xin[tt];
        float acc = bc;
#pragma unroll
        for (int j = 0; j < KM; j++)
            if (j < Kc) acc = __fadd_rn(acc, __fmul_rn(wc[j], win[j]));
        if (t < T) y[(int64_t)t * C + c] = ops_silu(acc);
#pragma unroll
        for (int j = 0; j + 1 < KM; j++)
            if (j + 1 < Kc) win[j] = win[j + 1];
    }
}

/* conv1d_kernel<4> for two adjacent channels a thread (c even): bf16x2 loads, float2 stores, the weights of
 * both channels in two float4 loads - each channel's arithmetic exactly conv1d_kernel's (the same taps in the
 * same order), so the same bits. Needs C even, xs even, x 4-byte and w / y / state 8-byte (w 16-byte) aligned. */
__global__ void conv1d_c2_kernel(const uint16_t *__restrict__ x, int64_t xs, int T, int C, const float *__restrict__ w,
                                 const float *__restrict__ b, const float *__restrict__ state, float *__restrict__ y) {
    cu_pdl_entry();
    const int c = 2 * (blockIdx.x * CONV_THREADS + threadIdx.x);
    if (c >= C) return;
    const int t0 = blockIdx.y * CONV_TOKENS;
    const float4 wa = *reinterpret_cast<const float4 *>(w + (int64_t)c * 4);
    const float4 wb = *reinterpret_cast<const float4 *>(w + (int64_t)c * 4 + 4);
    const float wc0[4] = {wa.x, wa.y, wa.z, wa.w}, wc1[4] = {wb.x, wb.y, wb.z, wb.w};
    float win0[4], win1[4];
#pragma unroll
    for (int j = 0; j < 3; j++) { /* inputs t0 - 3 + j; < 0: from the state */
        const int src = t0 - 3 + j;
        if (src >= 0) {
            const uint32_t v = *reinterpret_cast<const uint32_t *>(x + (int64_t)src * xs + c);
            win0[j] = ops_bf16_to_f32((uint16_t)(v & 0xffffu));
            win1[j] = ops_bf16_to_f32((uint16_t)(v >> 16));
        } else {
            const float2 v = *reinterpret_cast<const float2 *>(state + (int64_t)(3 + src) * C + c);
            win0[j] = v.x;
            win1[j] = v.y;
        }
    }
    win0[3] = win1[3] = 0.0f;
    float2 bc = make_float2(0.0f, 0.0f);
#ifndef FP4MOE_INJECT_FAULT_CONV1D /* deliberate fault (tests must catch it): the width-4 forms drop the bias */
    if (b) bc = *reinterpret_cast<const float2 *>(b + c);
#endif
    uint32_t xin[CONV_TOKENS]; /* all inputs loaded before any use */
#pragma unroll
    for (int tt = 0; tt < CONV_TOKENS; tt++)
        xin[tt] = t0 + tt < T ? *reinterpret_cast<const uint32_t *>(x + (int64_t)(t0 + tt) * xs + c) : 0u;
#pragma unroll
    for (int tt = 0; tt < CONV_TOKENS; tt++) {
        const int t = t0 + tt;
        win0[3] = ops_bf16_to_f32((uint16_t)(xin[tt] & 0xffffu));
        win1[3] = ops_bf16_to_f32((uint16_t)(xin[tt] >> 16));
        float a0 = bc.x, a1 = bc.y;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            a0 = __fadd_rn(a0, __fmul_rn(wc0[j], win0[j]));
            a1 = __fadd_rn(a1, __fmul_rn(wc1[j], win1[j]));
        }
        if (t < T) *reinterpret_cast<float2 *>(y + (int64_t)t * C + c) = make_float2(ops_silu(a0), ops_silu(a1));
#pragma unroll
        for (int j = 0; j < 3; j++) {
            win0[j] = win0[j + 1];
            win1[j] = win1[j + 1];
        }
    }
}

/* New state: the last P inputs of (state ++ x); ascending i reads row T+i > i first (in place). */
__global__ void conv_state_kernel(const uint16_t *x, int64_t xs, int T, int C, int Kc, float *state) {
    cu_pdl_entry();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int P = Kc - 1;
    for (int i = 0; i < P; i++) {
        const int src = T - P + i;
        state[(int64_t)i * C + c] = src >= 0 ? ops_bf16_to_f32(x[(int64_t)src * xs + c])
                                             : state[(int64_t)(P + src) * C + c];
    }
}

/* Thread (channel c, row r): one token of a batch of single-token sequences; row r uses the conv
 * state of slot row_slot[r] (state + slot * state_stride), read and shifted in place. */
__global__ void conv1d_decode_kernel(const uint16_t *__restrict__ x, int64_t xs, int R, int C,
                                     const float *__restrict__ w, const float *__restrict__ b, int Kc,
                                     const int32_t *__restrict__ row_slot, int64_t state_stride,
                                     float *__restrict__ state, float *__restrict__ y) {
    cu_pdl_entry();
    const int c = blockIdx.x * CONV_THREADS + threadIdx.x, r = blockIdx.y;
    if (c >= C || r >= R) return;
    const int P = Kc - 1;
    float *st = state + (int64_t)row_slot[r] * state_stride;
    const float xv = ops_bf16_to_f32(x[(int64_t)r * xs + c]);
    float acc = b ? b[c] : 0.0f;
    for (int j = 0; j < Kc; j++) {
        const float v = j < P ? st[(int64_t)j * C + c] : xv;
        acc = __fadd_rn(acc, __fmul_rn(w[(int64_t)c * Kc + j], v));
    }
    y[(int64_t)r * C + c] = ops_silu(acc);
    for (int i = 0; i + 1 < P; i++) st[(int64_t)i * C + c] = st[(int64_t)(i + 1) * C + c];
    if (P > 0) st[(int64_t)(P - 1) * C + c] = xv;
}

extern "C" int cuda_conv1d_decode(void *stream, const uint16_t *x, int64_t xs, int64_t R, int64_t C,
                                  const float *w, const float *b, int64_t Kc, const int32_t *row_slot,
                                  int64_t state_stride, float *state, float *y) {
    if (R <= 0) return FP4MOE_OK;
    if (Kc < 1 || Kc > CONV_KMAX || C > (1 << 30) || R > 65535)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda op conv1d decode: conv_kernel=%lld, %lld channels, "
                                "%lld rows", (long long)Kc, (long long)C, (long long)R);
    const dim3 grid(ops_blocks(C, CONV_THREADS), (unsigned)R);
    cu_launch(conv1d_decode_kernel, grid, CONV_THREADS, 0, (cudaStream_t)stream, x, xs, (int)R, (int)C, w, b, (int)Kc,
              row_slot, state_stride, state, y);
    OPS_LAUNCH_CHECK("conv1d decode");
    return FP4MOE_OK;
}

extern "C" int cuda_conv1d_causal(void *stream, const uint16_t *x, int64_t xs, int64_t T, int64_t C,
                                  const float *w, const float *b, int64_t Kc, float *state, float *y) {
    if (T <= 0) return FP4MOE_OK;
    if (Kc < 1 || Kc > CONV_KMAX || C > (1 << 30) || T > (1 << 30))
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda op conv1d: conv_kernel=%lld (at most %d), "
                                "%lld channels, %lld tokens", (long long)Kc, CONV_KMAX, (long long)C,
                                (long long)T);
    cudaStream_t st = (cudaStream_t)stream;
    const dim3 grid(ops_blocks(C, CONV_THREADS), ops_blocks(T, CONV_TOKENS));
    if (grid.y > 65535)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda op conv1d: %lld tokens in one call",
                                (long long)T);
    const bool c2 = Kc == 4 && C % 2 == 0 && xs % 2 == 0 && ((uintptr_t)x & 3) == 0 && ((uintptr_t)w & 15) == 0 &&
                    ((uintptr_t)y & 7) == 0 && ((uintptr_t)state & 7) == 0 && ((uintptr_t)b & 7) == 0;
    if (c2) {
        const dim3 g2(ops_blocks(C / 2, CONV_THREADS), grid.y);
        cu_launch(conv1d_c2_kernel, g2, CONV_THREADS, 0, st, x, xs, (int)T, (int)C, w, b, state, y);
    } else if (Kc == 4) {
        cu_launch(conv1d_kernel<4>, grid, CONV_THREADS, 0, st, x, xs, (int)T, (int)C, w, b, (int)Kc, state, y);
    } else {
        cu_launch(conv1d_kernel<0>, grid, CONV_THREADS, 0, st, x, xs, (int)T, (int)C, w, b, (int)Kc, state, y);
    }
    OPS_LAUNCH_CHECK("conv1d");
    if (Kc > 1) {
        cu_launch(conv_state_kernel, ops_blocks(C, 256), 256, 0, st, x, xs, (int)T, (int)C, (int)Kc, state);
        OPS_LAUNCH_CHECK("conv1d state update");
    }
    return FP4MOE_OK;
}

/* ---- selective scan --------------------------------------------------------------------------- */

#define SCAN_WARPS 4

/* torch.nn.functional.softplus (beta 1, threshold 20), as the CPU's. */
__device__ __forceinline__ float softplus_f(float v) { return v > 20.0f ? v : log1pf(expf(v)); }

/* Block (head h, PB = SCAN_WARPS * 32/LPP consecutive p of head_dim). LPP lanes share one p and
 * split its S state entries: lane quarter q owns n = i*LPP + q (i < NPL), so that a warp's
 * shared-memory reads of B[n] and C[n] hit LPP consecutive words (no bank conflict) and are
 * broadcast across the p of the warp. The state stays in registers for the whole call. */
template <int NPL, int LPP>
__global__ void __launch_bounds__(SCAN_WARPS * 32)
ssm_scan_kernel(cuda_ssm_args a, int TC) {
    cu_pdl_entry();
    constexpr int PW = 32 / LPP, PB = SCAN_WARPS * PW;
    if (a.row_slot) { /* batch of single-token sequences: row z with the state of its slot */
        const int64_t z = blockIdx.z;
        a.state += (int64_t)a.row_slot[z] * a.state_stride;
        a.x += z * a.xs;
        a.B += z * a.bcs;
        a.C += z * a.bcs;
        a.dt += z * a.dts;
        a.y += z * a.nh * a.hd;
    }
    extern __shared__ float sm[];
    const int S = (int)a.S, hd = (int)a.hd, nh = (int)a.nh;
    float *Bs = sm, *Cs = Bs + TC * S, *dts = Cs + TC * S, *dAs = dts + TC, *xsm = dAs + TC;
    const int h = blockIdx.y, g = h / (nh / (int)a.G), pbase = blockIdx.x * PB;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, pl = lane / LPP, q = lane % LPP;
    const int pw = warp * PW + pl, p = pbase + pw;
    const bool valid = p < hd;
    float *st = a.state + ((int64_t)h * hd + (valid ? p : 0)) * S;
    float s[NPL];
#pragma unroll
    for (int i = 0; i < NPL; i++) {
        const int n = i * LPP + q;
        s[i] = valid && n < S ? st[n] : 0.0f;
    }
    const float Ah = a.A[h], Dh = a.D[h], bias = a.dt_bias[h];
    const int64_t ystride = (int64_t)nh * hd;
    for (int t0 = 0; t0 < (int)a.T; t0 += TC) {
        const int tc = min(TC, (int)a.T - t0);
        __syncthreads(); /* the previous chunk is consumed */
        for (int i = threadIdx.x; i < tc * S; i += blockDim.x) {
            const int tt = i / S, n = i % S;
            const int64_t row = (int64_t)(t0 + tt) * a.bcs + (int64_t)g * S + n;
            Bs[i] = a.B[row];
            Cs[i] = a.C[row];
        }
        for (int tt = threadIdx.x; tt < tc; tt += blockDim.x) {
            float dt = softplus_f(__fadd_rn(ops_bf16_to_f32(a.dt[(int64_t)(t0 + tt) * a.dts + h]), bias));
            if (dt < a.dt_lo) dt = a.dt_lo;
            if (dt > a.dt_hi) dt = a.dt_hi;
            dts[tt] = dt;
            dAs[tt] = expf(__fmul_rn(dt, Ah));
        }
        for (int i = threadIdx.x; i < tc * PB; i += blockDim.x) {
            const int tt = i / PB, j = pbase + i % PB;
            xsm[i] = j < hd ? a.x[(int64_t)(t0 + tt) * a.xs + (int64_t)h * hd + j] : 0.0f;
        }
        __syncthreads();
        for (int tt = 0; tt < tc; tt++) {
            const float dA = dAs[tt], xv = xsm[tt * PB + pw], dx = __fmul_rn(dts[tt], xv);
            const float *Bt = Bs + tt * S, *Ct = Cs + tt * S;
            float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll
            for (int i = 0; i < NPL; i++) {
                const int n = i * LPP + q;
                if (n < S) {
                    s[i] = fmaf(dA, s[i], dx * Bt[n]);
                    if (i & 1) acc1 = fmaf(s[i], Ct[n], acc1);
                    else acc0 = fmaf(s[i], Ct[n], acc0);
                }
            }
            float acc = acc0 + acc1;
#pragma unroll
            for (int o = LPP / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
            if (valid && q == 0)
                a.y[(int64_t)(t0 + tt) * ystride + (int64_t)h * hd + p] = __fadd_rn(acc, __fmul_rn(Dh, xv));
        }
    }
#pragma unroll
    for (int i = 0; i < NPL; i++) {
        const int n = i * LPP + q;
        if (valid && n < S) st[n] = s[i];
    }
}

template <int NPL, int LPP>
static int launch_scan(const cuda_ssm_args *a, cudaStream_t st) {
    constexpr int PB = SCAN_WARPS * (32 / LPP);
    int TC = (int)(4096 / a->S);
    TC = TC < 8 ? 8 : (TC > 64 ? 64 : TC);
    const size_t smem = ((size_t)2 * TC * a->S + 2 * TC + (size_t)TC * PB) * sizeof(float);
    const dim3 grid(ops_blocks(a->hd, PB), (unsigned)a->nh, a->row_slot ? (unsigned)a->nb : 1u);
    cu_launch(ssm_scan_kernel<NPL, LPP>, grid, SCAN_WARPS * 32, smem, st, *a, TC);
    OPS_LAUNCH_CHECK("ssm scan");
    return FP4MOE_OK;
}

/* ---- tiled scan (prefill) ---------------------------------------------------------------------- */

#ifndef TS_LT
#define TS_LT 32 /* tokens per staged time tile (16 / 32 / 64 measured: 32 best, docs/GPU-NOTES.md) */
#endif
#ifndef TS_YCH
#define TS_YCH 2 /* independent FFMA chains of a row's y over its NR columns, summed at the end (states unchanged,
                    y summed in another order). On the H200 (bench/gpu_ssm, session 19) 2 chains took 0.0795 /
                    0.325 / 1.288 ms a layer at 512 / 2,048 / 8,192 tokens against one chain's 0.0838 / 0.339 /
                    1.344 (-4 to -5%; +0.5% prefill at 512 tokens); 4 chains 0.081 / 0.333 / 1.32 */
#endif

/* cp.async of 16 or 4 bytes global -> shared (sm_80+), and the group fences. */
__device__ __forceinline__ void ts_cp16(float *dst, const float *src) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void ts_cp4(float *dst, const float *src) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void ts_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void ts_wait_prev() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

/* dt and dA of head h at one token, exactly as ssm_scan_kernel computes them. */
__device__ __forceinline__ float2 ts_dt_dA(uint16_t raw, float bias, float dt_lo, float dt_hi, float Ah) {
    float dt = softplus_f(__fadd_rn(ops_bf16_to_f32(raw), bias));
    if (dt < dt_lo) dt = dt_lo;
    if (dt > dt_hi) dt = dt_hi;
    return make_float2(dt, expf(__fmul_rn(dt, Ah)));
}

/* Reduce-scatter of M values per lane over the lanes that differ in bits O, O/2, .., 1 of q: at
 * offset O each lane keeps one half of its values (the upper half when bit O of q is set) and adds
 * the partner's copy of that half. At the end lane q holds the sums of values q*R .. q*R+R-1,
 * R = M / (2*O). (Recursion instead of a loop so that every index is a constant: registers.) */
template <int M, int O>
__device__ __forceinline__ void ts_reduce_scatter(float *acc, int q) {
    if constexpr (O >= 1) {
        const bool upper = (q & O) != 0;
#pragma unroll
        for (int e = 0; e < M / 2; e++) {
            const float lo = acc[e], hi = acc[e + M / 2];
            const float send = upper ? lo : hi, keep = upper ? hi : lo;
            acc[e] = keep + __shfl_xor_sync(0xffffffffu, send, O);
        }
        ts_reduce_scatter<M / 2, O / 2>(acc, q);
    }
}

/* Geometry of the tiled kernel for state size S_, PR rows per thread and W warps per block. */
template <int S_, int PR, int W>
struct ts_geom {
    static constexpr int NR = S_ >= 64 ? 8 : 4;            /* state columns per thread */
    static constexpr int K4 = NR / 4;                      /* float4 chunks per row */
    static constexpr int NL = S_ / NR;                     /* lanes along n (a power of 2, <= 32) */
    static constexpr int PW = 32 / NL;                     /* p lanes per warp */
    static constexpr int PB = W * PW * PR;                 /* p rows per block */
    static constexpr int TT = NL / PR > 8 ? NL / PR : 8;   /* steps per y reduction */
    static constexpr int V = PR * TT;                      /* y partial sums per lane */
    static constexpr int R = V / NL;                       /* y outputs per lane per reduction */
    static constexpr int LT = TS_LT > TT ? TS_LT : TT;     /* tokens per staged tile */
    static constexpr int STAGE = LT * (2 * S_ + PB) + 2 * LT; /* floats: B, C, x, (dt, dA) */
    static_assert(NL <= 32 && 32 % NL == 0 && V % NL == 0 && LT % TT == 0, "ts_geom");
};

template <int S_, int PR, int W>
__global__ void __launch_bounds__(W * 32)
ssm_scan_tiled_kernel(cuda_ssm_args a, int vec) {
    cu_pdl_entry();
    using Gm = ts_geom<S_, PR, W>;
    constexpr int NR = Gm::NR, K4 = Gm::K4, NL = Gm::NL, PW = Gm::PW, PB = Gm::PB, TT = Gm::TT,
                  V = Gm::V, R = Gm::R, LT = Gm::LT, STAGE = Gm::STAGE;
    extern __shared__ __align__(16) float sm[];
    const int hd = (int)a.hd, nh = (int)a.nh, T = (int)a.T;
    const int h = blockIdx.y, g = h / (nh / (int)a.G), pbase = blockIdx.x * PB;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, q = lane % NL, pl = lane / NL;
    const int prow = (warp * PW + pl) * PR; /* first of this thread's PR rows, within the block */
    const float Ah = a.A[h], Dh = a.D[h], bias = a.dt_bias[h];

    /* state tile: rows p = pbase + prow + j, columns n = k*4*NL + 4*q + e (float4 chunk k) */
    float st[PR][NR];
#pragma unroll
    for (int j = 0; j < PR; j++) {
        const int p = pbase + prow + j;
#pragma unroll
        for (int k = 0; k < K4; k++) {
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (p < hd) v = *(const float4 *)(a.state + ((int64_t)h * hd + p) * S_ + k * 4 * NL + 4 * q);
            st[j][4 * k] = v.x; st[j][4 * k + 1] = v.y; st[j][4 * k + 2] = v.z; st[j][4 * k + 3] = v.w;
        }
    }

    /* one tile into stage `s`: B, C (LT x S_ each), x (LT x PB), dtA (LT float2) */
    auto load = [&](int s, int t0) {
        float *Bs = sm + s * STAGE, *Cs = Bs + LT * S_, *xs = Cs + LT * S_;
        const int tc = min(LT, T - t0);
        if (vec) {
            constexpr int SV = S_ / 4, PV = PB / 4;
            for (int i = tid; i < tc * SV; i += W * 32) {
                const int tt = i / SV, v = i % SV;
                const int64_t row = (int64_t)(t0 + tt) * a.bcs + (int64_t)g * S_ + 4 * v;
                ts_cp16(Bs + tt * S_ + 4 * v, a.B + row);
                ts_cp16(Cs + tt * S_ + 4 * v, a.C + row);
            }
            for (int i = tid; i < tc * PV; i += W * 32) {
                const int tt = i / PV, v = i % PV, p = pbase + 4 * v;
                const float *src = a.x + (int64_t)(t0 + tt) * a.xs + (int64_t)h * hd + p;
                float *dst = xs + tt * PB + 4 * v;
                if (p + 4 <= hd) ts_cp16(dst, src);
                else
                    for (int e = 0; e < 4; e++) dst[e] = p + e < hd ? src[e] : 0.0f;
            }
        } else {
            for (int i = tid; i < tc * S_; i += W * 32) {
                const int tt = i / S_, n = i % S_;
                const int64_t row = (int64_t)(t0 + tt) * a.bcs + (int64_t)g * S_ + n;
                ts_cp4(Bs + i, a.B + row);
                ts_cp4(Cs + i, a.C + row);
            }
            for (int i = tid; i < tc * PB; i += W * 32) {
                const int tt = i / PB, p = pbase + i % PB;
                if (p < hd) ts_cp4(xs + i, a.x + (int64_t)(t0 + tt) * a.xs + (int64_t)h * hd + p);
                else xs[i] = 0.0f;
            }
        }
    };
    auto dtA_at = [&](int s) { return (float2 *)(sm + s * STAGE + LT * (2 * S_ + PB)); };

    const int ntiles = (T + LT - 1) / LT;
    load(0, 0);
    ts_commit();
    if (tid < LT && tid < T) dtA_at(0)[tid] = ts_dt_dA(a.dt[(int64_t)tid * a.dts + h], bias, a.dt_lo, a.dt_hi, Ah);
    const int64_t ystride = (int64_t)nh * hd;

    for (int tile = 0; tile < ntiles; tile++) {
        const int s = tile & 1, t0 = tile * LT, tc = min(LT, T - t0);
        /* the next tile's copies and raw dt go out now and land during this tile's recurrence */
        uint16_t raw_next = 0;
        const bool has_next = tile + 1 < ntiles;
        if (has_next) {
            load(s ^ 1, t0 + LT);
            if (tid < LT && t0 + LT + tid < T) raw_next = a.dt[(int64_t)(t0 + LT + tid) * a.dts + h];
        }
        ts_commit();
        ts_wait_prev();
        __syncthreads();
        const float *Bs = sm + s * STAGE, *Cs = Bs + LT * S_, *xs = Cs + LT * S_;
        const float2 *dA2 = dtA_at(s);
#pragma unroll 1
        for (int u0 = 0; u0 < tc; u0 += TT) {
            float acc[V]; /* acc[tt * PR + j]: sum_n st[j][n] * C[n] after step u0 + tt */
#pragma unroll
            for (int tt = 0; tt < TT; tt++) {
                const int u = u0 + tt;
                if (u < tc) {
                    const float2 d = dA2[u];
                    float xv[PR];
                    if constexpr (PR == 2) {
                        const float2 x2 = *(const float2 *)(xs + u * PB + prow);
                        xv[0] = x2.x; xv[1] = x2.y;
                    } else if constexpr (PR == 4) {
                        const float4 x4 = *(const float4 *)(xs + u * PB + prow);
                        xv[0] = x4.x; xv[1] = x4.y; xv[2] = x4.z; xv[3] = x4.w;
                    } else {
#pragma unroll
                        for (int j = 0; j < PR; j++) xv[j] = xs[u * PB + prow + j];
                    }
                    float b[NR], c[NR];
#pragma unroll
                    for (int k = 0; k < K4; k++) {
                        const float4 b4 = *(const float4 *)(Bs + u * S_ + k * 4 * NL + 4 * q);
                        const float4 c4 = *(const float4 *)(Cs + u * S_ + k * 4 * NL + 4 * q);
                        b[4 * k] = b4.x; b[4 * k + 1] = b4.y; b[4 * k + 2] = b4.z; b[4 * k + 3] = b4.w;
                        c[4 * k] = c4.x; c[4 * k + 1] = c4.y; c[4 * k + 2] = c4.z; c[4 * k + 3] = c4.w;
                    }
#pragma unroll
                    for (int j = 0; j < PR; j++) {
                        const float dx = __fmul_rn(d.x, xv[j]);
#if TS_YCH == 1
                        float y = 0.0f;
#pragma unroll
                        for (int i = 0; i < NR; i++) {
                            st[j][i] = fmaf(d.y, st[j][i], __fmul_rn(dx, b[i])); /* as ssm_scan_kernel */
                            y = fmaf(st[j][i], c[i], y);
                        }
                        acc[tt * PR + j] = y;
#else /* TS_YCH independent chains over the columns, summed in order at the end */
                        float yc[TS_YCH];
#pragma unroll
                        for (int m = 0; m < TS_YCH; m++) yc[m] = 0.0f;
#pragma unroll
                        for (int i = 0; i < NR; i++) {
                            st[j][i] = fmaf(d.y, st[j][i], __fmul_rn(dx, b[i])); /* as ssm_scan_kernel */
                            yc[i % TS_YCH] = fmaf(st[j][i], c[i], yc[i % TS_YCH]);
                        }
                        float y = yc[0];
#pragma unroll
                        for (int m = 1; m < TS_YCH; m++) y += yc[m];
                        acc[tt * PR + j] = y;
#endif
                    }
                } else {
#pragma unroll
                    for (int j = 0; j < PR; j++) acc[tt * PR + j] = 0.0f;
                }
            }
            /* reduce-scatter over the NL lanes of one p group: at offset o each lane keeps one half
             * of its m values and adds the partner's copy of that half; after log2(NL) levels lane
             * q holds the sums of values q*R .. q*R+R-1 */
            ts_reduce_scatter<V, NL / 2>(acc, q);
#pragma unroll
            for (int r = 0; r < R; r++) {
                const int e = q * R + r, tt = e / PR, j = e % PR, u = u0 + tt, p = pbase + prow + j;
                if (u < tc && p < hd) {
                    const float xv = xs[u * PB + prow + j];
                    a.y[(int64_t)(t0 + u) * ystride + (int64_t)h * hd + p] = __fadd_rn(acc[r], __fmul_rn(Dh, xv));
                }
            }
        }
        if (has_next && tid < LT && t0 + LT + tid < T)
            dtA_at(s ^ 1)[tid] = ts_dt_dA(raw_next, bias, a.dt_lo, a.dt_hi, Ah);
        __syncthreads(); /* stage s is free for the tile after next; dtA of the next tile visible */
    }
#pragma unroll
    for (int j = 0; j < PR; j++) {
        const int p = pbase + prow + j;
        if (p >= hd) continue;
#pragma unroll
        for (int k = 0; k < K4; k++)
            *(float4 *)(a.state + ((int64_t)h * hd + p) * S_ + k * 4 * NL + 4 * q) =
                make_float4(st[j][4 * k], st[j][4 * k + 1], st[j][4 * k + 2], st[j][4 * k + 3]);
    }
}

template <int S_, int PR, int W>
static int launch_tiled(const cuda_ssm_args *a, cudaStream_t st) {
    using Gm = ts_geom<S_, PR, W>;
    const size_t smem = (size_t)2 * Gm::STAGE * sizeof(float);
    if (smem > 48 * 1024) {
        const cudaError_t e = cudaFuncSetAttribute(ssm_scan_tiled_kernel<S_, PR, W>,
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess)
            return fp4moe_set_error(FP4MOE_ECUDA, "cuda op ssm scan (tiled): %zu bytes of shared memory: %s",
                                    smem, cudaGetErrorString(e));
    }
    const int vec = ((uintptr_t)a->B % 16 == 0) && ((uintptr_t)a->C % 16 == 0) &&
                    ((uintptr_t)a->x % 16 == 0) && a->bcs % 4 == 0 && a->xs % 4 == 0 && a->hd % 4 == 0;
    const dim3 grid(ops_blocks(a->hd, Gm::PB), (unsigned)a->nh);
    cu_launch(ssm_scan_tiled_kernel<S_, PR, W>, grid, W * 32, smem, st, *a, vec);
    OPS_LAUNCH_CHECK("ssm scan (tiled)");
    return FP4MOE_OK;
}

/* Tile variants (PR rows per thread x W warps), for measurements; 0 = the default. */
template <int PR, int W>
static int launch_tiled_s(const cuda_ssm_args *a, cudaStream_t st) {
    switch (a->S) {
    case 16: return launch_tiled<16, PR, W>(a, st);
    case 32: return launch_tiled<32, PR, W>(a, st);
    case 64: return launch_tiled<64, PR, W>(a, st);
    case 128: return launch_tiled<128, PR, W>(a, st);
    default: return launch_tiled<256, PR, W>(a, st);
    }
}

/* ---- chunked SSD on tensor cores (prefill) ------------------------------------------------------
 * The same recurrence in the matrix form of the Mamba-2 paper (Dao & Gu 2024, "Transformers are SSMs",
 * section 6, the chunked SSD algorithm), with the chunks processed in order by one block so that the
 * state passing stays on chip. Block = (head h, SSD_PB consecutive p of head_dim), SSD_W warps; for
 * each chunk of SSD_L tokens t0 .. t0 + L - 1 (i, j: positions in the chunk; S_in the state entering it):
 *   decay(i, j) = prod_{k = j+1 .. i} dA[k] (j <= i; products in fp32, as the recurrence's),
 *   cum[i] = prod_{k <= i} dA[k],  w[j] = decay(L-1, j) dt[j],
 *   M[i][j] = (C[i] . B[j]) decay(i, j) dt[j] for j <= i, else 0                 (C B^T: L x L x S)
 *   y[i][p] = sum_j M[i][j] x[j][p] + cum[i] sum_n C[i][n] S_in[p][n] + D x[i][p]  (L x PB, K = L + S)
 *   S_out[p][n] = cum[L-1] S_in[p][n] + sum_j w[j] x[j][p] B[j][n]                 (PB x S, K = L)
 * (expand S_t = dA[t] S_{t-1} + dt[t] x[t] (outer) B[t] over the chunk). The products run on mma.sync
 * m16n8k8 TF32 with every operand split into hi + lo TF32 parts and the lo * lo term dropped ("3xTF32":
 * about 2^-20 relative error a product, fp32 accumulation; the hi * hi and the two cross products in
 * separate accumulators, i.e. two independent mma chains), so y and the state agree with the fp64
 * recurrence within the scan's tolerance - not bitwise with the recurrent kernels (another order of
 * the fp32 operations).
 * Without a C B^T workspace (PRE false), a chunk in three barrier-separated phases: (1) the decays (8 threads
 * a row); (2) the products that need no M - C B^T (then M, in shared memory), C S_in^T (warps 8-15, one
 * 16 x 16 tile of y each) and the state update (warps 0-7, a 16 x S/4 tile of the state each, held in
 * their accumulators across the chunks) - side by side; (3) M x and y (warps 8-15) while warps 0-7 store
 * the new state for the next chunk's C S_in^T. With the workspace (PRE), one block barrier a chunk: the
 * state team (warps 0-7) and the y team (8-15) share only [1] (chunk c's inputs, dt, dA and S_in
 * visible); the state team computes the decay rows 0-31 and again row L - 1 (w and cum[L-1], the same
 * operations), then updates the state and writes it into the other of two S buffers; the y team computes
 * rows 32-63, C S_in^T, waits for the state team's rows (a named barrier the state team only arrives at),
 * then M x and y. The same operations in both forms; the PRE form measured (H100, gpu_ssm, ms a layer):
 * 512 tokens 0.0577 against 0.0615, 2,048 0.191 against 0.207, 8,192 0.723 against 0.795 for the three
 * phases (docs/PERFORMANCE.md, session 50). The chunk inputs (C, B of the group, x of the head's rows) are
 * copied with cp.async one chunk ahead (double-buffered), the raw dt a chunk ahead in registers. Tokens past
 * T in the last chunk: dt = 0, dA = 1, zero rows (no contribution). Shared-memory rows are padded (+4 / +8
 * floats) so the fragment loads hit distinct banks. */
#define SSD_L 64  /* tokens a chunk */
#define SSD_PB 32 /* head_dim rows a block */
#define SSD_W 16  /* warps a block */
#ifndef SSD_MIN_T
#define SSD_MIN_T 128 /* cuda_ssm_scan takes the SSD from this many tokens (state sizes 64 and 128); H200, ms a
                         layer of the 30B-A3B shape, tiled / SSD: 64 tokens 0.0123 / 0.0128, 256 0.041 / 0.035 */
#endif
#ifndef SSD_PRE_MIN_T
#define SSD_PRE_MIN_T 512 /* calls from this many tokens precompute C B^T when given a workspace; H200, without /
                             with: 256 tokens 0.0351 / 0.0369 ms (the extra launch), 512 0.0644 / 0.0603, 2,048
                             0.240 / 0.206, 8,192 0.931 / 0.789 */
#endif

template <int S_> struct ssd_geom {
    static constexpr int L = SSD_L, PB = SSD_PB;
    static constexpr int SP = S_ + 4, XP = PB + 8, MP = L + 4;
    static constexpr int BUF = 2 * L * SP + L * XP;                        /* C, B, x of one chunk */
    static constexpr int FLOATS = 2 * BUF + 2 * L * MP + PB * SP + 4 * L;  /* + M (x2), S, dt, dA, cum, w */
    /* PRE: + a second S, dt and dA buffer, the chunk's total decay (+3 pad); 225,808 bytes at S 128 */
    static constexpr int FLOATS_PRE = FLOATS + PB * SP + 2 * L + 4;
    static constexpr int NQ = S_ / 32;                                     /* n8 tiles of a state tile */
    static_assert(L == 64 && PB == 32 && SSD_W == 16 && S_ % 32 == 0, "ssd_geom: the warp tiling below");
};

/* v = hi + lo + err, hi and lo TF32 values (the low 13 bits zero), |err| < 2^-20 |v| */
__device__ __forceinline__ void ssd_split(float v, uint32_t &hi, uint32_t &lo) {
#ifdef SSD_SPLIT_CVT /* round to nearest (|err| about 2^-22 |v|), two conversions */
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(hi) : "f"(v));
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(lo) : "f"(v - __uint_as_float(hi)));
#else /* truncation: two bit masks */
    hi = __float_as_uint(v) & 0xffffe000u;
    lo = __float_as_uint(v - __uint_as_float(hi)) & 0xffffe000u;
#endif
}
__device__ __forceinline__ void ssd_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/* big += ah bh, small += al bh + ah bl (3xTF32; the sum is big + small) */
__device__ __forceinline__ void ssd_mma3(float (&big)[4], float (&small)[4], const uint32_t (&ah)[4],
                                         const uint32_t (&al)[4], const uint32_t (&bh)[2], const uint32_t (&bl)[2]) {
#ifndef FP4MOE_INJECT_FAULT_SSD_TF32 /* deliberate fault (tests must catch it): plain TF32, lo parts dropped */
    ssd_mma(small, al, bh[0], bh[1]);
    ssd_mma(small, ah, bl[0], bl[1]);
#endif
    ssd_mma(big, ah, bh[0], bh[1]);
}
/* A fragment (rows r0.., columns k0..) of a row-major array (leading dimension ld); thread (g, t):
 * (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4) */
__device__ __forceinline__ void ssd_ld_a(const float *P, int ld, int r0, int k0, int g, int t, uint32_t (&h)[4],
                                         uint32_t (&l)[4]) {
    ssd_split(P[(r0 + g) * ld + k0 + t], h[0], l[0]);
    ssd_split(P[(r0 + g + 8) * ld + k0 + t], h[1], l[1]);
    ssd_split(P[(r0 + g) * ld + k0 + t + 4], h[2], l[2]);
    ssd_split(P[(r0 + g + 8) * ld + k0 + t + 4], h[3], l[3]);
}
/* The A fragment of the transpose of a row-major array (A[m][k] = P[k][m]) times sc[k] */
__device__ __forceinline__ void ssd_ld_at(const float *P, int ld, const float *sc, int m0, int k0, int g, int t,
                                          uint32_t (&h)[4], uint32_t (&l)[4]) {
    const float s0 = sc[k0 + t], s1 = sc[k0 + t + 4];
    ssd_split(P[(k0 + t) * ld + m0 + g] * s0, h[0], l[0]);
    ssd_split(P[(k0 + t) * ld + m0 + g + 8] * s0, h[1], l[1]);
    ssd_split(P[(k0 + t + 4) * ld + m0 + g] * s1, h[2], l[2]);
    ssd_split(P[(k0 + t + 4) * ld + m0 + g + 8] * s1, h[3], l[3]);
}
/* B fragment (k0.., n0..) of B[k][n] = P[n * ld + k] (stored by output column) */
__device__ __forceinline__ void ssd_ld_bn(const float *P, int ld, int k0, int n0, int g, int t, uint32_t (&h)[2],
                                          uint32_t (&l)[2]) {
    ssd_split(P[(n0 + g) * ld + k0 + t], h[0], l[0]);
    ssd_split(P[(n0 + g) * ld + k0 + t + 4], h[1], l[1]);
}
/* B fragment of B[k][n] = P[k * ld + n] (stored by k) */
__device__ __forceinline__ void ssd_ld_bk(const float *P, int ld, int k0, int n0, int g, int t, uint32_t (&h)[2],
                                          uint32_t (&l)[2]) {
    ssd_split(P[(k0 + t) * ld + n0 + g], h[0], l[0]);
    ssd_split(P[(k0 + t + 4) * ld + n0 + g], h[1], l[1]);
}

/* big / small (+)= A B over k in [0, K) by k8 steps for NQ n8 tiles of a warp (3xTF32): lda(k0, ah, al)
 * loads the A fragment, ldb(k0, q, bh, bl) the B fragment of tile q; tile q takes part when q < nq. */
template <int NQ, int UNROLL, class LA, class LB>
__device__ __forceinline__ void ssd_product(float (&big)[NQ][4], float (&small)[NQ][4], int K, int nq, LA lda, LB ldb) {
#pragma unroll UNROLL
    for (int k0 = 0; k0 < K; k0 += 8) {
        uint32_t ah[4], al[4];
        lda(k0, ah, al);
#pragma unroll
        for (int q = 0; q < NQ; q++) {
            if (q < nq) {
                uint32_t bh[2], bl[2];
                ldb(k0, q, bh, bl);
                ssd_mma3(big[q], small[q], ah, al, bh, bl);
            }
        }
    }
}

/* C B^T of every chunk (grid x) and group (grid y) of the call, for ssm_ssd_kernel<S_, true>: the
 * lower-triangle tiles of G[c][g] (L x L fp32, row-major) at a.ws + (c * G + g) * L * L (the tiles above
 * the diagonal are not written, and the scan kernel copies only the written ones). 8 warps,
 * 20 n8 tiles: warp w takes the m16 block 0 1 1 2 2 3 3 3 [w], n8 tiles from 0 0 2 0 3 0 3 6 [w],
 * 2 2 2 3 3 3 3 2 [w] of them. Rows past T: zero inputs. The same 3xTF32 products as the scan kernel
 * computes them itself. */
template <int S_>
__global__ void __launch_bounds__(256)
ssm_ssd_cb_kernel(cuda_ssm_args a, int vec) {
    cu_pdl_entry();
    using Gm = ssd_geom<S_>;
    constexpr int L = Gm::L, SP = Gm::SP;
    extern __shared__ __align__(16) float sm[];
    float *Cs = sm, *Bs = sm + L * SP;
    const int c = blockIdx.x, grp = blockIdx.y, T = (int)a.T, t0 = c * L, tc = min(L, T - t0);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    if (vec) {
        constexpr int SV = S_ / 4;
        for (int i = tid; i < L * SV; i += 256) {
            const int r = i / SV, v = i % SV;
            float4 cv = make_float4(0.0f, 0.0f, 0.0f, 0.0f), bv = cv;
            if (r < tc) {
                const int64_t row = (int64_t)(t0 + r) * a.bcs + (int64_t)grp * S_ + 4 * v;
                cv = *(const float4 *)(a.C + row);
                bv = *(const float4 *)(a.B + row);
            }
            *(float4 *)(Cs + r * SP + 4 * v) = cv;
            *(float4 *)(Bs + r * SP + 4 * v) = bv;
        }
    } else {
        for (int i = tid; i < L * S_; i += 256) {
            const int r = i / S_, n = i % S_;
            const int64_t row = (int64_t)(t0 + r) * a.bcs + (int64_t)grp * S_ + n;
            Cs[r * SP + n] = r < tc ? a.C[row] : 0.0f;
            Bs[r * SP + n] = r < tc ? a.B[row] : 0.0f;
        }
    }
    __syncthreads();
    const int gm = (0x33322110u >> (4 * warp)) & 15, gq = (0x63030200u >> (4 * warp)) & 15,
              gn = (0x23333222u >> (4 * warp)) & 15;
    float big[3][4] = {}, small[3][4] = {};
    ssd_product<3, 4>(big, small, S_, gn,
        [&](int k0, uint32_t (&ah)[4], uint32_t (&al)[4]) { ssd_ld_a(Cs, SP, 16 * gm, k0, g, t, ah, al); },
        [&](int k0, int q, uint32_t (&bh)[2], uint32_t (&bl)[2]) { ssd_ld_bn(Bs, SP, k0, 8 * (gq + q), g, t, bh, bl); });
    float *Gt = a.ws + ((int64_t)c * a.G + grp) * L * L;
#pragma unroll
    for (int q = 0; q < 3; q++) {
        if (q < gn) {
#pragma unroll
            for (int e = 0; e < 4; e += 2) {
                const int i = 16 * gm + g + 8 * (e >> 1), j = 8 * (gq + q) + 2 * t;
                *(float2 *)(Gt + i * L + j) = make_float2(big[q][e] + small[q][e], big[q][e + 1] + small[q][e + 1]);
            }
        }
    }
}

/* PRE: C B^T from ssm_ssd_cb_kernel (a.ws), copied with the chunk's inputs into the M buffer; else
 * computed here by warps 0-9 (the same products) */
template <int S_, bool PRE>
__global__ void __launch_bounds__(SSD_W * 32, 1)
ssm_ssd_kernel(cuda_ssm_args a, int vec) {
    cu_pdl_entry();
    using Gm = ssd_geom<S_>;
    constexpr int L = Gm::L, PB = Gm::PB, SP = Gm::SP, XP = Gm::XP, MP = Gm::MP, BUF = Gm::BUF, NQ = Gm::NQ;
    constexpr int NT = SSD_W * 32;
    extern __shared__ __align__(16) float sm[];
    constexpr int NS = PRE ? 2 : 1, ND = PRE ? 2 * L : L; /* S buffers; dt / dA floats */
    float *Mb = sm + 2 * BUF, *Ss = Mb + 2 * L * MP, *dtv = Ss + NS * PB * SP, *dAv = dtv + ND, *cum = dAv + ND,
          *wv = cum + L;
    const int hd = (int)a.hd, nh = (int)a.nh, T = (int)a.T;
    const int h = blockIdx.y, grp = h / (nh / (int)a.G), p0 = blockIdx.x * PB;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const float Ah = a.A[h], Dh = a.D[h], bias = a.dt_bias[h];
    const int64_t ystride = (int64_t)nh * hd;
    const bool sw = warp < 8; /* warps 0-7: the state; 8-15: y */

    /* warps 0-7: the state tile rows sp0 + g (+8), columns sn0 + 8 q + 2 t (+1), in the accumulator
     * layout of the state update */
    const int sp0 = 16 * (warp & 1), sn0 = (S_ / 4) * ((warp >> 1) & 3);
    float accS[NQ][4];
#pragma unroll
    for (int q = 0; q < NQ; q++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int p = p0 + sp0 + g + 8 * (e >> 1), n = sn0 + 8 * q + 2 * t + (e & 1);
            accS[q][e] = sw && p < hd ? a.state[((int64_t)h * hd + p) * S_ + n] : 0.0f;
            if (sw) Ss[(sp0 + g + 8 * (e >> 1)) * SP + n] = accS[q][e];
        }
    /* warps 8-15: the y tile rows 16 ym .., columns yp .. yp + 15 */
    const int ym = (warp >> 1) & 3, yp = 16 * (warp & 1);
    /* warps 0-9: a C B^T unit (m16 block gm, n8 tiles gq, gq + 1):
     * (0,0) (1,0) (1,2) (2,0) (2,2) (2,4) (3,0) (3,2) (3,4) (3,6) - the lower triangle */
    const int gm = (int)((0x3333222110ull >> (4 * warp)) & 15), gq = (int)((0x6420420200ull >> (4 * warp)) & 15);

    /* chunk inputs into buffer b: C, B (L x S_, rows of SP), x (L x PB, rows of XP); rows past T zero;
     * PRE: the chunk's C B^T into M buffer b (rows of MP). A thread's pieces are the same in every chunk
     * (NT is a multiple of P, a row's 16-byte pieces): piece v = tid % P of rows tid / P + k NT / P, so the
     * loops below have compile-time trip counts and the addresses move by a constant a k (the row index and
     * 64-bit row product of a generic i loop cost ~15-20 integer instructions a 16-byte copy) */
    constexpr int SV = S_ / 4, PV = PB / 4, LV = L / 4;
    static_assert(NT % SV == 0 && NT % PV == 0 && NT % LV == 0 && (L * SV) % NT == 0 && (L * PV) % NT == 0 &&
                      (L * LV) % NT == 0, "ssm_ssd_kernel: whole rows of pieces a thread");
    auto load = [&](int b, int t0) {
        float *Cs = sm + b * BUF, *Bs = Cs + L * SP, *Xs = Bs + L * SP;
        const int tc = min(L, T - t0);
        if constexpr (PRE) { /* the pieces ssm_ssd_cb_kernel wrote: row r, columns < 16 (r / 16 + 1) */
            constexpr int RS = NT / LV;
            const int r0 = tid / LV, v = tid % LV;
            const float *Gt = a.ws + ((int64_t)(t0 / L) * a.G + grp) * L * L + 4 * tid;
            float *dst = Mb + b * L * MP + r0 * MP + 4 * v;
#pragma unroll
            for (int k = 0; k < L * LV / NT; k++) {
                const int r = r0 + k * RS;
                if (4 * v < 16 * (r / 16 + 1)) ts_cp16(dst + k * RS * MP, Gt + 4 * k * NT);
            }
        }
        if (vec) {
            constexpr int RS = NT / SV;
            const int r0 = tid / SV, v = tid % SV;
            const int64_t step = (int64_t)RS * a.bcs;
            const float *src = a.C + ((int64_t)(t0 + r0) * a.bcs + (int64_t)grp * S_ + 4 * v);
            const uintptr_t cb = (uintptr_t)a.B - (uintptr_t)a.C; /* B's pieces at the same offsets */
            float *dc = Cs + r0 * SP + 4 * v;
#pragma unroll
            for (int k = 0; k < L * SV / NT; k++, src += step) {
                if (r0 + k * RS < tc) {
                    ts_cp16(dc + k * RS * SP, src);
                    ts_cp16(dc + L * SP + k * RS * SP, reinterpret_cast<const float *>((uintptr_t)src + cb));
                } else {
                    *(float4 *)(dc + k * RS * SP) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    *(float4 *)(dc + L * SP + k * RS * SP) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                }
            }
            constexpr int RX = NT / PV;
            const int rx = tid / PV, vx = tid % PV, p = p0 + 4 * vx;
            const float *xsrc = a.x + ((int64_t)(t0 + rx) * a.xs + (int64_t)h * hd + p);
            float *dx = Xs + rx * XP + 4 * vx;
#pragma unroll
            for (int k = 0; k < L * PV / NT; k++) {
                if (rx + k * RX < tc && p < hd) ts_cp16(dx + k * RX * XP, xsrc + (int64_t)k * RX * a.xs);
                else *(float4 *)(dx + k * RX * XP) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
        } else {
            for (int i = tid; i < L * S_; i += NT) {
                const int r = i / S_, n = i % S_;
                if (r < tc) {
                    const int64_t row = (int64_t)(t0 + r) * a.bcs + (int64_t)grp * S_ + n;
                    ts_cp4(Cs + r * SP + n, a.C + row);
                    ts_cp4(Bs + r * SP + n, a.B + row);
                } else {
                    Cs[r * SP + n] = 0.0f;
                    Bs[r * SP + n] = 0.0f;
                }
            }
            for (int i = tid; i < L * PB; i += NT) {
                const int r = i / PB, c = i % PB, p = p0 + c;
                if (r < tc && p < hd) ts_cp4(Xs + r * XP + c, a.x + (int64_t)(t0 + r) * a.xs + (int64_t)h * hd + p);
                else Xs[r * XP + c] = 0.0f;
            }
        }
    };

    const int nchunks = (T + L - 1) / L;
    load(0, 0);
    ts_commit();
    uint16_t raw = tid < L && tid < T ? a.dt[(int64_t)tid * a.dts + h] : 0;

    /* (1) the decays of row i, thread s of the row's 8 (8 consecutive lanes) owning columns j in [8 s, 8 s + 8):
     * loc[jj] = the product of dA over this eighth's tokens in (j, i], times up (the returned product over the
     * eighths above s) = decay(i, j) */
    auto row_decays = [&](const float *dA_, int i, int s, float (&loc)[8]) -> float {
        float r = 1.0f;
#pragma unroll
        for (int jj = 7; jj >= 0; jj--) {
            const int j = 8 * s + jj;
            loc[jj] = r;
            if (j <= i) r = __fmul_rn(r, dA_[j]);
        }
        /* r: the product over this eighth's tokens <= i; the eighths above s multiply in */
        float v = r;
#pragma unroll
        for (int o = 1; o < 8; o <<= 1) {
            const float u = __shfl_down_sync(0xffffffffu, v, o, 8);
            if (s + o < 8) v = __fmul_rn(v, u);
        }
        float up = __shfl_down_sync(0xffffffffu, v, 1, 8);
        if (s == 7) up = 1.0f;
        return up;
    };
    /* dt, dA of token tid of the chunk at t0 (as the recurrent kernels; past T: no step) into dt_, dA_; the next
     * chunk's raw dt into raw */
    auto chunk_dt = [&](float *dt_, float *dA_, int t0, int tc) {
        if (tid < L) {
            float2 d = make_float2(0.0f, 1.0f);
            if (tid < tc) d = ts_dt_dA(raw, bias, a.dt_lo, a.dt_hi, Ah);
            dt_[tid] = d.x;
            dA_[tid] = d.y;
            raw = t0 + L + tid < T ? a.dt[(int64_t)(t0 + L + tid) * a.dts + h] : 0;
        }
    };
    /* warps 8-15: C S_in^T of their y tile */
    auto c_sin = [&](const float *Cs, const float *Sin, float (&yo)[2][4]) {
        float big[2][4] = {}, small[2][4] = {};
        ssd_product<2, 4>(big, small, S_, 2,
            [&](int k0, uint32_t (&ah)[4], uint32_t (&al)[4]) { ssd_ld_a(Cs, SP, 16 * ym, k0, g, t, ah, al); },
            [&](int k0, int q, uint32_t (&bh)[2], uint32_t (&bl)[2]) { ssd_ld_bn(Sin, SP, k0, yp + 8 * q, g, t, bh, bl); });
#pragma unroll
        for (int q = 0; q < 2; q++)
#pragma unroll
            for (int e = 0; e < 4; e++) yo[q][e] = big[q][e] + small[q][e];
    };
    /* warps 0-7: S_out = cl S_in + (w x)^T B, in their accumulators */
    auto state_update = [&](const float *Xs, const float *Bs, float cl) {
        float small[NQ][4] = {};
#pragma unroll
        for (int q = 0; q < NQ; q++)
#pragma unroll
            for (int e = 0; e < 4; e++) accS[q][e] = __fmul_rn(accS[q][e], cl);
        ssd_product<NQ, 2>(accS, small, L, NQ,
            [&](int k0, uint32_t (&ah)[4], uint32_t (&al)[4]) { ssd_ld_at(Xs, XP, wv, sp0, k0, g, t, ah, al); },
            [&](int k0, int q, uint32_t (&bh)[2], uint32_t (&bl)[2]) { ssd_ld_bk(Bs, SP, k0, sn0 + 8 * q, g, t, bh, bl); });
#pragma unroll
        for (int q = 0; q < NQ; q++)
#pragma unroll
            for (int e = 0; e < 4; e++) accS[q][e] += small[q][e];
    };
    /* warps 0-7: their state tile into an S buffer */
    auto state_store = [&](float *S) {
#pragma unroll
        for (int q = 0; q < NQ; q++)
#pragma unroll
            for (int e = 0; e < 4; e++) S[(sp0 + g + 8 * (e >> 1)) * SP + sn0 + 8 * q + 2 * t + (e & 1)] = accS[q][e];
    };
    /* warps 8-15: y = M x + cum o (C S_in^T) + D x of their tile (M x over j <= i only) */
    auto y_out = [&](const float *Ms, const float *Xs, const float (&yo)[2][4], int t0, int tc) {
        float big[2][4] = {}, small[2][4] = {};
        ssd_product<2, 1>(big, small, 16 * ym + 16, 2,
            [&](int k0, uint32_t (&ah)[4], uint32_t (&al)[4]) { ssd_ld_a(Ms, MP, 16 * ym, k0, g, t, ah, al); },
            [&](int k0, int q, uint32_t (&bh)[2], uint32_t (&bl)[2]) { ssd_ld_bk(Xs, XP, k0, yp + 8 * q, g, t, bh, bl); });
#pragma unroll
        for (int q = 0; q < 2; q++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int i = 16 * ym + g + 8 * (e >> 1), pc = yp + 8 * q + 2 * t + (e & 1), p = p0 + pc;
                if (i < tc && p < hd)
                    a.y[(int64_t)(t0 + i) * ystride + (int64_t)h * hd + p] =
                        __fadd_rn(fmaf(cum[i], yo[q][e], big[q][e] + small[q][e]), __fmul_rn(Dh, Xs[i * XP + pc]));
            }
    };
    if constexpr (PRE) { /* one block barrier a chunk (the comment above ssd_geom); named barriers 1 (the state
                            team), 3 (the y team waiting for the state team's decay rows) */
    float *clv = wv + L;
    for (int c = 0; c < nchunks; c++) {
        const int t0 = c * L, tc = min(L, T - t0);
        float *dtc = dtv + (c & 1) * L, *dAc = dAv + (c & 1) * L;
        chunk_dt(dtc, dAc, t0, tc);
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        __syncthreads(); /* [1] */
        if (c + 1 < nchunks) load((c + 1) & 1, t0 + L);
        ts_commit();
        const float *Cs = sm + (c & 1) * BUF, *Bs = Cs + L * SP, *Xs = Bs + L * SP;
        float *Ms = Mb + (c & 1) * L * MP;
#ifndef FP4MOE_INJECT_FAULT_SSD_SBUF /* deliberate fault (tests must catch it): the y team reads the S buffer being written */
        const float *Sin = Ss + (c & 1) * PB * SP;
#else
        const float *Sin = Ss + ((c + 1) & 1) * PB * SP;
#endif
        /* decay rows: thread (row i, eighth s) as phase (1) below */
        auto decay_rows = [&](int i, int s) {
            float loc[8];
            const float up = row_decays(dAc, i, s, loc);
#pragma unroll
            for (int jj = 0; jj < 8; jj++) {
                const int j = 8 * s + jj;
                const float dec = __fmul_rn(loc[jj], up);
                const float m = j <= i ? __fmul_rn(dec, dtc[j]) : 0.0f;
                Ms[i * MP + j] = j <= i ? __fmul_rn(Ms[i * MP + j], m) : 0.0f;
            }
            if (s == 0) cum[i] = __fmul_rn(__fmul_rn(loc[0], up), dAc[0]);
        };
        if (sw) {
            decay_rows(tid >> 3, tid & 7); /* rows 0-31, for the y team */
            asm volatile("bar.arrive 3, 512;" ::: "memory");
            if (warp == 0) { /* row L - 1 (every 8 lanes; lanes 0-7 write) */
                const int s = lane & 7;
                float loc[8];
                const float up = row_decays(dAc, L - 1, s, loc);
                if (lane < 8) {
#pragma unroll
                    for (int jj = 0; jj < 8; jj++) {
                        const int j = 8 * s + jj;
                        wv[j] = __fmul_rn(__fmul_rn(loc[jj], up), dtc[j]);
                    }
                    if (s == 0) clv[0] = __fmul_rn(__fmul_rn(loc[0], up), dAc[0]);
                }
            }
            asm volatile("bar.sync 1, 256;" ::: "memory");
            state_update(Xs, Bs, clv[0]);
            state_store(Ss + ((c + 1) & 1) * PB * SP);
        } else {
            decay_rows(32 + ((tid - 256) >> 3), tid & 7); /* rows 32-63 */
            float yo[2][4];
            c_sin(Cs, Sin, yo);
            asm volatile("bar.sync 3, 512;" ::: "memory"); /* M and cum of both teams */
            y_out(Ms, Xs, yo, t0, tc);
        }
    }
    } else {

    for (int c = 0; c < nchunks; c++) {
        const int t0 = c * L, tc = min(L, T - t0);
        chunk_dt(dtv, dAv, t0, tc);
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        __syncthreads(); /* [1] chunk c's inputs, dt and dA visible; the other buffer free */
        if (c + 1 < nchunks) load((c + 1) & 1, t0 + L);
        ts_commit();
        const float *Cs = sm + (c & 1) * BUF, *Bs = Cs + L * SP, *Xs = Bs + L * SP;
        float *Ms = Mb + (c & 1) * L * MP;

        /* (1) decay products: thread (row i, eighth s) owns columns j in [8 s, 8 s + 8) */
        {
            const int i = tid >> 3, s = tid & 7;
            float loc[8];
            const float up = row_decays(dAv, i, s, loc);
#pragma unroll
            for (int jj = 0; jj < 8; jj++) {
                const int j = 8 * s + jj;
                const float dec = __fmul_rn(loc[jj], up); /* decay(i, j) */
                const float m = j <= i ? __fmul_rn(dec, dtv[j]) : 0.0f;
                if (i == L - 1) wv[j] = m;
                Ms[i * MP + j] = m;
            }
            if (s == 0) cum[i] = __fmul_rn(__fmul_rn(loc[0], up), dAv[0]);
        }
        __syncthreads(); /* [2] decays, cum, w */

        /* (2a) warps 0-9: M = (C B^T) o decays on one unit of the lower triangle */
        if (warp < 10) {
            float big[2][4] = {}, small[2][4] = {};
            ssd_product<2, 4>(big, small, S_, 2,
                [&](int k0, uint32_t (&ah)[4], uint32_t (&al)[4]) { ssd_ld_a(Cs, SP, 16 * gm, k0, g, t, ah, al); },
                [&](int k0, int q, uint32_t (&bh)[2], uint32_t (&bl)[2]) { ssd_ld_bn(Bs, SP, k0, 8 * (gq + q), g, t, bh, bl); });
#pragma unroll
            for (int q = 0; q < 2; q++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int i = 16 * gm + g + 8 * (e >> 1), j = 8 * (gq + q) + 2 * t + (e & 1);
                    Ms[i * MP + j] = __fmul_rn(Ms[i * MP + j], big[q][e] + small[q][e]);
                }
        }
        /* (2b) warps 8-15: C S_in^T for their y tile; warps 0-7: S_out = cum[L-1] S_in + (w x)^T B */
        float yo[2][4];
        if (!sw) c_sin(Cs, Ss, yo);
        else state_update(Xs, Bs, cum[L - 1]);
        __syncthreads(); /* [3] M done; every read of S_in done */

        if (!sw) y_out(Ms, Xs, yo, t0, tc); /* (3) */
        else state_store(Ss);               /* (3) the new state for the next chunk's C S_in^T */
    }
    } /* PRE */
    if (sw) {
#pragma unroll
        for (int q = 0; q < NQ; q++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int p = p0 + sp0 + g + 8 * (e >> 1), n = sn0 + 8 * q + 2 * t + (e & 1);
                if (p < hd) a.state[((int64_t)h * hd + p) * S_ + n] = accS[q][e];
            }
    }
}

/* auto_pre: precompute C B^T only from SSD_PRE_MIN_T tokens (cuda_ssm_scan); else whenever a workspace
 * is given (cuda_ssm_scan_kernel with CUDA_SSM_SSD: tests, measurements) */
template <int S_>
static int launch_ssd(const cuda_ssm_args *a, cudaStream_t st, bool auto_pre) {
    using Gm = ssd_geom<S_>;
    const size_t smem = (size_t)Gm::FLOATS * sizeof(float), smem_pre = (size_t)Gm::FLOATS_PRE * sizeof(float),
                 smem_cb = (size_t)2 * Gm::L * Gm::SP * sizeof(float);
    const bool pre = a->ws && a->ws_floats >= a->G * Gm::L * Gm::L && (uintptr_t)a->ws % 16 == 0 &&
                     (!auto_pre || a->T >= SSD_PRE_MIN_T);
    cudaError_t e = cudaFuncSetAttribute(ssm_ssd_kernel<S_, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_pre);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(ssm_ssd_kernel<S_, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(ssm_ssd_cb_kernel<S_>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_cb);
    if (e != cudaSuccess)
        return fp4moe_set_error(FP4MOE_ECUDA, "cuda op ssm scan (ssd): %zu bytes of shared memory: %s", smem_pre,
                                cudaGetErrorString(e));
    const int vec = ((uintptr_t)a->B % 16 == 0) && ((uintptr_t)a->C % 16 == 0) && ((uintptr_t)a->x % 16 == 0) &&
                    a->bcs % 4 == 0 && a->xs % 4 == 0 && a->hd % 4 == 0;
    const dim3 grid(ops_blocks(a->hd, SSD_PB), (unsigned)a->nh);
    if (!pre) {
        cu_launch(ssm_ssd_kernel<S_, false>, grid, SSD_W * 32, smem, st, *a, vec);
        OPS_LAUNCH_CHECK("ssm scan (ssd)");
        return FP4MOE_OK;
    }
    /* pieces of as many chunks as the workspace holds: C B^T of the piece, then its scan (state carried) */
    const int64_t piece = a->ws_floats / (a->G * Gm::L * Gm::L) * Gm::L;
    for (int64_t t0 = 0; t0 < a->T; t0 += piece) {
        cuda_ssm_args p = *a;
        p.T = a->T - t0 < piece ? a->T - t0 : piece;
        p.x = a->x + t0 * a->xs;
        p.B = a->B + t0 * a->bcs;
        p.C = a->C + t0 * a->bcs;
        p.dt = a->dt + t0 * a->dts;
        p.y = a->y + t0 * a->nh * a->hd;
        cu_launch(ssm_ssd_cb_kernel<S_>, dim3(ops_blocks(p.T, Gm::L), (unsigned)a->G), 256, smem_cb, st, p, vec);
        OPS_LAUNCH_CHECK("ssm scan (ssd C B^T)");
        cu_launch(ssm_ssd_kernel<S_, true>, grid, SSD_W * 32, smem_pre, st, p, vec);
        OPS_LAUNCH_CHECK("ssm scan (ssd)");
    }
    return FP4MOE_OK;
}

extern "C" int64_t cuda_ssm_ws_floats(int64_t T, int64_t G) { return (T + SSD_L - 1) / SSD_L * G * SSD_L * SSD_L; }

static int launch_seq(const cuda_ssm_args *a, cudaStream_t st) {
    if (a->S <= 16) return launch_scan<4, 4>(a, st);
    if (a->S <= 32) return launch_scan<8, 4>(a, st);
    if (a->S <= 64) return launch_scan<8, 8>(a, st);
    if (a->S <= 128) return launch_scan<16, 8>(a, st);
    return launch_scan<32, 8>(a, st);
}

extern "C" int cuda_ssm_scan_kernel(void *stream, const cuda_ssm_args *a, int kernel) {
    if (a->T <= 0) return FP4MOE_OK;
    if (a->S < 1 || a->S > 256 || a->G < 1 || a->nh % a->G || a->nh > 65535 || a->T > (1 << 30) ||
        a->hd > (1 << 20))
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda op ssm scan: ssm_state_size=%lld (at most 256), "
                                "%lld heads in %lld groups", (long long)a->S, (long long)a->nh,
                                (long long)a->G);
    cudaStream_t st = (cudaStream_t)stream;
    if (a->row_slot) {
        if (a->T != 1 || a->nb < 1 || a->nb > 65535)
            return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda op ssm scan: a batch of %lld rows of %lld tokens",
                                    (long long)a->nb, (long long)a->T);
        return launch_seq(a, st);
    }
    const int S = (int)a->S;
    const bool tiled_ok = (S == 16 || S == 32 || S == 64 || S == 128 || S == 256) &&
                          (uintptr_t)a->state % 16 == 0; /* float4 state tiles */
    const bool ssd_ok = (S == 64 || S == 128);
    if (kernel == CUDA_SSM_SSD ||
        (kernel == CUDA_SSM_AUTO && a->T >= SSD_MIN_T && strcmp(env_get(ENV_CUDA_SSM), "tiled"))) {
        const bool ap = kernel == CUDA_SSM_AUTO;
        if (ssd_ok) return S == 64 ? launch_ssd<64>(a, st, ap) : launch_ssd<128>(a, st, ap);
    }
    if (kernel == CUDA_SSM_SEQ || (kernel == CUDA_SSM_AUTO && a->T < 2) || !tiled_ok) return launch_seq(a, st);
    return launch_tiled_s<2, 4>(a, st);
}

extern "C" int cuda_ssm_scan(void *stream, const cuda_ssm_args *a) {
    return cuda_ssm_scan_kernel(stream, a, CUDA_SSM_AUTO);
}
