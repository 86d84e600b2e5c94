/* Token sampling: greedy argmax, or temperature + top-p (nucleus) sampling with a seeded
 * xorshift64* generator (the llama2.c sampler, with deterministic tie order). */
#include "fp4moe/model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"

int32_t fp4moe_argmax(const float *logits, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++)
        if (logits[i] > logits[best] || (isnan(logits[best]) && !isnan(logits[i]))) best = i;
    return (int32_t)best;
}

void fp4moe_sampler_params_default(fp4moe_sampler_params *p) {
    memset(p, 0, sizeof *p);
    p->top_p = 1.0f;
}

int fp4moe_sampler_init_params(fp4moe_sampler *s, int64_t vocab, const fp4moe_sampler_params *p) {
    if (!s) return fp4moe_set_error(FP4MOE_EINVAL, "sampler: NULL sampler");
    memset(s, 0, sizeof *s); /* fp4moe_sampler_free is safe after any failure */
    if (!p) return fp4moe_set_error(FP4MOE_EINVAL, "sampler: NULL parameters");
    if (vocab < 1 || vocab > INT32_MAX)
        return fp4moe_set_error(FP4MOE_EINVAL, "sampler: vocab=%lld", (long long)vocab);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return fp4moe_set_error(FP4MOE_EINVAL, "sampler: top_p=%g is not in (0, 1]", p->top_p);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return fp4moe_set_error(FP4MOE_EINVAL, "sampler: min_p=%g is not in [0, 1]", p->min_p);
    if (p->top_k < 0) return fp4moe_set_error(FP4MOE_EINVAL, "sampler: top_k=%lld < 0", (long long)p->top_k);
    if (isnan(p->temperature) || isinf(p->temperature))
        return fp4moe_set_error(FP4MOE_EINVAL, "sampler: temperature=%g", p->temperature);
    if (p->n_stop < 0 || p->n_stop > FP4MOE_MAX_STOP_IDS)
        return fp4moe_set_error(FP4MOE_EINVAL, "sampler: %d stop ids (at most %d)", p->n_stop, FP4MOE_MAX_STOP_IDS);
    for (int i = 0; i < p->n_stop; i++)
        if (p->stop_ids[i] < 0 || p->stop_ids[i] >= vocab)
            return fp4moe_set_error(FP4MOE_EINVAL, "sampler: stop id %d outside [0, %lld)", p->stop_ids[i],
                                    (long long)vocab);
    s->vocab = vocab;
    s->temperature = p->temperature;
    s->top_p = p->top_p;
    s->top_k = p->top_k;
    s->min_p = p->min_p;
    s->n_stop = p->n_stop;
    memcpy(s->stop_ids, p->stop_ids, sizeof s->stop_ids);
    if (!(p->repeat_penalty >= 0.0f) || isinf(p->repeat_penalty) || p->repeat_last_n < 0)
        return fp4moe_set_error(FP4MOE_EINVAL, "sampler: repeat_penalty=%g / repeat_last_n=%lld", p->repeat_penalty,
                                (long long)p->repeat_last_n);
    if (!isfinite(p->presence_penalty) || !isfinite(p->frequency_penalty))
        return fp4moe_set_error(FP4MOE_EINVAL, "sampler: presence_penalty=%g / frequency_penalty=%g (finite values)",
                                p->presence_penalty, p->frequency_penalty);
    if (p->n_bias < 0 || (p->n_bias > 0 && (!p->bias_ids || !p->bias)))
        return fp4moe_set_error(FP4MOE_EINVAL, "sampler: %lld logit biases without their arrays", (long long)p->n_bias);
    for (int64_t i = 0; i < p->n_bias; i++) {
        if (p->bias_ids[i] < 0 || p->bias_ids[i] >= vocab)
            return fp4moe_set_error(FP4MOE_EINVAL, "sampler: logit bias %lld: id %d outside [0, %lld)", (long long)i,
                                    p->bias_ids[i], (long long)vocab);
        if (!isfinite(p->bias[i]))
            return fp4moe_set_error(FP4MOE_EINVAL, "sampler: logit bias %lld (id %d) is %g", (long long)i,
                                    p->bias_ids[i], p->bias[i]);
    }
    s->rng = p->seed ? p->seed : 0x9E3779B97F4A7C15ull;
    s->probs = malloc((size_t)vocab * sizeof(float));
    s->cand = malloc((size_t)vocab * sizeof *s->cand);
    int pen_ok = 1;
    if (p->repeat_penalty > 0.0f && p->repeat_penalty != 1.0f) {
        s->repeat_penalty = p->repeat_penalty;
        s->repeat_last_n = p->repeat_last_n ? p->repeat_last_n : 64;
        s->recent = malloc((size_t)s->repeat_last_n * sizeof(int32_t));
        s->mark = calloc((size_t)vocab, sizeof(uint32_t));
        pen_ok = s->recent && s->mark;
    }
    if (p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f) {
        s->presence_penalty = p->presence_penalty;
        s->frequency_penalty = p->frequency_penalty;
        s->count = calloc((size_t)vocab, sizeof(int32_t));
        s->out_ids = malloc((size_t)vocab * sizeof(int32_t));
        pen_ok = pen_ok && s->count && s->out_ids;
    }
    if (p->n_bias > 0) {
        s->n_bias = p->n_bias;
        s->bias_ids = malloc((size_t)p->n_bias * sizeof(int32_t));
        s->bias = malloc((size_t)p->n_bias * sizeof(float));
        if (s->bias_ids && s->bias) {
            memcpy(s->bias_ids, p->bias_ids, (size_t)p->n_bias * sizeof(int32_t));
            memcpy(s->bias, p->bias, (size_t)p->n_bias * sizeof(float));
        }
        pen_ok = pen_ok && s->bias_ids && s->bias;
    }
    if (s->recent || s->count || s->n_bias) {
        s->pen = malloc((size_t)vocab * sizeof(float));
        pen_ok = pen_ok && s->pen;
    }
    if (!s->probs || !s->cand || !pen_ok) {
        fp4moe_sampler_free(s);
        return fp4moe_set_error(FP4MOE_ENOMEM, "sampler: out of memory");
    }
    return FP4MOE_OK;
}

