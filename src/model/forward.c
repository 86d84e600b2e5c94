/* The nemotron_h forward pass, written once over the backend table (src/backend/backend.h), for a
 * step of many sequences (spec NEMOTRON_H.md "Forward pass"):
 *   h = embed[token];  for each layer: h = h + mixer(rmsnorm(h) * norm.weight)
 *   (a layer's residual add runs in the next layer's rmsnorm launch; the last one alone)
 *   logits = lm_head(rmsnorm(h) * norm_f.weight)      (the rows that asked for logits)
 * Row-wise work (norms, projections, router, experts) runs over all rows of the step at once: the
 * router and the sort by expert see every row of every sequence, so the gather routes serve the
 * whole batch. The Mamba conv/scan and attention keep sequences apart (their ops take the step).
 *
 * Mamba-2 (transformers NemotronHMamba2Mixer.torch_forward):
 *   [z | xBC | dt] = in_proj(x);  xBC = silu(conv1d_causal(xBC));  [xs | B | C] = xBC
 *   y = ssm_scan(xs, dt, A, B, C, D);  out = out_proj(rmsnorm_grouped(y * silu(z)) * norm.weight)
 * dt = clamp(softplus(dt + dt_bias), time_step_limit[0], time_step_limit[1]) in prefill and decode,
 * as mlx-lm, vLLM and the state-spaces/mamba kernels do. transformers 5.17 instead clamps dt to
 * >= time_step_min in its chunked scan (every prefill) and not at all in its cached update. A model
 * trained through transformers' prefill path (the default model, the golden tiny models) declares
 * time_step_limit = [time_step_min, inf], so both readings are one function there
 * (docs/spec/NEMOTRON_H.md).
 * Attention: GQA, causal, no positional encoding, paged KV cache per sequence.
 * MoE: router (fp32) -> top-k -> (token, slot) rows sorted by expert -> gather_qmm up -> relu^2 ->
 *   gather_qmm down -> fp32 combine with the router weights (+ shared expert); with
 *   moe_latent_size the routed experts work in the latent width. */
#include "model/forward.h"

#include <stdlib.h>
#include <string.h>

#include "common/error.h"

#define TRY(expr)                                                                                  \
    do {                                                                                           \
        const int try_st_ = (expr);                                                                \
        if (try_st_) return try_st_;                                                               \
    } while (0)

static int has_layer(const fp4moe_config *c, char type) {
    return strchr(c->layer_types, type) != NULL;
}

/* ---- buffer plan ---------------------------------------------------------------------------- */

typedef struct {
    void **p;
    int64_t n;
    size_t esz;
    const char *what;
} plan_item;

