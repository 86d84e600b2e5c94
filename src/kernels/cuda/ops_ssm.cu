/* CUDA ops of the Mamba-2 mixer: the causal depthwise conv1d with state (+ silu) and the selective
 * scan with fp32 state. Formulas: spec NEMOTRON_H.md "Mamba-2", src/kernels/cpu/ops_ssm.c (dt
 * clamped to >= time_step_min on both the prefill and the decode path). Contracts: ops_cuda.h.
 *
 * The scan is the recurrent form for prefill too (not the chunked SSD matrix form): it is
 * sequential in time and parallel over heads x head_dim x state, which keeps it one function with
 * the same numbers for prefill and decode (as on the CPU). Tokens are staged through shared memory
 * in time chunks of TC steps. */
#include <math.h>

#include "kernels/cuda/ops_cuda.h"

#define CONV_KMAX 8
#define CONV_THREADS 128
#define CONV_TOKENS 16    /* tokens per thread */

/* ---- causal conv1d ----------------------------------------------------------------------------- */

/* Thread (channel c, CONV_TOKENS consecutive tokens); reads the state for positions before 0. */
__global__ void conv1d_kernel(const uint16_t *x, int64_t xs, int T, int C, const float *w,
                              const float *b, int Kc, const float *state, float *y) {
    const int c = blockIdx.x * CONV_THREADS + threadIdx.x;
    if (c >= C) return;
    const int P = Kc - 1, t0 = blockIdx.y * CONV_TOKENS;
    float wc[CONV_KMAX];
#pragma unroll
    for (int j = 0; j < CONV_KMAX; j++) wc[j] = j < Kc ? w[(int64_t)c * Kc + j] : 0.0f;
    const float bc = b ? b[c] : 0.0f;
    for (int tt = 0; tt < CONV_TOKENS; tt++) {
        const int t = t0 + tt;
        if (t >= T) break;
        float acc = bc;
#pragma unroll
        for (int j = 0; j < CONV_KMAX; j++) {
            if (j >= Kc) break;
            const int src = t - P + j; /* < 0: from the state */
            const float v = src >= 0 ? ops_bf16_to_f32(x[(int64_t)src * xs + c])
                                     : state[(int64_t)(P + src) * C + c];
            acc = __fadd_rn(acc, __fmul_rn(wc[j], v));
        }
        y[(int64_t)t * C + c] = ops_silu(acc);
    }
}

/* New state: the last P inputs of (state ++ x); ascending i reads row T+i > i first (in place). */
__global__ void conv_state_kernel(const uint16_t *x, int64_t xs, int T, int C, int Kc, float *state) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int P = Kc - 1;
    for (int i = 0; i < P; i++) {
        const int src = T - P + i;
        state[(int64_t)i * C + c] = src >= 0 ? ops_bf16_to_f32(x[(int64_t)src * xs + c])
                                             : state[(int64_t)(P + src) * C + c];
    }
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
    conv1d_kernel<<<grid, CONV_THREADS, 0, st>>>(x, xs, (int)T, (int)C, w, b, (int)Kc, state, y);
    OPS_LAUNCH_CHECK("conv1d");
    if (Kc > 1) {
        conv_state_kernel<<<ops_blocks(C, 256), 256, 0, st>>>(x, xs, (int)T, (int)C, (int)Kc, state);
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
    constexpr int PW = 32 / LPP, PB = SCAN_WARPS * PW;
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
            if (dt < a.dt_min) dt = a.dt_min;
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
    const dim3 grid(ops_blocks(a->hd, PB), (unsigned)a->nh);
    ssm_scan_kernel<NPL, LPP><<<grid, SCAN_WARPS * 32, smem, st>>>(*a, TC);
    OPS_LAUNCH_CHECK("ssm scan");
    return FP4MOE_OK;
}

extern "C" int cuda_ssm_scan(void *stream, const cuda_ssm_args *a) {
    if (a->T <= 0) return FP4MOE_OK;
    if (a->S < 1 || a->S > 256 || a->G < 1 || a->nh % a->G || a->nh > 65535 || a->T > (1 << 30) ||
        a->hd > (1 << 20))
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda op ssm scan: ssm_state_size=%lld (at most 256), "
                                "%lld heads in %lld groups", (long long)a->S, (long long)a->nh,
                                (long long)a->G);
    cudaStream_t st = (cudaStream_t)stream;
    if (a->S <= 16) return launch_scan<4, 4>(a, st);
    if (a->S <= 32) return launch_scan<8, 4>(a, st);
    if (a->S <= 64) return launch_scan<8, 8>(a, st);
    if (a->S <= 128) return launch_scan<16, 8>(a, st);
    return launch_scan<32, 8>(a, st);
}
