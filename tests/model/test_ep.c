/* Expert parallelism's exchange (src/model/ep.c) over the in-process loopback transport: world = 1
 * to 5 ranks, each a thread with its own rows (sorted top-k rows of random tokens plus an
 * out-of-range tail; one rank with no rows, one whose rows all belong to other ranks' experts),
 * random NVFP4 experts (E = 128, 8, and 3 with 4 ranks: a rank that owns no expert and receives no
 * rows), the experts computed by gather_qmm (qmv route) on the owner. Every rank's output must be
 * BITWISE equal to gather_qmm of its own rows on one rank, out-of-range rows zeros; an unsorted idx
 * on one rank makes every rank fail (no rank waits forever); the expert ranges cover [0, E) once.
 * Then whole models (the golden tiny models and the default model, CPU, f32, route qmv): 7
 * sequences spread over N = 1..4 ranks of an expert-parallel group (fp4moe_ep_group), each rank a
 * batch on its own thread, prefill in one step then greedy decode in lockstep (a rank without
 * sequences steps with no rows), every rank either on views of the one model or on its own model
 * loaded with only its share of the experts (MLX stacked in place, ModelOpt per expert, bf16 per
 * expert and a dequantized MLX model's stacked dense experts, both quantized on load): every
 * sequence's greedy ids equal those of one batch holding all. A share model refuses to run outside
 * its rank; a bad range is a load error. Ranks that step at different times with idle rounds in
 * between (fp4moe_ep_idle, a server's ranks) and end together. */
#include <limits.h>
#include <pthread.h>
#include <unistd.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "common/error.h"
#include "fp4moe/model.h"
#include "model/ep.h"
#include "ep_model_test.h"
#include "model_test.h"
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
    /* three exchanges (collectives: every rank does all three): buffers of the call, then a kept
     * scratch grown by the first use and reused by the second; the last one's y is checked */
    ep_scratch ws = {{0}, {0}};
    j->st = ep_moe_exchange(j->t, j->w->E, j->idx, j->x, j->B, (size_t)j->w->K * sizeof(float),
                            (size_t)j->w->N * sizeof(float), experts, &c, j->y, NULL);
    for (int i = 0; i < 2; i++) {
        if (j->B) memset(j->y, 0xff, (size_t)j->B * (size_t)j->w->N * sizeof(float)); /* poisoned before each */
        const int st = ep_moe_exchange(j->t, j->w->E, j->idx, j->x, j->B, (size_t)j->w->K * sizeof(float),
                                       (size_t)j->w->N * sizeof(float), experts, &c, j->y, &ws);
        if (!j->st) j->st = st;
    }
    ep_scratch_free(&ws);
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

/* ---- whole models ------------------------------------------------------------------------------- */

/* The model of directory dir holding rank `rank`'s share of the routed experts only. */
static fp4moe_model *load_share(const char *dir, int world, int rank) {
    fp4moe_load_options o;
    fp4moe_load_options_default(&o);
    o.expert_share = 1;
    fp4moe_model *m = NULL;
    if (fp4moe_model_load(dir, NULL, &m)) fail_msg("%s", fp4moe_last_error());
    fp4moe_ep_range(fp4moe_model_config(m)->n_experts, world, rank, &o.expert_lo, &o.expert_hi);
    fp4moe_model_free(m);
    m = NULL;
    if (fp4moe_model_load(dir, &o, &m)) fail_msg("%s share %d/%d: %s", dir, rank, world, fp4moe_last_error());
    return m;
}

/* share_dir: NULL: every rank runs the one model m (each sees views of its experts); else every rank
 * loads its own share of the experts from share_dir */