static int64_t plan(const fp4moe_config *c, int64_t cap, int64_t lgr, size_t act, fw_bufs *b, plan_item *it) {
    const int64_t H = c->hidden, V = c->vocab;
    const int64_t di = c->mamba_heads * c->mamba_head_dim, GS = c->mamba_groups * c->ssm_state;
    const int64_t cd = di + 2 * GS, np = 2 * di + 2 * GS + c->mamba_heads;
    const int64_t q = c->attn_heads * c->head_dim, kvs = c->kv_heads * c->head_dim;
    const int64_t E = c->n_experts, k = c->top_k, Hl = c->moe_latent ? c->moe_latent : H;
    const int64_t B = cap * k, I = c->moe_inter, Is = c->n_shared ? c->shared_inter : 0;
    int64_t n = 0;
#define ITEM(ptr, count, size, name) it[n++] = (plan_item){(void **)&(ptr), (count), (size), (name)}
    ITEM(b->meta, 4 * cap, 4, "step metadata");
    ITEM(b->h, cap * H, 4, "the residual stream");
    ITEM(b->xn, cap * H, act, "normed activations");
    ITEM(b->out_a, cap * H, act, "mixer outputs");
    ITEM(b->out_b, cap * H, act, "shared expert outputs");
    if (has_layer(c, FP4MOE_LAYER_MAMBA)) {
        ITEM(b->zx, cap * np, act, "in_proj outputs");
        ITEM(b->xbc, cap * cd, 4, "conv outputs");
        ITEM(b->y, cap * di, 4, "scan outputs");
        ITEM(b->yb, cap * di, act, "gated norm outputs");
    }
    if (has_layer(c, FP4MOE_LAYER_ATTENTION)) {
        ITEM(b->q, cap * q, act, "queries");
        ITEM(b->kb, (cap > 1 ? cap : 2) * kvs, act, "keys"); /* 2 rows: k and v of kv_proj's call */
        ITEM(b->kv_ids, 2, 4, "k / v ids");
        ITEM(b->vb, cap * kvs, act, "values");
        ITEM(b->att, cap * q, act, "attention outputs");
    }
    if (has_layer(c, FP4MOE_LAYER_MOE)) {
        ITEM(b->xn32, cap * H, 4, "router inputs");
        ITEM(b->rlogits, cap * E, 4, "router logits");
        ITEM(b->wts, B, 4, "router weights");
        ITEM(b->ids, B, 4, "router ids");
        ITEM(b->row_of, B, 4, "sort rows");
        ITEM(b->idx, B, 4, "sorted experts");
        ITEM(b->pos_of, B, 4, "sort positions");
        ITEM(b->xs, B * Hl, act, "expert inputs");
        ITEM(b->hs, B * I, act, "expert hidden");
        ITEM(b->ys, B * Hl, act, "expert outputs");
        ITEM(b->comb, cap * Hl, act, "combined outputs");
        if (c->moe_latent) ITEM(b->xl, cap * Hl, act, "latent inputs");
        if (Is) ITEM(b->shh, cap * Is, act, "shared expert hidden");
    }
    if (has_layer(c, FP4MOE_LAYER_MLP)) ITEM(b->hm, cap * c->mlp_inter, act, "MLP hidden");
    ITEM(b->lg, lgr * V, 4, "logits");
    ITEM(b->next, lgr, 4, "greedy tokens");
#undef ITEM
    return n;
}

int fw_bufs_alloc(const be_ops *be, void *bc, const fp4moe_config *c, int64_t cap, int64_t lg_rows,
                  fw_bufs *b) {
    memset(b, 0, sizeof *b);
    b->cap = cap;
    b->lg_rows = lg_rows;
    plan_item it[40];
    const int64_t n = plan(c, cap, lg_rows, be->act_size, b, it);
    for (int64_t i = 0; i < n; i++) {
        int64_t bytes;
        if (fp4moe_mul_overflow(it[i].n, (int64_t)it[i].esz, &bytes))
            return fp4moe_set_error(FP4MOE_EOVERFLOW, "buffers: %s for %lld rows overflow", it[i].what,
                                    (long long)cap);
        const int st = be->alloc(bc, (size_t)(bytes ? bytes : 1), it[i].p);
        if (st) return fp4moe_error_context(st, "buffers: %s (%lld bytes)", it[i].what, (long long)bytes);
    }
    if (b->kv_ids) {
#ifdef FP4MOE_INJECT_FAULT_KV_PAIR /* deliberate fault (tests must catch it): k and v swapped */
        static const uint32_t ids[2] = {1, 0};
#else
        static const uint32_t ids[2] = {0, 1};
#endif
        TRY(be->upload(bc, b->kv_ids, ids, sizeof ids));
    }
    return FP4MOE_OK;
}

void fw_bufs_free(const be_ops *be, void *bc, const fp4moe_config *c, fw_bufs *b) {
    plan_item it[40];
    const int64_t n = plan(c, b->cap, b->lg_rows, be->act_size, b, it);
    for (int64_t i = 0; i < n; i++)
        if (*it[i].p) be->free(bc, *it[i].p);
    memset(b, 0, sizeof *b);
}

/* ---- layers --------------------------------------------------------------------------------- */

static int mark(const fw_ctx *f, int kind) { return f->be->mark ? f->be->mark(f->bc, kind) : FP4MOE_OK; }

