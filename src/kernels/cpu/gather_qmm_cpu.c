/* gather_qmm on the CPU: route choice and the three routes (qmv, expert-batched, dequant + sgemm).
 * Contract: include/fp4moe/gather_qmm.h and docs/spec/NVFP4.md section 4. The drivers here
 * split the work into OpenMP work items; the arithmetic lives in the kernel tables of
 * gather_cpu.h (AVX2 or portable, chosen at run time). Every route: fp32 accumulation, the
 * per-expert global scale applied once in the fp32 epilogue, rows with idx >= E written as zeros. */
#include <cblas.h>
#include <limits.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "fp4moe/gather_qmm.h"
#include "fp4moe/nvfp4.h"
#include "kernels/cpu/gather_cpu.h"
#include "kernels/gather_common.h"

/* Expert-batched tiling: each run is cut into chunks of <= BATCHED_MC rows whose activations are
 * packed once per call (k-major panels of 16 rows); a work item is (chunk, tile of <= BATCHED_NT
 * weight rows); K is walked in steps of BATCHED_KC so that the decoded weight tile (NT x KC fp32,
 * 48 KiB) sits in L2 and one panel's activations (16 x KC fp32, 16 KiB) in L1. Activations are
 * packed in slabs of at most BATCHED_SLAB_FLOATS floats (128 MiB), so any B works. */
#define BATCHED_MC 96   /* multiple of 16 */
#define BATCHED_NT 48   /* multiple of 12 (the micro-kernels' weight-row blocks: 6 and 12) */
#define BATCHED_KC 256
#define BATCHED_PF_CHUNKS 2 /* prefetch distance in K-chunks */
/* Chunks with fewer rows than this use the qmv kernel inside the batched route: for them the
 * 8-row padding of the micro-kernel costs more than the extra decodes (docs/PERFORMANCE.md). */
#ifndef BATCHED_MIN_PANEL_ROWS
#define BATCHED_MIN_PANEL_ROWS 12
#endif
#define BATCHED_SLAB_FLOATS ((int64_t)32 << 20)
/* Dequant + sgemm: a work item is (expert run, tile of <= DQ_NC weight rows), rows in chunks of DQ_MC. */
#define DQ_NC 128
#define DQ_MC 256

typedef struct {
    const fp4moe_nvfp4_weights *w;
    const void *x;
    fp4moe_dtype dtype;
    int64_t esize; /* bytes per x / y element */
    void *y;
    const gather_cpu_kernels *kern;
    float stab[256]; /* E4M3 byte -> fp32 */
} gather_ctx;

static void ctx_init(gather_ctx *c, const fp4moe_nvfp4_weights *w, const void *x, fp4moe_dtype dtype,
                     void *y) {
    c->w = w;
    c->x = x;
    c->dtype = dtype;
    c->esize = (int64_t)fp4moe_dtype_size(dtype);
    c->y = y;
    c->kern = gather_cpu_kernels_select();
    for (int s = 0; s < 256; s++) c->stab[s] = fp4moe_e4m3_to_f32((uint8_t)s);
}

/* Codes / scales of weight row n of the expert whose weights serve the rows of expert e. */
static const uint8_t *expert_codes(const fp4moe_nvfp4_weights *w, int64_t e, int64_t n) {
    return w->codes + (gather_weight_expert(e, w->E) * w->N + n) * (w->K / 2);
}
static const uint8_t *expert_scales(const fp4moe_nvfp4_weights *w, int64_t e, int64_t n) {
    return w->scales + (gather_weight_expert(e, w->E) * w->N + n) * (w->K / 16);
}

static const void *x_row(const gather_ctx *c, int64_t b) {
    return (const char *)c->x + b * c->w->K * c->esize;
}
static void *y_at(const gather_ctx *c, int64_t b, int64_t n) {
    return (char *)c->y + (b * c->w->N + n) * c->esize;
}

/* Zeros the out-of-range runs (expert >= E); returns how many runs are in range. */
static int64_t zero_out_of_range(const gather_ctx *c, const gather_run *runs, int64_t nruns) {
    int64_t in_range = 0;
    for (int64_t i = 0; i < nruns; i++) {
        if (runs[i].expert >= (uint64_t)c->w->E)
            gather_zero_rows(c->y, c->w->N, c->esize, runs[i].start, runs[i].len);
        else
            in_range++;
    }
    return in_range;
}

static float *scratch_alloc(int64_t nfloats) {
    return aligned_alloc(64, (size_t)((nfloats * 4 + 63) / 64 * 64));
}

/* ---- qmv ------------------------------------------------------------------------------------- */

/* x rows [row0, row0 + n) (n <= GATHER_QMV_ROWS) as the qmv kernel takes them: fp32 (in xf unless x
 * is fp32), then in the kernel's own layout (in xq) where it has one. */
static const float *qmv_rows_x(const gather_ctx *c, int64_t row0, int64_t n, float *xf, float *xq) {
    const int64_t K = c->w->K;
    const float *xr = x_row(c, row0);
    if (c->dtype != FP4MOE_F32) {
        c->kern->x_to_f32(xr, c->dtype, n * K, xf);
        xr = xf;
    }
    if (!c->kern->qmv_x) return xr;
    c->kern->qmv_x(xr, K, (int)n, K, xq);
    return xq;
}

