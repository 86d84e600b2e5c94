/* The single-sequence session API (include/fp4moe/model.h): a batch of one sequence
 * (src/model/batch.c), whose forward is src/model/forward.c on the CPU or CUDA backend. */
#include "fp4moe/model.h"

#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "fp4moe/nvfp4.h"
#include "model/model_internal.h"

/* ---- session: a batch of one sequence ---------------------------------------------------------- */

void fp4moe_session_options_default(fp4moe_session_options *o) {
    memset(o, 0, sizeof *o);
    o->act_dtype = FP4MOE_F32;
    o->route = FP4MOE_ROUTE_AUTO;
    o->max_chunk = 256;
}

int fp4moe_session_new(const fp4moe_model *m, const fp4moe_session_options *opts,
                       fp4moe_session **out) {
    if (!m || !out) return fp4moe_set_error(FP4MOE_EINVAL, "session_new: NULL argument");
    *out = NULL;
    fp4moe_session_options o;
    if (opts) o = *opts;
    else fp4moe_session_options_default(&o);
    if (o.act_dtype != FP4MOE_F32 && o.act_dtype != FP4MOE_BF16)
        return fp4moe_set_error(FP4MOE_EINVAL, "session_new: activation dtype %s (supported: f32, bf16)",
                                fp4moe_dtype_name(o.act_dtype));
    if (o.max_chunk < 1)
        return fp4moe_set_error(FP4MOE_EINVAL, "session_new: max_chunk=%lld < 1", (long long)o.max_chunk);
    fp4moe_session *s = calloc(1, sizeof *s);
    if (!s) return fp4moe_set_error(FP4MOE_ENOMEM, "session_new: out of memory");
    s->m = m;
    s->opt = o;
    fp4moe_batch_options bo;
    fp4moe_batch_options_default(&bo);
    bo.max_seqs = 1;
    bo.max_kv_tokens = o.max_context > 0 ? o.max_context : 0;
    bo.max_context = o.max_context;
    bo.max_step_tokens = o.max_chunk;
    bo.act_dtype = o.act_dtype;
    bo.route = o.route;
    bo.cpu_act = o.cpu_act;
    bo.kv_dtype = o.kv_dtype;
    bo.device = o.device;
    bo.profile = o.profile;
    bo.interrupt = o.interrupt;
    bo.ep = o.ep;
    bo.ep_rank = o.ep_rank;
    int st = fp4moe_batch_new(m, &bo, &s->batch);
    if (!st) st = fp4moe_batch_add(s->batch, &s->seq);
    if (st) {
        fp4moe_session_free(s);
        return fp4moe_error_context(st, "session_new");
    }
    *out = s;
    return FP4MOE_OK;
}

int fp4moe_session_ep_leave(fp4moe_session *s) {
    if (!s) return fp4moe_set_error(FP4MOE_EINVAL, "session_ep_leave: NULL argument");
    return fp4moe_ep_leave(s->batch);
}

void fp4moe_session_free(fp4moe_session *s) {
    if (!s) return;
    fp4moe_batch_free(s->batch);
    free(s);
}

void fp4moe_session_reset(fp4moe_session *s) {
    if (!s || !s->batch) return;
    fp4moe_batch_remove(s->batch, s->seq);
    if (fp4moe_batch_add(s->batch, &s->seq)) s->seq = -1;   /* cannot fail: the slot was just freed */
}

int64_t fp4moe_session_pos(const fp4moe_session *s) { return s ? fp4moe_batch_pos(s->batch, s->seq) : -1; }

int session_check_input(const fp4moe_session *s, const int32_t *tokens, int64_t T) {
    if (!s || !tokens) return fp4moe_set_error(FP4MOE_EINVAL, "forward: NULL argument");
    if (T < 1) return fp4moe_set_error(FP4MOE_EINVAL, "forward: T=%lld < 1", (long long)T);
    const fp4moe_config *c = &s->m->cfg;
    for (int64_t t = 0; t < T; t++)
        if (tokens[t] < 0 || tokens[t] >= c->vocab)
            return fp4moe_set_error(FP4MOE_EINVAL, "forward: token %lld is id %d, outside [0, %lld)",
                                    (long long)t, tokens[t], (long long)c->vocab);
    const int64_t pos = fp4moe_session_pos(s);
    if (s->opt.max_context > 0 && pos + T > s->opt.max_context)
        return fp4moe_set_error(FP4MOE_EOVERFLOW, "forward: %lld + %lld tokens exceed the context "
                                "limit %lld", (long long)pos, (long long)T,
                                (long long)s->opt.max_context);
    return FP4MOE_OK;
}