static int mamba(const fw_ctx *f, const fw_layer *d, const fw_state *ls) {
    const fp4moe_config *c = f->cfg;
    const be_ops *be = f->be;
    void *bc = f->bc;
    const fw_bufs *b = f->b;
    const int64_t R = f->st->R;
    const int64_t nh = c->mamba_heads, hd = c->mamba_head_dim, G = c->mamba_groups, S = c->ssm_state;
    const int64_t di = nh * hd, GS = G * S, cd = di + 2 * GS, np = 2 * di + 2 * GS + nh;
    int st = be->linear(bc, d->in_proj, b->xn, R, 0, b->zx);
    if (st) return fp4moe_error_context(st, "in_proj");
    TRY(be->conv1d_silu(bc, f->st, BE_ACT(be, b->zx, di), np, cd, d->conv_w, d->conv_b, c->conv_kernel,
                        ls, b->xbc));
    const fw_ssm a = {
        .nh = nh, .hd = hd, .S = S, .G = G,
        .x = b->xbc, .xs = cd, .B = b->xbc + di, .C = b->xbc + di + GS, .bcs = cd,
        .dt = BE_ACT(be, b->zx, di + cd), .dts = np, .dt_bias = d->dt_bias, .A = d->A, .D = d->D,
        .dt_lo = c->time_step_limit[0], .dt_hi = c->time_step_limit[1], .y = b->y,
    };
    TRY(be->ssm_scan(bc, f->st, &a, ls));
    TRY(be->rmsnorm_gated(bc, b->y, b->zx, np, d->gnorm, R, di, G, c->eps, b->yb));
    st = be->linear(bc, d->out_proj, b->yb, R, 0, b->out_a);
    return st ? fp4moe_error_context(st, "out_proj") : FP4MOE_OK;
}

/* k into b->kb and v (*v: where): for a one-token step with a stacked kv_proj one linear_gather_x1
 * call (k and v its rows 0 and 1: kb's first two rows; the same kernel and K split as the two single
 * calls, so the same bits), else two linears (v into b->vb). */
static int kv_proj(const fw_ctx *f, const fw_layer *d, int64_t R, const void **v) {
    const be_ops *be = f->be;
    const fw_bufs *b = f->b;
    *v = b->vb;
    if (R == 1 && d->kv_proj && be->linear_gather_x1 && b->kv_ids) {
        const int st = be->linear_gather_x1(f->bc, d->kv_proj, b->xn, b->kv_ids, 2, 0, b->kb);
        if (st == FP4MOE_OK) {
            *v = BE_ACT(be, b->kb, f->cfg->kv_heads * f->cfg->head_dim);
            return FP4MOE_OK;
        }
        if (st != FP4MOE_EUNSUPPORTED) return st;
        fp4moe_clear_error();
    }
    const int st = be->linear(f->bc, d->k_proj, b->xn, R, 0, b->kb);
    return st ? st : be->linear(f->bc, d->v_proj, b->xn, R, 0, b->vb);
}

static int attention(const fw_ctx *f, const fw_layer *d, const fw_state *ls) {
    const fp4moe_config *c = f->cfg;
    const be_ops *be = f->be;
    void *bc = f->bc;
    const fw_bufs *b = f->b;
    const int64_t R = f->st->R;
    int st;
    /* Where the backend offers a second queue (be_ops side_begin, as for the MoE's shared expert), k
     * and v are projected on it, beside q (measured on the H200: +1.0% decode, docs/PERFORMANCE.md
     * session 16); the three outputs are disjoint buffers, xn is read by all, the results the same. */
    int side = 0;
    const void *vb = b->vb;
    if (be->side_begin) {
        const void *sw[2] = {d->k_proj, d->v_proj};
        TRY(be->side_begin(bc, R, sw, 2, &side));
    }
    if (side) {
        st = kv_proj(f, d, R, &vb);
        const int se = be->side_end(bc);
        if (!st) st = se;
        if (!st) st = be->linear(bc, d->q_proj, b->xn, R, 0, b->q);
#ifdef FP4MOE_INJECT_FAULT_ATTN_SIDE /* deliberate fault (tests must catch it): attention does not wait for k, v */
        const int sj = FP4MOE_OK;
#else
        const int sj = be->side_join(bc);
#endif
        if (!st) st = sj;
        if (st) return fp4moe_error_context(st, "q/k/v_proj (k and v beside q)");
    } else if ((st = be->linear(bc, d->q_proj, b->xn, R, 0, b->q)) || (st = kv_proj(f, d, R, &vb))) {
        return fp4moe_error_context(st, "q/k/v_proj");
    }
    TRY(be->attention(bc, f->st, b->q, b->kb, vb, ls, c->attn_heads, c->kv_heads, c->head_dim, b->att));
    st = be->linear(bc, d->o_proj, b->att, R, 0, b->out_a);
    return st ? fp4moe_error_context(st, "o_proj") : FP4MOE_OK;
}