static int64_t qmv_ldx(const gather_ctx *c) {
    return c->kern->qmv_ld ? c->kern->qmv_ld(c->w->K) : c->w->K;
}

/* Work items (group of <= GATHER_QMV_ROWS adjacent rows of one expert, piece of N); N is split
 * when there are too few groups to keep every thread busy (decode: B = top-k rows). */
static int route_qmv(const gather_ctx *c, const uint32_t *idx, int64_t B) {
    const int64_t N = c->w->N, K = c->w->K;
    gather_run *runs, *groups = NULL;
    int64_t nruns, ngroups = 0;
    int st = gather_find_runs(idx, B, 0, &runs, &nruns);
    if (st) return st;
    zero_out_of_range(c, runs, nruns);
    for (int64_t i = 0; i < nruns; i++)
        if (runs[i].expert < (uint64_t)c->w->E)
            ngroups += (runs[i].len + GATHER_QMV_ROWS - 1) / GATHER_QMV_ROWS;
    if (ngroups > 0 && !(groups = malloc((size_t)ngroups * sizeof *groups))) {
        free(runs);
        return fp4moe_set_error(FP4MOE_ENOMEM, "gather_qmm qmv: %lld row groups", (long long)ngroups);
    }
    for (int64_t i = 0, g = 0; i < nruns; i++) {
        if (runs[i].expert >= (uint64_t)c->w->E) continue;
        for (int64_t r = 0; r < runs[i].len; r += GATHER_QMV_ROWS)
            groups[g++] = (gather_run){runs[i].start + r,
                                       runs[i].len - r < GATHER_QMV_ROWS ? runs[i].len - r : GATHER_QMV_ROWS,
                                       runs[i].expert};
    }
    free(runs);

    const int64_t nthreads = omp_get_max_threads();
    int64_t pieces = 1;
    if (ngroups < 8 * nthreads) pieces = (8 * nthreads + ngroups - 1) / (ngroups ? ngroups : 1);
    if (pieces > (N + 31) / 32) pieces = (N + 31) / 32;           /* >= 32 outputs per piece */
    if (pieces < 1) pieces = 1;
    const int64_t chunk = ((N + pieces - 1) / pieces + 7) / 8 * 8;
    pieces = (N + chunk - 1) / chunk;
    const int64_t nitems = ngroups * pieces;
    int failed = 0;

#pragma omp parallel if (nitems > 1)
    {
        float *xf = c->dtype == FP4MOE_F32 ? NULL : scratch_alloc(GATHER_QMV_ROWS * K);
        float *xq = c->kern->qmv_x ? scratch_alloc(GATHER_QMV_ROWS * c->kern->qmv_ld(K)) : NULL;
        float *yf = scratch_alloc(GATHER_QMV_ROWS * chunk);
        const int ok = yf && (xf || c->dtype == FP4MOE_F32) && (xq || !c->kern->qmv_x);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < nitems; it++) {
            if (!ok) continue;
            const gather_run g = groups[it / pieces];
            const int64_t n0 = it % pieces * chunk, nn = N - n0 < chunk ? N - n0 : chunk;
            const float *xr = qmv_rows_x(c, g.start, g.len, xf, xq);
            c->kern->qmv(expert_codes(c->w, g.expert, n0), expert_scales(c->w, g.expert, n0), c->stab,
                         K, nn, xr, qmv_ldx(c), (int)g.len, yf, chunk);
            const float gs = gather_expert_gs(c->w->global_scale, g.expert);
            for (int64_t r = 0; r < g.len; r++)
                c->kern->y_from_f32(yf + r * chunk, nn, gs, c->dtype, y_at(c, g.start + r, n0));
        }
        free(xf);
        free(xq);
        free(yf);
    }
    free(groups);
    if (failed) return fp4moe_set_error(FP4MOE_ENOMEM, "gather_qmm qmv: per-thread scratch");
    return FP4MOE_OK;
}

/* ---- work items over (expert run, row chunk, weight-row tile) ----------------------------------- */

typedef struct {
    const gather_run *runs; /* in-range runs only */
    int64_t nruns, mc, nt, ntiles;
    int64_t *first; /* first[i] = index of run i's first item; first[nruns] = item count */
} item_space;

static int items_init(item_space *s, const gather_run *runs, int64_t nruns, int64_t N, int64_t mc,
                      int64_t nt) {
    s->runs = runs;
    s->nruns = nruns;
    s->mc = mc;
    s->nt = nt;
    s->ntiles = (N + nt - 1) / nt;
    s->first = malloc((size_t)(nruns + 1) * sizeof *s->first);
    if (!s->first) return fp4moe_set_error(FP4MOE_ENOMEM, "gather_qmm: %lld work items", (long long)nruns);
    s->first[0] = 0;
    for (int64_t i = 0; i < nruns; i++)
        s->first[i + 1] = s->first[i] + (runs[i].len + mc - 1) / mc * s->ntiles;
    return FP4MOE_OK;
}