static void model_case(const fp4moe_model *m, const char *name, const char *share_dir) {
    tu_rng r;
    tu_rng_seed(&r, 77);
    ep_model_job ref;
    memset(&ref, 0, sizeof ref);
    ref.m = m;
    ref.world = 1; /* the reference: every sequence in one batch */
    ref.device = FP4MOE_DEVICE_CPU;
    ref.act = FP4MOE_F32;
    ref.route = FP4MOE_ROUTE_QMV;
    const int64_t V = fp4moe_model_config(m)->vocab;
    for (int i = 0; i < EP_SEQS; i++) {
        ref.len[i] = 1 + tu_rng_below(&r, 40);
        ref.prompts[i] = malloc((size_t)ref.len[i] * sizeof(int32_t));
        for (int64_t t = 0; t < ref.len[i]; t++) ref.prompts[i][t] = (int32_t)tu_rng_below(&r, (uint32_t)V);
    }
    ep_run_rank(&ref);
    if (ref.st) fail_msg("%s: reference batch: %s", name, ref.err);
    for (int world = 1; world <= 4; world++) {
        fp4moe_ep_group *g = NULL;
        assert_int_equal(fp4moe_ep_group_new(world, &g), FP4MOE_OK);
        ep_model_job *job = calloc((size_t)world, sizeof *job);
        pthread_t th[4];
        fp4moe_model *own[4] = {NULL, NULL, NULL, NULL};
        for (int k = 0; k < world; k++) {
            job[k] = ref;
            job[k].g = g;
            job[k].rank = k;
            job[k].world = world;
            if (share_dir) job[k].m = own[k] = load_share(share_dir, world, k);
            memset(job[k].ids, 0xff, sizeof job[k].ids);
            assert_int_equal(pthread_create(&th[k], NULL, ep_run_rank, &job[k]), 0);
        }
        for (int k = 0; k < world; k++) pthread_join(th[k], NULL);
        for (int k = 0; k < world; k++) {
            if (job[k].st) fail_msg("%s: world %d rank %d: %s", name, world, k, job[k].err);
            for (int i = k; i < EP_SEQS; i += world)
                if (memcmp(job[k].ids[i], ref.ids[i], sizeof ref.ids[i]))
                    fail_msg("%s: world %d: sequence %d (rank %d) greedy ids differ from one rank's", name, world, i, k);
        }
        free(job);
        for (int k = 0; k < world; k++) fp4moe_model_free(own[k]);
        fp4moe_ep_group_free(g);
    }
    for (int i = 0; i < EP_SEQS; i++) free(ref.prompts[i]);
}

static void test_models_greedy_ids(void **state) {
    (void)state;
    const char *golden[] = {"tiny-a-mlx", "tiny-b-mlx", "tiny-a-modelopt", "tiny-a-bf16"};
    for (size_t i = 0; i < sizeof golden / sizeof golden[0]; i++) {
        char dir[256];
        snprintf(dir, sizeof dir, MT_GOLDEN "/%s", golden[i]);
        fp4moe_model *m = mt_load(golden[i], 1);
        model_case(m, golden[i], NULL);  /* one model, views */
        model_case(m, golden[i], dir);   /* each rank loads only its experts */
        fp4moe_model_free(m);
    }
    { /* dense stacked experts, quantized on load (a share quantizes only its rows): tiny-a-mlx
         dequantized by the fp4moe program next to this test */
        char exe[PATH_MAX], dir[] = "/tmp/fp4moe-test-ep-XXXXXX", cmd[3 * PATH_MAX];
        const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 16);
        assert_true(n > 0 && n < (ssize_t)sizeof exe - 16);
        exe[n] = 0;
        char *slash = strrchr(exe, '/');
        assert_non_null(slash);
        strcpy(slash + 1, "fp4moe");
        assert_non_null(mkdtemp(dir));
        snprintf(cmd, sizeof cmd, "'%s' dequantize --input " MT_GOLDEN "/tiny-a-mlx --output '%s/m' 2>/dev/null", exe, dir);
        if (system(cmd) != 0) fail_msg("'%s' failed (the fp4moe program is built with the tests)", cmd);
        char mdir[PATH_MAX];
        snprintf(mdir, sizeof mdir, "%s/m", dir);
        fp4moe_model *dm = NULL;
        if (fp4moe_model_load(mdir, NULL, &dm)) fail_msg("%s", fp4moe_last_error());
        model_case(dm, "tiny-a-mlx dequantized (stacked dense)", mdir);
        fp4moe_model_free(dm);
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        assert_int_equal(system(cmd), 0);
    }
    fp4moe_model *m = NULL;
    if (fp4moe_model_load("models/nemotron-h-tiny-moe", NULL, &m)) fail_msg("%s", fp4moe_last_error());
    model_case(m, "default model", NULL);
    model_case(m, "default model", "models/nemotron-h-tiny-moe");
    fp4moe_model_free(m);
}

