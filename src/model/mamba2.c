/* The Mamba-2 mixer of nemotron_h (spec NEMOTRON_H.md "Mamba-2"; transformers
 * NemotronHMamba2Mixer.torch_forward):
 *   [z | xBC | dt] = in_proj(x);  xBC = silu(conv1d_causal(xBC));  [xs | B | C] = xBC
 *   y = ssm_scan(xs, dt, A, B, C, D);  out = out_proj(rmsnorm_grouped(y * silu(z)) * norm.weight)
 * The conv and SSM states carry over between calls (prefill and decode use the same code).
 * dt clamp: dt = clamp(softplus(dt + dt_bias), time_step_limit[0], time_step_limit[1]) in prefill
 * and decode alike, as the engines these checkpoints are served with do: mlx-lm applies the
 * config's time_step_limit, vLLM's Mamba-2 mixer and the state-spaces/mamba kernels use
 * dt_limit = (0, inf), which NVIDIA's configs declare. transformers 5.17 instead clamps dt to
 * >= time_step_min in its chunked scan (every prefill) and not at all in its one-token cached
 * update; time_step_min is an initialisation parameter of dt_bias elsewhere. A model trained
 * through transformers' prefill path (the default model, the golden tiny models) declares
 * time_step_limit = [time_step_min, inf], so both readings give one function there
 * (docs/spec/NEMOTRON_H.md; tests/model/test_model_paths.c checks prefill == decode). */
#include "model/model_internal.h"

#include "common/error.h"

int mamba2_forward(fp4moe_session *s, int64_t l, const float *x, int64_t T, float *out) {
    const fp4moe_config *c = &s->m->cfg;
    const layer_weights *w = &s->m->layers[l];
    layer_state *ls = &s->ls[l];
    const int64_t nh = c->mamba_heads, hd = c->mamba_head_dim, G = c->mamba_groups;
    const int64_t S = c->ssm_state, di = nh * hd, GS = G * S, cd = di + 2 * GS;
    const int64_t np = w->in_proj.N;                 /* di + cd + nh */
    float *zxbcdt = arena_alloc(&s->scratch, (size_t)(T * np) * sizeof(float));
    float *xbc = arena_alloc(&s->scratch, (size_t)(T * cd) * sizeof(float));
    float *y = arena_alloc(&s->scratch, (size_t)(T * di) * sizeof(float));
    if (!zxbcdt || !xbc || !y) return FP4MOE_ENOMEM;

    int st = op_linear_forward(&s->ops, &w->in_proj, x, T, zxbcdt);
    if (st) return fp4moe_error_context(st, "in_proj");
    const float *z = zxbcdt, *dt = zxbcdt + di + cd;
    op_conv1d_causal(zxbcdt + di, np, T, cd, w->conv_w, w->conv_b, c->conv_kernel, ls->conv_state,
                     xbc);
    op_silu(xbc, T * cd);

    const op_ssm_args a = {
        .T = T, .nh = nh, .hd = hd, .S = S, .G = G,
        .x = xbc, .xs = cd, .B = xbc + di, .C = xbc + di + GS, .bcs = cd,
        .dt = dt, .dts = np, .dt_bias = w->dt_bias, .A = w->A, .D = w->D,
        .dt_lo = c->time_step_limit[0], .dt_hi = c->time_step_limit[1], .state = ls->ssm_state, .y = y,
    };
    op_ssm_scan(&a);
    op_rmsnorm_gated(y, di, z, np, w->gnorm, T, di, G, c->eps, y);
    st = op_linear_forward(&s->ops, &w->out_proj, y, T, out);
    return st ? fp4moe_error_context(st, "out_proj") : FP4MOE_OK;
}