static int mlp(const fw_ctx *f, const void *up, const void *down, const void *x, void *hbuf, void *out) {
    const be_ops *be = f->be;
    const int64_t R = f->st->R;
    int st = be->linear(f->bc, up, x, R, 1, hbuf); /* relu^2 in the up projection's epilogue */
    if (st) return fp4moe_error_context(st, "up_proj");
    st = be->linear(f->bc, down, hbuf, R, 0, out);
    return st ? fp4moe_error_context(st, "down_proj") : FP4MOE_OK;
}

/* Expert parallelism: the owner's part of a MoE layer, on the rows it received (ep_expert_fn). */
typedef struct {
    const fw_ctx *f;
    const fw_layer *d;              /* its experts: views of this rank's experts [lo, hi) */
    int64_t lo;
} ep_experts_ctx;

void fw_ep_scratch_free(const be_ops *be, void *bc, fw_ep_scratch *s) {
    ep_scratch_free(&s->exchange);
    ep_scratch_free(&s->stage);
    for (int i = 0; i < 4; i++)
        if (s->dev[i]) be->free(bc, s->dev[i]);
    memset(s, 0, sizeof *s);
}

/* Backend buffer i of the kept scratch with at least `bytes` (grown: the old one freed first). */
static int ep_dev(const fw_ctx *f, int i, size_t bytes, void **p) {
    fw_ep_scratch *s = f->ep_ws;
    if (bytes > s->dev_cap[i]) {
        if (s->dev[i]) f->be->free(f->bc, s->dev[i]);
        s->dev[i] = NULL;
        s->dev_cap[i] = 0;
        TRY(f->be->alloc(f->bc, bytes, &s->dev[i]));
        s->dev_cap[i] = bytes;
    }
    *p = s->dev[i];
    return FP4MOE_OK;
}

/* The host path (CPU backend): fn of ep_moe_exchange on the rows it received. */
static int ep_experts(void *ctx, const void *x, const uint32_t *idx, int64_t n, void *y) {
    ep_experts_ctx *e = ctx;
    const fw_ctx *f = e->f;
    const be_ops *be = f->be;
    void *bc = f->bc;
    int64_t bytes;
    if (fp4moe_mul_overflow(n * f->cfg->moe_inter, (int64_t)be->act_size, &bytes))
        return fp4moe_set_error(FP4MOE_EOVERFLOW, "experts: %lld received rows overflow", (long long)n);
    void *hidden, *lidx_v;
    TRY(ep_dev(f, 2, (size_t)bytes, &hidden));
    TRY(ep_dev(f, 3, (size_t)n * sizeof(uint32_t), &lidx_v));
    uint32_t *lidx = lidx_v;
    for (int64_t i = 0; i < n; i++) lidx[i] = idx[i] - (uint32_t)e->lo; /* ep_moe_exchange checked the range */
    int st = be->linear_gather(bc, e->d->experts_up, x, lidx, n, 1, hidden);
    if (st) return fp4moe_error_context(st, "experts up (gather_qmm)");
    st = be->linear_gather(bc, e->d->experts_down, hidden, lidx, n, 0, y);
    return st ? fp4moe_error_context(st, "experts down (gather_qmm)") : FP4MOE_OK;
}

/* ep_dev_io of the backend: copies on its stream, waits with sync */
static int ep_io_copy(void *ctx, void *dst, const void *src, size_t n) {
    const fw_ctx *f = ctx;
    return f->be->copy(f->bc, dst, src, n);
}
static int ep_io_wait(void *ctx) {
    const fw_ctx *f = ctx;
    return f->be->sync(f->bc);
}

/* A collective status: every rank's st, the first failure wins on every rank (the host alltoallv). */
static int ep_agree(ep_transport *t, int st) { return ep_moe_exchange_fail_if(t, st); }