int fp4moe_sampler_init(fp4moe_sampler *s, int64_t vocab, float temperature, float top_p,
                        uint64_t seed) {
    fp4moe_sampler_params p;
    fp4moe_sampler_params_default(&p);
    p.temperature = temperature;
    p.top_p = top_p;
    p.seed = seed;
    return fp4moe_sampler_init_params(s, vocab, &p);
}

int fp4moe_sampler_is_stop(const fp4moe_sampler *s, int32_t id) {
    for (int i = 0; s && i < s->n_stop; i++)
        if (s->stop_ids[i] == id) return 1;
    return 0;
}

void fp4moe_sampler_free(fp4moe_sampler *s) {
    if (!s) return;
    free(s->probs);
    free(s->cand);
    free(s->recent);
    free(s->mark);
    free(s->count);
    free(s->out_ids);
    free(s->bias_ids);
    free(s->bias);
    free(s->pen);
    s->probs = NULL;
    s->cand = NULL;
    s->recent = NULL;
    s->mark = NULL;
    s->count = s->out_ids = s->bias_ids = NULL;
    s->bias = s->pen = NULL;
    s->n_bias = s->n_out_ids = s->n_recent = 0;
}

/* Uniform in [0, 1) from xorshift64*. */
static float next_uniform(fp4moe_sampler *s) {
    s->rng ^= s->rng >> 12;
    s->rng ^= s->rng << 25;
    s->rng ^= s->rng >> 27;
    return (float)((s->rng * 0x2545F4914F6CDD1Dull) >> 40) * 0x1.0p-24f;
}