/* A session on rank 0 with the other ranks following (fp4moe_ep_follow) until it leaves: its greedy
 * ids equal a plain session's; the followers took every step; the protocol's errors. */
typedef struct {
    fp4moe_model *m;
    fp4moe_ep_group *g;
    int rank;
    int64_t steps;
    int st;
} follower_job;

/* A CPU batch of one sequence as rank `rank` of group g. */
static int rank_batch(const fp4moe_model *m, fp4moe_ep_group *g, int rank, fp4moe_batch **b) {
    fp4moe_batch_options o;
    fp4moe_batch_options_default(&o);
    o.device = FP4MOE_DEVICE_CPU;
    o.max_seqs = 1;
    o.ep = g;
    o.ep_rank = rank;
    *b = NULL;
    return fp4moe_batch_new(m, &o, b);
}

static void *run_follower(void *arg) {
    follower_job *f = arg;
    fp4moe_batch *b = NULL;
    f->st = rank_batch(f->m, f->g, f->rank, &b);
    if (!f->st) f->st = fp4moe_ep_follow(b, &f->steps);
    fp4moe_batch_free(b);
    return NULL;
}

static void greedy(fp4moe_session *s, const int32_t *prompt, int64_t n, int32_t *ids, int gen) {
    int32_t next;
    assert_int_equal(fp4moe_session_forward_argmax(s, prompt, n, &next), FP4MOE_OK);
    for (int i = 0; i < gen; i++) {
        ids[i] = next;
        assert_int_equal(fp4moe_session_forward_argmax(s, &next, 1, &next), FP4MOE_OK);
    }
}

static void test_followers(void **state) {
    (void)state;
    fp4moe_model *m = NULL;
    if (fp4moe_model_load("models/nemotron-h-tiny-moe", NULL, &m)) fail_msg("%s", fp4moe_last_error());
    int32_t prompt[30], ref[12], got[12];
    for (int i = 0; i < 30; i++) prompt[i] = 3 + (i * 37) % 800;
    fp4moe_session_options so;
    fp4moe_session_options_default(&so);
    so.max_chunk = 16; /* a prefill of two steps */
    fp4moe_session *s = NULL;
    assert_int_equal(fp4moe_session_new(m, &so, &s), FP4MOE_OK);
    greedy(s, prompt, 30, ref, 12);
    fp4moe_session_free(s);
    for (int world = 1; world <= 3; world++) {
        fp4moe_ep_group *g = NULL;
        assert_int_equal(fp4moe_ep_group_new(world, &g), FP4MOE_OK);
        follower_job f[3];
        pthread_t th[3];
        fp4moe_model *own[3] = {NULL, NULL, NULL};
        for (int r = 1; r < world; r++) {
            own[r] = load_share("models/nemotron-h-tiny-moe", world, r);
            f[r] = (follower_job){own[r], g, r, 0, -1};
            assert_int_equal(pthread_create(&th[r], NULL, run_follower, &f[r]), 0);
        }
        so.ep = g;
        so.ep_rank = 0;
        assert_int_equal(fp4moe_session_new(m, &so, &s), FP4MOE_OK);
        memset(got, 0xff, sizeof got);
        greedy(s, prompt, 30, got, 12);
        if (memcmp(got, ref, sizeof ref))
            fail_msg("world %d: a session with %d followers: greedy ids differ from a plain session", world, world - 1);
        assert_int_equal(fp4moe_session_ep_leave(s), FP4MOE_OK);
        assert_int_equal(fp4moe_session_forward_argmax(s, prompt, 1, &got[0]), FP4MOE_EINVAL); /* after leaving */
        assert_non_null(strstr(fp4moe_last_error(), "left"));
        for (int r = 1; r < world; r++) {
            pthread_join(th[r], NULL);
            assert_int_equal(f[r].st, FP4MOE_OK);
            assert_int_equal(f[r].steps, 2 + 12); /* the two prefill chunks and every decode step */
        }
        fp4moe_session_free(s);
        so.ep = NULL;
        for (int r = 1; r < world; r++) fp4moe_model_free(own[r]);
        fp4moe_ep_group_free(g);
    }
    /* not an expert-parallel batch */
    fp4moe_batch_options o;
    fp4moe_batch_options_default(&o);
    o.device = FP4MOE_DEVICE_CPU;
    fp4moe_batch *b = NULL;
    assert_int_equal(fp4moe_batch_new(m, &o, &b), FP4MOE_OK);
    assert_int_equal(fp4moe_ep_follow(b, NULL), FP4MOE_EINVAL);
    assert_int_equal(fp4moe_ep_leave(b), FP4MOE_EINVAL);
    fp4moe_batch_free(b);
    fp4moe_model_free(m);
}

