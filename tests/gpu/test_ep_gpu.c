/* Expert parallelism on CUDA (issue 13): the ranks of an fp4moe_ep_group are CUDA batches, each on its
 * own thread, all on this machine's one GPU (the loopback group; NCCL needs one device per rank, so
 * NCCL runs here as a group of one). For world = 1..4 ranks, 7 sequences (round-robin over the
 * ranks, a rank without sequences steps with no rows), prefill in one step then greedy decode in
 * lockstep, on the golden tiny models (MLX; ModelOpt, whose per-expert global scales the views must
 * offset) and the default model, every rank either on views of the one GPU model or on its own GPU
 * model loaded with only its share of the experts.
 *
 * The reference of rank r is a plain CUDA batch (no expert parallelism) of rank r's own sequences,
 * so that every op but the routed experts sees the same rows; the gather route is forced to batched,
 * whose per-row arithmetic does not depend on the other rows of a call (gather_batched.cu), so an
 * owner computing the rows it received gives the bits the rank computes alone: greedy ids must be
 * EQUAL. Also: NCCL with one rank (when libnccl.so.2 opens; else reported and skipped), and the
 * errors of the NCCL group (two ranks on one device, a device out of range). Needs a CUDA device;
 * exits 77 (skipped) without one. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "../model/ep_model_test.h"
#include "../model/model_test.h"
#include "fp4moe/gather_qmm.h"
#include "gpu_testutil.h"
#include "testutil.h"

#define DEFAULT_MODEL "models/nemotron-h-tiny-moe"
static fp4moe_model *load_gpu(const char *dir, int world, int rank) {
    fp4moe_load_options o;
    fp4moe_load_options_default(&o);
    o.device = FP4MOE_DEVICE_CUDA;
    fp4moe_model *m = NULL;
    if (world > 0) { /* rank's share of the experts only */
        if (fp4moe_model_load(dir, NULL, &m)) fail_msg("%s", fp4moe_last_error());
        o.expert_share = 1;
        fp4moe_ep_range(fp4moe_model_config(m)->n_experts, world, rank, &o.expert_lo, &o.expert_hi);
        fp4moe_model_free(m);
        m = NULL;
    }
    if (fp4moe_model_load(dir, &o, &m)) fail_msg("%s (%d/%d): %s", dir, rank, world, fp4moe_last_error());
    return m;
}

/* nccl: the group is NCCL's (world 1 only here); shares: every rank loads only its experts */
static void world_case(const fp4moe_model *m, const char *dir, const char *name, int world, int nccl, int shares,
                       ep_model_job *ref) {
    fp4moe_ep_group *g = NULL;
    const int gst = nccl ? fp4moe_ep_group_new_nccl(world, NULL, &g) : fp4moe_ep_group_new(world, &g);
    if (gst) fail_msg("%s: group of %d: %s", name, world, fp4moe_last_error());
    ep_model_job jobs[4];
    pthread_t th[4];
    fp4moe_model *own[4] = {NULL, NULL, NULL, NULL};
    for (int k = 0; k < world; k++) {
        jobs[k] = ref[k];
        jobs[k].g = g;
        if (shares) jobs[k].m = own[k] = load_gpu(dir, world, k);
        memset(jobs[k].ids, 0xff, sizeof jobs[k].ids);
        assert_int_equal(pthread_create(&th[k], NULL, ep_run_rank, &jobs[k]), 0);
    }
    for (int k = 0; k < world; k++) pthread_join(th[k], NULL);
    for (int k = 0; k < world; k++) {
        if (jobs[k].st) fail_msg("%s: world %d rank %d%s%s: %s", name, world, k, nccl ? " (nccl)" : "",
                                 shares ? " (share model)" : "", jobs[k].err);
        for (int i = k; i < EP_SEQS; i += world)
            if (memcmp(jobs[k].ids[i], ref[k].ids[i], sizeof ref[k].ids[i]))
                fail_msg("%s: world %d%s%s: sequence %d (rank %d): greedy ids differ from the rank's own batch",
                         name, world, nccl ? " (nccl)" : "", shares ? " (share model)" : "", i, k);
    }
    for (int k = 0; k < world; k++) fp4moe_model_free(own[k]);
    fp4moe_ep_group_free(g);
    print_message("ok   %s: world %d%s%s\n", name, world, nccl ? " (nccl)" : "", shares ? " (share models)" : "");
}