/* Item `it` -> expert, rows [*row0, *row0 + *m), weight rows [*n0, *n0 + nt) (clipped by caller). */
static uint32_t item_get(const item_space *s, int64_t it, int64_t *row0, int64_t *m, int64_t *n0) {
    int64_t lo = 0, hi = s->nruns - 1;
    while (lo < hi) { /* the run whose items contain `it` */
        const int64_t mid = (lo + hi + 1) / 2;
        if (s->first[mid] <= it) lo = mid;
        else hi = mid - 1;
    }
    const gather_run *r = &s->runs[lo];
    const int64_t local = it - s->first[lo], chunk = local / s->ntiles;
    *row0 = r->start + chunk * s->mc;
    *m = r->len - chunk * s->mc < s->mc ? r->len - chunk * s->mc : s->mc;
    *n0 = local % s->ntiles * s->nt;
    return r->expert;
}

/* Sorted runs, out-of-range rows zeroed, in-range runs compacted to the front of *runs. */
static int sorted_runs(const gather_ctx *c, const uint32_t *idx, int64_t B, gather_run **runs,
                       int64_t *nin) {
    int64_t nruns;
    int st = gather_find_runs(idx, B, 1, runs, &nruns);
    if (st) return st;
    zero_out_of_range(c, *runs, nruns);
    *nin = 0;
    for (int64_t i = 0; i < nruns; i++)
        if ((*runs)[i].expert < (uint64_t)c->w->E) (*runs)[(*nin)++] = (*runs)[i];
    return FP4MOE_OK;
}

/* ---- expert-batched ----------------------------------------------------------------------------- */

/* A chunk of <= BATCHED_MC rows of one expert's run; its activations packed at xoff (floats) in the
 * slab buffer: panels of 16 rows (the last one 8 or 16 wide), each k-major (element (k, r) at
 * k*PW + r), padding rows zero. */
typedef struct {
    int64_t row0, m, xoff;
    uint32_t expert;
} batched_chunk;

static int64_t pad8(int64_t m) { return (m + 7) / 8 * 8; }

static void pack_x(const gather_ctx *c, const batched_chunk *ch, float *xp, float *tmp) {
    const int64_t K = c->w->K, mp = pad8(ch->m);
    for (int64_t p0 = 0; p0 < mp; p0 += 16) {
        const int64_t pw = mp - p0 >= 16 ? 16 : 8;
        float *panel = xp + p0 * K;
        for (int64_t r = 0; r < pw; r++) {
            if (p0 + r < ch->m) c->kern->x_to_f32(x_row(c, ch->row0 + p0 + r), c->dtype, K, tmp);
            else memset(tmp, 0, (size_t)K * sizeof *tmp);
            for (int64_t k = 0; k < K; k++) panel[k * pw + r] = tmp[k];
        }
    }
}

/* Starts loading the codes and scale bytes of columns [k0, k0 + kc) of weight row j. */
static void prefetch_row(const uint8_t *codes, const uint8_t *scales, int64_t K, int64_t j, int64_t k0,
                         int64_t kc) {
    const uint8_t *p = codes + j * (K / 2) + k0 / 2;
    for (int64_t b = 0; b < kc / 2; b += 64) __builtin_prefetch(p + b);
    __builtin_prefetch(p + kc / 2 - 1);
    __builtin_prefetch(scales + j * (K / 16) + k0 / 16);
}

/* Decodes columns [k0, k0 + kc) of nn weight rows into wbuf (row stride BATCHED_KC), one row at
 * a time, while prefetching the same rows BATCHED_PF_CHUNKS K-chunks ahead (the rows are short
 * strided segments that the hardware prefetcher does not follow). */
static void decode_tile(const gather_ctx *c, const uint8_t *codes, const uint8_t *scales, int64_t nn,
                        int64_t k0, int64_t kc, float *wbuf) {
    const int64_t K = c->w->K, pf0 = k0 + BATCHED_PF_CHUNKS * BATCHED_KC;
    const int64_t pfc = K - pf0 < BATCHED_KC ? K - pf0 : BATCHED_KC;
    for (int64_t j = 0; j < nn; j++) {
        if (pfc > 0) prefetch_row(codes, scales, K, j, pf0, pfc);
        c->kern->decode(codes + j * (K / 2), scales + j * (K / 16), c->stab, K, 1, k0, kc,
                        wbuf + j * BATCHED_KC, BATCHED_KC);
    }
}

/* One work item: rows of chunk ch x weight rows [n0, n0 + nn). Each weight tile (NT x KC) is
 * decoded once, then every row panel of the chunk runs the micro-kernel over it. */
