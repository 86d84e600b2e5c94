/* fp4moe bench -m DIR | --synthetic CONFIG: prefill and decode speed of a nemotron_h model on the
 * CPU or the GPU. A fixed synthetic prompt (ids from a seeded generator, no tokenizer needed) is
 * prefilled, then gen-tokens are decoded greedily; repeated `repeats` times from an empty cache
 * (after `warmup` uncounted runs). Reports prefill tok/s and decode tok/s (median over the repeats)
 * and an FNV-1a hash of the generated ids (the same in every repeat, or the run fails: greedy
 * decoding is deterministic). --synthetic builds random NVFP4 weights with the exact shapes of a
 * config (fp4moe_model_synthetic; on CUDA directly in GPU memory). On CUDA, each speed is also
 * given next to its memory floor (weights read once per prefill, the active weights once per
 * decoded token, at --floor-bw bytes/s), and --profile splits the device time by layer kind. */
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "fp4moe/fp4moe.h"
#include "fp4moe/model.h"

#define CMD "bench"

typedef struct {
    const char *model, *synthetic, *dtype, *route, *device, *cpu_act, *kv_cache;
    fp4moe_kv_dtype kv;             /* kv_cache, parsed in bench() */
    int64_t prompt_tokens, gen_tokens, repeats, chunk, seed, warmup, batch, gpus, ep_ranks;
    double floor_bw;
    int json, no_quantize, profile;
    int64_t threads;
} bench_args;

typedef struct {
    double prefill_s, decode_s;
    uint64_t hash;
    int32_t *ids;                   /* the generated ids (the first counted run only), or NULL */
    double split_prefill[FP4MOE_PROF_KINDS], split_decode[FP4MOE_PROF_KINDS]; /* ms */
} bench_run;


/* --route, and the environment's route switches where set (they act under --route auto) */
static const char *route_text(const char *route, char *buf, size_t cap) {
    const char *er = fp4moe_env_value("FP4MOE_GATHER_ROUTE"), *eb = fp4moe_env_value("FP4MOE_GATHER_EXPERT_BATCHED");
    const int r = er && *er && strcmp(er, "auto"), b = eb && !strcmp(eb, "0");
    snprintf(buf, cap, "%s%s%s%s%s%s", route, r || b ? " (" : "", r ? "FP4MOE_GATHER_ROUTE=" : "", r ? er : "",
             b ? (r ? ", FP4MOE_GATHER_EXPERT_BATCHED=0" : "FP4MOE_GATHER_EXPERT_BATCHED=0") : "", r || b ? ")" : "");
    return buf;
}

static uint64_t fnv1a(uint64_t h, int32_t id) {
    for (int i = 0; i < 4; i++) {
        h ^= (uint64_t)((uint32_t)id >> (8 * i) & 0xFF);
        h *= 0x100000001B3ull;
    }
    return h;
}

/* Deterministic prompt ids in [3, V) (0..2 are usually pad/bos/eos); variant 0 is the prompt of
 * the single-sequence benchmark. */
static void synthetic_prompt_variant(int32_t *ids, int64_t n, int64_t V, uint64_t variant) {
    uint64_t x = 0x2545F4914F6CDD1Dull + variant * 0x9E3779B97F4A7C15ull;
    for (int64_t i = 0; i < n; i++) {
        x ^= x >> 12; x ^= x << 25; x ^= x >> 27;
        ids[i] = (int32_t)(V > 3 ? 3 + (int64_t)((x * 0x2545F4914F6CDD1Dull) >> 33) % (V - 3) : 0);
    }
}

static void synthetic_prompt(int32_t *ids, int64_t n, int64_t V) { synthetic_prompt_variant(ids, n, V, 0); }

/* One prefill + gen_tokens greedy decode steps; the next token is chosen where the logits are
 * (on the GPU: only the id comes back). */
static int one_run(fp4moe_session *s, const int32_t *prompt, const bench_args *a, bench_run *r) {
    double ms[FP4MOE_PROF_KINDS];
    fp4moe_session_reset(s);
    if (a->profile) fp4moe_session_profile(s, ms, 1);
    int32_t id = 0;
    double t0 = cli_now();
    int st = fp4moe_session_forward_argmax(s, prompt, a->prompt_tokens, &id);
    r->prefill_s = cli_now() - t0;
    if (!st && a->profile) st = fp4moe_session_profile(s, r->split_prefill, 1);
    r->hash = 0xCBF29CE484222325ull;
    t0 = cli_now();
    for (int64_t i = 0; !st && i < a->gen_tokens; i++) {
        r->hash = fnv1a(r->hash, id);
        if (r->ids) r->ids[i] = id;
        st = fp4moe_session_forward_argmax(s, &id, 1, &id);
    }
    r->decode_s = cli_now() - t0;
    if (!st && a->profile) st = fp4moe_session_profile(s, r->split_decode, 1);
    return st;
}

static int cmp_double(const void *x, const void *y) {
    const double a = *(const double *)x, b = *(const double *)y;
    return a < b ? -1 : a > b;
}

