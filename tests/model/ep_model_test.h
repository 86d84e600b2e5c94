/* The whole-model part of the expert-parallel tests (tests/model/test_ep.c on the CPU,
 * tests/gpu/test_ep_gpu.c on CUDA): one rank's batch of EP_SEQS sequences (those i with
 * i % world == rank; world 1: all), prefill in one step then EP_GEN greedy decode steps; every
 * rank runs every step even after an error (a MoE layer is a collective), so that a failure shows
 * in st instead of a hang. */
#ifndef FP4MOE_TESTS_EP_MODEL_TEST_H
#define FP4MOE_TESTS_EP_MODEL_TEST_H

#include <stdio.h>
#include <string.h>

#include "fp4moe/model.h"

#define EP_SEQS 7
#define EP_GEN 10

typedef struct {
    const fp4moe_model *m;
    fp4moe_ep_group *g;     /* NULL: a plain batch (no expert parallelism) */
    int rank, world;        /* the sequences i with i % world == rank */
    fp4moe_device device;
    fp4moe_dtype act;
    fp4moe_route route;
    int32_t *prompts[EP_SEQS];
    int64_t len[EP_SEQS];
    int32_t ids[EP_SEQS][EP_GEN];
    int st;
    char err[256];
} ep_model_job;

static void *ep_run_rank(void *arg) {
    ep_model_job *j = arg;
    fp4moe_batch_options o;
    fp4moe_batch_options_default(&o);
    o.device = j->device;
    o.act_dtype = j->act;
    o.route = j->route;
    o.max_seqs = EP_SEQS;
    o.max_step_tokens = 512;
    o.ep = j->g;
    o.ep_rank = j->g ? j->rank : 0;
    fp4moe_batch *b = NULL;
    j->st = fp4moe_batch_new(j->m, &o, &b);
    int64_t seq[EP_SEQS], mine[EP_SEQS], n = 0;
    fp4moe_batch_item it[EP_SEQS];
    int32_t next[EP_SEQS];
    for (int i = 0; i < EP_SEQS && !j->st; i++)
        if (i % j->world == j->rank) { /* round-robin: rank r holds sequences r, r + N, ... */
            mine[n] = i;
            j->st = fp4moe_batch_add(b, &seq[n++]);
        }
    for (int step = 0; step <= EP_GEN; step++) {
        int64_t k = 0;
        for (int64_t q = 0; q < n && !j->st; q++) {
            memset(&it[k], 0, sizeof it[k]);
            it[k].seq = seq[q];
            it[k].tokens = step ? &next[q] : j->prompts[mine[q]];
            it[k].n = step ? 1 : j->len[mine[q]];
            it[k].out_token = &next[q];
            k++;
        }
        const int st = b ? fp4moe_batch_step(b, it, k) : FP4MOE_OK;
        if (!j->st && st) j->st = st;
        for (int64_t q = 0; q < k && !j->st; q++) {
            if (it[q].status) j->st = it[q].status;
            else if (step < EP_GEN) j->ids[mine[q]][step] = next[q];
        }
    }
    if (j->st) snprintf(j->err, sizeof j->err, "%s", fp4moe_last_error());
    fp4moe_batch_free(b);
    return NULL;
}

#endif