static void batched_item(const gather_ctx *c, const batched_chunk *ch, const float *xp, int64_t n0,
                         float *wbuf, float *cbuf, float *tmp) {
    const int64_t N = c->w->N, K = c->w->K, mp = pad8(ch->m);
    const int64_t nn = N - n0 < BATCHED_NT ? N - n0 : BATCHED_NT, npad = (nn + 11) / 12 * 12;
    const uint8_t *codes = expert_codes(c->w, ch->expert, n0), *scales = expert_scales(c->w, ch->expert, n0);
    if (npad > nn) memset(wbuf + nn * BATCHED_KC, 0, (size_t)((npad - nn) * BATCHED_KC) * sizeof *wbuf);
    for (int64_t j = 0; j < nn; j++) /* the first chunks; later ones are prefetched while decoding */
        for (int64_t k0 = 0; k0 < BATCHED_PF_CHUNKS * BATCHED_KC && k0 < K; k0 += BATCHED_KC)
            prefetch_row(codes, scales, K, j, k0, K - k0 < BATCHED_KC ? K - k0 : BATCHED_KC);
    for (int64_t k0 = 0; k0 < K; k0 += BATCHED_KC) {
        const int64_t kc = K - k0 < BATCHED_KC ? K - k0 : BATCHED_KC;
        decode_tile(c, codes, scales, nn, k0, kc, wbuf); /* once per tile for all rows of the chunk */
        for (int64_t p0 = 0; p0 < mp; p0 += 16) {
            const int mv = mp - p0 >= 16 ? 2 : 1;
            c->kern->panel_gemm(mv, npad, kc, xp + p0 * K + k0 * 8 * mv, wbuf, BATCHED_KC, cbuf + p0,
                                BATCHED_MC, k0 == 0);
        }
    }
    const float gs = gather_expert_gs(c->w->global_scale, ch->expert);
    for (int64_t r = 0; r < ch->m; r++) { /* cbuf is [n][row]: transpose into y's rows */
        for (int64_t j = 0; j < nn; j++) tmp[j] = cbuf[j * BATCHED_MC + r];
        c->kern->y_from_f32(tmp, nn, gs, c->dtype, y_at(c, ch->row0 + r, n0));
    }
}

/* A short chunk (m < BATCHED_MIN_PANEL_ROWS): groups of <= GATHER_QMV_ROWS rows share each block
 * decode through the qmv kernel; xrows holds GATHER_QMV_ROWS x K fp32, xq GATHER_QMV_ROWS x
 * qmv_ld(K) (where the kernel has its own layout), yf GATHER_QMV_ROWS x NT. */
static void batched_item_short(const gather_ctx *c, const batched_chunk *ch, int64_t n0, float *xrows,
                               float *xq, float *yf) {
    const int64_t N = c->w->N, K = c->w->K, nn = N - n0 < BATCHED_NT ? N - n0 : BATCHED_NT;
    const float gs = gather_expert_gs(c->w->global_scale, ch->expert);
    for (int64_t r0 = 0; r0 < ch->m; r0 += GATHER_QMV_ROWS) {
        const int64_t g = ch->m - r0 < GATHER_QMV_ROWS ? ch->m - r0 : GATHER_QMV_ROWS;
        const float *xr = qmv_rows_x(c, ch->row0 + r0, g, xrows, xq);
        c->kern->qmv(expert_codes(c->w, ch->expert, n0), expert_scales(c->w, ch->expert, n0), c->stab, K, nn,
                     xr, qmv_ldx(c), (int)g, yf, BATCHED_NT);
        for (int64_t r = 0; r < g; r++)
            c->kern->y_from_f32(yf + r * BATCHED_NT, nn, gs, c->dtype, y_at(c, ch->row0 + r0 + r, n0));
    }
}

