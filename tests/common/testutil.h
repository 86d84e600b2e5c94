/* Test helpers shared by every test program (CPU and GPU): a seeded RNG, random NVFP4 expert
 * weights and activations (never zeros), idx patterns, output poisoning, and THE tolerance:
 *   |y - ref| <= atol(dtype) + rtol(dtype) * max_n |ref[b][n]|      (spec NVFP4.md section 4)
 * with ref computed in fp64 from the exact dequantized weights. */
#ifndef FP4MOE_TESTUTIL_H
#define FP4MOE_TESTUTIL_H

#include <stdint.h>
#include "fp4moe/gather_qmm.h"
#include "fp4moe/nvfp4.h"
#include "fp4moe/types.h"

/* xoshiro256** seeded through splitmix64. */
typedef struct { uint64_t s[4]; } tu_rng;
void tu_rng_seed(tu_rng *r, uint64_t seed);
uint64_t tu_rng_u64(tu_rng *r);
uint32_t tu_rng_below(tu_rng *r, uint32_t n);         /* uniform in [0, n) */
double tu_rng_uniform(tu_rng *r);                      /* uniform in [0, 1) */
double tu_rng_normal(tu_rng *r);                       /* standard normal */

/* The tolerance (one definition for the whole suite). */
double tu_rtol(fp4moe_dtype dtype);   /* f32 1e-5, f16 2e-3, bf16 1.6e-2 */
double tu_atol(fp4moe_dtype dtype);   /* 4 x the smallest normal of dtype */
/* Element i of an array of dtype (f32, f16 or bf16), as fp64. */
double tu_load_elem(const void *y, fp4moe_dtype dtype, int64_t i);

/* Compares y (B x N of dtype) with ref (fp64). Returns the number of elements out of tolerance
 * (NaN counts); prints the first few with `what` as a label. */
int64_t tu_check_close(const void *y, fp4moe_dtype dtype, const double *ref, int64_t B, int64_t N,
                       const char *what);

/* The full check of one gather_qmm output y (B x N of dtype): every element written (no NaN left
 * from poisoning), rows with idx[b] >= E exactly zero, and the rows[0..nrows) subset within the
 * tolerance of ref (nrows x N, fp64; computed for those rows only). ysub: scratch of nrows x N
 * elements. Returns the number of bad elements; prints the first few. */
int64_t tu_check_gather_output(const void *y, fp4moe_dtype dtype, const uint32_t *idx, int64_t B,
                               int64_t N, int64_t E, const int64_t *rows, int64_t nrows,
                               const double *ref, void *ysub, const char *label);

/* Fills n elements of dtype with NaN. */
void tu_poison(void *y, fp4moe_dtype dtype, int64_t n);

/* Random NVFP4 stacked expert weights: every code value occurs; scale bytes drawn from a realistic
 * range of E4M3 values (subnormal ones included, never 0x7F/0xFF); with_gs: per-expert decode
 * multipliers far from 1 and different per expert (in [1e-3, 1e3], log-uniform). */
typedef struct {
    fp4moe_nvfp4_weights w;
    uint8_t *codes;
    uint8_t *scales;
    float *gs;
} tu_weights;
int tu_weights_random(tu_weights *tw, int64_t E, int64_t N, int64_t K, int with_gs, tu_rng *r);
void tu_weights_free(tu_weights *tw);

/* B x K activations of dtype, N(0,1) values, none exactly zero. Caller frees. */
void *tu_random_x(fp4moe_dtype dtype, int64_t B, int64_t K, tu_rng *r);

/* idx patterns (B entries, caller frees). */
typedef enum {
    TU_IDX_TOPK_SORTED,     /* B/topk tokens, each with topk distinct random experts, sorted */
    TU_IDX_ONE_EXPERT,      /* every row the same expert (the last one) */
    TU_IDX_EMPTY_EXPERTS,   /* sorted; experts 0, E/2 and E-1 (and their neighbours) get no rows */
    TU_IDX_OOR_TAIL,        /* sorted top-k, the last ~1/8 of rows have idx >= E (E, E+1, 0xFFFFFFFF) */
    TU_IDX_DUPLICATES,      /* sorted; tokens pick the same expert several times */
    TU_IDX_UNSORTED         /* random experts in random order, a few >= E */
} tu_idx_pattern;
uint32_t *tu_make_idx(tu_idx_pattern p, int64_t B, int64_t E, int topk, tu_rng *r);
const char *tu_idx_pattern_name(tu_idx_pattern p);

/* setenv(name, value) (unsetenv when value is NULL) for an FP4MOE_* variable, then the library's
 * environment table is read again (it reads each variable once: src/common/env.h). */
void tu_setenv(const char *name, const char *value);

#endif