/* probs = softmax(logits / temperature), fp32 with the max subtracted. */
static void softmax_t(const float *logits, int64_t n, float temperature, float *probs) {
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; i++) mx = fmaxf(mx, logits[i]);
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        probs[i] = expf((logits[i] - mx) / temperature);
        sum += probs[i];
    }
    for (int64_t i = 0; i < n; i++) probs[i] = (float)(probs[i] / sum);
}

/* Probability descending, then id ascending. */
static int by_prob_desc(const void *a, const void *b) {
    const fp4moe_prob_id *x = a, *y = b;
    if (x->p != y->p) return x->p > y->p ? -1 : 1;
    return x->id < y->id ? -1 : 1;
}

/* Candidates by probability (descending, ties: lower id), cut by top_k, min_p, then top_p; one draw
 * from the renormalised rest. */
static int32_t sample_cut(fp4moe_sampler *s) {
    const int64_t n = s->vocab;
    /* tokens below (1 - top_p) / (n - 1) can never be in the nucleus (llama2.c's cut); with top_k or
     * min_p the full order is needed */
    const float cut = s->top_p < 1.0f && !s->top_k && s->min_p <= 0.0f ? (1.0f - s->top_p) / (float)(n > 1 ? n - 1 : 1)
                                                                     : 0.0f;
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++)
        if (s->probs[i] >= cut) s->cand[m++] = (fp4moe_prob_id){s->probs[i], (int32_t)i};
    qsort(s->cand, (size_t)m, sizeof *s->cand, by_prob_desc);
    if (s->top_k > 0 && m > s->top_k) m = s->top_k;
    if (s->min_p > 0.0f) {
        const float floor_p = s->min_p * s->cand[0].p;
        int64_t keep = 1;
        while (keep < m && s->cand[keep].p >= floor_p) keep++;
        m = keep;
    }
    double total = 1.0;                                /* top_p alone: of the whole distribution */
    if (s->top_k > 0 || s->min_p > 0.0f) {             /* after a cut: of what is left */
        total = 0.0;
        for (int64_t i = 0; i < m; i++) total += s->cand[i].p;
    }
    double mass = 0.0;
    int64_t last = m - 1;
    for (int64_t i = 0; i < m; i++) {
        mass += s->cand[i].p;
        if (mass >= s->top_p * total) { last = i; break; }
    }
    const double r = (double)next_uniform(s) * mass;
    double acc = 0.0;
    for (int64_t i = 0; i <= last; i++) {
        acc += s->cand[i].p;
        if (r < acc) return s->cand[i].id;
    }
    return s->cand[last].id;
}

void fp4moe_sampler_accept(fp4moe_sampler *s, int32_t id) {
    if (!s || !s->recent || id < 0 || id >= s->vocab) return;
    s->recent[s->recent_head] = id;
    s->recent_head = (s->recent_head + 1) % s->repeat_last_n;
    if (s->n_recent < s->repeat_last_n) s->n_recent++;
}

void fp4moe_sampler_accept_output(fp4moe_sampler *s, int32_t id) {
    fp4moe_sampler_accept(s, id);
    if (!s || !s->count || id < 0 || id >= s->vocab) return;
    if (s->count[id]++ == 0) s->out_ids[s->n_out_ids++] = id;
}

void fp4moe_sampler_forget(fp4moe_sampler *s) {
    if (!s) return;
    s->n_recent = s->recent_head = 0;
    for (int64_t i = 0; s->count && i < s->n_out_ids; i++) s->count[s->out_ids[i]] = 0;
    s->n_out_ids = 0;
}

/* The logits after the logit bias, the repetition penalty (once per distinct id of the window: an
 * id is marked with this pass's number when first penalized) and the presence / frequency penalties,
 * in vLLM's order, into s->pen; the logits themselves when all are off or have nothing to do. */