/* The device path (backends whose memory the host cannot read: CUDA): the rows stay on the device.
 * Only the row counts per owner go through the host (idx downloaded: B uint32); the experts' ids and
 * rows go to their owners with alltoallv_dev, the owner sorts what it received stably by expert
 * (sort_local), gathers the rows, runs up (relu^2) and down, puts the results back into arrival order
 * and returns them with alltoallv_dev; they land in this rank's row order. The same data flow and
 * results as ep_moe_exchange (ep.c), whose host version the CPU runs. */
static int ep_routed_dev(const fw_ctx *f, const fw_layer *d, int64_t E, int64_t B, int64_t Hl) {
    const be_ops *be = f->be;
    void *bc = f->bc;
    const fw_bufs *b = f->b;
    ep_transport *t = f->ep;
    fw_ep_scratch *ws = f->ep_ws;
    const int W = t->world;
    const size_t rowb = (size_t)Hl * be->act_size;
    const ep_dev_io io = {ep_io_copy, ep_io_wait, (void *)f};
    int64_t lo, hi, cnt[64] = {0}, rcnt[64], sb[64], rb[64], lo_d[65];
    ep_expert_range(E, W, t->rank, &lo, &hi);
    for (int r = 0; r <= W; r++) lo_d[r] = r * E / W; /* ep_expert_range's boundaries */
    int st = FP4MOE_OK;
    /* 1. this rank's rows per owner (idx is sorted: the owners' rows are contiguous) */
    uint32_t *hidx = ep_scratch_get(&ws->stage, 0, (size_t)B * sizeof *hidx + 1);
    if (!hidx) st = fp4moe_set_error(FP4MOE_ENOMEM, "experts: %lld row ids", (long long)B);
    if (!st) st = be->download(bc, hidx, b->idx, (size_t)B * sizeof *hidx);
    if (!st) st = be->sync(bc);
    int64_t nin = 0;
    for (int64_t i = 0, r = 0; !st && i < B; i++) {
        if (i && hidx[i] < hidx[i - 1]) st = fp4moe_set_error(FP4MOE_EINVAL, "ep: idx not sorted at row %lld", (long long)i);
        if (hidx[i] >= (uint64_t)E) continue; /* the out-of-range tail stays here (zeros) */
        while (hidx[i] >= (uint64_t)lo_d[r + 1]) r++;
        cnt[r]++;
        nin++;
    }
    if (st) memset(cnt, 0, sizeof cnt);
    /* 2. the counts (host), and any failure so far */
    for (int r = 0; r < W; r++) sb[r] = (int64_t)sizeof(int64_t);
    const int tst = t->alltoallv(t, cnt, sb, rcnt, (int64_t)sizeof rcnt, rb);
    if ((st = ep_agree(t, st ? st : tst))) return st;
    int64_t nrecv = 0;
    for (int r = 0; r < W; r++) nrecv += rcnt[r];
    /* 3. buffers: received ids and rows, their sort, the sorted rows, hidden, results */
    void *ir = NULL, *xr = NULL, *perm = NULL, *xsort, *hidden = NULL, *ysort, *yr;
    int64_t hb;
    if (fp4moe_mul_overflow(nrecv * f->cfg->moe_inter, (int64_t)be->act_size, &hb))
        st = fp4moe_set_error(FP4MOE_EOVERFLOW, "experts: %lld received rows", (long long)nrecv);
    const size_t nr = (size_t)nrecv + 1;
    if (!st) st = ep_dev(f, 0, nr * 4 * 3, &perm);           /* row_of, idx (local), pos_of */
    if (!st) st = ep_dev(f, 1, nr * 4, &ir);
    if (!st) st = ep_dev(f, 2, (size_t)hb + 1, &hidden);
    if (!st) st = ep_dev(f, 3, nr * rowb * 4, &xr);          /* xr, xsort, ysort, yr */
    if ((st = ep_agree(t, st))) return st;
    xsort = (char *)xr + nr * rowb;
    ysort = (char *)xsort + nr * rowb;
    yr = (char *)ysort + nr * rowb;
    uint32_t *row_of = perm, *lidx = (uint32_t *)perm + nr, *pos_of = (uint32_t *)perm + 2 * nr;
    /* 4. experts' ids and rows to their owners (this rank's buffers are complete: synced above) */
    for (int r = 0; r < W; r++) {
        sb[r] = cnt[r] * 4;
        rb[r] = rcnt[r] * 4;
    }
    st = t->alltoallv_dev(t, b->idx, sb, ir, rb, &io);
    for (int r = 0; r < W; r++) {
        sb[r] = cnt[r] * (int64_t)rowb;
        rb[r] = rcnt[r] * (int64_t)rowb;
    }
    const int xst = t->alltoallv_dev(t, b->xs, sb, xr, rb, &io);
    if (!st) st = xst;
    /* 5. the owned experts on everything received, sorted stably by expert (arrival order within one) */
    if (!st && nrecv) {
        st = be->sort_local(bc, ir, nrecv, lo, hi - lo, row_of, lidx, pos_of);
        if (!st) st = be->gather_rows(bc, xr, Hl, row_of, nrecv, 1, xsort);
        if (!st) st = be->linear_gather(bc, d->experts_up, xsort, lidx, nrecv, 1, hidden);
        if (!st) st = be->linear_gather(bc, d->experts_down, hidden, lidx, nrecv, 0, ysort);
#ifdef FP4MOE_INJECT_FAULT_EP_ORDER /* deliberate fault (tests must catch it): results back in sorted order */
        if (!st) st = be->copy(bc, yr, ysort, (size_t)nrecv * rowb);
#else
        if (!st) st = be->gather_rows(bc, ysort, Hl, pos_of, nrecv, 1, yr); /* back into arrival order */
#endif
        if (!st) st = be->sync(bc);
        if (st) st = fp4moe_error_context(st, "experts (gather_qmm on the received rows)");
    }
    if ((st = ep_agree(t, st))) return st;
    /* 6. the results back, in the order they came (so in each sender's row order) */
    for (int r = 0; r < W; r++) {
        sb[r] = rcnt[r] * (int64_t)rowb;
        rb[r] = cnt[r] * (int64_t)rowb;
    }
    st = t->alltoallv_dev(t, yr, sb, b->ys, rb, &io);
    if (!st && B > nin) st = be->zero(bc, BE_ACT(be, b->ys, nin * Hl), (size_t)(B - nin) * rowb);
    return st;
}

