/* gpu_attention: fp4moe's CUDA attention kernels at the Nemotron-3-Nano-30B-A3B attention shape
 * (32 query heads, 2 KV heads, head_dim 128, bf16, paged KV cache of 32-token pages), one layer:
 *   prefill  cuda_attention_prefill, one sequence, P = 0 cached positions, T queries (causal)
 *   decode   cuda_attention_decode_split, R rows (one per sequence), each at context L (R = 1 up to
 *            131,072; R = 64 up to 32,768)
 * Median milliseconds of one call (CUDA events around batches of calls). The same shapes run in
 * torch's scaled_dot_product_attention by scripts/attention_peer.py; scripts/gpu-attention-peer.sh
 * runs both and prints the ratio. Prints one line per case: "prefill T ms" / "decode L R ms".
 * Usage: gpu_attention [--quick | --prefill]   (--quick: T and L up to 2,048 / 8,192, fewer repeats;
 * --prefill: the prefill cases only) */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_testutil.h"
#include "kernels/cuda/ops_cuda.h"
#include "testutil.h"

#define NQ 32
#define NKV 2
#define DH 128
#define PAGE 32
#define KVS (NKV * DH)

typedef struct {
    void *q, *k, *v, *pages, *slot, *pos, *out;
    float *scratch;
    int64_t T, R, max_pages;
} ctx_t;

static int do_prefill(void *p) {
    ctx_t *c = p;
    return cuda_attention_prefill(NULL, c->q, c->k, c->v, c->pages, 0, c->T, NQ, NKV, DH, c->out);
}

static int do_decode(void *p) {
    ctx_t *c = p;
    return cuda_attention_decode_split(NULL, c->q, c->k, c->v, c->slot, c->pos, c->pages, c->max_pages, c->R, NQ, NKV,
                                       DH, c->scratch, c->out);
}

int main(int argc, char **argv) {
    gt_require_gpu("gpu_attention");
    const int quick = argc > 1 && !strcmp(argv[1], "--quick"), prefill_only = argc > 1 && !strcmp(argv[1], "--prefill");
    if (argc > 2 || (argc > 1 && !quick && !prefill_only)) {
        fprintf(stderr, "usage: gpu_attention [--quick | --prefill]\n");
        return 2;
    }
    tu_rng r;
    tu_rng_seed(&r, 5);
    const int64_t prefill_T[] = {512, 2048, 8192, 32768};
    const int64_t decode_L[] = {512, 2048, 8192, 32768, 131072};
    const int64_t decode_R[] = {1, 64};
    const int64_t maxtok = 131072 * 2;   /* cache rows: the longest context x the rows sharing it */
    /* one cache: pages in order; decode rows r use pages of their own slot (slot r), all slots
       point at the same physical pages (the data is the same for every row: timing only) */
    void *k = gt_rand_dev(maxtok * KVS, 1.0f, &r, 0), *v = gt_rand_dev(maxtok * KVS, 1.0f, &r, 1);
    printf("# fp4moe attention, nq %d nkv %d head_dim %d, bf16, pages of %d tokens\n", NQ, NKV, DH, PAGE);
    for (size_t i = 0; i < sizeof prefill_T / sizeof prefill_T[0]; i++) {
        const int64_t T = prefill_T[i];
        if (quick && T > 2048) break;
        const int64_t np = (T + PAGE - 1) / PAGE;
        int32_t *pg = malloc((size_t)np * 4);
        for (int64_t p = 0; p < np; p++) pg[p] = (int32_t)p;
        ctx_t c = {.q = gt_rand_dev(T * NQ * DH, 2.0f, &r, 0), .k = k, .v = v, .pages = gt_upload(pg, (size_t)np * 4),
                   .out = gt_upload(NULL, (size_t)(T * NQ * DH) * 2), .T = T};
        const float ms = gt_time_ms(do_prefill, &c, quick ? 3 : 7, T >= 8192 ? 3 : 10);
        printf("prefill %lld %.4f\n", (long long)T, ms);
        fflush(stdout);
        gt_free(c.q);
        gt_free(c.pages);
        gt_free(c.out);
        free(pg);
    }
    for (size_t ri = 0; ri < sizeof decode_R / sizeof decode_R[0] && !prefill_only; ri++)
        for (size_t i = 0; i < sizeof decode_L / sizeof decode_L[0]; i++) {
            const int64_t L = decode_L[i], R = decode_R[ri];
            if ((quick && L > 8192) || (R > 1 && L > 32768)) break;
            const int64_t np = (L + PAGE - 1) / PAGE;
            int32_t *pg = malloc((size_t)(np * R) * 4), *slot = malloc((size_t)R * 4), *pos = malloc((size_t)R * 4);
            for (int64_t s = 0; s < R; s++) {
                slot[s] = (int32_t)s;
                pos[s] = (int32_t)(L - 1);
                for (int64_t p = 0; p < np; p++) pg[s * np + p] = (int32_t)((p + s * 7) % (maxtok / PAGE));
            }
            ctx_t c = {.q = gt_rand_dev(R * NQ * DH, 2.0f, &r, 0), .k = k, .v = v,
                       .pages = gt_upload(pg, (size_t)(np * R) * 4), .slot = gt_upload(slot, (size_t)R * 4),
                       .pos = gt_upload(pos, (size_t)R * 4), .out = gt_upload(NULL, (size_t)(R * NQ * DH) * 2),
                       .scratch = gt_upload(NULL, cuda_attention_decode_scratch(R, NQ, DH)), .R = R,
                       .max_pages = np};
            const float ms = gt_time_ms(do_decode, &c, quick ? 3 : 7, 20);
            printf("decode %lld %lld %.4f\n", (long long)L, (long long)R, ms);
            fflush(stdout);
            gt_free(c.q);
            gt_free(c.pages);
            gt_free(c.slot);
            gt_free(c.pos);
            gt_free(c.out);
            gt_free(c.scratch);
            free(pg);
            free(slot);
            free(pos);
        }
    gt_free(k);
    gt_free(v);
    return 0;
}
