/* Internal: the one nemotron_h forward (src/model/forward.c) and its activation buffers. */
#ifndef FP4MOE_MODEL_FORWARD_H
#define FP4MOE_MODEL_FORWARD_H

#include <signal.h>

#include "backend/backend.h"
#include "model/ep.h"

/* Activation buffers of a step of at most `cap` rows (one plan for every backend: act buffers
 * have the backend's act element size, the rest fp32 / int32). Members of absent layer kinds are
 * NULL. */
typedef struct {
    int64_t cap, lg_rows;           /* rows of a step; rows of logits (head rows) */
    int32_t *meta;                  /* 4*cap: tokens, row slots, row positions, head rows */
    float *h;                       /* cap x H residual stream */
    void *xn, *out_a, *out_b;       /* cap x H act: normed input, mixer output, shared expert output */
    void *zx, *yb;                  /* Mamba: cap x in_proj.N, cap x d_inner (act) */
    float *xbc, *y;                 /* Mamba: cap x conv_dim, cap x d_inner */
    void *q, *kb, *vb, *att;        /* attention (act); kb holds at least 2 rows */
    uint32_t *kv_ids;               /* attention: {0, 1}, the idx of fw_layer kv_proj */
    float *xn32, *rlogits, *wts;    /* MoE: cap x H router input, cap x E, cap x k */
    int32_t *ids;
    uint32_t *row_of, *idx, *pos_of;
    void *xs, *hs, *ys, *comb, *xl, *shh; /* MoE act buffers */
    void *hm;                       /* dense MLP hidden */
    float *lg;                      /* lg_rows x V fp32 logits of the head rows */
    int32_t *next;                  /* lg_rows greedy tokens of the head rows */
} fw_bufs;

int fw_bufs_alloc(const be_ops *be, void *bc, const fp4moe_config *c, int64_t cap, int64_t lg_rows,
                  fw_bufs *b);
void fw_bufs_free(const be_ops *be, void *bc, const fp4moe_config *c, fw_bufs *b);

/* Expert parallelism: buffers an expert-parallel batch keeps from one MoE layer to the next (grown
 * to the largest step; zero-initialised; fw_ep_scratch_free after the last forward). */
typedef struct {
    ep_scratch exchange;            /* ep_moe_exchange's host buffers */
    ep_scratch stage;               /* device-memory backends: host copies of idx, rows, results, local ids */
    void *dev[4];                   /* backend memory: received rows, their results, hidden, local ids */
    size_t dev_cap[4];
} fw_ep_scratch;
void fw_ep_scratch_free(const be_ops *be, void *bc, fw_ep_scratch *s);

/* Everything one forward of a step needs. */
typedef struct {
    const fp4moe_config *cfg;
    const be_ops *be;
    void *bc;
    const fw_weights *w;
    const fw_bufs *b;
    const fw_state *state;          /* cfg.n_layers entries (unused members zero) */
    const fw_step *st;
    int argmax;                     /* also the greedy token of every head row (b->next) */
    const volatile sig_atomic_t *interrupt;
    ep_transport *ep;               /* expert parallelism: NULL = every expert here */
    fw_ep_scratch *ep_ws;           /* with ep: the batch's kept buffers */
} fw_ctx;

/* The forward of f->st (arg is a const fw_ctx *): embedding, layers, then the head rows' logits
 * (b->lg, n_head x V fp32) and greedy tokens. Errors name the layer and module. */
int fw_forward(void *arg);

#endif
