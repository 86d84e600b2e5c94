/* The Mamba-2 selective scan on CUDA (cuda_ssm_scan, src/kernels/cuda/ops_ssm.cu) against an fp64
 * reference of the recurrence (spec NEMOTRON_H.md "Mamba-2"; src/kernels/cpu/ops_ssm.c):
 *   dt = clamp(softplus(dt_raw + dt_bias), dt_lo, dt_hi); dA = exp(dt * A)
 *   state_h = dA * state_h + dt * x_h (outer) B_g;  y_h = state_h @ C_g + D_h * x_h,  g = h/(nh/G)
 * for each kernel (seq, tiled and the chunked SSD, cuda_ssm_scan_kernel; the SSD with its workspace of
 * C B^T chunks for the whole call, with one of a single chunk (the call in pieces) and without one), on random
 * data (never zeros; a random starting state, as after an earlier prefill chunk; raw dt low enough
 * that the time_step_min clamp is taken) with awkward sizes: T not a multiple of the time tiles,
 * T = 1, several groups, head_dim not a multiple of the block's rows, unaligned strides (the 4-byte
 * copy path), a state size the tiled kernel does not take (seq fallback). Checked:
 *   - y (every token) and the final state within SSM_RTOL of the reference, relative to the largest
 *     |reference| of the token's row (resp. of the head's state);
 *   - the tiled kernels' final states bit-identical to the seq kernel's (same fp32 operations in
 *     the same order), their y within 2e-6 of seq's (only the order of the sum over n differs); the
 *     SSD (3xTF32 matrix products, another order) only against the reference;
 *   - a prefill split in two calls (state carried) gives bit-identical states to one call (the
 *     recurrent kernels; the SSD's two calls are held to the reference's tolerance);
 *   - nothing written outside y, the state and the workspace (NaN guards after each), and no C B^T
 *     tile of the workspace read that the SSD did not write (the workspace poisoned with NaN).
 * Outputs are poisoned (NaN) before every call. Also the mixer's causal conv1d + silu
 * (cuda_conv1d_causal) against an fp64 reference (test_conv1d). Needs a CUDA device; exits 77
 * (skipped) without. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "gpu_testutil.h"
#include "kernels/cuda/ops_cuda.h"
#include "testutil.h"

#define SSM_RTOL 1e-4    /* fp32 recurrence vs fp64 reference (the brief: rel err < 1e-4) */
#define SEQ_RTOL 2e-6    /* tiled vs seq y: the same states, another order of the sum over n */
#define GUARD 64         /* floats after y and after the state that must stay untouched */

typedef struct {
    int64_t T, nh, hd, S, G, xs, bcs, dts;
} shape;

typedef struct {
    shape s;
    float *x, *B, *C, *dt_bias, *A, *D, *state0; /* host */
    uint16_t *dt;
    float dt_lo, dt_hi;
} problem;