/* tokens in chunks of max_chunk, one batch step each. */
static int session_run(fp4moe_session *s, const int32_t *tokens, int64_t T, float *logits,
                       int all_logits, int32_t *next) {
    int st = session_check_input(s, tokens, T);
    if (st) return st;
    const int64_t V = s->m->cfg.vocab;
    int64_t chunk = s->opt.max_chunk;
    if (logits && all_logits && chunk > batch_logit_rows(s->batch)) chunk = batch_logit_rows(s->batch);
    for (int64_t t0 = 0; t0 < T; t0 += chunk) {
        if (s->opt.interrupt && *s->opt.interrupt)
            return fp4moe_set_error(FP4MOE_EINTERRUPTED, "forward: interrupted");
        const int64_t n = T - t0 < chunk ? T - t0 : chunk;
        const int last = t0 + n == T;
        fp4moe_batch_item it = {.seq = s->seq, .tokens = tokens + t0, .n = n};
        if (logits && all_logits) {
            it.logits = FP4MOE_LOGITS_ALL;
            it.out_logits = logits + t0 * V;
        } else if (logits && last) {
            it.logits = FP4MOE_LOGITS_LAST;
            it.out_logits = logits;
        }
        if (next && last) it.out_token = next;
        if ((st = fp4moe_batch_step(s->batch, &it, 1))) return st;
        if (it.status) return fp4moe_set_error(it.status, "%s", it.error);
    }
    return FP4MOE_OK;
}

int fp4moe_session_forward(fp4moe_session *s, const int32_t *tokens, int64_t T, float *logits,
                           int all_logits) {
    return session_run(s, tokens, T, logits, all_logits, NULL);
}

int fp4moe_session_forward_argmax(fp4moe_session *s, const int32_t *tokens, int64_t T,
                                  int32_t *next) {
    if (!next) return fp4moe_set_error(FP4MOE_EINVAL, "forward_argmax: NULL argument");
    return session_run(s, tokens, T, NULL, 0, next);
}

fp4moe_device fp4moe_session_device(const fp4moe_session *s) {
    return s && batch_on_cuda(s->batch) ? FP4MOE_DEVICE_CUDA : FP4MOE_DEVICE_CPU;
}

int fp4moe_session_profile(fp4moe_session *s, double ms[FP4MOE_PROF_KINDS], int reset) {
    if (!s || !ms) return fp4moe_set_error(FP4MOE_EINVAL, "session profile: NULL argument");
    return batch_profile(s->batch, ms, reset);
}

/* ---- devices --------------------------------------------------------------------------------- */

const char *fp4moe_device_name(fp4moe_device d) {
    switch (d) {
    case FP4MOE_DEVICE_DEFAULT: return "default";
    case FP4MOE_DEVICE_CPU: return "cpu";
    case FP4MOE_DEVICE_CUDA: return "cuda";
    }
    return "?";
}

int fp4moe_device_parse(const char *s, fp4moe_device *out) {
    if (!s || !out) return fp4moe_set_error(FP4MOE_EINVAL, "device: NULL argument");
    if (!strcmp(s, "cpu")) *out = FP4MOE_DEVICE_CPU;
    else if (!strcmp(s, "cuda")) *out = FP4MOE_DEVICE_CUDA;
    else if (!strcmp(s, "auto")) *out = fp4moe_cuda_available() ? FP4MOE_DEVICE_CUDA : FP4MOE_DEVICE_CPU;
    else return fp4moe_set_error(FP4MOE_EINVAL, "device '%s' (expected cpu, cuda or auto)", s);
    return FP4MOE_OK;
}

int fp4moe_model_on_gpu(const fp4moe_model *m) { return m && m->gpu != NULL; }

const char *fp4moe_prof_kind_name(fp4moe_prof_kind k) {
    static const char *names[FP4MOE_PROF_KINDS] = {"mamba", "attention", "moe routed", "moe shared",
                                                   "lm_head", "other"};
    return (int)k >= 0 && k < FP4MOE_PROF_KINDS ? names[k] : "?";
}