static int route_batched(const gather_ctx *c, const uint32_t *idx, int64_t B) {
    const int64_t N = c->w->N, K = c->w->K, ntiles = (N + BATCHED_NT - 1) / BATCHED_NT;
    gather_run *runs;
    int64_t nruns, nchunks = 0;
    int st = sorted_runs(c, idx, B, &runs, &nruns);
    if (st) return st;
    for (int64_t i = 0; i < nruns; i++) nchunks += (runs[i].len + BATCHED_MC - 1) / BATCHED_MC;
    /* chunks, and slabs of chunks whose packed activations fit BATCHED_SLAB_FLOATS (>= 1 chunk) */
    batched_chunk *chunks = malloc((size_t)(nchunks ? nchunks : 1) * sizeof *chunks);
    int64_t *slab_end = malloc((size_t)(nchunks ? nchunks : 1) * sizeof *slab_end);
    int64_t nslabs = 0, slab_floats = 0, max_slab = 0;
    if (!chunks || !slab_end) {
        free(runs); free(chunks); free(slab_end);
        return fp4moe_set_error(FP4MOE_ENOMEM, "gather_qmm batched: %lld row chunks", (long long)nchunks);
    }
    for (int64_t i = 0, ci = 0; i < nruns; i++)
        for (int64_t r = 0; r < runs[i].len; r += BATCHED_MC, ci++) {
            const int64_t m = runs[i].len - r < BATCHED_MC ? runs[i].len - r : BATCHED_MC;
            if (slab_floats > 0 && m >= BATCHED_MIN_PANEL_ROWS && slab_floats + pad8(m) * K > BATCHED_SLAB_FLOATS) {
                slab_end[nslabs++] = ci;
                slab_floats = 0;
            }
            chunks[ci] = (batched_chunk){runs[i].start + r, m, slab_floats, runs[i].expert};
            if (m >= BATCHED_MIN_PANEL_ROWS) slab_floats += pad8(m) * K; /* short chunks are not packed */
            if (slab_floats > max_slab) max_slab = slab_floats;
        }
    if (nchunks > 0) slab_end[nslabs++] = nchunks;
    free(runs);
    float *xpack = max_slab > 0 ? scratch_alloc(max_slab) : NULL;
    int failed = max_slab > 0 && !xpack;

#pragma omp parallel if (nchunks * ntiles > 1 && !failed)
    {
        float *wbuf = scratch_alloc(BATCHED_NT * BATCHED_KC);
        float *cbuf = scratch_alloc(BATCHED_NT * BATCHED_MC);
        float *tmp = scratch_alloc(K > BATCHED_NT ? K : BATCHED_NT);
        float *xrows = scratch_alloc(GATHER_QMV_ROWS * K), *yf = scratch_alloc(GATHER_QMV_ROWS * BATCHED_NT);
        float *xq = c->kern->qmv_x ? scratch_alloc(GATHER_QMV_ROWS * qmv_ldx(c)) : NULL;
        const int ok = wbuf && cbuf && tmp && xrows && yf && (xq || !c->kern->qmv_x) && !failed;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t sl = 0, c0 = 0; sl < nslabs; c0 = slab_end[sl++]) {
            const int64_t c1 = slab_end[sl];
#pragma omp for schedule(dynamic, 1)
            for (int64_t ci = c0; ci < c1; ci++)
                if (ok && chunks[ci].m >= BATCHED_MIN_PANEL_ROWS) pack_x(c, &chunks[ci], xpack + chunks[ci].xoff, tmp);
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = c0 * ntiles; it < c1 * ntiles; it++) {
                if (!ok) continue;
                const batched_chunk *ch = &chunks[it / ntiles];
                if (ch->m < BATCHED_MIN_PANEL_ROWS)
                    batched_item_short(c, ch, it % ntiles * BATCHED_NT, xrows, xq, yf);
                else
                    batched_item(c, ch, xpack + ch->xoff, it % ntiles * BATCHED_NT, wbuf, cbuf, tmp);
            }
        }
        free(wbuf);
        free(cbuf);
        free(tmp);
        free(xrows);
        free(xq);
        free(yf);
    }
    free(xpack);
    free(chunks);
    free(slab_end);
    if (failed) return fp4moe_set_error(FP4MOE_ENOMEM, "gather_qmm batched: scratch buffers");
    return FP4MOE_OK;
}

/* ---- dequant + sgemm ------------------------------------------------------------------------- */

/* OpenBLAS's thread count is process-wide: the dequant_gemm route runs its GEMMs inside its own OpenMP
 * team, so it holds OpenBLAS at one thread while any call of it runs (from any application thread) and
 * gives back the value from before the first of them when the last ends (fp4moe_set_threads meanwhile
 * sets that value). Guarded by the unnamed OpenMP critical section (one lock of the process; a named one
 * would add a global symbol to the embeddable library). */
static int blas_users, blas_saved;
static void blas_single_enter(void) {
#pragma omp critical
    {
        if (blas_users++ == 0) {
            blas_saved = openblas_get_num_threads();
            openblas_set_num_threads(1);
        }
    }
}
static void blas_single_leave(void) {
#pragma omp critical
    {
        if (--blas_users == 0) openblas_set_num_threads(blas_saved);
    }
}

static int route_dequant_gemm(const gather_ctx *c, const uint32_t *idx, int64_t B) {
    const int64_t N = c->w->N, K = c->w->K;
    gather_run *runs;
    int64_t nruns;
    item_space s;
    if (K > INT_MAX) /* BLAS takes int dimensions */
        return fp4moe_set_error(FP4MOE_EOVERFLOW, "gather_qmm dequant_gemm: K=%lld exceeds the BLAS int range",
                                (long long)K);
    int st = sorted_runs(c, idx, B, &runs, &nruns);
    if (st) return st;
    /* one item per (run, weight-row tile); its rows are walked inside in chunks of DQ_MC */
    if ((st = items_init(&s, runs, nruns, N, INT64_MAX / 2, DQ_NC))) {
        free(runs);
        return st;
    }
    const int64_t nitems = s.first[nruns];
    int failed = 0;
    blas_single_enter();

#pragma omp parallel if (nitems > 1)
    {
        float *xbuf = scratch_alloc(DQ_MC * K);
        float *wbuf = scratch_alloc(DQ_NC * K);
        float *cbuf = scratch_alloc(DQ_MC * DQ_NC);
        const int ok = xbuf && wbuf && cbuf;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < nitems; it++) {
            if (!ok) continue;
            int64_t row0, m, n0;
            const uint32_t e = item_get(&s, it, &row0, &m, &n0);
            const int64_t nn = N - n0 < DQ_NC ? N - n0 : DQ_NC;
            c->kern->decode(expert_codes(c->w, e, n0), expert_scales(c->w, e, n0), c->stab, K, nn, 0, K,
                            wbuf, K);
            const float gs = gather_expert_gs(c->w->global_scale, e);
            for (int64_t r0 = 0; r0 < m; r0 += DQ_MC) {
                const int64_t mm = m - r0 < DQ_MC ? m - r0 : DQ_MC;
                const float *xp = (const float *)x_row(c, row0 + r0);
                if (c->dtype != FP4MOE_F32) {
                    c->kern->x_to_f32(xp, c->dtype, mm * K, xbuf);
                    xp = xbuf;
                }
                /* C (mm x nn) = X (mm x K) * W^T (K x nn) */
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)mm, (int)nn, (int)K, 1.0f, xp,
                            (int)K, wbuf, (int)K, 0.0f, cbuf, (int)nn);
                for (int64_t r = 0; r < mm; r++)
                    c->kern->y_from_f32(cbuf + r * nn, nn, gs, c->dtype, y_at(c, row0 + r0 + r, n0));
            }
        }
        free(xbuf);
        free(wbuf);
        free(cbuf);
    }
    blas_single_leave();
    free(s.first);
    free(runs);
    if (failed) return fp4moe_set_error(FP4MOE_ENOMEM, "gather_qmm dequant_gemm: per-thread scratch");
    return FP4MOE_OK;
}