static float bf16_to_f32(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint16_t f32_to_bf16_trunc(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

static float *rand_floats(tu_rng *r, int64_t n, double lo, double hi) {
    float *v = malloc((size_t)n * sizeof *v);
    for (int64_t i = 0; i < n; i++) {
        double u = lo + (hi - lo) * tu_rng_uniform(r);
        if (u == 0.0) u = 1e-3;
        v[i] = (float)u;
    }
    return v;
}

static problem make_problem(shape s, uint64_t seed) {
    tu_rng r;
    tu_rng_seed(&r, seed);
    problem p = {.s = s, .dt_lo = 1e-3f, .dt_hi = 1.5f}; /* softplus(2 + 1) > 1.5: clamped */
    p.x = rand_floats(&r, s.T * s.xs, -2.0, 2.0);
    p.B = rand_floats(&r, s.T * s.bcs, -1.0, 1.0);
    p.C = rand_floats(&r, s.T * s.bcs, -1.0, 1.0);
    p.dt = malloc((size_t)(s.T * s.dts) * sizeof *p.dt);
    for (int64_t i = 0; i < s.T * s.dts; i++) /* softplus(-9 - 3) ~ 6e-6 < dt_lo: clamped */
        p.dt[i] = f32_to_bf16_trunc((float)(-9.0 + 11.0 * tu_rng_uniform(&r)));
    p.dt_bias = rand_floats(&r, s.nh, -3.0, 1.0);
    p.A = malloc((size_t)s.nh * sizeof *p.A);
    for (int64_t h = 0; h < s.nh; h++) p.A[h] = -expf((float)(2.8 * tu_rng_uniform(&r))); /* -exp(A_log) */
    p.D = rand_floats(&r, s.nh, -1.5, 1.5);
    p.state0 = rand_floats(&r, s.nh * s.hd * s.S, -1.0, 1.0);
    return p;
}

static void free_problem(problem *p) {
    free(p->x); free(p->B); free(p->C); free(p->dt); free(p->dt_bias); free(p->A); free(p->D);
    free(p->state0);
}

/* fp64 recurrence over tokens [0, T): y (T x nh*hd), state (nh*hd*S) updated in place. */
static void reference(const problem *p, double *y, double *state) {
    const shape s = p->s;
    for (int64_t t = 0; t < s.T; t++)
        for (int64_t h = 0; h < s.nh; h++) {
            const int64_t g = h / (s.nh / s.G);
            double v = (double)bf16_to_f32(p->dt[t * s.dts + h]) + p->dt_bias[h];
            double dt = v > 20.0 ? v : log1p(exp(v));
            if (dt < p->dt_lo) dt = p->dt_lo;
            if (dt > p->dt_hi) dt = p->dt_hi;
            const double dA = exp(dt * p->A[h]);
            const float *B = p->B + t * s.bcs + g * s.S, *C = p->C + t * s.bcs + g * s.S;
            for (int64_t q = 0; q < s.hd; q++) {
                const double xv = p->x[t * s.xs + h * s.hd + q];
                double *st = state + (h * s.hd + q) * s.S, acc = 0.0;
                for (int64_t n = 0; n < s.S; n++) {
                    st[n] = dA * st[n] + dt * xv * B[n];
                    acc += st[n] * C[n];
                }
                y[t * s.nh * s.hd + h * s.hd + q] = acc + p->D[h] * xv;
            }
        }
}

typedef struct {
    float *x, *B, *C, *dt_bias, *A, *D, *state, *y;
    uint16_t *dt;
    float *ws;         /* the SSD's workspace for the whole call, then GUARD floats */
    int64_t ws_floats;
} dev;

static dev upload(const problem *p) {
    const shape s = p->s;
    dev d;
    d.x = gt_upload(p->x, (size_t)(s.T * s.xs) * 4);
    d.B = gt_upload(p->B, (size_t)(s.T * s.bcs) * 4);
    d.C = gt_upload(p->C, (size_t)(s.T * s.bcs) * 4);
    d.dt = gt_upload(p->dt, (size_t)(s.T * s.dts) * 2);
    d.dt_bias = gt_upload(p->dt_bias, (size_t)s.nh * 4);
    d.A = gt_upload(p->A, (size_t)s.nh * 4);
    d.D = gt_upload(p->D, (size_t)s.nh * 4);
    d.state = gt_upload(NULL, (size_t)(s.nh * s.hd * s.S + GUARD) * 4);
    d.y = gt_upload(NULL, (size_t)(s.T * s.nh * s.hd + GUARD) * 4);
    d.ws_floats = cuda_ssm_ws_floats(s.T, s.G);
    d.ws = gt_upload(NULL, (size_t)(d.ws_floats + GUARD) * 4);
    return d;
}

static void free_dev(dev *d) {
    gt_free(d->x); gt_free(d->B); gt_free(d->C); gt_free(d->dt); gt_free(d->dt_bias); gt_free(d->A);
    gt_free(d->D); gt_free(d->state); gt_free(d->y); gt_free(d->ws);
}

/* Runs the scan of tokens [t0, t0+T) with the kernel `mode`, from the state already on the device:
 * seq, tiled, ssd (with the workspace for the whole call), ssd-piece (a workspace of one 64-token
 * chunk: the call in pieces), ssd-nows (no workspace: C B^T inside the scan kernel). */
static int run_scan(const problem *p, const dev *d, int64_t t0, int64_t T, const char *mode) {
    const shape s = p->s;
    const cuda_ssm_args a = {
        .T = T, .nh = s.nh, .hd = s.hd, .S = s.S, .G = s.G,
        .x = d->x + t0 * s.xs, .xs = s.xs, .B = d->B + t0 * s.bcs, .C = d->C + t0 * s.bcs, .bcs = s.bcs,
        .dt = d->dt + t0 * s.dts, .dts = s.dts, .dt_bias = d->dt_bias, .A = d->A, .D = d->D,
        .dt_lo = p->dt_lo, .dt_hi = p->dt_hi, .state = d->state, .y = d->y + t0 * s.nh * s.hd,
        .ws = strcmp(mode, "ssd-nows") ? d->ws : NULL,
        .ws_floats = !strcmp(mode, "ssd-piece") ? cuda_ssm_ws_floats(1, s.G) : d->ws_floats,
    };
    const int kernel = !strcmp(mode, "seq") ? CUDA_SSM_SEQ : !strncmp(mode, "ssd", 3) ? CUDA_SSM_SSD : CUDA_SSM_TILED;
    const int rc = cuda_ssm_scan_kernel(NULL, &a, kernel);
    if (rc) fprintf(stderr, "cuda_ssm_scan (%s): %s\n", mode, fp4moe_last_error());
    GT_CHECK(cudaDeviceSynchronize());
    return rc;
}

/* Largest |got - ref| / max|ref| over rows of n; NaN -> infinity. */
static double row_err(const float *got, const double *ref, int64_t rows, int64_t n) {
    double worst = 0.0;
    for (int64_t r = 0; r < rows; r++) {
        double mx = 0.0, e = 0.0;
        for (int64_t i = 0; i < n; i++) mx = fmax(mx, fabs(ref[r * n + i]));
        for (int64_t i = 0; i < n; i++) {
            const double d = fabs((double)got[r * n + i] - ref[r * n + i]);
            if (!(d <= 1e300)) return INFINITY;
            e = fmax(e, d);
        }
        worst = fmax(worst, e / (mx > 0 ? mx : 1.0));
    }
    return worst;
}

typedef struct {
    float *y, *state; /* host copies, with the guards */
} result;

/* One full run of `mode`: poisoned y, the starting state; split > 0: two calls at token split. */
static result run_mode(const problem *p, const dev *d, const char *mode, int64_t split) {
    const shape s = p->s;
    const int64_t ny = s.T * s.nh * s.hd, ns = s.nh * s.hd * s.S;
    gt_poison(d->y, (size_t)(ny + GUARD) * 4);
    gt_poison(d->state, (size_t)(ns + GUARD) * 4);
    gt_poison(d->ws, (size_t)(d->ws_floats + GUARD) * 4); /* C B^T tiles never written must never be read */
    GT_CHECK(cudaMemcpy(d->state, p->state0, (size_t)ns * 4, cudaMemcpyHostToDevice));
    if (split > 0) {
        assert_int_equal(run_scan(p, d, 0, split, mode), 0);
        assert_int_equal(run_scan(p, d, split, s.T - split, mode), 0);
    } else {
        assert_int_equal(run_scan(p, d, 0, s.T, mode), 0);
    }
    result r = {malloc((size_t)(ny + GUARD) * 4), malloc((size_t)(ns + GUARD) * 4)};
    gt_download(r.y, d->y, (size_t)(ny + GUARD) * 4);
    gt_download(r.state, d->state, (size_t)(ns + GUARD) * 4);
    float *wsg = malloc((size_t)GUARD * 4);
    gt_download(wsg, d->ws + d->ws_floats, (size_t)GUARD * 4);
    for (int i = 0; i < GUARD; i++) { /* the guards stay NaN */
        assert_true(isnan(r.y[ny + i]));
        assert_true(isnan(r.state[ns + i]));
        assert_true(isnan(wsg[i]));
    }
    free(wsg);
    return r;
}

static const char *const k_modes[] = {"seq", "tiled", "ssd", "ssd-piece", "ssd-nows"};
#define N_MODES (int)(sizeof k_modes / sizeof k_modes[0])

static void check_shape(shape s, uint64_t seed) {
    problem p = make_problem(s, seed);
    const int64_t ny = s.T * s.nh * s.hd, ns = s.nh * s.hd * s.S;
    double *yref = malloc((size_t)ny * sizeof *yref), *sref = malloc((size_t)ns * sizeof *sref);
    for (int64_t i = 0; i < ns; i++) sref[i] = p.state0[i];
    reference(&p, yref, sref);
    dev d = upload(&p);
    result seq = {0};
    for (int m = 0; m < N_MODES; m++) {
        result r = run_mode(&p, &d, k_modes[m], 0);
        const double ey = row_err(r.y, yref, s.T, s.nh * s.hd);
        const double es = row_err(r.state, sref, s.nh, s.hd * s.S);
        printf("  T=%-4lld nh=%-3lld hd=%-3lld S=%-3lld G=%-2lld %-8s y err %.2e  state err %.2e\n",
               (long long)s.T, (long long)s.nh, (long long)s.hd, (long long)s.S, (long long)s.G,
               k_modes[m], ey, es);
        assert_true(ey <= SSM_RTOL);
        assert_true(es <= SSM_RTOL);
        if (m == 0) {
            seq = r;
            continue;
        }
        if (!strncmp(k_modes[m], "ssd", 3)) {
            /* the chunked matrix form: another order of the fp32 operations, so only the reference
             * decides; a prefill in two calls (other chunk boundaries) too */
            if (s.T > 1) {
                result r2 = run_mode(&p, &d, k_modes[m], s.T / 2 + 1 == s.T ? 1 : s.T / 2 + 1);
                const double ey2 = row_err(r2.y, yref, s.T, s.nh * s.hd), es2 = row_err(r2.state, sref, s.nh, s.hd * s.S);
                if (ey2 > SSM_RTOL || es2 > SSM_RTOL) printf("  ssd in two calls: y err %.2e  state err %.2e\n", ey2, es2);
                assert_true(ey2 <= SSM_RTOL);
                assert_true(es2 <= SSM_RTOL);
                free(r2.y); free(r2.state);
            }
            free(r.y); free(r.state);
            continue;
        }
        /* against seq: identical states, y up to the order of the sum over n */
        assert_memory_equal(r.state, seq.state, (size_t)ns * 4);
        double *yseq = malloc((size_t)ny * sizeof *yseq);
        for (int64_t i = 0; i < ny; i++) yseq[i] = seq.y[i];
        const double ev = row_err(r.y, yseq, s.T, s.nh * s.hd);
        free(yseq);
        if (ev > SEQ_RTOL) printf("  %s vs seq: y err %.2e\n", k_modes[m], ev);
        assert_true(ev <= SEQ_RTOL);
        /* a prefill in two calls carries the state exactly */
        if (s.T > 1) {
            result r2 = run_mode(&p, &d, k_modes[m], s.T / 2 + 1 == s.T ? 1 : s.T / 2 + 1);
            assert_memory_equal(r2.state, seq.state, (size_t)ns * 4);
            assert_memory_equal(r2.y, r.y, (size_t)ny * 4);
            free(r2.y); free(r2.state);
        }
        free(r.y); free(r.state);
    }
    free(seq.y); free(seq.state);
    free_dev(&d);
    free(yref); free(sref);
    free_problem(&p);
}

/* The 30B-A3B head shape (S 128, head_dim 64), fewer heads; T across several time tiles + tail. */
static void test_nemotron_head_shape(void **st) {
    (void)st;
    const int64_t nh = 8, hd = 64, S = 128, G = 2, di = nh * hd, cd = di + 2 * G * S;
    check_shape((shape){77, nh, hd, S, G, cd, cd, di + cd + nh}, 1);
    check_shape((shape){16, nh, hd, S, G, cd, cd, di + cd + nh}, 2);
}

/* Several SSD chunks (64 tokens) with a tail, and the copy path of unaligned strides with a state of
 * 64 and a head_dim that fills neither of a block's 32-row halves (rows masked). */
static void test_chunks(void **st) {
    (void)st;
    const int64_t nh = 4, hd = 64, S = 128, G = 2, di = nh * hd, cd = di + 2 * G * S;
    check_shape((shape){300, nh, hd, S, G, cd, cd, di + cd + nh}, 11);
    check_shape((shape){70, 4, 12, 64, 2, 51, 131, 5}, 12);
    check_shape((shape){128, 6, 40, 64, 3, 248, 384, 6}, 13);
}

static void test_one_token(void **st) {
    (void)st;
    check_shape((shape){1, 8, 64, 128, 8, 512, 2048, 8}, 3);
    check_shape((shape){1, 4, 12, 32, 2, 48, 64, 4}, 4);
}

static void test_awkward_shapes(void **st) {
    (void)st;
    check_shape((shape){33, 8, 20, 64, 4, 164, 512, 9}, 5);   /* hd not a multiple of the block */
    check_shape((shape){40, 3, 6, 16, 1, 19, 17, 5}, 6);      /* unaligned strides: 4-byte copies */
    check_shape((shape){19, 4, 8, 256, 4, 32, 2048, 4}, 7);   /* S 256 */
    check_shape((shape){17, 6, 12, 32, 3, 72, 192, 6}, 8);    /* S 32, three groups */
    check_shape((shape){9, 4, 8, 100, 2, 32, 200, 4}, 9);     /* S 100: seq fallback */
}

/* All 64 heads and 8 groups of the 30B shape over a few tiles (the grid of the real launch). */
static void test_full_30b_heads(void **st) {
    (void)st;
    const int64_t nh = 64, hd = 64, S = 128, G = 8, di = nh * hd, cd = di + 2 * G * S;
    check_shape((shape){37, nh, hd, S, G, cd, cd, nh}, 10);
}

/* ---- the causal conv1d + silu of the Mamba-2 mixer (cuda_conv1d_causal) -------------------------
 * Against an fp64 reference: y[t][c] = silu(b[c] + sum_j w[c][j] in[t - (Kc-1) + j][c]), in[< 0]
 * from the starting state; the new state the last Kc - 1 inputs (exact copies). Kc = 4 takes the
 * kernel specialised for nemotron_h's width, others the general form; T not a multiple of the
 * kernel's 16-token runs, T shorter than the window, C not a multiple of its 128 channels, a row
 * stride xs > C, no bias. y is poisoned before the call and a guard after it must stay NaN. */
static void conv_case(int64_t T, int64_t C, int64_t Kc, int64_t xs, int bias, uint64_t seed) {
    tu_rng r;
    tu_rng_seed(&r, seed);
    const int64_t P = Kc - 1;
    uint16_t *x = malloc((size_t)(T * xs) * 2);
    float *w = malloc((size_t)(C * Kc) * 4), *b = malloc((size_t)C * 4), *st0 = malloc((size_t)(P * C + 1) * 4);
    float *y = malloc((size_t)(T * C + GUARD) * 4), *st = malloc((size_t)(P * C + 1) * 4);
    assert_true(x && w && b && st0 && y && st);
    for (int64_t i = 0; i < T * xs; i++) x[i] = gt_f2bf((float)(4.0 * tu_rng_uniform(&r) - 2.0));
    for (int64_t i = 0; i < C * Kc; i++) w[i] = (float)(tu_rng_uniform(&r) - 0.5);
    for (int64_t i = 0; i < C; i++) b[i] = (float)(0.5 * tu_rng_uniform(&r) - 0.25);
    for (int64_t i = 0; i < P * C; i++) st0[i] = (float)(2.0 * tu_rng_uniform(&r) - 1.0);
    st0[P * C] = NAN; /* a guard after the state: must stay NaN */
    uint16_t *dx = gt_upload(x, (size_t)(T * xs) * 2);
    float *dw = gt_upload(w, (size_t)(C * Kc) * 4), *db = gt_upload(b, (size_t)C * 4);
    float *dst = gt_upload(st0, (size_t)(P * C + 1) * 4), *dy = gt_upload(NULL, (size_t)(T * C + GUARD) * 4);
    gt_poison(dy, (size_t)(T * C + GUARD) * 4);
    assert_int_equal(cuda_conv1d_causal(NULL, dx, xs, T, C, dw, bias ? db : NULL, Kc, dst, dy), FP4MOE_OK);
    GT_CHECK(cudaDeviceSynchronize());
    gt_download(y, dy, (size_t)(T * C + GUARD) * 4);
    gt_download(st, dst, (size_t)(P * C + 1) * 4);
    double worst = 0.0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t c = 0; c < C; c++) {
            double acc = bias ? b[c] : 0.0;
            for (int64_t j = 0; j < Kc; j++) {
                const int64_t pos = t - P + j;
                const double v = pos >= 0 ? fp4moe_bf16_to_f32(x[pos * xs + c]) : st0[(P + pos) * C + c];
                acc += (double)w[c * Kc + j] * v;
            }
            const double ref = acc / (1.0 + exp(-acc)), e = fabs(y[t * C + c] - ref) / (1.0 + fabs(ref));
            if (isnan(e)) worst = INFINITY; /* an output never written (poisoned NaN) */
            else if (e > worst) worst = e;
        }
    for (int64_t i = 0; i < GUARD; i++)
        if (!isnan(y[T * C + i])) fail_msg("conv1d T=%lld C=%lld Kc=%lld: wrote past y", (long long)T, (long long)C, (long long)Kc);
    if (!isnan(st[P * C])) fail_msg("conv1d T=%lld C=%lld Kc=%lld: wrote past the state", (long long)T, (long long)C, (long long)Kc);
    if (!(worst <= 1e-5))
        fail_msg("conv1d T=%lld C=%lld Kc=%lld xs=%lld: worst error %.3g (> 1e-5)", (long long)T, (long long)C,
                 (long long)Kc, (long long)xs, worst);
    for (int64_t i = 0; i < P; i++)
        for (int64_t c = 0; c < C; c++) {
            const int64_t src = T - P + i;
            const float want = src >= 0 ? fp4moe_bf16_to_f32(x[src * xs + c]) : st0[(P + src) * C + c];
            if (memcmp(&want, &st[i * C + c], 4))
                fail_msg("conv1d T=%lld Kc=%lld: state row %lld channel %lld is %g, not %g", (long long)T, (long long)Kc,
                         (long long)i, (long long)c, st[i * C + c], want);
        }
    gt_free(dx); gt_free(dw); gt_free(db); gt_free(dst); gt_free(dy);
    free(x); free(w); free(b); free(st0); free(y); free(st);
}

static void test_conv1d(void **st) {
    (void)st;
    conv_case(16, 6144, 4, 10304, 1, 11); /* the 30B-A3B xBC rows inside the in_proj rows */
    conv_case(77, 300, 4, 310, 1, 12);    /* several 16-token runs and a tail, C % 128 != 0 */
    conv_case(2, 200, 4, 200, 1, 13);     /* T < Kc - 1: the state shifts through */
    conv_case(1, 129, 4, 129, 0, 14);     /* one token, no bias */
    conv_case(40, 129, 3, 140, 1, 15);    /* the general form */
    conv_case(33, 64, 6, 70, 1, 16);
    conv_case(20, 96, 1, 96, 1, 17);      /* width 1: no state */
}

int main(void) {
    gt_require_gpu("test_ssm_gpu");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_nemotron_head_shape),
        cmocka_unit_test(test_chunks),
        cmocka_unit_test(test_one_token),
        cmocka_unit_test(test_awkward_shapes),
        cmocka_unit_test(test_full_30b_heads),
        cmocka_unit_test(test_conv1d),
    };
    /* FP4MOE_TEST_FILTER: the tests whose names start with it (a sanitizer run of a few shapes) */
    const char *filter = getenv("FP4MOE_TEST_FILTER");
    static char pattern[128];
    if (filter && *filter) {
        snprintf(pattern, sizeof pattern, "%s*", filter);
        cmocka_set_test_filter(pattern);
    }
    return cmocka_run_group_tests(tests, NULL, NULL);
}
