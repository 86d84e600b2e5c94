/* MoE routing on the CPU: the nemotron_h router (sigmoid, correction bias for choice only,
 * grouped top-k, normalisation, routed scaling), the stable sort of (token, slot) rows by expert,
 * and the fp32 combine. Formulas: spec NEMOTRON_H.md "MoE"; transformers
 * NemotronHMoE.route_tokens_to_experts, with deterministic ties (lower id first). */
#include "kernels/cpu/ops.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"

/* Index of the largest of v[0..n) not yet taken; ties -> lowest index. */
static int64_t argmax_free(const float *v, const unsigned char *taken, int64_t n) {
    int64_t best = -1;
    for (int64_t i = 0; i < n; i++)
        if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
    return best;
}

/* Sum of the two largest values of v[0..n), n >= 2. */
static float top2_sum(const float *v, int64_t n) {
    float a = -INFINITY, b = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        if (v[i] > a) { b = a; a = v[i]; }
        else if (v[i] > b) b = v[i];
    }
    return a + b;
}

/* Keeps the topk_group best groups (by sum of their top-2 choice scores); the rest -> -inf. */
static void mask_groups(const op_router_cfg *r, float *choice, float *gscore, unsigned char *gtaken) {
    const int64_t G = r->n_group, per = r->E / G;
    for (int64_t g = 0; g < G; g++) {
        gscore[g] = top2_sum(choice + g * per, per);
        gtaken[g] = 0;
    }
    for (int64_t j = 0; j < r->topk_group; j++) gtaken[argmax_free(gscore, gtaken, G)] = 1;
    for (int64_t g = 0; g < G; g++)
        if (!gtaken[g])
            for (int64_t e = 0; e < per; e++) choice[g * per + e] = -INFINITY;
}

/* One token: scratch holds E floats (choice) + E + n_group bytes + n_group floats. */
static void route_one(const op_router_cfg *r, const float *logit, float *choice, float *gscore,
                      unsigned char *taken, unsigned char *gtaken, int32_t *ids, float *wts) {
    const int64_t E = r->E;
    for (int64_t e = 0; e < E; e++) {
        const float s = 1.0f / (1.0f + expf(-logit[e]));
        choice[e] = s + (r->bias ? r->bias[e] : 0.0f);
        taken[e] = 0;
    }
    if (r->n_group > 1) mask_groups(r, choice, gscore, gtaken);
    float sum = 0.0f;
    for (int64_t j = 0; j < r->k; j++) {
        const int64_t e = argmax_free(choice, taken, E);
        taken[e] = 1;
        ids[j] = (int32_t)e;
        wts[j] = 1.0f / (1.0f + expf(-logit[e]));   /* the weight is s, never the choice score */
        sum += wts[j];
    }
    for (int64_t j = 0; j < r->k; j++) {
        if (r->norm_topk_prob) wts[j] /= sum + 1e-20f;
        wts[j] *= r->scaling;
    }
}

int op_router_topk(const op_router_cfg *r, const float *logits, int64_t T, int32_t *ids,
                   float *wts) {
    const int64_t E = r->E, G = r->n_group;
    int failed = 0;
#pragma omp parallel reduction(| : failed) if (T * E >= (1 << 14))
    {
        float *choice = malloc((size_t)(E + G) * sizeof(float));
        unsigned char *taken = malloc((size_t)(E + G));
        if (!choice || !taken) failed = 1;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++)
            if (choice && taken)
                route_one(r, logits + t * E, choice, choice + E, taken, taken + E, ids + t * r->k,
                          wts + t * r->k);
        free(choice);
        free(taken);
    }
    if (failed) return fp4moe_set_error(FP4MOE_ENOMEM, "router: out of memory");
    return FP4MOE_OK;
}

int op_sort_by_expert(const int32_t *ids, int64_t B, int64_t E, uint32_t *row_of, uint32_t *idx,
                      uint32_t *pos_of) {
    int64_t *start = calloc((size_t)E + 1, sizeof *start);
    if (!start) return fp4moe_set_error(FP4MOE_ENOMEM, "moe sort: out of memory");
    for (int64_t b = 0; b < B; b++) start[ids[b] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    for (int64_t b = 0; b < B; b++) {                 /* rows in original order: stable */
        const int64_t p = start[ids[b]]++;
        row_of[p] = (uint32_t)b;
        idx[p] = (uint32_t)ids[b];
        pos_of[b] = (uint32_t)p;
    }
    free(start);
    return FP4MOE_OK;
}

void op_moe_combine(const float *ys, int64_t H, const uint32_t *pos_of, const float *wts,
                    int64_t T, int64_t k, float *out) {
#pragma omp parallel for schedule(static) if (T * k * H >= (1 << 16))
    for (int64_t t = 0; t < T; t++) {
        float *o = out + t * H;
        memset(o, 0, (size_t)H * sizeof(float));
        for (int64_t j = 0; j < k; j++) {
            const float w = wts[t * k + j];
            const float *y = ys + (int64_t)pos_of[t * k + j] * H;
            for (int64_t i = 0; i < H; i++) o[i] += w * y[i];
        }
    }
}