/* ---- W4A8: int8 activations, integer dot products (gather_q8.h) ------------------------------ */

/* Work: chunks of <= mc rows of one expert's run (mc = GATHER_QMV_ROWS for the qmv route, Q8_MC for
 * the expert-batched one) x pieces of <= Q8_NT weight rows. A slab of consecutive chunks (contiguous rows) is
 * quantized once, then each work item decodes its weight rows Q8_SUB at a time into a per-thread
 * buffer (in L1/L2) and runs every 8-row group of its chunk over them: each weight tile streamed
 * from memory and decoded once for all rows of the chunk. */
#define Q8_MC 96
#define Q8_SUB 16
#define Q8_NT 256 /* most weight rows per work item (bounds the per-thread output buffer) */
#define Q8_SLAB_BYTES ((int64_t)64 << 20)

typedef struct {
    int64_t row0, m;
    uint32_t expert;
} q8_chunk;

/* The end of the slab that starts at chunk c0: consecutive chunks (increasing rows; out-of-range
 * runs may lie between them) whose rows span at most span_max rows, at least one chunk. */
static int64_t slab_end(const q8_chunk *chunks, int64_t nchunks, int64_t c0, int64_t span_max) {
    int64_t c1 = c0 + 1;
    while (c1 < nchunks && chunks[c1].row0 + chunks[c1].m - chunks[c0].row0 <= span_max) c1++;
    return c1;
}