static double median(double *v, int64_t n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Bytes a prefill reads (every weight once, the embedding aside) and a decode step reads (the
 * same with k of E experts per MoE layer). */
static void weight_bytes(const fp4moe_model *m, double *prefill, double *decode) {
    fp4moe_model_stats s;
    fp4moe_model_get_stats(m, &s);
    const fp4moe_config *c = fp4moe_model_config(m);
    const double rest = (double)(s.bytes_lm_head + s.bytes_mamba + s.bytes_attention + s.bytes_moe_shared +
                                 s.bytes_moe_router + s.bytes_mlp + s.bytes_norms);
    *prefill = rest + (double)s.bytes_moe_experts;
    *decode = rest + (c->n_experts ? (double)s.bytes_moe_experts * (double)c->top_k / (double)c->n_experts : 0.0);
}

typedef struct {
    double pf, dc;                  /* median tok/s */
    double pf_floor, dc_floor;      /* tok/s at floor_bw */
    double split_pf[FP4MOE_PROF_KINDS], split_dc[FP4MOE_PROF_KINDS]; /* median ms */
    double wb_prefill, wb_decode;
} bench_summary;

static void summarize(const bench_args *a, const fp4moe_model *m, const bench_run *runs, bench_summary *o) {
    const int64_t R = a->repeats;
    double *v = malloc((size_t)R * sizeof *v);
    for (int64_t i = 0; i < R; i++) v[i] = (double)a->prompt_tokens / runs[i].prefill_s;
    o->pf = median(v, R);
    for (int64_t i = 0; i < R; i++) v[i] = (double)a->gen_tokens / runs[i].decode_s;
    o->dc = median(v, R);
    for (int k = 0; k < FP4MOE_PROF_KINDS; k++) {
        for (int64_t i = 0; i < R; i++) v[i] = runs[i].split_prefill[k];
        o->split_pf[k] = median(v, R);
        for (int64_t i = 0; i < R; i++) v[i] = runs[i].split_decode[k] / (double)a->gen_tokens;
        o->split_dc[k] = median(v, R);
    }
    free(v);
    weight_bytes(m, &o->wb_prefill, &o->wb_decode);
    o->pf_floor = (double)a->prompt_tokens / (o->wb_prefill / a->floor_bw);
    o->dc_floor = a->floor_bw / o->wb_decode;
}

static cJSON *split_json(const double *ms) {
    cJSON *o = cJSON_CreateObject();
    for (int k = 0; k < FP4MOE_PROF_KINDS; k++)
        cJSON_AddNumberToObject(o, fp4moe_prof_kind_name((fp4moe_prof_kind)k), ms[k]);
    return o;
}

/* The setup fields every bench --json object starts with: model, format, device, dtypes, route, threads */
static void json_setup(cJSON *o, const bench_args *a, const fp4moe_model *m, fp4moe_device dev, const char *what) {
    cJSON_AddStringToObject(o, "model", what);
    cJSON_AddBoolToObject(o, "synthetic", a->synthetic != NULL);
    cJSON_AddStringToObject(o, "format", fp4moe_quant_mode_name(fp4moe_model_format(m)));
    cJSON_AddStringToObject(o, "device", fp4moe_device_name(dev));
    cJSON_AddStringToObject(o, "dtype", a->dtype);
    cJSON_AddStringToObject(o, "cpu_act", a->cpu_act);
    cJSON_AddStringToObject(o, "kv_cache_dtype", a->kv_cache);
    cJSON_AddStringToObject(o, "route", a->route);
    /* the value in force (the default when unset), so that two runs' JSON compare as they ran */
    cJSON_AddStringToObject(o, "FP4MOE_GATHER_EXPERT_BATCHED", fp4moe_env_value("FP4MOE_GATHER_EXPERT_BATCHED"));
    cJSON_AddNumberToObject(o, "threads", omp_get_max_threads());
}

static void report(const bench_args *a, const fp4moe_model *m, fp4moe_device dev, const bench_run *runs) {
    const int64_t R = a->repeats;
    bench_summary sm;
    summarize(a, m, runs, &sm);
    const char *what = a->synthetic ? a->synthetic : a->model;
    char hash[24];
    snprintf(hash, sizeof hash, "%016llx", (unsigned long long)runs[0].hash);
    if (a->json) {
        cJSON *o = cJSON_CreateObject();
        json_setup(o, a, m, dev, what);
        cJSON_AddNumberToObject(o, "prompt_tokens", (double)a->prompt_tokens);
        cJSON_AddNumberToObject(o, "gen_tokens", (double)a->gen_tokens);
        cJSON_AddNumberToObject(o, "repeats", (double)R);
        cJSON_AddNumberToObject(o, "warmup", (double)a->warmup);
        double *pf = malloc((size_t)R * sizeof *pf), *dc = malloc((size_t)R * sizeof *dc);
        for (int64_t i = 0; i < R; i++) {
            pf[i] = (double)a->prompt_tokens / runs[i].prefill_s;
            dc[i] = (double)a->gen_tokens / runs[i].decode_s;
        }
        cJSON_AddItemToObject(o, "prefill_tok_s", cJSON_CreateDoubleArray(pf, (int)R));
        cJSON_AddItemToObject(o, "decode_tok_s", cJSON_CreateDoubleArray(dc, (int)R));
        free(pf);
        free(dc);
        cJSON_AddNumberToObject(o, "prefill_tok_s_median", sm.pf);
        cJSON_AddNumberToObject(o, "decode_tok_s_median", sm.dc);
        cJSON_AddStringToObject(o, "gen_ids_fnv1a", hash);
        if (runs[0].ids) cJSON_AddItemToObject(o, "gen_ids", cJSON_CreateIntArray(runs[0].ids, (int)a->gen_tokens));
        {
            cJSON_AddNumberToObject(o, "weight_bytes_prefill", sm.wb_prefill);
            cJSON_AddNumberToObject(o, "weight_bytes_decode_token", sm.wb_decode);
            cJSON_AddNumberToObject(o, "floor_bw_bytes_s", a->floor_bw);
            cJSON_AddNumberToObject(o, "prefill_floor_tok_s", sm.pf_floor);
            cJSON_AddNumberToObject(o, "decode_floor_tok_s", sm.dc_floor);
            cJSON_AddNumberToObject(o, "prefill_floor_fraction", sm.pf / sm.pf_floor);
            cJSON_AddNumberToObject(o, "decode_floor_fraction", sm.dc / sm.dc_floor);
        }
        if (a->profile) {
            cJSON_AddItemToObject(o, "prefill_split_ms", split_json(sm.split_pf));
            cJSON_AddItemToObject(o, "decode_split_ms_per_token", split_json(sm.split_dc));
        }
        cli_json_print_obj(o);
        cJSON_Delete(o);
        return;
    }
    printf("model          %s (%s%s)\n", what, fp4moe_quant_mode_name(fp4moe_model_format(m)),
           a->synthetic ? ", synthetic weights" : "");
    char rs[160];
    printf("setup          %lld prompt tokens, %lld generated, %lld repeats, %s activations%s, "
           "route %s, device %s, %d threads, %s kernels\n", (long long)a->prompt_tokens, (long long)a->gen_tokens,
           (long long)R, a->dtype, !strcmp(a->cpu_act, "q8") ? " (NVFP4 matmuls W4A8)" : "",
           route_text(a->route, rs, sizeof rs), fp4moe_device_name(dev), omp_get_max_threads(), fp4moe_gather_cpu_isa());
    printf("prefill        %.2f tok/s (median); floor %.0f tok/s (%.2f GB at %.4g GB/s): %.3f of it\n", sm.pf,
           sm.pf_floor, sm.wb_prefill * 1e-9, a->floor_bw * 1e-9, sm.pf / sm.pf_floor);
    printf("decode         %.2f tok/s (median); floor %.2f tok/s (%.3f GB per token): %.3f of it\n", sm.dc,
           sm.dc_floor, sm.wb_decode * 1e-9, sm.dc / sm.dc_floor);
    printf("gen ids hash   %s (FNV-1a 64)\n", hash);
    if (a->profile) {
        printf("split (device ms, median)   prefill    decode/token\n");
        for (int k = 0; k < FP4MOE_PROF_KINDS; k++)
            printf("  %-24s %10.3f %12.4f\n", fp4moe_prof_kind_name((fp4moe_prof_kind)k), sm.split_pf[k],
                   sm.split_dc[k]);
    }
}


/* The aggregate speeds of a --batch run (medians over the counted repeats) and the hash of every
 * sequence's hash, in sequence order. */
static void batch_summary(const bench_args *a, const double *pf, const double *dc, const uint64_t *hash0, int64_t N,
                          double *pfm, double *dcm, uint64_t *all) {
    const int64_t R = a->repeats;
    double *v = malloc((size_t)R * sizeof *v);
    *pfm = *dcm = 0.0;
    if (v) {
        for (int64_t i = 0; i < R; i++) v[i] = (double)(N * a->prompt_tokens) / pf[a->warmup + i];
        *pfm = median(v, R);
        for (int64_t i = 0; i < R; i++) v[i] = (double)(N * a->gen_tokens) / dc[a->warmup + i];
        *dcm = median(v, R);
        free(v);
    }
    *all = 0xCBF29CE484222325ull;
    for (int64_t i = 0; i < N; i++) *all = fnv1a(fnv1a(*all, (int32_t)hash0[i]), (int32_t)(hash0[i] >> 32));
}

/* The fields both --batch reports share: sizes and aggregate speeds. */
static void batch_json_fields(cJSON *j, const bench_args *a, int64_t N, double pfm, double dcm) {
    cJSON_AddNumberToObject(j, "batch", (double)N);
    cJSON_AddNumberToObject(j, "prompt_tokens", (double)a->prompt_tokens);
    cJSON_AddNumberToObject(j, "gen_tokens", (double)a->gen_tokens);
    cJSON_AddNumberToObject(j, "repeats", (double)a->repeats);
    cJSON_AddNumberToObject(j, "warmup", (double)a->warmup);
    cJSON_AddNumberToObject(j, "prefill_tok_s_aggregate", pfm);
    cJSON_AddNumberToObject(j, "decode_tok_s_aggregate", dcm);
    cJSON_AddNumberToObject(j, "decode_tok_s_per_sequence", dcm / (double)N);
}

/* ["%016llx", ...] of the N sequences' hashes */
static cJSON *hash_array(const uint64_t *hash0, int64_t N) {
    cJSON *arr = cJSON_CreateArray();
    for (int64_t i = 0; i < N; i++) {
        char h[24];
        snprintf(h, sizeof h, "%016llx", (unsigned long long)hash0[i]);
        cJSON_AddItemToArray(arr, cJSON_CreateString(h));
    }
    return arr;
}

/* The hashes of a --batch run: gen_ids_fnv1a (a string, as the solo run's: sequence 0's ids, whose prompt is the
 * solo run's), gen_ids_fnv1a_per_sequence (all N), gen_ids_fnv1a_all (one hash of those) */
static void batch_hash_fields(cJSON *j, const uint64_t *hash0, int64_t N, const char *all) {
    char h0[24];
    snprintf(h0, sizeof h0, "%016llx", (unsigned long long)hash0[0]);
    cJSON_AddStringToObject(j, "gen_ids_fnv1a", h0);
    cJSON_AddItemToObject(j, "gen_ids_fnv1a_per_sequence", hash_array(hash0, N));
    cJSON_AddStringToObject(j, "gen_ids_fnv1a_all", all);
}

/* ---- --batch N: N concurrent sequences ------------------------------------------------------- */

/* One repeat: N sequences join, their prompts are prefilled in steps of at most max_step_tokens
 * (several sequences per step), then every sequence decodes gen_tokens greedily, one step per token
 * for all N together. */
static int batch_run(fp4moe_batch *b, int32_t *const *prompts, const bench_args *a, double *pf_s, double *dc_s,
                     uint64_t *hash, int32_t *ids0, double *split_pf, double *split_dc) {
    const int64_t N = a->batch, P = a->prompt_tokens, G = a->gen_tokens;
    int64_t *seq = calloc((size_t)N, sizeof *seq), *fed = calloc((size_t)N, sizeof *fed);
    int32_t *next = calloc((size_t)N, sizeof *next);
    fp4moe_batch_item *it = calloc((size_t)N, sizeof *it);
    int st = seq && fed && next && it ? FP4MOE_OK : fp4moe_set_error(FP4MOE_ENOMEM, "bench: out of memory");
    for (int64_t i = 0; !st && i < N; i++) {
        st = fp4moe_batch_add(b, &seq[i]);
        hash[i] = 0xCBF29CE484222325ull;
    }
    double ms[FP4MOE_PROF_KINDS];
    if (!st && a->profile) st = fp4moe_batch_profile(b, ms, 1);
    double t0 = cli_now();
    for (int64_t done = 0; !st && done < N;) {
        int64_t k = 0, budget = a->chunk;
        for (int64_t i = 0; i < N && budget > 0; i++) {
            if (fed[i] >= P) continue;
            const int64_t n = P - fed[i] < budget ? P - fed[i] : budget;
            it[k] = (fp4moe_batch_item){.seq = seq[i], .tokens = prompts[i] + fed[i], .n = n,
                                        .out_token = fed[i] + n == P ? &next[i] : NULL};
            budget -= n;
            fed[i] += n;
            done += fed[i] == P;
            k++;
        }
        st = fp4moe_batch_step(b, it, k);
        for (int64_t j = 0; !st && j < k; j++)
            if (it[j].status) st = fp4moe_set_error(it[j].status, "%s", it[j].error);
    }
    *pf_s = cli_now() - t0;
    if (!st && a->profile) st = fp4moe_batch_profile(b, split_pf, 1);
    t0 = cli_now();
    for (int64_t g = 0; !st && g < G; g++) {
        for (int64_t i = 0; i < N; i++) {
            hash[i] = fnv1a(hash[i], next[i]);
            if (i == 0 && ids0) ids0[g] = next[0];
            it[i] = (fp4moe_batch_item){.seq = seq[i], .tokens = &next[i], .n = 1, .out_token = &next[i]};
        }
        st = fp4moe_batch_step(b, it, N);
        for (int64_t j = 0; !st && j < N; j++)
            if (it[j].status) st = fp4moe_set_error(it[j].status, "%s", it[j].error);
    }
    *dc_s = cli_now() - t0;
    if (!st && a->profile) st = fp4moe_batch_profile(b, split_dc, 1);
    for (int64_t i = 0; seq && i < N; i++) fp4moe_batch_remove(b, seq[i]);
    free(seq);
    free(fed);
    free(next);
    free(it);
    return st;
}

static int bench_batch(const bench_args *a, const fp4moe_model *m, fp4moe_dtype dt, fp4moe_route route,
                       fp4moe_device dev) {
    const int64_t N = a->batch, R = a->repeats, V = fp4moe_model_config(m)->vocab;
    fp4moe_batch_options o;
    fp4moe_batch_options_default(&o);
    o.max_seqs = N;
    o.max_step_tokens = a->chunk;
    o.act_dtype = dt;
    o.route = route;
    cli_parse_cpu_act(CMD, a->cpu_act, dev, &o.cpu_act); /* checked in bench() */
    o.kv_dtype = a->kv;
    o.device = dev;
    o.interrupt = cli_install_sigint();
    o.profile = a->profile;
    double split_pf[FP4MOE_PROF_KINDS] = {0}, split_dc[FP4MOE_PROF_KINDS] = {0};
    fp4moe_batch *b = NULL;
    int32_t **prompts = calloc((size_t)N, sizeof *prompts);
    uint64_t *hash = calloc((size_t)N, sizeof *hash), *hash0 = calloc((size_t)N, sizeof *hash0);
    double *pf = calloc((size_t)(R + a->warmup), sizeof *pf), *dc = calloc((size_t)(R + a->warmup), sizeof *dc);
    int32_t *ids0 = calloc((size_t)a->gen_tokens, sizeof *ids0);
    int st = prompts && hash && hash0 && pf && dc && ids0 ? fp4moe_batch_new(m, &o, &b) : FP4MOE_ENOMEM;
    for (int64_t i = 0; !st && i < N; i++) {
        if (!(prompts[i] = malloc((size_t)a->prompt_tokens * sizeof(int32_t)))) st = FP4MOE_ENOMEM;
        else synthetic_prompt_variant(prompts[i], a->prompt_tokens, V, (uint64_t)i);
    }
    for (int64_t r = 0; !st && r < a->warmup + R; r++) {
        st = batch_run(b, prompts, a, &pf[r], &dc[r], r ? hash : hash0, r == a->warmup ? ids0 : NULL, split_pf,
                       split_dc);
        for (int64_t i = 0; !st && r && i < N; i++)
            if (hash[i] != hash0[i])
                st = fp4moe_set_error(FP4MOE_EFORMAT, "run %lld: sequence %lld generated other tokens than in run "
                                      "0: greedy decoding is not deterministic", (long long)r, (long long)i);
        if (!st && !a->json)
            fprintf(stderr, "%s: %s %lld: prefill %.3f s, decode %.3f s (%lld sequences)\n", CMD,
                    r < a->warmup ? "warm-up" : "repeat", (long long)(r < a->warmup ? r : r - a->warmup), pf[r],
                    dc[r], (long long)N);
    }
    int rc = st ? cli_fail(CMD, st) : FP4MOE_EXIT_OK;
    if (!st) {
        double pfm, dcm;
        uint64_t all;
        batch_summary(a, pf, dc, hash0, N, &pfm, &dcm, &all);
        const char *what = a->synthetic ? a->synthetic : a->model;
        if (a->json) {
            cJSON *j = cJSON_CreateObject();
            json_setup(j, a, m, dev, what);
            batch_json_fields(j, a, N, pfm, dcm);
            char h[24];
            snprintf(h, sizeof h, "%016llx", (unsigned long long)all);
            batch_hash_fields(j, hash0, N, h);
            cJSON_AddItemToObject(j, "gen_ids_0", cJSON_CreateIntArray(ids0, (int)a->gen_tokens));
            if (a->profile) {   /* the last repeat's device time */
                cJSON_AddItemToObject(j, "prefill_split_ms", split_json(split_pf));
                for (int k = 0; k < FP4MOE_PROF_KINDS; k++) split_dc[k] /= (double)a->gen_tokens;
                cJSON_AddItemToObject(j, "decode_split_ms_per_step", split_json(split_dc));
            }
            cli_json_print_obj(j);
            cJSON_Delete(j);
        } else {
            printf("model          %s (%s%s)\n", what, fp4moe_quant_mode_name(fp4moe_model_format(m)),
                   a->synthetic ? ", synthetic weights" : "");
            printf("setup          %lld sequences x (%lld prompt tokens, %lld generated), %lld repeats, %s "
                   "activations, route %s, device %s, %d threads\n", (long long)N, (long long)a->prompt_tokens,
                   (long long)a->gen_tokens, (long long)R, a->dtype, a->route, fp4moe_device_name(dev),
                   omp_get_max_threads());
            printf("prefill        %.2f tok/s aggregate (median)\n", pfm);
            printf("decode         %.2f tok/s aggregate, %.2f tok/s per sequence (median)\n", dcm, dcm / (double)N);
            printf("gen ids hash   %016llx over all sequences; sequence 0: %016llx (FNV-1a 64)\n",
                   (unsigned long long)all, (unsigned long long)hash0[0]);
            for (int64_t i = 0; i < N; i++) printf("  seq %-4lld %016llx\n", (long long)i, (unsigned long long)hash0[i]);
            if (a->profile) {
                printf("split (device ms, last repeat)   prefill    decode/step\n");
                for (int k = 0; k < FP4MOE_PROF_KINDS; k++)
                    printf("  %-24s %10.3f %12.4f\n", fp4moe_prof_kind_name((fp4moe_prof_kind)k), split_pf[k],
                           split_dc[k] / (double)a->gen_tokens);
            }
        }
    }
    for (int64_t i = 0; prompts && i < N; i++) free(prompts[i]);
    free(prompts);
    free(hash);
    free(hash0);
    free(pf);
    free(dc);
    free(ids0);
    fp4moe_batch_free(b);
    return rc;
}

/* ---- --gpus N / --ep-ranks N: expert parallelism ------------------------------------------------ */

/* Rank r of R holds the sequences i = r, r + R, ... of --batch and 1/R of every MoE layer's routed
 * experts; all ranks step in lockstep (a rank with nothing to prefill steps with no rows: the MoE
 * layers are collectives), one thread each. */
typedef struct {
    const bench_args *a;
    int rank, ranks, nccl;
    fp4moe_ep_group *g;
    fp4moe_dtype dt;
    fp4moe_route route;
    fp4moe_device dev;
    pthread_barrier_t *bar;
    int *flag;                      /* ranks ints: per-barrier reports (more work / failed) */
    double *pf, *dc;                /* rank 0: the wall time of each run's prefill and decode */
    uint64_t *hash0;                /* --batch: run 0's hash of each sequence (global order) */
    int st;
    char err[512];
} ep_job;

/* Every rank reports v; returns the OR over ranks (two barriers: all written, all read). */
static int ep_any(ep_job *j, int v) {
    j->flag[j->rank] = v;
    pthread_barrier_wait(j->bar);
    int any = 0;
    for (int r = 0; r < j->ranks; r++) any |= j->flag[r];
    pthread_barrier_wait(j->bar);
    return any;
}

static void *ep_rank_main(void *arg) {
    ep_job *j = arg;
    const bench_args *a = j->a;
    fp4moe_model *m = NULL;
    fp4moe_batch *b = NULL;
    int st = FP4MOE_OK;
    if (j->nccl) st = fp4moe_cuda_set_device(j->rank);
    if (!st && a->synthetic) { /* every GPU makes the whole synthetic model; the rank uses views of its experts */
        st = cli_synthetic_quiet(a->synthetic, (uint64_t)a->seed, j->dev, &m);
    } else if (!st) { /* a checkpoint: each rank loads only its share of the routed experts */
        st = cli_load_share_quiet(a->model, !a->no_quantize, j->dev, j->ranks, j->rank, &m);
    }
    const int64_t N = a->batch, R = a->repeats, P = a->prompt_tokens, G = a->gen_tokens;
    const int64_t n = N > j->rank ? (N - j->rank + j->ranks - 1) / j->ranks : 0; /* this rank's sequences */
    int32_t **prompts = calloc((size_t)n + 1, sizeof *prompts), *next = calloc((size_t)n + 1, sizeof *next);
    int64_t *seq = calloc((size_t)n + 1, sizeof *seq), *fed = calloc((size_t)n + 1, sizeof *fed);
    uint64_t *hash = calloc((size_t)n + 1, sizeof *hash);
    fp4moe_batch_item *it = calloc((size_t)n + 1, sizeof *it);
    if (!st && (!prompts || !next || !seq || !fed || !hash || !it)) st = fp4moe_set_error(FP4MOE_ENOMEM, "out of memory");
    if (!st) {
        fp4moe_batch_options o;
        fp4moe_batch_options_default(&o);
        o.max_seqs = n > 0 ? n : 1;
        o.max_step_tokens = a->chunk;
        o.act_dtype = j->dt;
        o.route = j->route;
        cli_parse_cpu_act(CMD, a->cpu_act, j->dev, &o.cpu_act); /* checked in bench() */
        o.kv_dtype = a->kv;
        o.device = j->dev;
        o.ep = j->g;
        o.ep_rank = j->rank;
        st = fp4moe_batch_new(m, &o, &b);
    }
    const int64_t V = m ? fp4moe_model_config(m)->vocab : 1;
    for (int64_t q = 0; !st && q < n; q++) {
        if (!(prompts[q] = malloc((size_t)P * sizeof(int32_t)))) st = fp4moe_set_error(FP4MOE_ENOMEM, "out of memory");
        else synthetic_prompt_variant(prompts[q], P, V, (uint64_t)(j->rank + q * j->ranks));
    }
    if (st) snprintf(j->err, sizeof j->err, "rank %d: %s", j->rank, fp4moe_last_error());
    int failed = ep_any(j, st != FP4MOE_OK); /* setup: all ranks go on, or none */
    for (int64_t r = 0; !failed && r < a->warmup + R; r++) {
        for (int64_t q = 0; !st && q < n; q++) {
            st = fp4moe_batch_add(b, &seq[q]);
            fed[q] = 0;
            hash[q] = 0xCBF29CE484222325ull;
        }
        failed = ep_any(j, st != FP4MOE_OK);
        double t0 = cli_now();
        for (int more = 1; more && !failed;) { /* prefill, chunks of at most --chunk tokens a rank */
            int64_t k = 0, budget = a->chunk;
            for (int64_t q = 0; q < n && budget > 0; q++) {
                if (fed[q] >= P) continue;
                const int64_t c = P - fed[q] < budget ? P - fed[q] : budget;
                it[k++] = (fp4moe_batch_item){.seq = seq[q], .tokens = prompts[q] + fed[q], .n = c,
                                              .out_token = fed[q] + c == P ? &next[q] : NULL};
                budget -= c;
                fed[q] += c;
            }
            st = fp4moe_batch_step(b, it, k);
            for (int64_t x = 0; !st && x < k; x++)
                if (it[x].status) st = fp4moe_set_error(it[x].status, "%s", it[x].error);
            int left = 0;
            for (int64_t q = 0; q < n; q++) left |= fed[q] < P;
            failed = ep_any(j, st != FP4MOE_OK ? 2 : left) & 2;
            more = ep_any(j, left) && !failed;
        }
        if (j->rank == 0) j->pf[r] = cli_now() - t0;
        t0 = cli_now();
        for (int64_t g = 0; g < G && !failed; g++) {
            for (int64_t q = 0; q < n; q++) {
                hash[q] = fnv1a(hash[q], next[q]);
                it[q] = (fp4moe_batch_item){.seq = seq[q], .tokens = &next[q], .n = 1, .out_token = &next[q]};
            }
            st = fp4moe_batch_step(b, it, n);
            for (int64_t x = 0; !st && x < n; x++)
                if (it[x].status) st = fp4moe_set_error(it[x].status, "%s", it[x].error);
            failed = ep_any(j, st != FP4MOE_OK);
        }
        if (j->rank == 0) j->dc[r] = cli_now() - t0;
        for (int64_t q = 0; q < n && !failed; q++) {
            const int64_t i = j->rank + q * j->ranks;
            if (r == 0) j->hash0[i] = hash[q];
            else if (hash[q] != j->hash0[i] && !st)
                st = fp4moe_set_error(FP4MOE_EFORMAT, "run %lld: sequence %lld generated other tokens than in run 0: "
                                      "greedy decoding is not deterministic", (long long)r, (long long)i);
            fp4moe_batch_remove(b, seq[q]);
        }
        if (st && !j->err[0]) snprintf(j->err, sizeof j->err, "rank %d: %s", j->rank, fp4moe_last_error());
        failed |= ep_any(j, st != FP4MOE_OK);
        if (!failed && !a->json && j->rank == 0)
            fprintf(stderr, "%s: %s %lld: prefill %.3f s, decode %.3f s (%lld sequences on %d ranks)\n", CMD,
                    r < a->warmup ? "warm-up" : "repeat", (long long)(r < a->warmup ? r : r - a->warmup), j->pf[r],
                    j->dc[r], (long long)N, j->ranks);
    }
    j->st = st ? st : failed ? FP4MOE_EINVAL : FP4MOE_OK;
    for (int64_t q = 0; prompts && q < n; q++) free(prompts[q]);
    free(prompts);
    free(next);
    free(seq);
    free(fed);
    free(hash);
    free(it);
    fp4moe_batch_free(b);
    fp4moe_model_free(m);
    return NULL;
}

static int bench_ep(const bench_args *a, fp4moe_dtype dt, fp4moe_route route, fp4moe_device dev) {
    const int nccl = a->gpus > 1, W = (int)(nccl ? a->gpus : a->ep_ranks);
    const int64_t N = a->batch, R = a->repeats;
    if (nccl) {
        const int rc = cli_check_gpus(CMD, W, a->device, dev);
        if (rc) return rc;
    }
    fp4moe_ep_group *g = NULL;
    int st = nccl ? fp4moe_ep_group_new_nccl(W, NULL, &g) : fp4moe_ep_group_new(W, &g);
    if (st) return cli_fail(CMD, st);
    ep_job *jobs = calloc((size_t)W, sizeof *jobs);
    pthread_t *th = calloc((size_t)W, sizeof *th);
    int *flag = calloc((size_t)W, sizeof *flag);
    double *pf = calloc((size_t)(R + a->warmup), sizeof *pf), *dc = calloc((size_t)(R + a->warmup), sizeof *dc);
    uint64_t *hash0 = calloc((size_t)N, sizeof *hash0);
    pthread_barrier_t bar;
    if (!jobs || !th || !flag || !pf || !dc || !hash0 || pthread_barrier_init(&bar, NULL, (unsigned)W)) {
        free(jobs); free(th); free(flag); free(pf); free(dc); free(hash0);
        fp4moe_ep_group_free(g);
        return cli_fail(CMD, fp4moe_set_error(FP4MOE_ENOMEM, "out of memory"));
    }
    if (!a->json)
        fprintf(stderr, "%s: %d expert-parallel ranks (%s), %lld sequences\n", CMD, W,
                nccl ? "NCCL, one GPU each" : "in-process loopback on one device", (long long)N);
    int started = 0;
    for (int r = 0; r < W; r++) {
        jobs[r] = (ep_job){a, r, W, nccl, g, dt, route, dev, &bar, flag, pf, dc, hash0, 0, {0}};
        if (pthread_create(&th[r], NULL, ep_rank_main, &jobs[r])) break;
        started++;
    }
    for (int r = 0; r < started; r++) pthread_join(th[r], NULL);
    int rc = FP4MOE_EXIT_OK;
    if (started < W) {
        rc = cli_fail(CMD, fp4moe_set_error(FP4MOE_ENOMEM, "cannot start %d rank threads", W)); /* the others wait */
    } else {
        for (int r = 0; r < W; r++)
            if (jobs[r].st && jobs[r].err[0]) {
                fprintf(stderr, "%s: %s\n", CMD, jobs[r].err);
                if (rc == FP4MOE_EXIT_OK) rc = cli_fail(CMD, fp4moe_set_error(jobs[r].st, "%s", jobs[r].err));
            }
        if (rc == FP4MOE_EXIT_OK && jobs[0].st) rc = cli_fail(CMD, jobs[0].st);
    }
    if (rc == FP4MOE_EXIT_OK) {
        double pfm, dcm;
        uint64_t all;
        batch_summary(a, pf, dc, hash0, N, &pfm, &dcm, &all);
        char h[24];
        snprintf(h, sizeof h, "%016llx", (unsigned long long)all);
        if (a->json) {
            cJSON *j = cJSON_CreateObject();
            cJSON_AddStringToObject(j, "model", a->synthetic ? a->synthetic : a->model);
            cJSON_AddBoolToObject(j, "synthetic", a->synthetic != NULL);
            cJSON_AddStringToObject(j, "device", fp4moe_device_name(dev));
            cJSON_AddStringToObject(j, "dtype", a->dtype);
            cJSON_AddStringToObject(j, "route", a->route);
            cJSON_AddStringToObject(j, "ep_transport", nccl ? "nccl" : "loopback");
            cJSON_AddNumberToObject(j, "ep_ranks", W);
            batch_json_fields(j, a, N, pfm, dcm);
            batch_hash_fields(j, hash0, N, h);
            cli_json_print_obj(j);
            cJSON_Delete(j);
        } else {
            printf("setup          %lld sequences x (%lld prompt tokens, %lld generated), %d expert-parallel ranks "
                   "(%s), %s activations, route %s, device %s\n", (long long)N, (long long)a->prompt_tokens,
                   (long long)a->gen_tokens, W, nccl ? "NCCL" : "loopback", a->dtype, a->route, fp4moe_device_name(dev));
            printf("prefill        %.2f tok/s aggregate (median)\n", pfm);
            printf("decode         %.2f tok/s aggregate, %.2f tok/s per sequence (median)\n", dcm, dcm / (double)N);
            printf("gen ids hash   %s over all sequences (FNV-1a 64)\n", h);
        }
    }
    pthread_barrier_destroy(&bar);
    free(jobs); free(th); free(flag); free(pf); free(dc); free(hash0);
    fp4moe_ep_group_free(g);
    return rc;
}

/* ---- the benchmark ---------------------------------------------------------------------------- */

/* The benchmark's forwards hand back only the greedy id (argmax skips NaN), so broken weights would be timed
 * and hashed as if fine: one untimed forward of the first (up to 64) prompt tokens with the settings of the
 * run, its logits checked (CLI_BAD_LOGITS). */
static int check_logits(fp4moe_model *m, const fp4moe_session_options *so, int64_t prompt_tokens) {
    const int64_t V = fp4moe_model_config(m)->vocab, n = prompt_tokens < 64 ? prompt_tokens : 64;
    int32_t *ids = malloc((size_t)n * sizeof *ids);
    float *lg = malloc((size_t)V * sizeof *lg);
    fp4moe_session *s = NULL;
    int st = ids && lg ? fp4moe_session_new(m, so, &s) : FP4MOE_ENOMEM;
    if (!st) {
        synthetic_prompt(ids, n, V);
        st = fp4moe_session_forward(s, ids, n, lg, 0);
    }
    if (!st && cli_bad_logits(lg, V)) st = fp4moe_set_error(FP4MOE_EFORMAT, CLI_BAD_LOGITS);
    fp4moe_session_free(s);
    free(lg);
    free(ids);
    return st;
}

static int bench(bench_args *a) {
    fp4moe_dtype dt;
    fp4moe_route route;
    fp4moe_device dev;
    fp4moe_cpu_act ca;
    int rc = cli_parse_compute(CMD, a->device, a->dtype, a->cpu_act, &dev, &dt, &ca);
    if (!rc) rc = cli_parse_kv_dtype(CMD, a->kv_cache, dev, &a->kv);
    if (rc) return rc;
    a->kv_cache = fp4moe_kv_dtype_name(a->kv);
    a->dtype = fp4moe_dtype_name(dt);     /* the settings in force, for the report */
    a->cpu_act = fp4moe_cpu_act_name(ca);
    if (fp4moe_route_parse(a->route, &route))
        return cli_usage_error(CMD, "--route must be auto, qmv, batched or dequant_gemm");
    if (a->warmup == INT64_MIN) a->warmup = dev == FP4MOE_DEVICE_CUDA ? 1 : 0; /* not given */
    if (a->profile && dev != FP4MOE_DEVICE_CUDA)
        return cli_usage_error(CMD, "--profile times device events: it needs --device cuda");
    if (a->gpus == 1 && (rc = cli_check_gpus(CMD, 1, a->device, dev))) return rc; /* one GPU: as generate's */
    if (a->gpus > 1 || a->ep_ranks > 0) { /* expert parallelism: every rank loads its own model */
        if (a->batch < 1) return cli_usage_error(CMD, "--gpus / --ep-ranks need --batch N (the sequences to spread)");
        if (a->profile) return cli_usage_error(CMD, "--profile is not available with --gpus / --ep-ranks");
        if (a->chunk <= 0) a->chunk = dev == FP4MOE_DEVICE_CUDA ? CLI_CUDA_BATCH_CHUNK : 256;
        if (a->chunk < a->batch) a->chunk = a->batch;
        return bench_ep(a, dt, route, dev);
    }
    fp4moe_model *m = NULL;
    rc = a->synthetic ? cli_load_synthetic(CMD, a->synthetic, (uint64_t)a->seed, dev, &m) : cli_load_model_on(CMD, a->model, !a->no_quantize, dev, &m);
    if (rc) return rc;
    if (a->floor_bw == 0.0) { /* the floors' bandwidth: the H200's copy rate, or this CPU's reads */
        a->floor_bw = dev == FP4MOE_DEVICE_CUDA ? 4.2e12 : cli_measure_read_gbs((size_t)512 << 20) * 1e9;
        if (!(a->floor_bw > 0.0)) a->floor_bw = 1e10;
        if (dev != FP4MOE_DEVICE_CUDA) fprintf(stderr, "%s: memory read bandwidth (512 MB): %.1f GB/s\n", CMD, a->floor_bw * 1e-9);
    }
    {
        const int64_t maxp = fp4moe_model_config(m)->max_position;
        if (maxp > 0 && a->prompt_tokens + a->gen_tokens > maxp)
            fprintf(stderr, "%s: warning: %lld prompt + %lld generated tokens go past the model's "
                    "max_position_embeddings %lld (speed is measured all the same)\n", CMD, (long long)a->prompt_tokens,
                    (long long)a->gen_tokens, (long long)maxp);
    }
    fp4moe_session_options so;
    fp4moe_session_options_default(&so);
    so.act_dtype = dt;
    so.cpu_act = ca;
    so.kv_dtype = a->kv;
    so.route = route;
    so.interrupt = cli_install_sigint();
    so.device = dev;
    so.profile = a->profile;
    if (dev == FP4MOE_DEVICE_CUDA) so.max_chunk = a->batch > 0 ? CLI_CUDA_BATCH_CHUNK : cli_cuda_chunk(a->prompt_tokens);
    if (a->chunk > 0) so.max_chunk = a->chunk;
    if (a->batch > 0) {
        if (a->chunk > 0 && a->chunk < a->batch) {
            fp4moe_model_free(m);
            return cli_usage_error(CMD, "--chunk (tokens per step) must be at least --batch: every sequence "
                                   "decodes one token per step");
        }
        if (a->chunk <= 0) a->chunk = dev == FP4MOE_DEVICE_CUDA ? CLI_CUDA_BATCH_CHUNK : 256;
        if (a->chunk < a->batch) a->chunk = a->batch;
        const int cst = check_logits(m, &so, a->prompt_tokens); /* (a session with the run's settings) */
        rc = cst ? cli_fail(CMD, cst) : bench_batch(a, m, dt, route, dev);
        fp4moe_model_free(m);
        return rc;
    }
    const int64_t V = fp4moe_model_config(m)->vocab;
    fp4moe_session *s = NULL;
    int32_t *prompt = malloc((size_t)a->prompt_tokens * sizeof *prompt);
    bench_run *runs = calloc((size_t)(a->repeats + a->warmup), sizeof *runs);
    int32_t *ids = malloc((size_t)a->gen_tokens * sizeof *ids);
    if (runs && ids) runs[a->warmup].ids = ids;
    int st = prompt && runs && ids ? check_logits(m, &so, a->prompt_tokens) : FP4MOE_ENOMEM;
    if (!st) st = fp4moe_session_new(m, &so, &s);
    if (!st) synthetic_prompt(prompt, a->prompt_tokens, V);
    for (int64_t i = 0; !st && i < a->warmup + a->repeats; i++) {
        bench_run *r = &runs[i];
        st = one_run(s, prompt, a, r);
        if (!st && r->hash != runs[0].hash)
            st = fp4moe_set_error(FP4MOE_EFORMAT, "run %lld generated other tokens than run 0: greedy "
                                  "decoding is not deterministic", (long long)i);
        if (!st && !a->json)
            fprintf(stderr, "%s: %s %lld: prefill %.3f s, decode %.3f s\n", CMD,
                    i < a->warmup ? "warm-up" : "repeat", (long long)(i < a->warmup ? i : i - a->warmup),
                    r->prefill_s, r->decode_s);
    }
    rc = st ? cli_fail(CMD, st) : FP4MOE_EXIT_OK;
    if (!st) report(a, m, fp4moe_session_device(s), runs + a->warmup);
    free(ids);
    free(runs);
    free(prompt);
    fp4moe_session_free(s);
    fp4moe_model_free(m);
    return rc;
}

int cmd_bench(int argc, char **argv) {
    bench_args a = {.prompt_tokens = 512, .gen_tokens = 128, .repeats = 3, .warmup = INT64_MIN, .dtype = NULL,
                    .route = "auto", .device = "auto", .floor_bw = 0};
    const cli_opt opts[] = {
        {"--model", "-m", CLI_STRING, &a.model, "DIR", "model directory"},
        {"--synthetic", NULL, CLI_STRING, &a.synthetic, "CONFIG",
         "random NVFP4 weights with the shapes of CONFIG (config.json path or a name under configs/)"},
        {"--threads", "-t", CLI_INT, &a.threads, "N", "CPU threads (default: one per core)"},
        {"--device", NULL, CLI_STRING, &a.device, "DEV", "cpu, cuda or auto (default auto: cuda when a GPU is visible)"},
        {"--prompt-tokens", NULL, CLI_INT, &a.prompt_tokens, "N", "prompt length (default 512)"},
        {"--gen-tokens", NULL, CLI_INT, &a.gen_tokens, "N", "tokens decoded after the prompt (default 128)"},
        {"--repeats", NULL, CLI_INT, &a.repeats, "N", "runs; speeds are medians (default 3)"},
        {"--warmup", NULL, CLI_INT, &a.warmup, "N", "uncounted runs first (default 1 on cuda, 0 on cpu)"},
        {"--dtype", NULL, CLI_STRING, &a.dtype, "DT", "matmul activations: f32 or bf16 (default f32 on cpu; cuda: bf16 only)"},
        {"--cpu-act", NULL, CLI_STRING, &a.cpu_act, "MODE", CLI_CPU_ACT_HELP},
        {"--kv-cache-dtype", NULL, CLI_STRING, &a.kv_cache, "T", CLI_KV_HELP},
        {"--route", NULL, CLI_STRING, &a.route, "R", "gather_qmm route: auto, qmv, batched, dequant_gemm (default auto)"},
        {"--chunk", NULL, CLI_INT, &a.chunk, "N", "prefill chunk in tokens (default and 0: 256 on cpu; on cuda 32768, or the prompt's length rounded up to 256 if shorter; --batch: 8192)"},
        {"--seed", NULL, CLI_INT, &a.seed, "S", "seed of the synthetic weights (default: fixed)"},
        {"--batch", NULL, CLI_INT, &a.batch, "N",
         "N concurrent sequences in one batch (each prefills --prompt-tokens, then decodes --gen-tokens): "
         "aggregate and per-sequence tok/s, each sequence's id hash"},
        {"--gpus", NULL, CLI_INT, &a.gpus, "N",
         "expert parallelism over N CUDA devices through NCCL (libnccl.so.2 on LD_LIBRARY_PATH): each GPU "
         "holds 1/N of every MoE layer's routed experts and 1/N of the --batch sequences (default 0: none)"},
        {"--ep-ranks", NULL, CLI_INT, &a.ep_ranks, "N",
         "expert parallelism with N ranks on this one device (in-process loopback): the --gpus path "
         "without N GPUs, to check it and to time its exchange"},
        {"--profile", NULL, CLI_FLAG, &a.profile, NULL, "cuda: device time by layer kind (prefill, decode per token)"},
        {"--floor-bw", NULL, CLI_DOUBLE, &a.floor_bw, "B/S", "memory bandwidth of the floors, bytes/s (default: cuda 4.2e12, the H200's; cpu: this machine's read bandwidth, measured)"},
        {"--no-quantize", NULL, CLI_FLAG, &a.no_quantize, NULL, "keep dense checkpoints dense"},
        {"--json", NULL, CLI_FLAG, &a.json, NULL, "print one JSON object on stdout"},
    };
    const cli_spec spec = {CMD, "fp4moe bench (-m DIR | --synthetic CONFIG) [options]",
                           "Measures prefill and decode speed (median tok/s over the repeats) on a fixed\n"
                           "synthetic prompt, and hashes the greedy token ids. --synthetic runs the exact\n"
                           "shapes of a config with random NVFP4 weights (on cuda made in GPU memory), e.g.\n"
                           "  fp4moe bench --synthetic nemotron-3-nano-30b-a3b --device cuda",
                           opts, (int)(sizeof opts / sizeof opts[0]), NULL, 0, NULL};
    int rc = cli_parse(&spec, argc, argv);
    if (rc == CLI_HELP) return FP4MOE_EXIT_OK;
    if (rc) return FP4MOE_EXIT_USAGE;
    if (a.chunk < 0) return cli_usage_error(CMD, "--chunk must be >= 1 (0: the default)");
    if (a.seed < 0) return cli_usage_error(CMD, "--seed must be >= 0");
    if (a.warmup < 0 && a.warmup != INT64_MIN) return cli_usage_error(CMD, "--warmup must be >= 0");
    if (a.warmup > 1000) return cli_usage_error(CMD, "--warmup must be at most 1000");
    if (a.model && a.seed)
        fprintf(stderr, "fp4moe %s: warning: --seed sets the synthetic weights' seed: it does nothing with -m\n", CMD);
    if (!a.model == !a.synthetic) return cli_usage_error(CMD, "give exactly one of -m DIR and --synthetic CONFIG");
    if (a.batch < 0 || a.batch > 65535) return cli_usage_error(CMD, "--batch must be in 0 .. 65535");
    if (a.gpus < 0 || a.gpus > 64 || a.ep_ranks < 0 || a.ep_ranks > 64)
        return cli_usage_error(CMD, "--gpus and --ep-ranks must be in 1 .. 64 (0: none, the default)");
    if (a.gpus > 1 && a.ep_ranks > 1) return cli_usage_error(CMD, "give one of --gpus and --ep-ranks");
    if (a.prompt_tokens < 1 || a.gen_tokens < 1 || a.repeats < 1)
        return cli_usage_error(CMD, "--prompt-tokens, --gen-tokens and --repeats must be >= 1");
    /* a bound far past any model's context (262,144 for Nemotron-3-Nano), before anything is allocated: 2^31 prompt
     * tokens once ran to 4.4 GB of memory before any message (a long-context user's trial) */
    if (a.prompt_tokens > ((int64_t)1 << 24) - a.gen_tokens)
        return cli_usage_error(CMD, "--prompt-tokens %lld + --gen-tokens %lld: at most 16777216 tokens a sequence",
                               (long long)a.prompt_tokens, (long long)a.gen_tokens);
    if (!(a.floor_bw >= 0.0)) return cli_usage_error(CMD, "--floor-bw must be > 0 (0: the default)");
    if (a.floor_bw > 0.0 && a.floor_bw < 1e6) /* surely meant as GB/s (a helper's audit, session 44) */
        return cli_usage_error(CMD, "--floor-bw %g: it is in bytes/s (e.g. 4.2e12 for 4.2 TB/s), not GB/s",
                               a.floor_bw);
    if ((rc = cli_set_threads(CMD, a.threads))) return rc;
    if ((rc = cli_require_model_dir(CMD, a.model))) return rc;
    return bench(&a);
}