/* The routed experts of an expert-parallel rank. */
static int ep_routed(const fw_ctx *f, const fw_layer *d, int64_t E, int64_t B, int64_t Hl) {
    int st;
    if (f->be->device_memory) {
        st = ep_routed_dev(f, d, E, B, Hl);
    } else {
        int64_t lo, hi;
        ep_expert_range(E, f->ep->world, f->ep->rank, &lo, &hi);
        ep_experts_ctx ec = {f, d, lo};
        const size_t rowb = (size_t)Hl * f->be->act_size;
        st = ep_moe_exchange(f->ep, E, f->b->idx, f->b->xs, B, rowb, rowb, ep_experts, &ec, f->b->ys,
                             &f->ep_ws->exchange);
    }
    return st ? fp4moe_error_context(st, "experts (expert parallel, rank %d of %d)", f->ep->rank, f->ep->world)
              : FP4MOE_OK;
}

/* The routed experts of a MoE layer: routing, the expert matmuls, the weighted combine (and the
 * latent projections); *routed: the result. */
static int moe_routed(const fw_ctx *f, const fw_layer *d, const void **routed) {
    const fp4moe_config *c = f->cfg;
    const be_ops *be = f->be;
    void *bc = f->bc;
    const fw_bufs *b = f->b;
    const int64_t R = f->st->R;
    const int64_t H = c->hidden, E = c->n_experts, k = c->top_k, B = R * k;
    const int64_t Hl = c->moe_latent ? c->moe_latent : H;
    const fw_router rc = {E, k, c->n_group, c->topk_group, c->norm_topk_prob, c->routed_scaling,
                          d->router_bias, d->router_w3};
    TRY(be->moe_route(bc, &rc, b->xn32, b->xn, R, d->router_w, H, b->rlogits, b->ids, b->wts, b->row_of, b->idx,
                      b->pos_of));
    const void *xin = b->xn;
    int st;
    if (c->moe_latent) {
        if ((st = be->linear(bc, d->latent_in, b->xn, R, 0, b->xl))) return fp4moe_error_context(st, "fc1_latent_proj");
        xin = b->xl;
    }
    /* one token (a decode step of one sequence): its k rows are all xin's row, which the backend may
     * read in place of k gathered copies (linear_gather_x1; the same results) */
    int up_done = 0, down_done = 0;
    if (R == 1 && !f->ep && be->linear_gather_x1) {
        st = be->linear_gather_x1(bc, d->experts_up, xin, b->idx, B, 1, b->hs);
        if (st == FP4MOE_OK) up_done = 1;
        else if (st == FP4MOE_EUNSUPPORTED) fp4moe_clear_error();
        else return fp4moe_error_context(st, "experts up (gather_qmm, one token)");
    }
    /* more tokens: the backend may run both projections in one step (experts_rows), or read the rows through row_of
     * in place of gathered copies (linear_gather_rows); the same results */
    if (!up_done && R > 1 && !f->ep && be->experts_rows) {
        st = be->experts_rows(bc, d->experts_up, d->experts_down, xin, R, b->row_of, k, b->idx, B, b->hs, b->ys);
        if (st == FP4MOE_OK) up_done = down_done = 1;
        else if (st == FP4MOE_EUNSUPPORTED) fp4moe_clear_error();
        else return fp4moe_error_context(st, "experts up + down (gather_qmm, fused)");
    }
    if (!up_done && R > 1 && !f->ep && be->linear_gather_rows) {
        st = be->linear_gather_rows(bc, d->experts_up, xin, R, b->row_of, k, b->idx, B, 1, b->hs);
        if (st == FP4MOE_OK) up_done = 1;
        else if (st == FP4MOE_EUNSUPPORTED) fp4moe_clear_error();
        else return fp4moe_error_context(st, "experts up (gather_qmm, rows through row_of)");
    }
    if (!up_done) TRY(be->gather_rows(bc, xin, Hl, b->row_of, B, k, b->xs));
    if (f->ep) { /* the rows go to the ranks that own their experts and come back (src/model/ep.c) */
        TRY(ep_routed(f, d, E, B, Hl));
    } else {
        if (!up_done && (st = be->linear_gather(bc, d->experts_up, b->xs, b->idx, B, 1, b->hs))) /* with relu^2 */
            return fp4moe_error_context(st, "experts up (gather_qmm)");
        if (!down_done && (st = be->linear_gather(bc, d->experts_down, b->hs, b->idx, B, 0, b->ys)))
            return fp4moe_error_context(st, "experts down (gather_qmm)");
    }
    TRY(be->moe_combine(bc, b->ys, Hl, b->pos_of, b->wts, R, k, b->comb));
    *routed = b->comb;
    if (c->moe_latent) {
        if ((st = be->linear(bc, d->latent_out, b->comb, R, 0, b->out_a))) return fp4moe_error_context(st, "fc2_latent_proj");
        *routed = b->out_a;
    }
    return FP4MOE_OK;
}