static int route_w4a8(const gather_ctx *c, const uint32_t *idx, int64_t B, int sorted, int64_t mc) {
    const gather_cpu_kernels *kn = c->kern;
    const int64_t N = c->w->N, K = c->w->K, G = kn->q8_group, Kp = (K + G - 1) / G * G, nl = Kp / 8;
    const int64_t row_bytes = Kp + nl * (int64_t)(sizeof(float) + sizeof(int32_t));
    gather_run *runs;
    int64_t nruns, nchunks = 0;
    int st = gather_find_runs(idx, B, sorted, &runs, &nruns);
    if (st) return st;
    zero_out_of_range(c, runs, nruns);
    for (int64_t i = 0; i < nruns; i++)
        if (runs[i].expert < (uint64_t)c->w->E) nchunks += (runs[i].len + mc - 1) / mc;
    q8_chunk *chunks = malloc((size_t)(nchunks ? nchunks : 1) * sizeof *chunks);
    if (!chunks) {
        free(runs);
        return fp4moe_set_error(FP4MOE_ENOMEM, "gather_qmm w4a8: %lld row chunks", (long long)nchunks);
    }
    for (int64_t i = 0, ci = 0; i < nruns; i++) {
        if (runs[i].expert >= (uint64_t)c->w->E) continue;
        for (int64_t r = 0; r < runs[i].len; r += mc)
            chunks[ci++] = (q8_chunk){runs[i].start + r, runs[i].len - r < mc ? runs[i].len - r : mc,
                                      runs[i].expert};
    }
    free(runs);

    /* N pieces (multiples of Q8_SUB, <= Q8_NT rows) and >= 8 work items per thread when possible */
    const int64_t nthreads = omp_get_max_threads();
    int64_t pieces = 1;
    if (nchunks < 8 * nthreads) pieces = (8 * nthreads + nchunks - 1) / (nchunks ? nchunks : 1);
    if (pieces > (N + 31) / 32) pieces = (N + 31) / 32;
    if (pieces < (N + Q8_NT - 1) / Q8_NT) pieces = (N + Q8_NT - 1) / Q8_NT;
    if (pieces < 1) pieces = 1;
    const int64_t chunk_n = ((N + pieces - 1) / pieces + Q8_SUB - 1) / Q8_SUB * Q8_SUB;
    pieces = (N + chunk_n - 1) / chunk_n;
    int64_t slab_rows = Q8_SLAB_BYTES / row_bytes;
    if (slab_rows < mc) slab_rows = mc;
    int64_t max_rows = 0; /* the largest slab's row span */
    for (int64_t c0 = 0, c1; c0 < nchunks; c0 = c1) {
        c1 = slab_end(chunks, nchunks, c0, slab_rows);
        const int64_t span = chunks[c1 - 1].row0 + chunks[c1 - 1].m - chunks[c0].row0;
        if (span > max_rows) max_rows = span;
    }
    int8_t *xq = malloc((size_t)(max_rows * Kp) + 64);
    float *xs = malloc((size_t)(max_rows * nl) * sizeof *xs + 64);
    int32_t *xc = malloc((size_t)(max_rows * nl) * sizeof *xc + 64);
    int failed = !xq || !xs || !xc;

#pragma omp parallel if (nchunks * pieces > 1 && !failed)
    {
        float *xf = scratch_alloc(mc * K);            /* a chunk's rows in fp32 */
        uint8_t *wq = aligned_alloc(64, (size_t)(Q8_SUB * Kp + 63) / 64 * 64);
        float *ws = scratch_alloc(Q8_SUB * nl);
        float *yf = scratch_alloc(mc * chunk_n);
        const int ok = xf && wq && ws && yf && !failed;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t c0 = 0, c1; c0 < nchunks; c0 = c1) {
            c1 = slab_end(chunks, nchunks, c0, slab_rows);
            const int64_t base = chunks[c0].row0; /* the slab's rows lie in [base, base + max_rows) */
#pragma omp for schedule(dynamic, 1)
            for (int64_t ci = c0; ci < c1; ci++) {
                if (!ok) continue;
                const q8_chunk *ch = &chunks[ci];
                const float *xr = x_row(c, ch->row0);
                if (c->dtype != FP4MOE_F32) {
                    kn->x_to_f32(xr, c->dtype, ch->m * K, xf);
                    xr = xf;
                }
                const int64_t o = ch->row0 - base;
                kn->q8_x(xr, ch->m, K, xq + o * Kp, xs + o * nl, xc + o * nl);
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = c0 * pieces; it < c1 * pieces; it++) {
                if (!ok) continue;
                const q8_chunk *ch = &chunks[it / pieces];
                const int64_t n0 = it % pieces * chunk_n, nn = N - n0 < chunk_n ? N - n0 : chunk_n;
                const int64_t o = ch->row0 - base;
                const float gs = gather_expert_gs(c->w->global_scale, ch->expert);
                if (ch->m <= 8 && kn->q8_qmv) { /* one row group: decode in registers */
                    kn->q8_qmv(expert_codes(c->w, ch->expert, n0), expert_scales(c->w, ch->expert, n0), c->stab, K,
                               nn, xq + o * Kp, xs + o * nl, xc + o * nl, (int)ch->m, yf, chunk_n);
                } else {
                    for (int64_t s0 = 0; s0 < nn; s0 += Q8_SUB) { /* each sub-tile decoded once */
                        const int64_t ns = nn - s0 < Q8_SUB ? nn - s0 : Q8_SUB;
                        kn->q8_decode(expert_codes(c->w, ch->expert, n0 + s0),
                                      expert_scales(c->w, ch->expert, n0 + s0), c->stab, K, ns, wq, ws);
                        for (int64_t r0 = 0; r0 < ch->m; r0 += 8)
                            kn->q8_dot(wq, ws, K, ns, xq + (o + r0) * Kp, xs + (o + r0) * nl, xc + (o + r0) * nl,
                                       (int)(ch->m - r0 < 8 ? ch->m - r0 : 8), yf + r0 * chunk_n + s0, chunk_n);
                    }
                }
                for (int64_t r = 0; r < ch->m; r++)
                    kn->y_from_f32(yf + r * chunk_n, nn, gs, c->dtype, y_at(c, ch->row0 + r, n0));
            }
        }
        free(xf);
        free(wq);
        free(ws);
        free(yf);
    }
    free(xq);
    free(xs);
    free(xc);
    free(chunks);
    if (failed) return fp4moe_set_error(FP4MOE_ENOMEM, "gather_qmm w4a8: scratch buffers");
    return FP4MOE_OK;
}

/* ---- route choice and entry points -------------------------------------------------------------- */

/* The CPU route predicate (the only one). qmv unless the input is sorted and has at least
 * FP4MOE_BATCHED_MIN_ROWS rows; then the expert-batched route, which measured faster than
 * dequant + sgemm on both Nemotron MoE shapes (E=128, 3072 rows, bf16, 2-core Zen 3 VM, median
 * wall: up 644-671 vs 732-787 ms, down 700-728 vs 860-874 ms; docs/PERFORMANCE.md, "Route
 * choice"). Short runs (E=128 with B near 64) are no slower there than in qmv, because the batched
 * route gives chunks of < BATCHED_MIN_PANEL_ROWS rows to the qmv kernel. The routes have no tile
 * constraints on B, N or K (every remainder is handled), so the predicate needs no shape test. Environment: FP4MOE_GATHER_ROUTE=qmv|batched|dequant_gemm wins where legal
 * (batched and dequant_gemm need sorted input); else FP4MOE_GATHER_EXPERT_BATCHED=0 gives qmv. */
