/* The MoE mixer and the dense MLP of nemotron_h (spec NEMOTRON_H.md "MoE", "MLP"):
 *   router (fp32) -> top-k experts and weights per token
 *   (token, slot) rows sorted by expert -> gather_qmm up -> relu^2 -> gather_qmm down
 *   -> fp32 combine with the router weights -> + shared_expert(x)
 * With moe_latent_size the routed experts work in the latent width (fc1/fc2_latent_proj). */
#include "model/model_internal.h"

#include <string.h>

#include "common/error.h"

int mlp_forward(fp4moe_session *s, const op_linear *up, const op_linear *down, const float *x,
                int64_t T, float *out) {
    float *hbuf = arena_alloc(&s->scratch, (size_t)(T * up->N) * sizeof(float));
    if (!hbuf) return FP4MOE_ENOMEM;
    int st = op_linear_forward(&s->ops, up, x, T, hbuf);
    if (st) return fp4moe_error_context(st, "up_proj");
    op_relu2(hbuf, T * up->N);
    st = op_linear_forward(&s->ops, down, hbuf, T, out);
    return st ? fp4moe_error_context(st, "down_proj") : FP4MOE_OK;
}

/* Router logits (T x E) = xa @ gate^T in fp32 (transformers NemotronHTopkRouter). */
static void router_logits(const layer_weights *w, const float *xa, int64_t T, int64_t E, int64_t H,
                          float *logits) {
    op_matmul_f32(xa, T, w->router_w, E, H, logits, E);
}

/* The routed experts on rows already sorted by expert: ys = down(relu2(up(xs))). */
static int experts_forward(fp4moe_session *s, const layer_weights *w, const float *xs,
                           const uint32_t *idx, int64_t B, float *ys) {
    const int64_t inter = w->experts_up.N;
    float *hs = arena_alloc(&s->scratch, (size_t)(B * inter) * sizeof(float));
    if (!hs) return FP4MOE_ENOMEM;
    int st = op_linear_gather(&s->ops, &w->experts_up, xs, idx, B, hs);
    if (st) return fp4moe_error_context(st, "experts up (gather_qmm)");
    op_relu2(hs, B * inter);
    st = op_linear_gather(&s->ops, &w->experts_down, hs, idx, B, ys);
    return st ? fp4moe_error_context(st, "experts down (gather_qmm)") : FP4MOE_OK;
}

/* Routed part: out (T x H) = combine of the top-k experts of each token. */
static int routed_forward(fp4moe_session *s, const layer_weights *w, const float *xa, int64_t T,
                          float *out) {
    const fp4moe_config *c = &s->m->cfg;
    const int64_t H = c->hidden, E = c->n_experts, k = c->top_k, B = T * k;
    const int64_t Hl = c->moe_latent ? c->moe_latent : H;
    float *logits = arena_alloc(&s->scratch, (size_t)(T * E) * sizeof(float));
    int32_t *ids = arena_alloc(&s->scratch, (size_t)B * sizeof(int32_t));
    float *wts = arena_alloc(&s->scratch, (size_t)B * sizeof(float));
    uint32_t *row_of = arena_alloc(&s->scratch, (size_t)B * sizeof(uint32_t));
    uint32_t *idx = arena_alloc(&s->scratch, (size_t)B * sizeof(uint32_t));
    uint32_t *pos_of = arena_alloc(&s->scratch, (size_t)B * sizeof(uint32_t));
    float *xs = arena_alloc(&s->scratch, (size_t)(B * Hl) * sizeof(float));
    float *ys = arena_alloc(&s->scratch, (size_t)(B * Hl) * sizeof(float));
    float *comb = arena_alloc(&s->scratch, (size_t)(T * Hl) * sizeof(float));
    float *xl = c->moe_latent ? arena_alloc(&s->scratch, (size_t)(T * Hl) * sizeof(float)) : NULL;
    if (!logits || !ids || !wts || !row_of || !idx || !pos_of || !xs || !ys || !comb ||
        (c->moe_latent && !xl))
        return FP4MOE_ENOMEM;

    router_logits(w, xa, T, E, H, logits);
    const op_router_cfg rc = {E, k, c->n_group, c->topk_group, c->norm_topk_prob,
                              c->routed_scaling, w->router_bias};
    int st = op_router_topk(&rc, logits, T, ids, wts);
    if (!st) st = op_sort_by_expert(ids, B, E, row_of, idx, pos_of);
    if (!st && xl) st = op_linear_forward(&s->ops, &w->latent_in, xa, T, xl);
    if (st) return st;
    const float *xin = xl ? xl : xa;
    for (int64_t p = 0; p < B; p++)                       /* gather rows in expert order */
        memcpy(xs + p * Hl, xin + (int64_t)(row_of[p] / k) * Hl, (size_t)Hl * sizeof(float));
    if ((st = experts_forward(s, w, xs, idx, B, ys))) return st;
    op_moe_combine(ys, Hl, pos_of, wts, T, k, comb);
    op_round_act(s->ops.act, comb, T * Hl);
    if (!xl) {
        memcpy(out, comb, (size_t)(T * H) * sizeof(float));
        return FP4MOE_OK;
    }
    st = op_linear_forward(&s->ops, &w->latent_out, comb, T, out);
    return st ? fp4moe_error_context(st, "fc2_latent_proj") : FP4MOE_OK;
}

int moe_forward(fp4moe_session *s, int64_t l, const float *x, int64_t T, float *out) {
    const layer_weights *w = &s->m->layers[l];
    const int64_t H = s->m->cfg.hidden;
    float *xa = arena_alloc(&s->scratch, (size_t)(T * H) * sizeof(float));
    if (!xa) return FP4MOE_ENOMEM;
    memcpy(xa, x, (size_t)(T * H) * sizeof(float));
    op_round_act(s->ops.act, xa, T * H);               /* what every matmul of the block reads */
    int st = routed_forward(s, w, xa, T, out);
    if (st || !w->shared_up.N) return st;
    float *sh = arena_alloc(&s->scratch, (size_t)(T * H) * sizeof(float));
    if (!sh) return FP4MOE_ENOMEM;
    if ((st = mlp_forward(s, &w->shared_up, &w->shared_down, xa, T, sh)))
        return fp4moe_error_context(st, "shared expert");
    op_add(out, sh, T * H);
    return FP4MOE_OK;
}