/* The MoE mixer; its output is *out_a (+ *out_b, the shared expert's, or NULL). Where the backend
 * offers a second queue (be_ops side_begin: the CUDA backend in decode steps, FP4MOE_CUDA_SIDE_STREAM)
 * the shared expert is issued first, on it, and runs beside the routing and the routed experts;
 * the buffers of the two parts are disjoint (xn is read by both), and the results are the same. */
static int moe(const fw_ctx *f, const fw_layer *d, const void **out_a, const void **out_b) {
    const be_ops *be = f->be;
    void *bc = f->bc;
    const fw_bufs *b = f->b;
    const int64_t R = f->st->R;
    int side = 0, st;
    if (d->shared_up && !f->ep && be->side_begin) {
        const void *sw[2] = {d->shared_up, d->shared_down};
        TRY(be->side_begin(bc, R, sw, 2, &side));
    }
    if (side) {
        st = mlp(f, d->shared_up, d->shared_down, b->xn, b->shh, b->out_b);
        const int se = be->side_end(bc);
        if (!st) st = se;
        if (!st) st = moe_routed(f, d, out_a);
        const int sj = be->side_join(bc);
        if (!st) st = sj;
        if (st) return fp4moe_error_context(st, "moe (shared expert beside the routed experts)");
        *out_b = b->out_b;
        TRY(mark(f, FP4MOE_PROF_MOE_ROUTED));
        return mark(f, FP4MOE_PROF_MOE_SHARED);
    }
    TRY(moe_routed(f, d, out_a));
    TRY(mark(f, FP4MOE_PROF_MOE_ROUTED));
    const void *shared = NULL;
    if (d->shared_up) {
        if ((st = mlp(f, d->shared_up, d->shared_down, b->xn, b->shh, b->out_b)))
            return fp4moe_error_context(st, "shared expert");
        shared = b->out_b;
    }
    *out_b = shared;
    return mark(f, FP4MOE_PROF_MOE_SHARED);
}

