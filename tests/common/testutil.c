#include "testutil.h"

#include "common/env.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void tu_rng_seed(tu_rng *r, uint64_t seed) {
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&seed);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t tu_rng_u64(tu_rng *r) {
    uint64_t *s = r->s;
    uint64_t out = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3];
    s[2] ^= t; s[3] = rotl(s[3], 45);
    return out;
}

uint32_t tu_rng_below(tu_rng *r, uint32_t n) { return (uint32_t)((tu_rng_u64(r) >> 32) * n >> 32); }

double tu_rng_uniform(tu_rng *r) { return (double)(tu_rng_u64(r) >> 11) * 0x1.0p-53; }

double tu_rng_normal(tu_rng *r) {
    double u1 = tu_rng_uniform(r), u2 = tu_rng_uniform(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

double tu_rtol(fp4moe_dtype dtype) {
    switch (dtype) {
    case FP4MOE_F32: return 1e-5;
    case FP4MOE_F16: return 2e-3;
    default: return 1.6e-2;
    }
}

double tu_atol(fp4moe_dtype dtype) {
    switch (dtype) {
    case FP4MOE_F32: return 4.0 * FLT_MIN;
    case FP4MOE_F16: return 4.0 * 6.103515625e-05;
    default: return 4.0 * FLT_MIN; /* bf16 has fp32's exponent range */
    }
}

double tu_load_elem(const void *y, fp4moe_dtype dtype, int64_t i) {
    switch (dtype) {
    case FP4MOE_F32: return ((const float *)y)[i];
    case FP4MOE_F16: return fp4moe_f16_to_f32(((const uint16_t *)y)[i]);
    default: return fp4moe_bf16_to_f32(((const uint16_t *)y)[i]);
    }
}

int64_t tu_check_close(const void *y, fp4moe_dtype dtype, const double *ref, int64_t B, int64_t N,
                       const char *what) {
    const double rtol = tu_rtol(dtype), atol = tu_atol(dtype);
    int64_t bad = 0;
    for (int64_t b = 0; b < B; b++) {
        double rowmax = 0;
        for (int64_t n = 0; n < N; n++) rowmax = fmax(rowmax, fabs(ref[b * N + n]));
        const double lim = atol + rtol * rowmax;
        for (int64_t n = 0; n < N; n++) {
            const double v = tu_load_elem(y, dtype, b * N + n), d = fabs(v - ref[b * N + n]);
            if (!(d <= lim)) {
                if (bad < 5)
                    fprintf(stderr, "  %s: y[%lld][%lld] = %.9g, ref %.9g, |diff| %.3g > %.3g\n", what,
                            (long long)b, (long long)n, v, ref[b * N + n], d, lim);
                bad++;
            }
        }
    }
    if (bad) fprintf(stderr, "  %s: %lld of %lld elements out of tolerance (%s)\n", what, (long long)bad,
                     (long long)(B * N), fp4moe_dtype_name(dtype));
    return bad;
}

int64_t tu_check_gather_output(const void *y, fp4moe_dtype dtype, const uint32_t *idx, int64_t B,
                               int64_t N, int64_t E, const int64_t *rows, int64_t nrows,
                               const double *ref, void *ysub, const char *label) {
    const size_t es = fp4moe_dtype_size(dtype);
    int64_t bad = 0;
    for (int64_t b = 0; b < B; b++) {           /* every row: no NaN left, OOR rows exactly 0 */
        const int oor = idx[b] >= (uint64_t)E;
        for (int64_t n = 0; n < N; n++) {
            const double v = tu_load_elem(y, dtype, b * N + n);
            if (isnan(v) || (oor && v != 0.0)) {
                if (bad < 3) fprintf(stderr, "  %s: y[%lld][%lld] = %g (idx %u)\n", label, (long long)b,
                                     (long long)n, v, idx[b]);
                bad++;
            }
        }
    }
    for (int64_t i = 0; i < nrows; i++)
        memcpy((char *)ysub + i * N * es, (const char *)y + rows[i] * N * es, N * es);
    return bad + tu_check_close(ysub, dtype, ref, nrows, N, label);
}

void tu_poison(void *y, fp4moe_dtype dtype, int64_t n) {
    if (dtype == FP4MOE_F32) {
        for (int64_t i = 0; i < n; i++) ((float *)y)[i] = NAN;
    } else {
        const uint16_t nan16 = dtype == FP4MOE_F16 ? 0x7E00 : 0x7FC0;
        for (int64_t i = 0; i < n; i++) ((uint16_t *)y)[i] = nan16;
    }
}

/* A realistic scale byte: exponent field 1..11 mostly (values 2^-6..2^4), sometimes a subnormal. */
static uint8_t random_scale_byte(tu_rng *r) {
    uint32_t u = tu_rng_below(r, 64);
    if (u == 0) return (uint8_t)(1 + tu_rng_below(r, 7));   /* subnormal 0x01..0x07 */
    uint8_t e = (uint8_t)(1 + tu_rng_below(r, 11)), m = (uint8_t)tu_rng_below(r, 8);
    return (uint8_t)((e << 3) | m);
}

int tu_weights_random(tu_weights *tw, int64_t E, int64_t N, int64_t K, int with_gs, tu_rng *r) {
    memset(tw, 0, sizeof *tw);
    const size_t nc = (size_t)(E * N * (K / 2)), ns = (size_t)(E * N * (K / 16));
    tw->codes = malloc(nc ? nc : 1);
    tw->scales = malloc(ns ? ns : 1);
    if (!tw->codes || !tw->scales) return -1;
    for (size_t i = 0; i < nc; i++) tw->codes[i] = (uint8_t)tu_rng_u64(r);
    for (size_t i = 0; i < ns; i++) tw->scales[i] = random_scale_byte(r);
    if (with_gs) {
        tw->gs = malloc((size_t)E * sizeof(float));
        if (!tw->gs) return -1;
        for (int64_t e = 0; e < E; e++) {
            double l = -3.0 + 6.0 * tu_rng_uniform(r);          /* log10 in [-3, 3] */
            if (fabs(l) < 0.5) l = l < 0 ? l - 0.5 : l + 0.5;     /* keep it far from 1 */
            tw->gs[e] = (float)pow(10.0, l);
        }
    }
    tw->w.codes = tw->codes;
    tw->w.scales = tw->scales;
    tw->w.global_scale = tw->gs;
    tw->w.E = E; tw->w.N = N; tw->w.K = K;
    return 0;
}

void tu_weights_free(tu_weights *tw) {
    free(tw->codes); free(tw->scales); free(tw->gs);
    memset(tw, 0, sizeof *tw);
}

void *tu_random_x(fp4moe_dtype dtype, int64_t B, int64_t K, tu_rng *r) {
    const int64_t n = B * K;
    float *f = malloc((size_t)(n ? n : 1) * sizeof(float));
    if (!f) return NULL;
    for (int64_t i = 0; i < n; i++) {
        double v = tu_rng_normal(r);
        if (fabs(v) < 1e-3) v = v < 0 ? -1e-3 : 1e-3;
        f[i] = (float)v;
    }
    if (dtype == FP4MOE_F32) return f;
    void *out = malloc((size_t)(n ? n : 1) * 2);
    if (out) fp4moe_from_f32(f, n, dtype, out);
    free(f);
    return out;
}

static int cmp_u32(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

static uint32_t pick_nonempty(tu_rng *r, int64_t E) {
    for (;;) {   /* experts 0, 1, E/2, E/2+1, E-2, E-1 stay empty (when E is large enough) */
        uint32_t e = tu_rng_below(r, (uint32_t)E);
        if (E < 8) return e;
        if (e <= 1 || e == E / 2 || e == E / 2 + 1 || e >= E - 2) continue;
        return e;
    }
}

uint32_t *tu_make_idx(tu_idx_pattern p, int64_t B, int64_t E, int topk, tu_rng *r) {
    uint32_t *idx = malloc((size_t)(B ? B : 1) * sizeof(uint32_t));
    if (!idx) return NULL;
    if (topk < 1) topk = 1;
    for (int64_t b = 0; b < B; b++) {
        switch (p) {
        case TU_IDX_ONE_EXPERT: idx[b] = (uint32_t)(E - 1); break;
        case TU_IDX_EMPTY_EXPERTS: idx[b] = pick_nonempty(r, E); break;
        case TU_IDX_DUPLICATES: idx[b] = (b % topk) < topk / 2 + 1 ? (uint32_t)((b / topk * 7) % E)
                                                                   : tu_rng_below(r, (uint32_t)E); break;
        case TU_IDX_UNSORTED: idx[b] = tu_rng_below(r, 16) == 0 ? (uint32_t)(E + tu_rng_below(r, 3))
                                                                : tu_rng_below(r, (uint32_t)E); break;
        default: {
            /* distinct experts inside each token's group of topk rows, when E allows */
            int64_t t0 = b - b % topk;
            uint32_t e;
            int again;
            do {
                e = tu_rng_below(r, (uint32_t)E);
                again = 0;
                if (E >= topk)
                    for (int64_t j = t0; j < b; j++) again |= idx[j] == e;
            } while (again);
            idx[b] = e;
        }
        }
    }
    if (p == TU_IDX_OOR_TAIL) {
        int64_t tail = B / 8 > 0 ? B / 8 : (B > 0 ? 1 : 0);
        for (int64_t b = B - tail; b < B; b++) {
            uint32_t c = tu_rng_below(r, 3);
            idx[b] = c == 0 ? (uint32_t)E : c == 1 ? (uint32_t)E + 1 : 0xFFFFFFFFu;
        }
    }
    if (p != TU_IDX_UNSORTED) qsort(idx, (size_t)B, sizeof(uint32_t), cmp_u32);
    return idx;
}

const char *tu_idx_pattern_name(tu_idx_pattern p) {
    switch (p) {
    case TU_IDX_TOPK_SORTED: return "topk_sorted";
    case TU_IDX_ONE_EXPERT: return "one_expert";
    case TU_IDX_EMPTY_EXPERTS: return "empty_experts";
    case TU_IDX_OOR_TAIL: return "oor_tail";
    case TU_IDX_DUPLICATES: return "duplicates";
    default: return "unsorted";
    }
}

void tu_setenv(const char *name, const char *value) {
    if (value) setenv(name, value, 1);
    else unsetenv(name);
    env_reload();
}