/* Ranks that each get their own work at different rounds (a server's ranks): every round each rank
 * calls fp4moe_batch_step (it has work) or fp4moe_ep_idle (it has none, or is stopping once done);
 * rank r's sequence starts at round start[r] (rank 2 of 3 never gets one); each sequence's greedy
 * ids equal a plain session's; the group ends in the first round in which every rank is stopping,
 * for every rank in the same round; after that the batch refuses to step or idle. */
typedef struct {
    fp4moe_model *m;
    fp4moe_ep_group *g;
    int rank, start, gen;
    const int32_t *prompt;
    int64_t np;
    int32_t ids[12];
    int64_t rounds, idle_steps;
    int st;
} idle_job;

static void *run_idle_rank(void *arg) {
    idle_job *j = arg;
    fp4moe_batch *b = NULL;
    j->st = rank_batch(j->m, j->g, j->rank, &b);
    int64_t seq = -1;
    int produced = 0, done = 0;
    int32_t next = 0;
    for (int64_t round = 0; !j->st && !done; round++) {
        if (round >= j->start && produced < j->gen) {
            fp4moe_batch_item it;
            memset(&it, 0, sizeof it);
            if (seq < 0 && (j->st = fp4moe_batch_add(b, &seq))) break;
            it.seq = seq;
            it.tokens = produced ? &next : j->prompt;
            it.n = produced ? 1 : j->np;
            it.out_token = &next;
            if ((j->st = fp4moe_batch_step(b, &it, 1)) || (j->st = it.status)) break;
            j->ids[produced++] = next;
        } else {
            int stepped = 0;
            j->st = fp4moe_ep_idle(b, produced >= j->gen && round >= j->start, &stepped, &done);
            j->idle_steps += stepped;
        }
        j->rounds = round + 1;
    }
    if (!j->st && fp4moe_batch_step(b, NULL, 0) != FP4MOE_EINVAL) j->st = -100; /* the group has ended */
    if (!j->st && fp4moe_ep_idle(b, 1, NULL, NULL) != FP4MOE_EINVAL) j->st = -101;
    fp4moe_batch_free(b);
    return NULL;
}

static void test_idle_rounds(void **state) {
    (void)state;
    fp4moe_model *m = NULL;
    if (fp4moe_model_load("models/nemotron-h-tiny-moe", NULL, &m)) fail_msg("%s", fp4moe_last_error());
    int32_t prompt[2][20], ref[2][12];
    fp4moe_session_options so;
    fp4moe_session_options_default(&so);
    for (int k = 0; k < 2; k++) {
        for (int i = 0; i < 20; i++) prompt[k][i] = 3 + (i * 37 + k * 101) % 800;
        fp4moe_session *s = NULL;
        assert_int_equal(fp4moe_session_new(m, &so, &s), FP4MOE_OK);
        greedy(s, prompt[k], 20, ref[k], 12);
        fp4moe_session_free(s);
    }
    const int world = 3, start[3] = {0, 4, 0}, gen[3] = {12, 8, 0};
    fp4moe_ep_group *g = NULL;
    assert_int_equal(fp4moe_ep_group_new(world, &g), FP4MOE_OK);
    idle_job j[3];
    pthread_t th[3];
    for (int r = 0; r < world; r++) {
        memset(&j[r], 0, sizeof j[r]);
        j[r].m = load_share("models/nemotron-h-tiny-moe", world, r);
        j[r].g = g;
        j[r].rank = r;
        j[r].start = start[r];
        j[r].gen = gen[r];
        j[r].prompt = prompt[r & 1];
        j[r].np = 20;
        assert_int_equal(pthread_create(&th[r], NULL, run_idle_rank, &j[r]), 0);
    }
    for (int r = 0; r < world; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < world; r++) {
        if (j[r].st) fail_msg("rank %d: status %d (%s)", r, j[r].st, fp4moe_last_error());
        assert_int_equal(j[r].rounds, 13); /* rank 1 steps in rounds 4 .. 11, rank 0 in 0 .. 11, all stop in 12 */
        if (gen[r] && memcmp(j[r].ids, ref[r & 1], sizeof(int32_t) * (size_t)gen[r]))
            fail_msg("rank %d: greedy ids differ from a plain session's", r);
        fp4moe_model_free(j[r].m);
    }
    assert_int_equal(j[2].idle_steps, 12);     /* rank 2 took part in every step of the others */
    assert_int_equal(j[1].idle_steps, 4);      /* rank 1 before its own sequence */
    fp4moe_ep_group_free(g);
    fp4moe_batch_options o;
    fp4moe_batch_options_default(&o);
    o.device = FP4MOE_DEVICE_CPU;
    fp4moe_batch *b = NULL;
    assert_int_equal(fp4moe_batch_new(m, &o, &b), FP4MOE_OK);
    assert_int_equal(fp4moe_ep_idle(b, 0, NULL, NULL), FP4MOE_EINVAL); /* not an expert-parallel batch */
    fp4moe_batch_free(b);
    fp4moe_model_free(m);
}

