/* Expert parallelism's exchange (src/model/ep.c) over the in-process loopback transport: world = 1
 * to 5 ranks, each a thread with its own rows (sorted top-k rows of random tokens plus an
 * out-of-range tail; one rank with no rows, one whose rows all belong to other ranks' experts),
 * random NVFP4 experts (E = 128, 8, and 3 with 4 ranks: a rank that owns no expert and receives no
 * rows), the experts computed by gather_qmm (qmv route) on the owner. Every rank's output must be
 * BITWISE equal to gather_qmm of its own rows on one rank, out-of-range rows zeros; an unsorted idx
 * on one rank makes every rank fail (no rank waits forever); the expert ranges cover [0, E) once. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "common/error.h"
#include "model/ep.h"
#include "testutil.h"

typedef struct {
    const fp4moe_nvfp4_weights *w;
} expert_ctx;

static int experts(void *ctx, const void *x, const uint32_t *idx, int64_t n, void *y) {
    const expert_ctx *c = ctx;
    return fp4moe_gather_qmm_cpu_route(c->w, x, FP4MOE_F32, idx, n, 1, FP4MOE_ROUTE_QMV, y);
}

typedef struct {
    ep_transport *t;
    const fp4moe_nvfp4_weights *w;
    const uint32_t *idx;
    const float *x;
    int64_t B;
    float *y;
    int st;
} rank_job;

static void *run_rank(void *arg) {
    rank_job *j = arg;
    expert_ctx c = {j->w};
    j->st = ep_moe_exchange(j->t, j->w->E, j->idx, j->x, j->B, (size_t)j->w->K * sizeof(float),
                            (size_t)j->w->N * sizeof(float), experts, &c, j->y);
    return NULL;
}

/* rows of rank r: `tokens` tokens x top-k sorted, an out-of-range tail of `oor` rows; kind 1: every
 * row's expert >= E/2 (rank 0 of 2+ then sends everything away), kind 2: no rows */
static uint32_t *rank_rows(tu_rng *r, int64_t E, int64_t tokens, int topk, int64_t oor, int kind, int64_t *B) {
    *B = kind == 2 ? 0 : tokens * topk + oor;
    uint32_t *idx = malloc((size_t)(*B + 1) * sizeof *idx);
    int64_t n = 0;
    if (kind != 2) {
        for (int64_t t = 0; t < tokens * topk; t++) {
            const int64_t lo = kind == 1 ? E / 2 : 0;
            idx[n++] = (uint32_t)(lo + tu_rng_below(r, (uint32_t)(E - lo)));
        }
        for (int64_t i = 1; i < n; i++) /* insertion sort: small */
            for (int64_t j = i; j > 0 && idx[j - 1] > idx[j]; j--) {
                const uint32_t s = idx[j];
                idx[j] = idx[j - 1];
                idx[j - 1] = s;
            }
        for (int64_t i = 0; i < oor; i++) idx[n++] = (uint32_t)(E + i);
    }
    return idx;
}

static void run_world(int64_t E, int64_t N, int64_t K, int world, uint64_t seed, int bad_rank) {
    tu_rng r;
    tu_rng_seed(&r, seed);
    tu_weights tw;
    assert_int_equal(tu_weights_random(&tw, E, N, K, 1, &r), 0);
    ep_transport *t[64];
    assert_int_equal(ep_loopback_create(world, t), FP4MOE_OK);
    rank_job job[64];
    pthread_t th[64];
    uint32_t *idx[64];
    float *x[64];
    for (int k = 0; k < world; k++) {
        const int kind = world > 1 && k == 1 ? 2 : (world > 1 && k == 0 ? 1 : 0);
        int64_t B;
        idx[k] = rank_rows(&r, E, 3 + k * 5, 6 > E ? (int)E : 6, k % 2 ? 3 : 0, kind, &B);
        if (k == bad_rank && B >= 2) { /* break the sort on one rank */
            idx[k][0] = (uint32_t)(E - 1);
            idx[k][1] = 0;
        }
        x[k] = B ? tu_random_x(FP4MOE_F32, B, K, &r) : malloc(1);
        job[k] = (rank_job){t[k], &tw.w, idx[k], x[k], B, malloc((size_t)(B * N + 1) * sizeof(float)), -1};
        tu_poison(job[k].y, FP4MOE_F32, B * N);
    }
    for (int k = 0; k < world; k++) assert_int_equal(pthread_create(&th[k], NULL, run_rank, &job[k]), 0);
    for (int k = 0; k < world; k++) pthread_join(th[k], NULL);
    for (int k = 0; k < world; k++) {
        if (bad_rank >= 0) {
            if (job[k].st == FP4MOE_OK) fail_msg("world %d: rank %d succeeded although rank %d's idx is unsorted", world, k, bad_rank);
            continue;
        }
        if (job[k].st != FP4MOE_OK) fail_msg("world %d rank %d: %s", world, k, fp4moe_last_error());
        const int64_t B = job[k].B;
        float *ref = malloc((size_t)(B * N + 1) * sizeof *ref);
        assert_int_equal(fp4moe_gather_qmm_cpu_route(&tw.w, x[k], FP4MOE_F32, idx[k], B, 1, FP4MOE_ROUTE_QMV, ref),
                         FP4MOE_OK);
        if (memcmp(ref, job[k].y, (size_t)(B * N) * sizeof(float)))
            fail_msg("E=%lld world %d rank %d (%lld rows): the exchanged result differs from one rank's", (long long)E,
                     world, k, (long long)B);
        for (int64_t b = 0; b < B; b++)
            if (idx[k][b] >= (uint32_t)E)
                for (int64_t n = 0; n < N; n++) assert_true(job[k].y[b * N + n] == 0.0f);
        free(ref);
    }
    for (int k = 0; k < world; k++) {
        free(idx[k]);
        free(x[k]);
        free(job[k].y);
    }
    ep_loopback_free(t, world);
    tu_weights_free(&tw);
}

static void test_exchange_equals_one_rank(void **state) {
    (void)state;
    for (int world = 1; world <= 5; world++) {
        run_world(128, 40, 64, world, 10 + (uint64_t)world, -1);
        run_world(8, 24, 32, world, 20 + (uint64_t)world, -1);
    }
    run_world(3, 16, 32, 4, 30, -1); /* 4 ranks, 3 experts: rank 0 owns none */
}

static void test_a_failing_rank_fails_all(void **state) {
    (void)state;
    run_world(128, 40, 64, 3, 40, 2);
    run_world(8, 24, 32, 4, 41, 3);
}

static void test_expert_ranges(void **state) {
    (void)state;
    const int64_t Es[] = {1, 3, 8, 128, 129};
    for (size_t i = 0; i < sizeof Es / sizeof Es[0]; i++)
        for (int world = 1; world <= 9; world++) {
            int64_t next = 0, most = 0, least = Es[i];
            for (int k = 0; k < world; k++) {
                int64_t lo, hi;
                ep_expert_range(Es[i], world, k, &lo, &hi);
                assert_int_equal(lo, next);
                assert_true(hi >= lo);
                next = hi;
                if (hi - lo > most) most = hi - lo;
                if (hi - lo < least) least = hi - lo;
            }
            assert_int_equal(next, Es[i]);
            assert_true(most - least <= 1); /* uneven by one expert at most */
        }
    assert_int_equal(ep_loopback_create(0, NULL), FP4MOE_EINVAL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_exchange_equals_one_rank),
        cmocka_unit_test(test_a_failing_rank_fails_all),
        cmocka_unit_test(test_expert_ranges),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
