/* Batched runtime scenarios shared by the CPU test (tests/model/test_batch.c) and the GPU test
 * (tests/gpu/test_model_gpu.c): sequences of random prompt lengths join a batch at different
 * steps, prefill in chunks of their own sizes next to other sequences' decode tokens, generate
 * greedily and leave; each sequence's ids must equal the ids it gets alone (a session). */
#ifndef FP4MOE_TESTS_BATCH_TEST_H
#define FP4MOE_TESTS_BATCH_TEST_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fp4moe/model.h"
#include "fp4moe/fp4moe.h"

typedef struct {
    int32_t *prompt;
    int64_t L, G, join, chunk;
    int32_t *solo, *got;
    /* run state */
    int64_t id, fed, ngot;
    int state;                      /* 0 waiting, 1 running, 2 done */
    int32_t next;
} bt_seq;

/* The CPU activation mode of every session and batch these helpers make (tests set it). */
static fp4moe_cpu_act bt_cpu_act = FP4MOE_CPU_ACT_FLOAT;
/* And their KV cache type. */
static fp4moe_kv_dtype bt_kv_dtype = FP4MOE_KV_AUTO;

static inline uint64_t bt_rand(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static inline void bt_check(int st, const char *what) {
    if (st) {
        fprintf(stderr, "%s: %s\n", what, fp4moe_last_error());
        abort();
    }
}

/* The ids a sequence gets alone: a session, whole prompt, then one decode per token. */
static inline void bt_solo(const fp4moe_model *m, fp4moe_device dev, fp4moe_dtype act, bt_seq *q) {
    fp4moe_session_options o;
    fp4moe_session_options_default(&o);
    o.act_dtype = act;
    o.cpu_act = bt_cpu_act;
    o.kv_dtype = bt_kv_dtype;
    o.device = dev;
    fp4moe_session *s;
    bt_check(fp4moe_session_new(m, &o, &s), "solo session");
    int32_t t;
    bt_check(fp4moe_session_forward_argmax(s, q->prompt, q->L, &t), "solo prefill");
    for (int64_t i = 0; i < q->G; i++) {
        q->solo[i] = t;
        if (i + 1 < q->G) bt_check(fp4moe_session_forward_argmax(s, &q->solo[i], 1, &t), "solo decode");
    }
    fp4moe_session_free(s);
}

/* Moves sequence q to a new id restored from a snapshot of itself (same position). */
static inline void bt_snapshot_roundtrip(fp4moe_batch *b, bt_seq *q) {
    fp4moe_snapshot *sn;
    const int64_t pos = fp4moe_batch_pos(b, q->id);
    bt_check(fp4moe_batch_snapshot(b, q->id, &sn), "snapshot");
    bt_check(fp4moe_batch_remove(b, q->id), "remove");
    bt_check(fp4moe_batch_add_from_snapshot(b, sn, &q->id), "restore");
    if (fp4moe_batch_pos(b, q->id) != pos || fp4moe_snapshot_pos(sn) != pos) {
        fprintf(stderr, "snapshot: position %lld, restored %lld\n", (long long)pos,
                (long long)fp4moe_batch_pos(b, q->id));
        abort();
    }
    fp4moe_snapshot_free(sn);
}

/* Where the batched ids of q first differ from its solo ids (step i): the solo logits at that step,
 * (logit[solo id] - logit[batched id]) / |logit[solo id]|: a near tie when small (two bf16 steps:
 * 2^-7, the near_tie rule of tests/gpu/test_model_gpu.c). */
static inline double bt_tie_gap(const fp4moe_model *m, fp4moe_device dev, fp4moe_dtype act, const bt_seq *q,
                                int64_t i, int32_t other) {
    const int64_t V = fp4moe_model_config(m)->vocab;
    fp4moe_session_options o;
    fp4moe_session_options_default(&o);
    o.act_dtype = act;
    o.cpu_act = bt_cpu_act;
    o.kv_dtype = bt_kv_dtype;
    o.device = dev;
    fp4moe_session *s;
    bt_check(fp4moe_session_new(m, &o, &s), "solo session");
    float *lg = malloc((size_t)V * sizeof(float));
    bt_check(fp4moe_session_forward(s, q->prompt, q->L, lg, 0), "solo prefill");
    for (int64_t j = 0; j < i; j++) bt_check(fp4moe_session_forward(s, &q->solo[j], 1, lg, 0), "solo decode");
    const double top = fabs((double)lg[q->solo[i]]);
    const double gap = ((double)lg[q->solo[i]] - (double)lg[other]) / (top > 0 ? top : 1);
    free(lg);
    fp4moe_session_free(s);
    return gap;
}

/* n sequences through one batch of max_seqs slots (fewer than n: slots are reused). Returns the
 * number of sequences whose ids differ from their solo ids (and prints the first difference).
 * tie_tol > 0 (CUDA): a sequence that departs from its solo ids where the solo logits of the two ids
 * are within tie_tol (relative) of each other counts as a near tie, not as a difference (printed and
 * counted): the gather routes' arithmetic differs between row counts below and above 64
 * (fp32 FMA qmv vs tensor cores), so a row's bits can depend on the batch it runs in. */
static inline int bt_scenario_tol(const fp4moe_model *m, fp4moe_device dev, fp4moe_dtype act, int n,
                                  int64_t max_seqs, uint64_t seed, int snapshots, const char *label, double tie_tol,
                                  int *near_ties) {
    const int64_t V = fp4moe_model_config(m)->vocab;
    uint64_t r = seed * 0x9E3779B97F4A7C15ull + 1;
    bt_seq *q = calloc((size_t)n, sizeof *q);
    for (int i = 0; i < n; i++) {
        q[i].L = 1 + (int64_t)(bt_rand(&r) % 48);
        q[i].G = 3 + (int64_t)(bt_rand(&r) % 10);
        q[i].join = (int64_t)(bt_rand(&r) % 8);
        q[i].chunk = 1 + (int64_t)(bt_rand(&r) % 19);
        q[i].prompt = malloc((size_t)q[i].L * sizeof(int32_t));
        for (int64_t t = 0; t < q[i].L; t++) q[i].prompt[t] = (int32_t)(bt_rand(&r) % (uint64_t)V);
        q[i].solo = calloc((size_t)q[i].G, sizeof(int32_t));
        q[i].got = calloc((size_t)q[i].G, sizeof(int32_t));
        bt_solo(m, dev, act, &q[i]);
    }
    fp4moe_batch_options o;
    fp4moe_batch_options_default(&o);
    o.max_seqs = max_seqs;
    o.act_dtype = act;
    o.cpu_act = bt_cpu_act;
    o.kv_dtype = bt_kv_dtype;
    o.device = dev;
    o.max_step_tokens = 128;
    fp4moe_batch *b;
    bt_check(fp4moe_batch_new(m, &o, &b), "batch_new");
    fp4moe_batch_item *it = calloc((size_t)n, sizeof *it);
    int *who = calloc((size_t)n, sizeof *who);
    int done = 0, mixed = 0;
    for (int64_t step = 0; done < n && step < 100000; step++) {
        for (int i = 0; i < n; i++)
            if (q[i].state == 0 && q[i].join <= step && fp4moe_batch_count(b) < max_seqs) {
                bt_check(fp4moe_batch_add(b, &q[i].id), "batch_add");
                q[i].state = 1;
            }
        int k = 0, ndec = 0, npre = 0;
        int64_t budget = o.max_step_tokens;  /* a scheduler: decode tokens first, then prefill chunks */
        for (int pass = 0; pass < 2; pass++)
            for (int i = 0; i < n; i++) {
                if (q[i].state != 1 || (pass == 0) != (q[i].fed >= q[i].L) || budget == 0) continue;
                fp4moe_batch_item *x = &it[k];
                memset(x, 0, sizeof *x);
                x->seq = q[i].id;
                if (q[i].fed < q[i].L) {
                    const int64_t left = q[i].L - q[i].fed;
                    x->n = left < q[i].chunk ? left : q[i].chunk;
                    if (x->n > budget) x->n = budget;
                    x->tokens = q[i].prompt + q[i].fed;
                    if (x->n == left) x->out_token = &q[i].next;
                    npre++;
                } else {
                    x->n = 1;
                    x->tokens = &q[i].got[q[i].ngot - 1];
                    x->out_token = &q[i].next;
                    ndec++;
                }
                budget -= x->n;
                who[k++] = i;
            }
        mixed += ndec > 0 && npre > 0;
        if (!k) continue;
        bt_check(fp4moe_batch_step(b, it, k), "batch_step");
        for (int j = 0; j < k; j++) {
            bt_seq *s = &q[who[j]];
            if (it[j].status) {
                fprintf(stderr, "%s: item of sequence %d failed: %s\n", label, who[j], it[j].error);
                abort();
            }
            s->fed += it[j].n;
            if (!it[j].out_token) continue;
            s->got[s->ngot++] = s->next;
            if (s->ngot == s->G) {
                bt_check(fp4moe_batch_remove(b, s->id), "batch_remove");
                s->state = 2;
                done++;
            } else if (snapshots && s->ngot == 2 && (who[j] % 3) == 0) {
                bt_snapshot_roundtrip(b, s);
            }
        }
    }
    int bad = 0, ties = 0;
    for (int i = 0; i < n; i++) {
        int64_t same = 0;
        while (same < q[i].G && q[i].got[same] == q[i].solo[same]) same++;
        if (same < q[i].G && tie_tol > 0) {
            const double gap = bt_tie_gap(m, dev, act, &q[i], same, q[i].got[same]);
            printf("%s: sequence %d departs at token %lld (%d batched, %d alone): logit gap %.3g of max |logit| "
                   "(%s)\n", label, i, (long long)same, q[i].got[same], q[i].solo[same], gap,
                   gap <= tie_tol ? "near tie, accepted" : "NOT a near tie");
            if (gap <= tie_tol) {
                ties++;
                same = q[i].G;
            }
        }
        if (same < q[i].G) {
            if (!bad)
                fprintf(stderr, "%s: sequence %d (prompt %lld, chunk %lld): token %lld is %d batched, %d alone\n",
                        label, i, (long long)q[i].L, (long long)q[i].chunk, (long long)same, q[i].got[same],
                        q[i].solo[same]);
            bad++;
        }
        free(q[i].prompt);
        free(q[i].solo);
        free(q[i].got);
    }
    printf("%-34s %2d sequences, %lld slots, %d mixed prefill+decode steps: %d differ from solo%s\n", label, n,
           (long long)max_seqs, mixed, bad, ties ? " (near ties accepted, see above)" : "");
    if (near_ties) *near_ties += ties;
    free(q);
    free(it);
    free(who);
    fp4moe_batch_free(b);
    return bad;
}

static inline int bt_scenario(const fp4moe_model *m, fp4moe_device dev, fp4moe_dtype act, int n, int64_t max_seqs,
                              uint64_t seed, int snapshots, const char *label) {
    return bt_scenario_tol(m, dev, act, n, max_seqs, seed, snapshots, label, 0.0, NULL);
}

#endif