static const float *penalize(fp4moe_sampler *s, const float *logits) {
    const int rep = s->recent && s->n_recent, out = s->count && s->n_out_ids;
    if (!rep && !out && !s->n_bias) return logits;
    memcpy(s->pen, logits, (size_t)s->vocab * sizeof(float));
    for (int64_t i = 0; i < s->n_bias; i++) s->pen[s->bias_ids[i]] += s->bias[i];
    if (rep) {
        if (++s->pass == 0) { /* the marks wrapped: clear them */
            memset(s->mark, 0, (size_t)s->vocab * sizeof(uint32_t));
            s->pass = 1;
        }
        for (int64_t i = 0; i < s->n_recent; i++) {
            const int32_t id = s->recent[i];
            if (s->mark[id] == s->pass) continue;
            s->mark[id] = s->pass;
            const float l = s->pen[id];
            s->pen[id] = l > 0.0f ? l / s->repeat_penalty : l * s->repeat_penalty;
        }
    }
    for (int64_t i = 0; out && i < s->n_out_ids; i++) {
        const int32_t id = s->out_ids[i];
#ifdef FP4MOE_INJECT_FAULT_SAMPLER_COUNT /* deliberate fault (tests must catch it): the count ignored */
        s->pen[id] -= s->frequency_penalty + s->presence_penalty;
#else
        s->pen[id] -= s->frequency_penalty * (float)s->count[id] + s->presence_penalty;
#endif
    }
    return s->pen;
}

int64_t fp4moe_logprobs(const float *logits, int64_t V, int32_t id, float *lp, int64_t top_n, fp4moe_prob_id *top) {
    if (!logits || V < 1 || id < 0 || id >= V || top_n < 0 || (top_n > 0 && !top)) {
        fp4moe_set_error(FP4MOE_EINVAL, "logprobs: bad arguments (V=%lld, id=%d, top_n=%lld)", (long long)V, id,
                         (long long)top_n);
        return -1;
    }
    float mx = -INFINITY;
    for (int64_t i = 0; i < V; i++)
        if (logits[i] > mx) mx = logits[i];
    double sum = 0.0;
    for (int64_t i = 0; i < V; i++)
        if (logits[i] > -INFINITY) sum += exp((double)logits[i] - (double)mx); /* NaN: not > -inf */
    const double lz = (double)mx + log(sum);
    if (lp) *lp = isnan(logits[id]) ? -INFINITY : (float)((double)logits[id] - lz);
    const int64_t k = top_n < V ? top_n : V;
    if (k == 0) return 0;
    /* top[0..m) sorted by (logit desc, id asc): an insertion when a logit beats the last kept one */
    int64_t m = 0;
    for (int64_t i = 0; i < V; i++) {
        const float l = isnan(logits[i]) ? -INFINITY : logits[i];
        if (m == k && !(l > top[m - 1].p)) continue; /* ties keep the lower id already there */
        int64_t pos = m < k ? m++ : k - 1;
        while (pos > 0 && l > top[pos - 1].p) {
            top[pos] = top[pos - 1];
            pos--;
        }
        top[pos] = (fp4moe_prob_id){l, (int32_t)i};
    }
    for (int64_t i = 0; i < k; i++) top[i].p = (float)((double)top[i].p - lz);
    return k;
}

int32_t fp4moe_sample(fp4moe_sampler *s, const float *logits) {
    if (!s || !logits || s->vocab < 1) {
        fp4moe_set_error(FP4MOE_EINVAL, "sample: %s", !s ? "NULL sampler" : !logits ? "NULL logits" : "sampler not initialised");
        return -1;
    }
    logits = penalize(s, logits);
    if (s->temperature <= 0.0f) return fp4moe_argmax(logits, s->vocab);
    softmax_t(logits, s->vocab, s->temperature, s->probs);
    return sample_cut(s);
}