fp4moe_route fp4moe_gather_route_choose_cpu(const fp4moe_nvfp4_weights *w, int64_t B, int sorted) {
    (void)w;
    const fp4moe_route forced = gather_env_route();
    if (forced == FP4MOE_ROUTE_QMV || (forced != FP4MOE_ROUTE_AUTO && sorted)) return forced;
    if (gather_env_batched_off()) return FP4MOE_ROUTE_QMV;
    if (sorted && B >= FP4MOE_BATCHED_MIN_ROWS) return FP4MOE_ROUTE_BATCHED;
    return FP4MOE_ROUTE_QMV;
}

int fp4moe_gather_qmm_cpu_route(const fp4moe_nvfp4_weights *w, const void *x, fp4moe_dtype dtype,
                                const uint32_t *idx, int64_t B, int sorted, fp4moe_route route,
                                void *y) {
    int st = fp4moe_gather_qmm_check(w, x, idx, B, y);
    if (st) return st;
    if (fp4moe_dtype_size(dtype) == 0)
        return fp4moe_set_error(FP4MOE_EINVAL, "gather_qmm: unknown dtype %d", (int)dtype);
    if (route == FP4MOE_ROUTE_AUTO) route = fp4moe_gather_route_choose_cpu(w, B, sorted);
    if ((route == FP4MOE_ROUTE_BATCHED || route == FP4MOE_ROUTE_DEQUANT_GEMM) && !sorted)
        return fp4moe_set_error(FP4MOE_EINVAL, "gather_qmm: route %s needs sorted idx (sorted=0)",
                                fp4moe_route_name(route));
    if (B == 0) return FP4MOE_OK;
    gather_ctx c;
    ctx_init(&c, w, x, dtype, y);
    switch (route) {
    case FP4MOE_ROUTE_QMV: return route_qmv(&c, idx, B);
    case FP4MOE_ROUTE_BATCHED: return route_batched(&c, idx, B);
    case FP4MOE_ROUTE_DEQUANT_GEMM: return route_dequant_gemm(&c, idx, B);
    default: return fp4moe_set_error(FP4MOE_EINVAL, "gather_qmm: unknown route %d", (int)route);
    }
}

int fp4moe_gather_qmm_cpu_w4a8(const fp4moe_nvfp4_weights *w, const void *x, fp4moe_dtype dtype,
                               const uint32_t *idx, int64_t B, int sorted, fp4moe_route route, void *y) {
    int st = fp4moe_gather_qmm_check(w, x, idx, B, y);
    if (st) return st;
    if (fp4moe_dtype_size(dtype) == 0)
        return fp4moe_set_error(FP4MOE_EINVAL, "gather_qmm w4a8: unknown dtype %d", (int)dtype);
    if (route == FP4MOE_ROUTE_AUTO) route = fp4moe_gather_route_choose_cpu(w, B, sorted);
    if ((route == FP4MOE_ROUTE_BATCHED || route == FP4MOE_ROUTE_DEQUANT_GEMM) && !sorted)
        return fp4moe_set_error(FP4MOE_EINVAL, "gather_qmm w4a8: route %s needs sorted idx (sorted=0)",
                                fp4moe_route_name(route));
    if (route != FP4MOE_ROUTE_QMV && route != FP4MOE_ROUTE_BATCHED && route != FP4MOE_ROUTE_DEQUANT_GEMM)
        return fp4moe_set_error(FP4MOE_EINVAL, "gather_qmm w4a8: unknown route %d", (int)route);
    if (B == 0) return FP4MOE_OK;
    gather_ctx c;
    ctx_init(&c, w, x, dtype, y);
    return route_w4a8(&c, idx, B, sorted, route == FP4MOE_ROUTE_QMV ? GATHER_QMV_ROWS : Q8_MC);
}

int fp4moe_gather_qmm_cpu(const fp4moe_nvfp4_weights *w, const void *x, fp4moe_dtype dtype,
                          const uint32_t *idx, int64_t B, int sorted, void *y) {
    return fp4moe_gather_qmm_cpu_route(w, x, dtype, idx, B, sorted, FP4MOE_ROUTE_AUTO, y);
}

int fp4moe_set_threads(int n) {
    static int default_threads;
    if (n < 0) return fp4moe_set_error(FP4MOE_EINVAL, "threads: %d < 0", n);
    if (!default_threads) default_threads = omp_get_max_threads();
    const int t = n ? n : default_threads;
    omp_set_num_threads(t);
#pragma omp critical
    {
        if (blas_users) blas_saved = t; /* a dequant_gemm call holds OpenBLAS at 1: set when the last ends */
        else openblas_set_num_threads(t);
    }
    return FP4MOE_OK;
}
