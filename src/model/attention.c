/* The attention mixer of nemotron_h (spec NEMOTRON_H.md "Attention"): GQA, causal, no positional
 * encoding; K and V of every position are kept in fp32 caches that grow with the context. */
#include "model/model_internal.h"

#include <stdlib.h>

#include "common/error.h"

/* Room for `need` positions in the KV cache of layer state ls (rows of kvs floats). */
static int reserve_kv(layer_state *ls, int64_t need, int64_t kvs) {
    if (need <= ls->cap) return FP4MOE_OK;
    int64_t cap = ls->cap ? ls->cap : 256;
    while (cap < need) cap *= 2;
    float *k = realloc(ls->k_cache, (size_t)(cap * kvs) * sizeof(float));
    if (k) ls->k_cache = k;
    float *v = k ? realloc(ls->v_cache, (size_t)(cap * kvs) * sizeof(float)) : NULL;
    if (v) ls->v_cache = v;
    if (!k || !v)
        return fp4moe_set_error(FP4MOE_ENOMEM, "attention: cannot grow the KV cache to %lld tokens",
                                (long long)cap);
    ls->cap = cap;
    return FP4MOE_OK;
}

int attention_forward(fp4moe_session *s, int64_t l, const float *x, int64_t T, float *out) {
    const fp4moe_config *c = &s->m->cfg;
    const layer_weights *w = &s->m->layers[l];
    layer_state *ls = &s->ls[l];
    const int64_t nq = c->attn_heads, nkv = c->kv_heads, dh = c->head_dim, kvs = nkv * dh;
    const int64_t P = s->pos;
    int st = reserve_kv(ls, P + T, kvs);
    if (st) return st;
    float *q = arena_alloc(&s->scratch, (size_t)(T * nq * dh) * sizeof(float));
    float *att = arena_alloc(&s->scratch, (size_t)(T * nq * dh) * sizeof(float));
    if (!q || !att) return FP4MOE_ENOMEM;
    if ((st = op_linear_forward(&s->ops, &w->q_proj, x, T, q)) ||
        (st = op_linear_forward(&s->ops, &w->k_proj, x, T, ls->k_cache + P * kvs)) ||
        (st = op_linear_forward(&s->ops, &w->v_proj, x, T, ls->v_cache + P * kvs)))
        return fp4moe_error_context(st, "q/k/v_proj");
    if ((st = op_attention_causal(q, nq * dh, ls->k_cache, ls->v_cache, P, T, nq, nkv, dh, att)))
        return st;
    op_round_act(s->ops.act, att, T * nq * dh);
    st = op_linear_forward(&s->ops, &w->o_proj, att, T, out);
    return st ? fp4moe_error_context(st, "o_proj") : FP4MOE_OK;
}