/* One layer's mixer on xn = rmsnorm(h) * norm (made by the previous layer's residual step); its
 * output is *a (+ *b). */
static int layer(const fw_ctx *f, int64_t l, const void **a, const void **b2) {
    const fw_layer *d = &f->w->layers[l];
    const fw_bufs *b = f->b;
    int st = FP4MOE_OK;
    *a = b->out_a;
    *b2 = NULL;
    switch (d->type) {
    case FP4MOE_LAYER_MAMBA:
        st = mamba(f, d, &f->state[l]);
        if (!st) st = mark(f, FP4MOE_PROF_MAMBA);
        break;
    case FP4MOE_LAYER_ATTENTION:
        st = attention(f, d, &f->state[l]);
        if (!st) st = mark(f, FP4MOE_PROF_ATTENTION);
        break;
    case FP4MOE_LAYER_MOE:
        st = moe(f, d, a, b2);
        break;
    default:
        st = mlp(f, d->up, d->down, b->xn, b->hm, b->out_a);
        if (!st) st = mark(f, FP4MOE_PROF_OTHER);
    }
    return st ? fp4moe_error_context(st, "layer %lld (%s)", (long long)l, fp4moe_layer_type_name(d->type))
              : FP4MOE_OK;
}

/* xn (and xn32 when layer l is MoE: the router's fp32 input) = rmsnorm(h) * layer l's norm, after
 * h += a (+ b) when a is not NULL (the previous layer's residual, in the same launch). */
static int norm_for(const fw_ctx *f, int64_t l, const void *a, const void *b2) {
    const fw_layer *d = &f->w->layers[l];
    const int st = f->be->rmsnorm(f->bc, f->b->h, a, b2, d->norm, f->st->R, f->cfg->hidden, f->cfg->eps, f->b->xn,
                                  d->type == FP4MOE_LAYER_MOE ? f->b->xn32 : NULL);
    return st ? fp4moe_error_context(st, "layer %lld (norm)", (long long)l) : FP4MOE_OK;
}

int fw_forward(void *arg) {
    const fw_ctx *f = arg;
    const fp4moe_config *c = f->cfg;
    const be_ops *be = f->be;
    const fw_bufs *b = f->b;
    const fw_step *s = f->st;
    TRY(mark(f, FP4MOE_PROF_OTHER));
    TRY(be->embed(f->bc, f->w->embed, s->d_tokens, s->R, b->h));
    TRY(mark(f, FP4MOE_PROF_OTHER));
    const void *a = NULL, *a2 = NULL; /* the residual of the layer before */
    for (int64_t l = 0; l < c->n_layers; l++) {
        if (f->interrupt && *f->interrupt)
            return fp4moe_set_error(FP4MOE_EINTERRUPTED, "forward: interrupted");
        TRY(norm_for(f, l, a, a2));
        TRY(layer(f, l, &a, &a2));
    }
    if (c->n_layers > 0) TRY(be->residual_add(f->bc, b->h, a, a2, s->R * c->hidden));
    if (s->n_head > 0) {
        TRY(be->rmsnorm_rows(f->bc, b->h, s->d_head_rows, s->n_head, f->w->norm_f, c->hidden, c->eps, b->xn));
        const int st = be->linear_f32out(f->bc, f->w->lm_head, b->xn, s->n_head, b->lg);
        if (st) return fp4moe_error_context(st, "lm_head");
        if (f->argmax) TRY(be->argmax_rows(f->bc, b->lg, s->n_head, c->vocab, b->next));
        TRY(mark(f, FP4MOE_PROF_LM_HEAD));
    }
    return FP4MOE_OK;
}