static int g_nccl = -1; /* NCCL's version, 0: not available */

static void model_case(const char *dir, const char *name) {
    fp4moe_model *m = load_gpu(dir, 0, 0);
    tu_rng r;
    tu_rng_seed(&r, 91);
    ep_model_job base;
    memset(&base, 0, sizeof base);
    base.m = m;
    base.device = FP4MOE_DEVICE_CUDA;
    base.act = FP4MOE_BF16;
    base.route = FP4MOE_ROUTE_BATCHED; /* per-row arithmetic independent of the other rows */
    const int64_t V = fp4moe_model_config(m)->vocab;
    for (int i = 0; i < EP_SEQS; i++) {
        base.len[i] = 1 + tu_rng_below(&r, 40);
        base.prompts[i] = malloc((size_t)base.len[i] * sizeof(int32_t));
        for (int64_t t = 0; t < base.len[i]; t++) base.prompts[i][t] = (int32_t)tu_rng_below(&r, (uint32_t)V);
    }
    for (int world = 1; world <= 4; world++) {
        ep_model_job ref[4];
        for (int k = 0; k < world; k++) { /* rank k's own sequences in a plain batch */
            ref[k] = base;
            ref[k].rank = k;
            ref[k].world = world;
            ep_run_rank(&ref[k]);
            if (ref[k].st) fail_msg("%s: reference of rank %d/%d: %s", name, k, world, ref[k].err);
        }
        world_case(m, dir, name, world, 0, 0, ref);
        world_case(m, dir, name, world, 0, 1, ref);
        if (world == 1 && g_nccl > 0) world_case(m, dir, name, 1, 1, 0, ref);
    }
    for (int i = 0; i < EP_SEQS; i++) free(base.prompts[i]);
    fp4moe_model_free(m);
}

static void test_models(void **state) {
    (void)state;
    model_case(MT_GOLDEN "/tiny-a-mlx", "tiny-a-mlx");
    model_case(MT_GOLDEN "/tiny-a-modelopt", "tiny-a-modelopt");
    if (!access(DEFAULT_MODEL "/config.json", R_OK)) model_case(DEFAULT_MODEL, "default model");
}

static void test_nccl_errors(void **state) {
    (void)state;
    fp4moe_ep_group *g = NULL;
    if (g_nccl <= 0) {
        assert_int_equal(fp4moe_ep_group_new_nccl(1, NULL, &g), FP4MOE_EUNSUPPORTED);
        print_message("NCCL not available here: %s\n", fp4moe_last_error());
        assert_non_null(strstr(fp4moe_last_error(), "libnccl"));
        return;
    }
    const int n = fp4moe_cuda_device_count(), same[2] = {0, 0}, out_of_range[1] = {n};
    assert_int_equal(fp4moe_ep_group_new_nccl(2, same, &g), FP4MOE_EINVAL);
    assert_non_null(strstr(fp4moe_last_error(), "same device"));
    assert_int_equal(fp4moe_ep_group_new_nccl(1, out_of_range, &g), FP4MOE_EINVAL);
    assert_non_null(strstr(fp4moe_last_error(), "visible"));
    assert_int_equal(fp4moe_ep_group_new_nccl(0, NULL, &g), FP4MOE_EINVAL);
    assert_null(g);
}

int main(void) {
    gt_require_gpu("test_ep_gpu");
    g_nccl = fp4moe_nccl_version();
    printf("NCCL: %s (version code %d)\n", g_nccl > 0 ? "found" : "not found", g_nccl);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_models),
        cmocka_unit_test(test_nccl_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