static void test_group_errors(void **state) {
    (void)state;
    fp4moe_ep_group *g = NULL;
    assert_int_equal(fp4moe_ep_group_new(0, &g), FP4MOE_EINVAL);
    assert_int_equal(fp4moe_ep_group_new(65, &g), FP4MOE_EINVAL);
    assert_int_equal(fp4moe_ep_group_new(2, &g), FP4MOE_OK);
    fp4moe_model *m = mt_load("tiny-a-mlx", 1);
    fp4moe_batch_options o;
    fp4moe_batch_options_default(&o);
    o.device = FP4MOE_DEVICE_CPU;
    o.ep = g;
    o.ep_rank = 2;
    fp4moe_batch *b = NULL;
    assert_int_equal(fp4moe_batch_new(m, &o, &b), FP4MOE_EINVAL);
    assert_non_null(strstr(fp4moe_last_error(), "ep_rank 2"));
    fp4moe_model_free(m);
    { /* a share holds fewer expert bytes: only its experts */
        fp4moe_model *full = mt_load("tiny-a-modelopt", 1), *half = load_share(MT_GOLDEN "/tiny-a-modelopt", 2, 1);
        fp4moe_model_stats a, h;
        fp4moe_model_get_stats(full, &a);
        fp4moe_model_get_stats(half, &h);
        const int64_t E = fp4moe_model_config(full)->n_experts, lo = E / 2;
        assert_true(h.bytes_moe_experts * E == a.bytes_moe_experts * (E - lo));
        fp4moe_model_free(full);
        fp4moe_model_free(half);
    }
    m = load_share(MT_GOLDEN "/tiny-a-mlx", 2, 1); /* rank 1's share */
    o.ep = NULL;
    assert_int_equal(fp4moe_batch_new(m, &o, &b), FP4MOE_EINVAL); /* no group */
    assert_non_null(strstr(fp4moe_last_error(), "no group given"));
    o.ep = g;
    o.ep_rank = 0;
    assert_int_equal(fp4moe_batch_new(m, &o, &b), FP4MOE_EINVAL); /* another rank's share */
    assert_non_null(strstr(fp4moe_last_error(), "this rank owns others"));
    o.ep_rank = 1;
    assert_int_equal(fp4moe_batch_new(m, &o, &b), FP4MOE_OK);
    fp4moe_batch_free(b);
    fp4moe_model_free(m);
    fp4moe_load_options lo;
    fp4moe_load_options_default(&lo);
    lo.expert_share = 1;
    lo.expert_lo = 3;
    lo.expert_hi = 2;
    assert_int_equal(fp4moe_model_load(MT_GOLDEN "/tiny-a-mlx", &lo, &m), FP4MOE_EINVAL);
    assert_non_null(strstr(fp4moe_last_error(), "expert range [3, 2)"));
    fp4moe_ep_group_free(g);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_exchange_equals_one_rank),
        cmocka_unit_test(test_a_failing_rank_fails_all),
        cmocka_unit_test(test_expert_ranges),
        cmocka_unit_test(test_models_greedy_ids),
        cmocka_unit_test(test_group_errors),
        cmocka_unit_test(test_followers),
        cmocka_unit_test(test_idle_rounds),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
