/* The engine thread of fp4moe serve: continuous batching over one fp4moe_batch (srv.h).
 *
 * Each loop: admit queued jobs while sequences are free (a job whose prompt extends a kept
 * snapshot starts from it: prefix reuse), drop jobs whose client went away (their sequence is
 * removed at once), then one fp4moe_batch_step: a decode token for every job in its answer, then
 * prefill chunks of the others within max_step_tokens (a chunk ends at the chat history's end so
 * that a snapshot of it can be kept for the next turn). Tokens are sampled per job (greedy on the
 * device, else fp4moe_sample on the logits), detokenized with a streaming decoder, passed through
 * srv_text (stop strings, reasoning split) and appended to the job's output (SSE chunks, or the
 * final JSON body) under the engine lock; the HTTP side is woken through the job's wake callback.
 * One step failing in the forward fails the jobs of that step only.
 *
 * Expert parallelism (ep_ranks > 1, docs/EP.md): one such loop per rank, each on its own thread with
 * its own batch (its share of the routed experts), its own sequences (a queued request goes to the
 * rank with the fewest; max_seqs each) and its own prefix cache (prefix_cache_bytes split evenly).
 * Every round each rank either steps (fp4moe_batch_step) or, without work, takes part in the
 * others' step (fp4moe_ep_idle); a round in which nobody stepped lets idle ranks wait for an event
 * (a request, a cancellation, the shutdown). At shutdown every rank ends its jobs, then announces
 * "stopping" until all have (the group ends in one round). */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "server/srv.h"

enum { PH_QUEUED = 0, PH_PREFILL = 1, PH_DECODE = 2, PH_DONE = 3, PH_WAIT = 4 /* a choice waiting for the prompt's
                                                                              state from choice 0 */ };

struct srv_job {
    srv_engine *e;
    int refs;                                 /* under e->lock */
    srv_request r;
    srv_job *next;                            /* queue link */
    /* engine thread only */
    struct srv_rank *rk;                      /* the rank that runs it (NULL while queued) */
    int phase;
    int64_t seq, fed, cached;
    int32_t next_tok;
    fp4moe_sampler smp;
    int smp_ok;
    fp4moe_tokenizer_stream ts;
    int ts_ok;
    srv_text text;
    int32_t *gen;
    int64_t n_gen, cap_gen;
    float *logits;
    srv_tool_split tsplit;                    /* chat with tools: content -> (content, the calls' text) */
    int tsplit_on, held;                      /* held: deltas held back whole (a stream's keep-alive comments) */
    uint64_t call_rng;                        /* tool call ids */
    fp4moe_grammar_matcher *gm;               /* structured output: the output's place in r.grammar (NULL: none) */
    float *mlog;                              /* ... and the logits with its mask (the sampler's input; logprobs
                                                 come from the raw ones, as vLLM's) */
    double t_submit, t_admit, t_first, t_last;
    double ms_restore, ms_snapshot;           /* prefix cache copies of this job */
    int n_steps_prefill;
    srv_buf acc[2];                           /* non-stream: reasoning, content */
    int role_sent;
    cJSON *lp;                                /* logprobs not yet sent (a stream) or all (non-stream): chat
                                                 {"content": [...]}, completion {"tokens", "token_logprobs",
                                                 "top_logprobs", "text_offset"} */
    int64_t text_chars;                       /* code points of the decoded output so far (text_offset) */
    srv_buf echo;                             /* echo: the prompt's text (decoded) */
    int64_t echo_chars, *echo_off;            /* its code points; echo + logprobs: each prompt token's offset */
    float *plog;                              /* echo + logprobs: the logits of a prefill chunk's rows */
    int64_t plog_rows;
    int fin;                                  /* this job's sequence has ended (done, failed or cancelled) */
    cJSON *choice_json;                       /* non-stream: the finished choice object */
    /* n > 1 choices: the HTTP side holds a group job, never queued, and each choice is a job of its own (one
       sequence, its own sampler) whose output goes to the group; a request of one choice is its own group */
    srv_job *grp;                             /* the group (this job itself when n = 1) */
    int index;                                /* the choice's index */
    srv_job **choice;                         /* group, n > 1: its choices (a reference on each) */
    int n_choice, n_fin;                      /* group: choices, and those finished (e->lock) */
    int64_t gen_total;                        /* group: output tokens of the finished choices */
    /* group, n > 1 (not echo): the prompt computed once, by choice 0; the choices admitted on its rank start from
       its state (e->lock) */
    struct srv_rank *prank;                   /* choice 0's rank (NULL until admitted) */
    int pstate;                               /* 0: pending; 1: ready (psnap, plogits / ptok); -1: each choice
                                                 computes the prompt itself */
    fp4moe_snapshot *psnap;                   /* choice 0's state right after the prompt */
    float *plogits;                           /* the prompt's last logits (choices that sample on the host) */
    int32_t ptok;                             /* its greedy token (the device's argmax) */
    int pleft;                                /* choices that may still start from psnap (freed at 0) */
    int pshare;                               /* the choices share the prompt (one prompt, not echo) */
    int64_t prompt_total;                     /* group: the tokens of its prompts (usage) */
    /* shared with the HTTP side (e->lock), used on the group */
    srv_buf out;                              /* SSE bytes, or the final body */
    size_t n_read;
    int done, cancelled, http, armed;
    void (*wake)(void *);
    void *wake_ctx;
    char id[48];
    int64_t created;
};

typedef struct {
    int32_t *tok;
    int64_t n;
    fp4moe_snapshot *s;
    size_t bytes;
    uint64_t used;
} cache_entry;

#define N_ROW_BUCKETS 11
#define N_TIME_BUCKETS 12
static const double k_row_b[N_ROW_BUCKETS] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024};
static const double k_ttft_b[N_TIME_BUCKETS] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30};
static const double k_itl_b[N_TIME_BUCKETS] = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 5};

typedef struct {
    double b[N_TIME_BUCKETS > N_ROW_BUCKETS ? N_TIME_BUCKETS : N_ROW_BUCKETS];
    int nb;
    uint64_t count[16];
    uint64_t n;
    double sum;
} histo;

static void histo_init(histo *h, const double *b, int nb) {
    memset(h, 0, sizeof *h);
    memcpy(h->b, b, (size_t)nb * sizeof(double));
    h->nb = nb;
}
static void histo_add(histo *h, double v) {
    for (int i = 0; i < h->nb; i++)
        if (v <= h->b[i]) h->count[i]++;
    h->n++;
    h->sum += v;
}

/* One engine thread: a batch and its jobs (one rank of an expert-parallel group, or the only one). */
typedef struct srv_rank {
    struct srv_engine *e;
    int rank;
    fp4moe_batch *b;
    pthread_t th;
    int th_ok;
    int64_t n_load;                 /* jobs admitted here and not yet dropped (e->lock) */
    /* this rank's thread only */
    srv_job **act;
    int64_t n_act;
    fp4moe_batch_item *items;
    srv_job **item_job;
    cache_entry *cache;
    int64_t n_cache;                /* changed under e->lock (read by the metrics) */
    size_t cache_bytes;             /* likewise */
    int64_t cache_budget;           /* bytes: prefix_cache_bytes / ranks */
    uint64_t tick;
} srv_rank;

struct srv_engine {
    const fp4moe_model *m;
    const fp4moe_tokenizer *tok;
    char *model_name;
    srv_engine_options o;
    int64_t V, tok_vocab;
    int32_t think_open, think_close;
    fp4moe_grammar_vocab *gv;         /* the tokenizer's byte trie for structured output (built once) */
    uint64_t call_counter;            /* tool call ids: each job's own sequence */
    pthread_mutex_t lock;
    pthread_cond_t cv;
    int lock_ok;
    int go;                         /* rank threads start their rounds at 1; -1: they exit at once */
    int stopping;
    uint64_t events;                /* requests, cancellations, shutdown (idle ranks wait for one) */
    srv_job *qhead, *qtail;
    int64_t n_queued, n_running;
    uint64_t counter;
    uint64_t id_base, n_ids;        /* response ids: mix64(id_base + n_ids), n_ids counted up (e->lock) */
    int n_ranks;
    srv_rank *ranks;
    /* metrics (e->lock) */
    int http_code[16];
    uint64_t http_count[16];
    int n_codes;
    uint64_t prompt_tokens, gen_tokens, cached_tokens, steps, finish[4];
    histo rows, ttft, itl, step_s;
};

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* ---- output (engine thread, e->lock held) ------------------------------------------------------ */

/* An SSE event into the group's output. */
static void out_event(srv_job *j, cJSON *o) {
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!s) return;
    srv_buf_printf(&j->grp->out, "data: %s\n\n", s);
    free(s);
}

static cJSON *chunk_base(const srv_job *j) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", j->grp->id);
    cJSON_AddStringToObject(o, "object", j->r.kind == SRV_CHAT ? "chat.completion.chunk" : "text_completion");
    cJSON_AddNumberToObject(o, "created", (double)j->grp->created);
    cJSON_AddStringToObject(o, "model", j->e->model_name);
    return o;
}

/* The usage of a group: the prompt once, the output tokens of every choice, the prompt tokens a choice reused */
static cJSON *usage_json(const srv_job *j) {
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "prompt_tokens", (double)j->prompt_total);
    cJSON_AddNumberToObject(u, "completion_tokens", (double)j->gen_total);
    cJSON_AddNumberToObject(u, "total_tokens", (double)(j->prompt_total + j->gen_total));
    if (j->cached) {
        cJSON *d = cJSON_AddObjectToObject(u, "prompt_tokens_details");
        cJSON_AddNumberToObject(d, "cached_tokens", (double)j->cached);
    }
    return u;
}

/* An empty logprobs object of the job's kind. */
static cJSON *lp_new(const srv_job *j) {
    cJSON *o = cJSON_CreateObject();
    if (j->r.kind == SRV_CHAT) {
        cJSON_AddArrayToObject(o, "content");
    } else {
        cJSON_AddArrayToObject(o, "tokens");
        cJSON_AddArrayToObject(o, "token_logprobs");
        cJSON_AddArrayToObject(o, "top_logprobs");
        cJSON_AddArrayToObject(o, "text_offset");
    }
    return o;
}

/* choice.logprobs: the entries gathered since the last chunk (a stream) or all of them, null when the request
 * asked for none. A stream's chunk carries them only when no text is held back (a possible stop string, a partial
 * tag or character), so that each entry comes with its token's text or after it; the last chunk carries the rest. */
static void add_logprobs(srv_job *j, cJSON *choice, int final) {
    const cJSON *first = j->lp ? j->lp->child : NULL; /* content / tokens: empty when nothing is pending */
    const int held = !final && (!srv_text_idle(&j->text) || (j->ts_ok && fp4moe_tokenizer_stream_pending(&j->ts)));
    if (!j->r.logprobs || !j->lp || (j->r.stream && (!(first && first->child) || held))) {
        cJSON_AddNullToObject(choice, "logprobs");
        return;
    }
    cJSON_AddItemToObject(choice, "logprobs", j->lp);
    j->lp = lp_new(j);
}

/* A tool call delta of a stream: {"index": 0, ["id", "type", "function": {"name"}], "function": {"arguments"}} */
static cJSON *call_delta(const cJSON *call, int index, int head, const char *args, size_t n_args) {
    cJSON *c = cJSON_CreateObject(), *f;
    cJSON_AddNumberToObject(c, "index", index);
    if (head) {
        cJSON_AddItemToObject(c, "id", cJSON_Duplicate(cJSON_GetObjectItemCaseSensitive(call, "id"), 1));
        cJSON_AddStringToObject(c, "type", "function");
    }
    f = cJSON_AddObjectToObject(c, "function");
    if (head) cJSON_AddItemToObject(f, "name", cJSON_Duplicate(cJSON_GetObjectItemCaseSensitive(
                                                   cJSON_GetObjectItemCaseSensitive(call, "function"), "name"), 1));
    cJSON_AddItemToObject(f, "arguments", srv_json_string(args ? args : "", n_args));
    return c;
}

/* A one-call tool_calls array for the named tool_choice (id drawn here) with the arguments text so far */
static cJSON *forced_call(srv_job *j, const char *args, size_t n) {
    cJSON *arr = cJSON_CreateArray(), *c = cJSON_CreateObject(), *f;
    char id[32];
    srv_tool_call_id(id, &j->call_rng);
    cJSON_AddStringToObject(c, "id", id);
    cJSON_AddStringToObject(c, "type", "function");
    f = cJSON_AddObjectToObject(c, "function");
    cJSON_AddStringToObject(f, "name", j->r.tool_forced);
    cJSON_AddItemToObject(f, "arguments", srv_json_string(args ? args : "", n));
    cJSON_AddItemToArray(arr, c);
    return arr;
}

/* The tool calls of a finished answer (auto tool choice): the split's calls parsed, or NULL (then the calls' text
 * joins the content in *rest) */
static cJSON *finish_calls(srv_job *j, srv_buf *rest, int cut) {
    if (!j->tsplit_on) return NULL;
    srv_tool_split_flush(&j->tsplit, rest);
    if (!j->tsplit.in_calls) return NULL;
    cJSON *tools = j->r.tools_json ? cJSON_Parse(j->r.tools_json) : NULL;
    cJSON *calls = srv_tool_calls_parse(j->tsplit.fmt, j->tsplit.calls.p, j->tsplit.calls.n, tools, cut, &j->call_rng);
    cJSON_Delete(tools);
    if (!calls) srv_buf_add(rest, j->tsplit.calls.p, j->tsplit.calls.n);
    j->tsplit.calls.n = 0;
    return calls;
}

/* One SSE chunk with a delta (stream), or the text kept for the final body (non-stream). Chat with tools: the
 * content goes through the tool-call split first (the calls come at the end: the last chunk / the message); a named
 * tool_choice: the content is the call's arguments. */
static void emit_raw(srv_job *j, const srv_delta *d, const char *finish, cJSON *calls);
static void emit(srv_job *j, const srv_delta *d, const char *finish) {
    if (j->grp->done) return;
    if (j->r.kind != SRV_CHAT || (!j->tsplit_on && !j->r.tool_forced && !j->r.tool_required)) {
        emit_raw(j, d, finish, NULL);
        return;
    }
    srv_delta d2 = *d;
    srv_buf pass = {0};
    cJSON *calls = NULL;
    if (j->r.tool_forced) { /* the content is the arguments: a stream sends them as the call's deltas */
        if (!j->r.stream) {
            emit_raw(j, d, finish, NULL);
            return;
        }
        if (d->n_content || !j->role_sent) {
            calls = cJSON_CreateArray();
            cJSON *one = forced_call(j, NULL, 0);
            cJSON_AddItemToArray(calls, call_delta(one->child, 0, !j->role_sent, d->content, d->n_content));
            cJSON_Delete(one);
        }
        d2.content = "";
        d2.n_content = 0;
        emit_raw(j, &d2, finish, calls);
        return;
    }
    if (j->r.tool_required) { /* the output is the calls: kept (j->acc[1]), sent whole at the end */
        if (j->r.stream) {
            srv_buf_add(&j->acc[1], d->content, d->n_content);
            if (finish) { /* the calls it completed; the rest (a call cut short) is no content */
                calls = srv_tool_calls_required(j->acc[1].p, j->acc[1].n, &j->call_rng);
                j->acc[1].n = 0;
            }
        } else {
            srv_buf_add(&pass, d->content, d->n_content);
        }
    } else {
        srv_tool_split_feed(&j->tsplit, d->content, d->n_content, &pass);
        if (finish && j->r.stream) calls = finish_calls(j, &pass, !strcmp(finish, "length"));
    }
    d2.content = pass.p ? pass.p : "";
    d2.n_content = pass.n;
    /* a stream holding a call back sends an SSE comment now and then: a write that finds a client gone (cancelled
       then, as any stream), which clients ignore */
    if (j->r.stream && !finish && !pass.n && d->n_content && ++j->held % 8 == 0) srv_buf_add(&j->grp->out, ":\n\n", 3);
    if (calls && j->r.tool_single) /* parallel_tool_calls false: the first call */
        while (cJSON_GetArraySize(calls) > 1) cJSON_DeleteItemFromArray(calls, 1);
    if (calls && j->r.stream) { /* a stream's calls: one delta each, whole */
        cJSON *deltas = cJSON_CreateArray();
        int i = 0;
        for (const cJSON *c = calls->child; c; c = c->next, i++) {
            const cJSON *a = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(c, "function"), "arguments");
            cJSON_AddItemToArray(deltas, call_delta(c, i, 1, cJSON_GetStringValue(a),
                                                    cJSON_GetStringValue(a) ? strlen(cJSON_GetStringValue(a)) : 0));
        }
        cJSON_Delete(calls);
        calls = deltas;
        if (strcmp(finish, "length")) finish = "tool_calls"; /* (cut by max_tokens: "length", the calls as parsed) */
    }
    emit_raw(j, &d2, finish, calls);
    srv_buf_free(&pass);
}

static void emit_raw(srv_job *j, const srv_delta *d, const char *finish, cJSON *calls) {
    if (j->grp->done) { /* (the request ended: a sibling choice failed, or the client went) */
        cJSON_Delete(calls);
        return;
    }
    if (!j->r.stream) {
        const char *part[2] = {d->reasoning, d->content};
        const size_t n[2] = {d->n_reasoning, d->n_content};
        for (int k = 0; k < 2; k++) srv_buf_add(&j->acc[k], part[k], n[k]);
        return;
    }
    if (!d->n_reasoning && !d->n_content && !finish && j->role_sent && !calls) return; /* (logprobs wait for text) */
    cJSON *o = chunk_base(j), *ch = cJSON_AddArrayToObject(o, "choices"), *c = cJSON_CreateObject();
    cJSON_AddItemToArray(ch, c);
    cJSON_AddNumberToObject(c, "index", j->index);
    if (j->r.kind == SRV_CHAT) {
        cJSON *delta = cJSON_AddObjectToObject(c, "delta");
        if (!j->role_sent) cJSON_AddStringToObject(delta, "role", "assistant");
        if (d->n_reasoning) cJSON_AddItemToObject(delta, "reasoning_content", srv_json_string(d->reasoning, d->n_reasoning));
        if (d->n_content || (!j->role_sent && !d->n_reasoning && !calls))
            cJSON_AddItemToObject(delta, "content", srv_json_string(d->content, d->n_content));
        if (calls) cJSON_AddItemToObject(delta, "tool_calls", calls);
        calls = NULL;
        j->role_sent = 1;
    } else {
        cJSON_AddItemToObject(c, "text", srv_json_string(d->content, d->n_content));
        j->role_sent = 1;
    }
    cJSON_Delete(calls);
    add_logprobs(j, c, finish != NULL);
    if (finish) cJSON_AddStringToObject(c, "finish_reason", finish);
    else cJSON_AddNullToObject(c, "finish_reason");
    if (j->r.continuous_usage) { /* vLLM's continuous_usage_stats: this choice's prompt and its tokens so far */
        cJSON *u = cJSON_AddObjectToObject(o, "usage");
        cJSON_AddNumberToObject(u, "prompt_tokens", (double)j->r.n_ids);
        cJSON_AddNumberToObject(u, "completion_tokens", (double)j->n_gen);
        cJSON_AddNumberToObject(u, "total_tokens", (double)(j->r.n_ids + j->n_gen));
    }
    out_event(j, o);
}

/* A finished choice of a whole (non-stream) answer. */
static cJSON *choice_object(srv_job *j, const char *finish) {
    cJSON *c = cJSON_CreateObject();
    cJSON_AddNumberToObject(c, "index", j->index);
    if (j->r.kind == SRV_CHAT) {
        cJSON *msg = cJSON_AddObjectToObject(c, "message");
        cJSON_AddStringToObject(msg, "role", "assistant");
        cJSON *calls = j->r.tool_forced    ? forced_call(j, j->acc[1].p, j->acc[1].n)
                       : j->r.tool_required ? srv_tool_calls_required(j->acc[1].p, j->acc[1].n, &j->call_rng)
                                            : finish_calls(j, &j->acc[1], !strcmp(finish, "length"));
        if (j->r.tool_required) j->acc[1].n = 0; /* (the output is calls: a cut one is no content) */
        if (calls && j->r.tool_single)
            while (cJSON_GetArraySize(calls) > 1) cJSON_DeleteItemFromArray(calls, 1);
        if (calls) {
            if (j->acc[1].n) cJSON_AddItemToObject(msg, "content", srv_json_string(j->acc[1].p, j->acc[1].n));
            else cJSON_AddNullToObject(msg, "content");
            if (j->r.tool_forced) cJSON_ReplaceItemInObject(msg, "content", cJSON_CreateNull());
            cJSON_AddItemToObject(msg, "tool_calls", calls);
            if (!j->r.tool_forced && strcmp(finish, "length")) finish = "tool_calls";
        } else if ((j->r.reasoning || j->r.tool_required) && !j->acc[1].n) { /* all reasoning (null, as vLLM's
                                                                                reasoning parsers give), or no call */
            cJSON_AddNullToObject(msg, "content");
        } else {
            cJSON_AddItemToObject(msg, "content", srv_json_string(j->acc[1].n ? j->acc[1].p : "", j->acc[1].n));
        }
        if (j->r.reasoning && j->acc[0].n)
            cJSON_AddItemToObject(msg, "reasoning_content", srv_json_string(j->acc[0].p, j->acc[0].n));
        else cJSON_AddNullToObject(msg, "reasoning_content");
    } else {
        cJSON_AddItemToObject(c, "text", srv_json_string(j->acc[1].n ? j->acc[1].p : "", j->acc[1].n));
    }
    add_logprobs(j, c, 1);
    cJSON_AddStringToObject(c, "finish_reason", finish);
    return c;
}

/* The whole answer of group g: its choices in index order, the usage. */
static void final_body(srv_job *g) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", g->id);
    cJSON_AddStringToObject(o, "object", g->r.kind == SRV_CHAT ? "chat.completion" : "text_completion");
    cJSON_AddNumberToObject(o, "created", (double)g->created);
    cJSON_AddStringToObject(o, "model", g->e->model_name);
    cJSON *ch = cJSON_AddArrayToObject(o, "choices");
    for (int i = 0; i < g->n_choice; i++) {
        srv_job *c = g->choice ? g->choice[i] : g;
        if (c->choice_json) cJSON_AddItemToArray(ch, c->choice_json);
        c->choice_json = NULL;
    }
    cJSON_AddItemToObject(o, "usage", usage_json(g));
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (s) srv_buf_add(&g->out, s, strlen(s));
    free(s);
}

/* Wakes the HTTP side if it waits (lock held; MHD_resume_connection only sets flags). */
static void notify(srv_job *j) {
    if (j->armed && (j->r.stream || j->done)) {
        j->armed = 0;
        if (j->wake) j->wake(j->wake_ctx);
    }
}

static void job_unref_locked(srv_job *j);

/* ---- prefix cache (engine thread) ---------------------------------------------------------------- */

static void cache_drop(srv_rank *rk, int64_t i) {
    srv_engine *e = rk->e;
    cache_entry *c = &rk->cache[i];
    fp4moe_snapshot_free(c->s);
    free(c->tok);
    pthread_mutex_lock(&e->lock);
    rk->cache_bytes -= c->bytes;
    rk->cache[i] = rk->cache[--rk->n_cache];
    pthread_mutex_unlock(&e->lock);
}

/* Keeps a snapshot of sequence `seq` whose first n tokens are tok (copied). */
static void cache_put(srv_rank *rk, int64_t seq, const int32_t *a, int64_t na, const int32_t *b, int64_t n) {
    srv_engine *e = rk->e;
    if (rk->cache_budget <= 0 || n < e->o.prefix_min_tokens || n < 1) return;
    for (int64_t i = 0; i < rk->n_cache; i++) {
        cache_entry *c = &rk->cache[i];
        if (c->n != n) continue;
        const int64_t k = n < na ? n : na;
        if (!memcmp(c->tok, a, (size_t)k * sizeof(int32_t)) &&
            (n <= na || !memcmp(c->tok + na, b, (size_t)(n - na) * sizeof(int32_t)))) {
            c->used = ++rk->tick;
            return;
        }
    }
    fp4moe_snapshot *s = NULL;
    if (fp4moe_batch_snapshot(rk->b, seq, &s)) return;
    const size_t bytes = fp4moe_snapshot_bytes(s) + (size_t)n * sizeof(int32_t);
    if ((int64_t)bytes > rk->cache_budget) {
        fp4moe_snapshot_free(s);
        return;
    }
    while (rk->n_cache && (int64_t)(rk->cache_bytes + bytes) > rk->cache_budget) {
        int64_t lru = 0;
        for (int64_t i = 1; i < rk->n_cache; i++)
            if (rk->cache[i].used < rk->cache[lru].used) lru = i;
        cache_drop(rk, lru);
    }
    cache_entry *grown = realloc(rk->cache, (size_t)(rk->n_cache + 1) * sizeof *grown);
    int32_t *t = malloc((size_t)n * sizeof(int32_t));
    if (!grown || !t) {
        if (grown) rk->cache = grown;
        free(t);
        fp4moe_snapshot_free(s);
        return;
    }
    rk->cache = grown;
    const int64_t k = n < na ? n : na;
    memcpy(t, a, (size_t)k * sizeof(int32_t));
    if (n > na) memcpy(t + na, b, (size_t)(n - na) * sizeof(int32_t));
    pthread_mutex_lock(&e->lock);
    rk->cache[rk->n_cache++] = (cache_entry){t, n, s, bytes, ++rk->tick};
    rk->cache_bytes += bytes;
    pthread_mutex_unlock(&e->lock);
}

/* The longest kept prefix of ids[0..n) that leaves at least one token to run, or -1. */
static int64_t cache_find(srv_rank *rk, const int32_t *ids, int64_t n) {
    int64_t best = -1;
    for (int64_t i = 0; i < rk->n_cache; i++) {
        const cache_entry *c = &rk->cache[i];
        if (c->n < n && (best < 0 || c->n > rk->cache[best].n) && !memcmp(c->tok, ids, (size_t)c->n * sizeof(int32_t)))
            best = i;
    }
    return best;
}

/* ---- job life (engine thread) --------------------------------------------------------------------- */

static void release_seq(srv_job *j) {
    if (j->seq >= 0) fp4moe_batch_remove(j->rk->b, j->seq);
    j->seq = -1;
}

static const char *const k_finish_name[] = {"stop", "length"};

/* One line per finished request on stderr (option log), as llama-server prints its timings. */
static void log_job(const srv_engine *e, const srv_job *j, int http, const char *finish) {
    if (!e->o.log) return;
    const double now = now_s();
    char ttft[32] = "-"; /* no token: no time to the first one (a cancelled or failed request) */
    if (j->n_gen) snprintf(ttft, sizeof ttft, "%.1f ms", 1e3 * (j->t_first - j->t_submit));
    const double dec = j->n_gen > 1 ? (double)(j->n_gen - 1) / (j->t_last - j->t_first) : 0.0;
    char rank[48] = "";
    if (e->n_ranks > 1 && j->rk) snprintf(rank, sizeof rank, " rank %d", j->rk->rank);
    if (j->grp != j) snprintf(rank + strlen(rank), sizeof rank - strlen(rank), " choice %d", j->index);
    fprintf(stderr, "serve: %s %d%s prompt %lld (cached %lld) output %lld (%s) queue %.1f ms ttft %s "
            "decode %.1f tok/s total %.1f ms (prefill steps %d, restore %.1f ms, snapshot %.1f ms)\n", j->id, http, rank,
            (long long)j->r.n_ids, (long long)j->cached, (long long)j->n_gen, finish,
            1e3 * ((j->t_admit > 0 ? j->t_admit : now) - j->t_submit), ttft, dec, 1e3 * (now - j->t_submit),
            j->n_steps_prefill, j->ms_restore, j->ms_snapshot);
}

/* Ends a job that failed: its HTTP status, an OpenAI error body (or an SSE error event). */
/* The other choices of j's group that still run are dropped at the engine's next step (e->lock held). */
static void cancel_siblings(srv_engine *e, srv_job *j) {
    srv_job *g = j->grp;
    for (int i = 0; g->choice && i < g->n_choice; i++)
        if (g->choice[i] != j && !g->choice[i]->fin) g->choice[i]->cancelled = 1;
    e->events++;
}

/* Ends group g with an error (e->lock held; nothing when it has ended): a stream (headers sent or not) ends with an
 * SSE error event, a whole answer is replaced by the error body with its status. */
static void group_fail(srv_job *g, int http, const char *msg) {
    if (g->done) return;
    srv_error er;
    srv_fail(&er, http, NULL, "%s", msg);
    char *body = srv_error_json(&er);
    if (!g->r.stream) g->out.n = 0;
    g->http = http;                  /* read for whole answers only (a stream sent its 200) */
    if (g->r.stream) srv_buf_printf(&g->out, "data: %s\n\ndata: [DONE]\n\n", body ? body : "{}");
    else if (body) srv_buf_add(&g->out, body, strlen(body));
    free(body);
    g->done = 1;
    notify(g);
}

/* Ends a job that failed: its group fails with this status and message (the other choices are dropped). */
static void finish_error(srv_engine *e, srv_job *j, int http, const char *msg) {
    release_seq(j);
    pthread_mutex_lock(&e->lock);
    j->fin = 1;
    j->phase = PH_DONE;
    e->finish[3]++;
    log_job(e, j, http, msg);
    e->n_running--;
    group_fail(j->grp, http, msg);
    cancel_siblings(e, j);
    pthread_mutex_unlock(&e->lock);
}

static void finish_ok(srv_engine *e, srv_job *j, int reason /* 0 stop, 1 length */) {
    srv_delta d;
    const char *t;
    int64_t n = 0;
    if (j->ts_ok && !fp4moe_tokenizer_stream_flush(&j->ts, &t, &n) && n) {
        srv_delta d2;
        if (srv_text_feed(&j->text, t, (size_t)n, &d2) == 1) reason = 0;
        pthread_mutex_lock(&e->lock);
        emit(j, &d2, NULL);
        pthread_mutex_unlock(&e->lock);
    }
    srv_text_finish(&j->text, &d);
    /* a snapshot of the whole conversation so far: the next turn may extend it */
    if (j->seq >= 0 && j->r.kind == SRV_CHAT) {   /* chats continue; completions are not kept (the copy costs) */
        const int64_t pos = fp4moe_batch_pos(j->rk->b, j->seq);
        if (pos > j->r.n_ids) cache_put(j->rk, j->seq, j->r.ids, j->r.n_ids, j->gen, pos);
    }
    release_seq(j);
    pthread_mutex_lock(&e->lock);
    srv_job *g = j->grp;
    if (!g->done) {
        emit(j, &d, j->r.stream ? k_finish_name[reason] : NULL);
        if (!j->r.stream) j->choice_json = choice_object(j, k_finish_name[reason]);
    }
    j->fin = 1;
    j->phase = PH_DONE;
    e->finish[reason]++;
    log_job(e, j, 200, k_finish_name[reason]);
    e->n_running--;
    g->n_fin++;
    g->gen_total += j->n_gen;
    if (j->cached > g->cached) g->cached = j->cached;
    if (!g->done && g->n_fin == g->n_choice) { /* the last choice: the usage, the end */
        if (g->r.stream) {
            if (g->r.include_usage) {
                cJSON *o = chunk_base(j);
                cJSON_AddArrayToObject(o, "choices");
                cJSON_AddItemToObject(o, "usage", usage_json(g));
                out_event(j, o);
            }
            srv_buf_add(&g->out, "data: [DONE]\n\n", 14);
        } else {
            final_body(g);
        }
        g->http = 200;
        g->done = 1;
    }
    notify(g);
    pthread_mutex_unlock(&e->lock);
}

static uint64_t mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static int echo_setup(srv_engine *e, srv_job *j);
static int take_token(srv_engine *e, srv_job *j, int32_t id);

/* One choice less may start from the group's prompt state (e->lock held): at none, it is freed. */
static void prompt_left(srv_job *g) {
    if (--g->pleft > 0) return;
    fp4moe_snapshot_free(g->psnap);
    free(g->plogits);
    g->psnap = NULL;
    g->plogits = NULL;
}

/* Choice j (index > 0, on the rank of choice 0, its group's prompt state ready) starts from it: a sequence restored
 * after the prompt, its first token sampled from the prompt's last logits with its own sampler. 0, or -1 when it
 * failed (no room: 503). */
/* The job's next token from its logits (j->logits; greedy ids from the device when there are none), through the
 * structured-output mask while the output is under a grammar (not while it is in the reasoning that the prompt
 * opened). Returns the id, or -1 when the job ended here: the grammar's value is complete and no stop id may end
 * it (ignore_eos: finished, "stop"), or no token continues it (an error). */
static int32_t job_sample(srv_engine *e, srv_job *j, int32_t device_id) {
    if (!j->logits) return device_id;
    /* (the constraint waits only for a reasoning the prompt opened: an output that opens <think> itself is under it) */
    if (!j->gm || (j->r.reasoning && j->r.reasoning_start && j->text.in_reasoning)) return fp4moe_sample(&j->smp, j->logits);
    memcpy(j->mlog, j->logits, (size_t)e->V * sizeof(float));
    if (fp4moe_grammar_mask_logits(j->gm, j->mlog, e->V) == 0) {
        if (fp4moe_grammar_is_complete(j->gm)) finish_ok(e, j, 0);
        else finish_error(e, j, 500, "structured output: no token of the vocabulary continues the grammar here");
        return -1;
    }
    const int32_t id = fp4moe_sample(&j->smp, j->mlog);
    if (fp4moe_grammar_accept_token(j->gm, id)) { /* (the mask allowed it: cannot happen) */
        finish_error(e, j, 500, fp4moe_last_error());
        return -1;
    }
    return id;
}

static int start_from_prompt(srv_rank *rk, srv_job *j) {
    srv_engine *e = rk->e;
    srv_job *g = j->grp;
    const int st = fp4moe_batch_add_from_snapshot(rk->b, g->psnap, &j->seq);
    if (st) {
        j->seq = -1;
        char msg[256];
        snprintf(msg, sizeof msg, "no room for the request's sequence: %s", fp4moe_last_error());
        pthread_mutex_lock(&e->lock);
        prompt_left(g);
        pthread_mutex_unlock(&e->lock);
        finish_error(e, j, 503, msg);
        return -1;
    }
    j->fed = j->r.n_ids;
    j->phase = PH_PREFILL;
    if (j->logits) memcpy(j->logits, g->plogits, (size_t)e->V * sizeof(float));
    pthread_mutex_lock(&e->lock);
    prompt_left(g);
    pthread_mutex_unlock(&e->lock);
    const int32_t id = job_sample(e, j, g->ptok);
    if (id < 0) return 0;
    fp4moe_sampler_accept_output(&j->smp, id);
    take_token(e, j, id);
    return 0;
}

/* Choice 0 of a group has computed the prompt: its state (a snapshot at the prompt's end, the last logits or the
 * greedy token) is kept for the other choices, and those waiting on this rank start from it (on failure they compute
 * the prompt themselves). */
static void share_prompt(srv_rank *rk, srv_job *j) {
    srv_engine *e = rk->e;
    srv_job *g = j->grp;
    fp4moe_snapshot *s = NULL;
    float *pl = NULL;
    int ok = !fp4moe_batch_snapshot(rk->b, j->seq, &s);
    if (ok && j->logits) {
        if ((ok = (pl = malloc((size_t)e->V * sizeof(float))) != NULL))
            memcpy(pl, j->logits, (size_t)e->V * sizeof(float));
    }
    if (!ok) {
        fp4moe_snapshot_free(s);
        s = NULL;
    }
    pthread_mutex_lock(&e->lock);
    g->psnap = s;
    g->plogits = pl;
    g->ptok = j->next_tok;
    g->pstate = ok ? 1 : -1;
    pthread_mutex_unlock(&e->lock);
    for (int64_t i = 0; i < rk->n_act; i++) {
        srv_job *w = rk->act[i];
        if (w->grp != g || w->phase != PH_WAIT || w->fin) continue;
        if (ok) {
            start_from_prompt(rk, w);
        } else {
            w->phase = PH_PREFILL;
            pthread_mutex_lock(&e->lock);
            prompt_left(g);
            pthread_mutex_unlock(&e->lock);
        }
    }
}

/* Sets a job up for its first step; 0, or -1 when it already failed. */
static int admit(srv_rank *rk, srv_job *j) {
    srv_engine *e = rk->e;
    j->rk = rk;
    j->seq = -1;
    if (!j->r.has_seed) j->r.sp.seed = mix64((uint64_t)time(NULL) ^ mix64(++e->counter)) | 1;
    if (fp4moe_sampler_init_params(&j->smp, e->V, &j->r.sp)) {
        finish_error(e, j, 400, fp4moe_last_error());
        return -1;
    }
    j->smp_ok = 1;
    /* logits on the host: to sample, for logprobs, or for penalties / a logit bias (the sampler's pen buffer);
       else greedy ids come from the device's argmax */
    const int host = j->r.sp.temperature > 0.0f || j->r.logprobs || j->smp.pen || j->r.grammar;
    if (host && !(j->logits = malloc((size_t)e->V * sizeof(float)))) {
        finish_error(e, j, 500, "out of memory");
        return -1;
    }
    if (j->r.tools_fmt != SRV_TOOLS_NONE) {
        srv_tool_split_init(&j->tsplit, j->r.tools_fmt);
        j->tsplit_on = 1;
    }
    j->call_rng = mix64(e->id_base ^ mix64(__atomic_add_fetch(&e->call_counter, 1, __ATOMIC_RELAXED))); /* (unique ids) */
    if (j->r.grammar) {
        const int st = e->gv ? fp4moe_grammar_matcher_new(j->r.grammar->g, e->gv, j->r.sp.stop_ids, j->r.sp.n_stop, &j->gm)
                             : fp4moe_set_error(FP4MOE_ENOMEM, "no grammar vocab");
        if (st || !(j->mlog = malloc((size_t)e->V * sizeof(float)))) {
            finish_error(e, j, 500, "out of memory");
            return -1;
        }
    }
    if (j->r.logprobs && !(j->lp = lp_new(j))) {
        finish_error(e, j, 500, "out of memory");
        return -1;
    }
    for (int64_t i = 0; i < j->r.n_ids; i++) fp4moe_sampler_accept(&j->smp, j->r.ids[i]); /* (a no-op unless
                                                                         repetition_penalty is on) */
    fp4moe_tokenizer_stream_init(&j->ts, e->tok, 1);
    j->ts_ok = 1;
    srv_text_init(&j->text, j->r.stop, j->r.n_stop, j->r.reasoning, j->r.reasoning_start);
    if (j->r.echo && echo_setup(e, j)) {
        finish_error(e, j, 500, "out of memory");
        return -1;
    }
    /* n > 1: choice 0 computes the prompt; the others on its rank wait for its state, or start from it */
    srv_job *g = j->grp;
    if (g != j && g->pshare) {
        pthread_mutex_lock(&e->lock);
        if (j->index == 0) g->prank = rk;
        const int mine = j->index > 0 && g->prank == rk, ready = g->pstate;
        if (j->index > 0 && (!mine || ready < 0)) prompt_left(g); /* (computes the prompt itself) */
        pthread_mutex_unlock(&e->lock);
        if (mine && ready >= 0) {
            j->t_admit = now_s();
            if (ready == 0) {
                j->phase = PH_WAIT;
                return 0;
            }
            return start_from_prompt(rk, j);
        }
    }
    /* (echo + logprobs needs the logits of every prompt position: no snapshot) */
    const int64_t hit = j->plog ? -1 : cache_find(rk, j->r.ids, j->r.n_ids);
    int st;
    if (hit >= 0) {
        const double t = now_s();
        st = fp4moe_batch_add_from_snapshot(rk->b, rk->cache[hit].s, &j->seq);
        j->ms_restore = 1e3 * (now_s() - t);
        if (!st) {
            j->fed = j->cached = rk->cache[hit].n;
            rk->cache[hit].used = ++rk->tick;
        }
    } else {
        st = fp4moe_batch_add(rk->b, &j->seq);
    }
    if (st) {
        j->seq = -1;
        char msg[256];
        snprintf(msg, sizeof msg, "no room for the request's sequence: %s", fp4moe_last_error());
        finish_error(e, j, 503, msg);
        return -1;
    }
    j->phase = PH_PREFILL;
    j->t_admit = now_s();
    pthread_mutex_lock(&e->lock);
    e->prompt_tokens += (uint64_t)j->r.n_ids;
    e->cached_tokens += (uint64_t)j->cached;
    pthread_mutex_unlock(&e->lock);
    return 0;
}

/* The token's text as logprobs give it: its bytes (*piece, *n: maybe a part of a character) as lossy UTF-8 (NULL:
 * out of memory). */
static cJSON *token_text(const srv_engine *e, const srv_job *j, int32_t id, const char **piece, int64_t *n) {
    *piece = "";
    *n = 0;
    if ((int64_t)id < e->tok_vocab && fp4moe_tokenizer_id_to_token(e->tok, id))
        fp4moe_tokenizer_token_to_piece(e->tok, id, piece, n);
    if (j->r.tokens_as_ids) { /* vLLM's return_tokens_as_token_ids */
        char t[32];
        snprintf(t, sizeof t, "token_id:%d", id);
        return cJSON_CreateString(t);
    }
    srv_buf b = {0};
    cJSON *s = srv_utf8_lossy(&b, *piece, (size_t)*n) < 0 ? NULL : srv_json_string(b.p ? b.p : "", b.n);
    srv_buf_free(&b);
    return s;
}

static cJSON *token_bytes(const char *piece, int64_t n) {
    cJSON *a = cJSON_CreateArray();
    for (int64_t i = 0; a && i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber((double)(unsigned char)piece[i]));
    return a;
}

/* A logprob as JSON: -inf (a token of zero probability, e.g. after a bias of -100 chose it) as -9999.0, as vLLM */
static double lp_json(float lp) { return lp > -9999.0f ? (double)lp : -9999.0; }

/* Appends token id's entry to j->lp: its log-probability among the logits that chose it (row: V logits; NULL for
 * the first token of an echoed prompt, which has none: null) and the top_logprobs most likely tokens (chat: {token,
 * logprob, bytes, top_logprobs}; completion: the four parallel lists, text_offset `offset`). */
static void add_logprob_entry(srv_engine *e, srv_job *j, int32_t id, const float *row, int64_t offset) {
    fp4moe_prob_id top[SRV_MAX_TOP_LOGPROBS];
    float lp = 0.0f;
    const int64_t k = row ? fp4moe_logprobs(row, e->V, id, &lp, j->r.top_logprobs, top) : 0;
    if (k < 0 || !j->lp) return;
    const char *piece;
    int64_t n;
    if (j->r.kind == SRV_CHAT) {
        cJSON *ent = cJSON_CreateObject(), *tops = cJSON_CreateArray();
        cJSON_AddItemToObject(ent, "token", token_text(e, j, id, &piece, &n));
        cJSON_AddNumberToObject(ent, "logprob", lp_json(lp));
        cJSON_AddItemToObject(ent, "bytes", token_bytes(piece, n));
        for (int64_t i = 0; i < k; i++) {
            cJSON *t = cJSON_CreateObject();
            cJSON_AddItemToObject(t, "token", token_text(e, j, top[i].id, &piece, &n));
            cJSON_AddNumberToObject(t, "logprob", lp_json(top[i].p));
            cJSON_AddItemToObject(t, "bytes", token_bytes(piece, n));
            cJSON_AddItemToArray(tops, t);
        }
        cJSON_AddItemToObject(ent, "top_logprobs", tops);
        cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(j->lp, "content"), ent);
        return;
    }
    cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(j->lp, "tokens"), token_text(e, j, id, &piece, &n));
    cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(j->lp, "token_logprobs"),
                         row ? cJSON_CreateNumber(lp_json(lp)) : cJSON_CreateNull());
    cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(j->lp, "text_offset"), cJSON_CreateNumber((double)offset));
    if (!row) {
        cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(j->lp, "top_logprobs"), cJSON_CreateNull());
        return;
    }
    cJSON *d = cJSON_CreateObject();
    for (int64_t i = 0; i <= k; i++) { /* the k most likely, then the chosen token when not among them (OpenAI: "up
                                         to logprobs + 1 elements", vLLM) */
        const int32_t t = i < k ? top[i].id : id;
        cJSON *s = token_text(e, j, t, &piece, &n);
        /* a key is a C string: a NUL token's text (a raw \u0000 item) is "\xEF\xBF\xBD" there */
        const char *key = s && cJSON_IsRaw(s) ? "\xEF\xBF\xBD" : s ? s->valuestring : NULL;
        if (key && !cJSON_GetObjectItemCaseSensitive(d, key)) /* two tokens of one text: the likelier */
            cJSON_AddNumberToObject(d, key, lp_json(i < k ? top[i].p : lp));
        cJSON_Delete(s);
    }
    cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(j->lp, "top_logprobs"), d);
}

/* Code points in n bytes of valid UTF-8 (the streaming decoder's output). */
static int64_t utf8_chars(const char *s, int64_t n) {
    int64_t c = 0;
    for (int64_t i = 0; i < n; i++) c += ((unsigned char)s[i] & 0xC0) != 0x80;
    return c;
}

#define ECHO_LOGITS_BYTES ((int64_t)32 << 20) /* echo + logprobs: a prefill chunk's logits at most (rows x V x 4) */

/* echo: the prompt's text, decoded as the output is (special tokens skipped), and with logprobs each prompt token's
 * text_offset in it, the first token's null entry and the buffer of a prefill chunk's logits (chunks of at most
 * ECHO_LOGITS_BYTES). Returns 0, or -1 when out of memory. */
static int echo_setup(srv_engine *e, srv_job *j) {
    const int64_t T = j->r.n_ids;
    if (j->r.logprobs) {
        j->plog_rows = ECHO_LOGITS_BYTES / (e->V * (int64_t)sizeof(float));
        if (j->plog_rows > e->o.max_step_tokens) j->plog_rows = e->o.max_step_tokens;
        if (j->plog_rows < 1) j->plog_rows = 1;
        j->echo_off = malloc((size_t)T * sizeof(int64_t));
        j->plog = malloc((size_t)(j->plog_rows * e->V) * sizeof(float));
        if (!j->echo_off || !j->plog) return -1;
    }
    fp4moe_tokenizer_stream ts;
    fp4moe_tokenizer_stream_init(&ts, e->tok, 1);
    int rc = 0;
    for (int64_t k = 0; k <= T && !rc; k++) {
        const char *text = "\xEF\xBF\xBD";
        int64_t n = 3;
        if (k < T && j->echo_off) j->echo_off[k] = j->echo_chars;
        if (k == T) {
            if (fp4moe_tokenizer_stream_flush(&ts, &text, &n)) rc = -1;
        } else if ((int64_t)j->r.ids[k] < e->tok_vocab && fp4moe_tokenizer_id_to_token(e->tok, j->r.ids[k])) {
            if (fp4moe_tokenizer_stream_push(&ts, j->r.ids[k], &text, &n)) text = "\xEF\xBF\xBD", n = 3;
        }
        if (!rc && srv_buf_add(&j->echo, text, (size_t)n)) rc = -1;
        j->echo_chars += utf8_chars(text, n);
    }
    fp4moe_tokenizer_stream_free(&ts);
    if (!rc && j->lp) add_logprob_entry(e, j, j->r.ids[0], NULL, 0);
    return rc;
}

/* A sampled token: stop checks, text, output; 1 when the job ended. */
static int take_token(srv_engine *e, srv_job *j, int32_t id) {
    const double t = now_s();
    if (j->n_gen == j->cap_gen) {
        const int64_t c = j->cap_gen ? j->cap_gen * 2 : 64;
        int32_t *g = realloc(j->gen, (size_t)c * sizeof(int32_t));
        if (!g) {
            finish_error(e, j, 500, "out of memory");
            return 1;
        }
        j->gen = g;
        j->cap_gen = c;
    }
    j->gen[j->n_gen++] = id;
    pthread_mutex_lock(&e->lock);
    e->gen_tokens++;
    if (j->n_gen == 1) histo_add(&e->ttft, t - j->t_submit);
    else histo_add(&e->itl, t - j->t_last);
    pthread_mutex_unlock(&e->lock);
    if (j->n_gen == 1) j->t_first = t;
    j->t_last = t;
    if (fp4moe_sampler_is_stop(&j->smp, id)) {
        finish_ok(e, j, 0);
        return 1;
    }
    if (j->r.logprobs)   /* (every output token but a stop id, which has no text) */
        add_logprob_entry(e, j, id, j->logits, j->echo_chars + j->text_chars);
    const char *text;
    int64_t n = 0;
    char unknown[4] = "\xEF\xBF\xBD";
    if (id == e->think_open && e->think_open >= 0) text = "<think>", n = 7;
    else if (id == e->think_close && e->think_close >= 0) text = "</think>", n = 8;
    else if ((int64_t)id >= e->tok_vocab || !fp4moe_tokenizer_id_to_token(e->tok, id)) text = unknown, n = 3;
    else if (fp4moe_tokenizer_stream_push(&j->ts, id, &text, &n)) text = unknown, n = 3;
    j->text_chars += utf8_chars(text, n);
    srv_delta d;
    const int stopped = srv_text_feed(&j->text, text, (size_t)n, &d);
    if (stopped < 0) {
        finish_error(e, j, 500, "out of memory");
        return 1;
    }
    pthread_mutex_lock(&e->lock);
    emit(j, &d, NULL);
    notify(j->grp);
    pthread_mutex_unlock(&e->lock);
    if (stopped) {
        finish_ok(e, j, 0);
        return 1;
    }
    if (j->n_gen >= j->r.max_tokens || j->fed + 1 > e->o.context) {
        finish_ok(e, j, 1);
        return 1;
    }
    j->next_tok = id;
    j->phase = PH_DECODE;
    return 0;
}

static void job_free(srv_job *j) {
    srv_request_free(&j->r);
    if (j->smp_ok) fp4moe_sampler_free(&j->smp);
    if (j->ts_ok) fp4moe_tokenizer_stream_free(&j->ts);
    srv_text_free(&j->text);
    free(j->gen);
    free(j->logits);
    fp4moe_grammar_matcher_free(j->gm);
    free(j->mlog);
    if (j->tsplit_on) srv_tool_split_free(&j->tsplit);
    cJSON_Delete(j->lp);
    cJSON_Delete(j->choice_json);
    fp4moe_snapshot_free(j->psnap);
    free(j->plogits);
    for (int i = 0; j->choice && i < j->n_choice; i++) /* a group: its references on the choices */
        if (j->choice[i] && --j->choice[i]->refs == 0) job_free(j->choice[i]);
    free(j->choice);
    srv_buf_free(&j->echo);
    free(j->echo_off);
    free(j->plog);
    srv_buf_free(&j->acc[0]);
    srv_buf_free(&j->acc[1]);
    srv_buf_free(&j->out);
    free(j);
}

static void job_unref_locked(srv_job *j) {
    if (--j->refs == 0) job_free(j);
}

/* ---- the loop -------------------------------------------------------------------------------------- */

/* 1 when rank rk may take a queued job now: it has the fewest jobs of all ranks (ties: any), e->lock. */
static int least_loaded(const srv_rank *rk) {
    const srv_engine *e = rk->e;
    for (int r = 0; r < e->n_ranks; r++)
        if (e->ranks[r].n_load < rk->n_load) return 0;
    return 1;
}

static void count_http_locked(srv_engine *e, int http);

/* Ends a cancelled job (e->lock held): the client went away (a stream's connection released it, or the HTTP
 * side saw a non-stream client's socket closed: srv_job_cancel). Logged with status 499 (nginx's "client closed
 * request"); a connection still waiting for the whole answer is woken (it then sends an error body to the closed
 * socket and lets go of the job). */
static void finish_cancelled(srv_engine *e, srv_job *j) {
    srv_job *g = j->grp;
    j->fin = 1;
    j->phase = PH_DONE;
    e->finish[2]++;
    log_job(e, j, g->done ? g->http : 499, g->done ? "dropped: its request ended" : "cancelled");
    if (g->done) return;       /* (a choice whose sibling failed) */
    g->http = 499;
    if (!g->r.stream) {
        count_http_locked(e, 499); /* (the HTTP side's reply goes to a closed socket, if it goes at all) */
        srv_error er;
        srv_fail(&er, 499, NULL, "%s", "cancelled: the client closed the connection");
        char *body = srv_error_json(&er);
        g->out.n = 0;
        if (body) srv_buf_add(&g->out, body, strlen(body));
        free(body);
    }
    g->done = 1;
    cancel_siblings(e, j);
    notify(g);
}

/* The engine lets go of a job it has ended (e->lock held): its reference, and a choice's on its group. */
static void engine_drop(srv_job *j) {
    srv_job *g = j->grp;
    job_unref_locked(j);
    if (g != j) job_unref_locked(g);
}

/* The KV tokens (whole pages of `page` tokens) a job is planned to hold in a fixed pool: its prompt and max_tokens
 * when they fit the pool, else its prompt and one page to grow (a request that may run to the context). */
static int64_t kv_plan(const srv_engine *e, const srv_job *j, int64_t page) {
    const int64_t all = j->r.n_ids + j->r.max_tokens + 1;
    const int64_t t = all <= e->o.kv_tokens ? all : j->r.n_ids + 1 + page;
    return (t + page - 1) / page * page;
}

/* One round of rank rk: admissions, then one step of its jobs, or (expert parallelism, no work)
 * one idle round; `events` is e->events as read before the round. */
static void step_once(srv_rank *rk, uint64_t events) {
    srv_engine *e = rk->e;
    /* 1. cancellations and admissions */
    srv_job *adm[256];
    int n_adm = 0;
    pthread_mutex_lock(&e->lock);
    for (int64_t i = 0; i < rk->n_act;) {
        srv_job *j = rk->act[i];
        if (j->cancelled && !j->fin) {
            pthread_mutex_unlock(&e->lock);
            release_seq(j);
            pthread_mutex_lock(&e->lock);
            e->n_running--;
            finish_cancelled(e, j);
        }
        if (j->fin) {
            rk->act[i] = rk->act[--rk->n_act];
            rk->n_load--;
            engine_drop(j);
            continue;
        }
        i++;
    }
    /* a fixed KV pool (--kv-cache-tokens): a job waits in the queue until its planned KV (kv_plan) is free beyond
     * what the running jobs' plans still take (it was admitted and failed with 503 when the pool ran out; vLLM queues
     * too). Alone on the rank it is admitted whatever it needs (it fails if it cannot fit: no deadlock). */
    int64_t page = 0, kv_left = fp4moe_batch_kv_free(rk->b, &page);
    for (int64_t i = 0; kv_left >= 0 && i < rk->n_act; i++) { /* what the running ones will still take */
        const srv_job *r = rk->act[i];
        const int64_t pos = r->seq >= 0 ? fp4moe_batch_pos(rk->b, r->seq) : 0;
        const int64_t held = (pos + page - 1) / page * page, more = kv_plan(e, r, page) - held;
        if (more > 0) kv_left -= more;
    }
    while (e->qhead && rk->n_act + n_adm < e->o.max_seqs && n_adm < 256 && least_loaded(rk)) {
        srv_job *j = e->qhead;
        if (kv_left >= 0 && !j->cancelled) {
            const int64_t need = kv_plan(e, j, page);
            if (need > kv_left && rk->n_act + n_adm > 0) break;
            kv_left -= need;
        }
        e->qhead = j->next;
        if (!e->qhead) e->qtail = NULL;
        e->n_queued--;
        if (j->cancelled) {
            finish_cancelled(e, j);
            engine_drop(j);
            continue;
        }
        e->n_running++;
        rk->n_load++;
        adm[n_adm++] = j;
    }
    pthread_mutex_unlock(&e->lock);
    for (int i = 0; i < n_adm; i++) {
        srv_job *j = adm[i];
        rk->act[rk->n_act++] = j;
        admit(rk, j);
    }
    /* 2. the step: decode rows first, then prefill chunks */
    int64_t n_items = 0, rows = 0, heads = 0;
    const int64_t budget = e->o.max_step_tokens, head_cap = fp4moe_batch_logit_rows(rk->b); /* rows of logits */
    for (int pass = 0; pass < 2; pass++) {
        for (int64_t i = 0; i < rk->n_act && rows < budget; i++) {
            srv_job *j = rk->act[i];
            if (j->fin) continue;
            if (j->phase != (pass == 0 ? PH_DECODE : PH_PREFILL)) continue;
            fp4moe_batch_item *it = &rk->items[n_items];
            memset(it, 0, sizeof *it);
            it->seq = j->seq;
            if (pass == 0) {
                it->tokens = &j->next_tok;
                it->n = 1;
            } else {
                int64_t n = j->r.n_ids - j->fed;
                if (n > budget - rows) n = budget - rows;
                if (j->r.history > j->fed && j->fed + n > j->r.history && j->r.history >= e->o.prefix_min_tokens &&
                    rk->cache_budget > 0)
                    n = j->r.history - j->fed;   /* end a chunk at the history: keep its snapshot */
                if (j->plog && n > j->plog_rows) n = j->plog_rows;
                if (j->plog && n > head_cap - heads) n = head_cap - heads; /* each row returns logits */
                if (n < 1) continue;
                it->tokens = j->r.ids + j->fed;
                it->n = n;
            }
            const int last = pass == 0 || j->fed + it->n == j->r.n_ids;
            const int64_t need = pass == 1 && j->plog ? it->n : last;
            if (heads + need > head_cap) continue;   /* (the logits of this step are all taken: the next one) */
            heads += need;
            if (pass == 1 && j->plog) {   /* echo + logprobs: every row's logits (the last row's choose) */
                it->logits = FP4MOE_LOGITS_ALL;
                it->out_logits = j->plog;
            } else if (last) {
                if (j->logits) {
                    it->logits = FP4MOE_LOGITS_LAST;
                    it->out_logits = j->logits;
                } else {
                    it->out_token = &j->next_tok;
                }
            }
            rk->item_job[n_items++] = j;
            rows += it->n;
        }
    }
    if (n_items == 0) {
        int stepped = 0;
        if (e->n_ranks > 1) {                 /* take part in the others' step, if any */
            if (fp4moe_ep_idle(rk->b, 0, &stepped, NULL))
                fprintf(stderr, "serve: rank %d: %s\n", rk->rank, fp4moe_last_error());
        }
        if (stepped) return;
        pthread_mutex_lock(&e->lock);
        if (!e->stopping && e->events == events) {
            int cancel = 0;
            for (int64_t i = 0; i < rk->n_act; i++) cancel |= rk->act[i]->cancelled;
            if (!cancel && (e->n_ranks > 1 || !e->qhead)) {
                struct timespec ts;
                clock_gettime(CLOCK_REALTIME, &ts);
                ts.tv_nsec += (e->n_ranks > 1 ? 20 : 200) * 1000000L; /* ranks: a short safety net */
                if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
                pthread_cond_timedwait(&e->cv, &e->lock, &ts);
            }
        }
        pthread_mutex_unlock(&e->lock);
        return;
    }
    const double t0 = now_s();
    const int st = fp4moe_batch_step(rk->b, rk->items, n_items);
    const double dt = now_s() - t0;
    pthread_mutex_lock(&e->lock);
    e->steps++;
    histo_add(&e->rows, (double)rows);
    histo_add(&e->step_s, dt);
    pthread_mutex_unlock(&e->lock);
    char msg[320];
    if (st) snprintf(msg, sizeof msg, "the forward failed: %s", fp4moe_last_error());
    for (int64_t k = 0; k < n_items; k++) {
        srv_job *j = rk->item_job[k];
        fp4moe_batch_item *it = &rk->items[k];
        if (!st && it->status == FP4MOE_EOVERFLOW && j->phase == PH_DECODE && j->n_gen > 0) {
            /* a fixed KV pool (--kv-cache-tokens) ran out while this request decoded: its answer so far, finish_reason
             * "length" (as at the context limit), not a 503 that throws the generated text away (a long-context
             * user's trial) */
            if (e->o.log) fprintf(stderr, "serve: %s: %s: the answer ends here (finish_reason length)\n", j->id, it->error);
            finish_ok(e, j, 1);
            continue;
        }
        if (st || it->status) {
            if (!st) snprintf(msg, sizeof msg, "%s", it->error);
            finish_error(e, j, st ? 500 : (it->status == FP4MOE_EOVERFLOW ? 503 : 500), msg);
            continue;
        }
        const int64_t fed0 = j->fed;
        j->fed += it->n;
        if (j->phase == PH_PREFILL) j->n_steps_prefill++;
        if (j->phase == PH_PREFILL && j->plog) { /* echo + logprobs: the prompt tokens that these rows predict */
            for (int64_t q = 0; q < it->n; q++)
                if (fed0 + q + 1 < j->r.n_ids)
                    add_logprob_entry(e, j, j->r.ids[fed0 + q + 1], j->plog + q * e->V, j->echo_off[fed0 + q + 1]);
            if (j->fed == j->r.n_ids) memcpy(j->logits, j->plog + (it->n - 1) * e->V, (size_t)e->V * sizeof(float));
        }
        if (j->phase == PH_PREFILL && j->fed == j->r.history && j->r.history > j->cached) {
            const double t = now_s();
            cache_put(rk, j->seq, j->r.ids, j->r.history, NULL, j->r.history);
            j->ms_snapshot += 1e3 * (now_s() - t);
        }
        if (j->phase == PH_PREFILL && j->fed < j->r.n_ids) continue;
        if (j->phase == PH_PREFILL && j->r.echo) { /* the prompt's text first (with its logprobs, when asked) */
            const srv_delta d = {"", j->echo.p ? j->echo.p : "", 0, j->echo.n};
            pthread_mutex_lock(&e->lock);
            emit(j, &d, NULL);
            notify(j->grp);
            pthread_mutex_unlock(&e->lock);
            if (j->r.max_tokens == 0) {
                finish_ok(e, j, 1);
                continue;
            }
        }
        if (!it->out_token && !it->out_logits) continue;
        if (j->phase == PH_PREFILL && j->grp != j && j->index == 0 && j->grp->pshare) share_prompt(rk, j);
        const int32_t id = job_sample(e, j, j->next_tok);
        if (id < 0) continue;
        fp4moe_sampler_accept_output(&j->smp, id);     /* (a no-op unless a penalty is on) */
        take_token(e, j, id);
    }
}

static void *rank_main(void *arg) {
    srv_rank *rk = arg;
    srv_engine *e = rk->e;
    pthread_mutex_lock(&e->lock);          /* every rank's thread exists before the first round */
    while (!e->go) pthread_cond_wait(&e->cv, &e->lock);
    const int go = e->go;
    pthread_mutex_unlock(&e->lock);
    if (go < 0) return NULL;
    if (e->o.ep_gpus && fp4moe_cuda_set_device(rk->rank))
        fprintf(stderr, "serve: rank %d: %s\n", rk->rank, fp4moe_last_error());
    for (;;) {
        pthread_mutex_lock(&e->lock);
        const int stop = e->stopping;
        const uint64_t events = e->events;
        pthread_mutex_unlock(&e->lock);
        if (stop) break;
        step_once(rk, events);
    }
    /* shutting down: every job still here (and every queued one, taken by whichever rank comes
       first) ends with 503 */
    pthread_mutex_lock(&e->lock);
    while (e->qhead) {
        srv_job *j = e->qhead;
        e->qhead = j->next;
        if (!e->qhead) e->qtail = NULL;
        e->n_queued--;
        rk->act[rk->n_act++] = j; /* act has room: queue entries are bounded by max_queue */
        j->phase = PH_PREFILL;
        e->n_running++;
    }
    pthread_mutex_unlock(&e->lock);
    for (int64_t i = 0; i < rk->n_act; i++) {
        srv_job *j = rk->act[i];
        if (!j->fin) finish_error(e, j, 503, "the server is shutting down");
        pthread_mutex_lock(&e->lock);
        engine_drop(j);
        pthread_mutex_unlock(&e->lock);
    }
    rk->n_act = 0;
    /* expert parallelism: "stopping" until every rank is (the others may still be ending theirs) */
    for (int done = 0; e->n_ranks > 1 && !done;)
        if (fp4moe_ep_idle(rk->b, 1, NULL, &done)) {
            fprintf(stderr, "serve: rank %d: %s\n", rk->rank, fp4moe_last_error());
            break;
        }
    return NULL;
}

/* Decode steps of every row count 1..max_seqs, twice each: the CUDA backend captures a graph per
 * row count on its second sight, so serving never waits for a capture (with a fixed KV pool, which
 * is never regrown: a regrow drops the graphs). One rank only (expert-parallel batches run without
 * graphs). */
static int warmup(srv_rank *rk) {
    srv_engine *e = rk->e;
    const int64_t n = e->o.max_seqs;
    int64_t *seq = malloc((size_t)n * sizeof *seq);
    int32_t *tok = malloc((size_t)n * sizeof *tok);
    int st = seq && tok ? FP4MOE_OK : fp4moe_set_error(FP4MOE_ENOMEM, "serve: out of memory");
    int64_t added = 0;
    for (; !st && added < n; added++) st = fp4moe_batch_add(rk->b, &seq[added]);
    if (st) added--;
    for (int64_t i = 0; !st && i < n; i++) tok[i] = 1;
    for (int64_t r = 1; !st && r <= n; r++)
        for (int rep = 0; !st && rep < 2; rep++) {
            for (int64_t i = 0; i < r; i++) {
                memset(&rk->items[i], 0, sizeof rk->items[i]);
                rk->items[i].seq = seq[i];
                rk->items[i].tokens = &tok[i];
                rk->items[i].n = 1;
                rk->items[i].out_token = &tok[i];
            }
            st = fp4moe_batch_step(rk->b, rk->items, r);
            for (int64_t i = 0; !st && i < r; i++)
                if (rk->items[i].status) st = fp4moe_set_error(rk->items[i].status, "warm-up: %s", rk->items[i].error);
            for (int64_t i = 0; i < r; i++) tok[i] = 1;
        }
    for (int64_t i = 0; i < added; i++) fp4moe_batch_remove(rk->b, seq[i]);
    free(seq);
    free(tok);
    return st;
}

/* ---- public (server) side ---------------------------------------------------------------------------- */

int srv_engine_new(const fp4moe_model *m, const fp4moe_tokenizer *tok, const char *model_name,
                   const srv_engine_options *o, srv_engine **out) {
    *out = NULL;
    const int W = o->ep_ranks > 1 ? o->ep_ranks : 1;
    if (W > 1 && (!o->ep || !o->ep_models))
        return fp4moe_set_error(FP4MOE_EINVAL, "serve: %d expert-parallel ranks need a group and a model each", W);
    srv_engine *e = calloc(1, sizeof *e);
    if (!e) return fp4moe_set_error(FP4MOE_ENOMEM, "serve: out of memory");
    e->m = m;
    e->tok = tok;
    e->o = *o;
    /* mix64 is a bijection of 64-bit words, so ids of one process never repeat; the base differs between
     * processes (time, pid, an address) so that restarted servers do not reuse one another's ids */
    e->id_base = mix64((uint64_t)time(NULL) ^ mix64((uint64_t)getpid()) ^ (uint64_t)(uintptr_t)e);
    e->model_name = strdup(model_name);
    e->V = fp4moe_model_config(m)->vocab;
    e->tok_vocab = fp4moe_tokenizer_vocab_size(tok);
    e->think_open = fp4moe_tokenizer_token_to_id(tok, "<think>");
    e->think_close = fp4moe_tokenizer_token_to_id(tok, "</think>");
    if (fp4moe_grammar_vocab_new(tok, &e->gv)) {
        free(e->model_name);
        free(e);
        return FP4MOE_ENOMEM;
    }
    histo_init(&e->rows, k_row_b, N_ROW_BUCKETS);
    histo_init(&e->ttft, k_ttft_b, N_TIME_BUCKETS);
    histo_init(&e->itl, k_itl_b, N_TIME_BUCKETS);
    histo_init(&e->step_s, k_itl_b, N_TIME_BUCKETS);
    pthread_mutex_init(&e->lock, NULL);
    pthread_cond_init(&e->cv, NULL);
    e->lock_ok = 1;
    e->n_ranks = W;
    e->ranks = calloc((size_t)W, sizeof *e->ranks);
    int st = !e->model_name || !e->ranks ? fp4moe_set_error(FP4MOE_ENOMEM, "serve: out of memory") : FP4MOE_OK;
    const int64_t cap = o->max_seqs + o->max_queue + 1;
    for (int r = 0; !st && r < W; r++) {
        srv_rank *rk = &e->ranks[r];
        rk->e = e;
        rk->rank = r;
        rk->cache_budget = o->prefix_cache_bytes / W;
        rk->act = calloc((size_t)cap, sizeof *rk->act);
        rk->items = calloc((size_t)o->max_seqs, sizeof *rk->items);
        rk->item_job = calloc((size_t)o->max_seqs, sizeof *rk->item_job);
        if (!rk->act || !rk->items || !rk->item_job) {
            st = fp4moe_set_error(FP4MOE_ENOMEM, "serve: out of memory");
            break;
        }
        fp4moe_batch_options bo;
        fp4moe_batch_options_default(&bo);
        bo.max_seqs = o->max_seqs;
        bo.max_step_tokens = o->max_step_tokens;
        bo.max_context = o->context;
        bo.max_kv_tokens = o->kv_tokens;
        bo.device = o->device;
        bo.act_dtype = o->act_dtype;
        bo.cpu_act = o->cpu_act;
        bo.kv_dtype = o->kv_dtype;
        if (W > 1) {
            bo.ep = o->ep;
            bo.ep_rank = r;
        }
        if (o->ep_gpus && (st = fp4moe_cuda_set_device(r))) break;
        st = fp4moe_batch_new(W > 1 ? o->ep_models[r] : m, &bo, &rk->b);
    }
    if (o->ep_gpus) (void)fp4moe_cuda_set_device(0);
    if (!st && o->warmup && W == 1) st = warmup(&e->ranks[0]);
    for (int r = 0; !st && r < W; r++) {
        if (pthread_create(&e->ranks[r].th, NULL, rank_main, &e->ranks[r])) st = fp4moe_set_error(FP4MOE_ENOMEM, "serve: no thread");
        else e->ranks[r].th_ok = 1;
    }
    pthread_mutex_lock(&e->lock);
    e->go = st ? -1 : 1;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->lock);
    if (st) {
        srv_engine_free(e);
        return st;
    }
    *out = e;
    return FP4MOE_OK;
}

void srv_engine_free(srv_engine *e) {
    if (!e) return;
    int threads = 0;
    for (int r = 0; e->ranks && r < e->n_ranks; r++) threads += e->ranks[r].th_ok;
    if (threads) {                  /* (threads that never got go = 1 exit without a round) */
        pthread_mutex_lock(&e->lock);
        e->stopping = 1;
        e->events++;
        pthread_cond_broadcast(&e->cv);
        pthread_mutex_unlock(&e->lock);
        for (int r = 0; r < e->n_ranks; r++)
            if (e->ranks[r].th_ok) pthread_join(e->ranks[r].th, NULL);
    }
    for (int r = 0; e->ranks && r < e->n_ranks; r++) {
        srv_rank *rk = &e->ranks[r];
        while (rk->n_cache) cache_drop(rk, rk->n_cache - 1);
        free(rk->cache);
        fp4moe_batch_free(rk->b);
        free(rk->act);
        free(rk->items);
        free(rk->item_job);
    }
    free(e->ranks);
    if (e->lock_ok) {
        pthread_mutex_destroy(&e->lock);
        pthread_cond_destroy(&e->cv);
    }
    fp4moe_grammar_vocab_free(e->gv);
    free(e->model_name);
    free(e);
}

void srv_engine_shutdown(srv_engine *e) {
    pthread_mutex_lock(&e->lock);
    e->stopping = 1;
    e->events++;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->lock);
}

/* A job of request r (moved in; for a choice of a group: a copy), not yet queued. */
static srv_job *job_new(srv_engine *e, srv_request *r, int copy) {
    srv_job *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    if (copy) {
        if (srv_request_copy(r, &j->r)) {
            free(j);
            return NULL;
        }
    } else {
        j->r = *r;
        memset(r, 0, sizeof *r);
    }
    j->e = e;
    j->seq = -1;
    j->grp = j;
    j->n_choice = 1;
    j->t_submit = now_s();
    j->created = (int64_t)time(NULL);
    return j;
}

srv_job *srv_engine_submit(srv_engine *e, srv_request *r, void (*wake)(void *), void *ctx, srv_error *err) {
    const int per = r->n > 1 ? r->n : 1, np = r->n_prompts > 1 ? r->n_prompts : 1, n = per * np;
    const long long cap = (long long)e->n_ranks * e->o.max_seqs + e->o.max_queue;
    if (n > cap) {
        srv_fail(err, 400, np > 1 ? "prompt" : "n", "%d prompts x 'n' %d: %d sequences; this server runs at most %lld at "
                 "once and in its queue (--max-seqs x ranks + --max-queue)", np, per, n, cap);
        return NULL;
    }
    int64_t prompt_total = r->n_ids, longest = r->n_ids;
    for (int p = 1; p < np; p++) {
        prompt_total += r->more_n[p - 1];
        if (r->more_n[p - 1] > longest) longest = r->more_n[p - 1];
    }
    if (e->o.kv_tokens > 0 && longest + 1 > e->o.kv_tokens) { /* could never be admitted: said now */
        srv_fail(err, 400, "prompt", "the prompt has %lld tokens; this server's KV cache pool holds %lld "
                 "(--kv-cache-tokens)", (long long)longest, (long long)e->o.kv_tokens);
        return NULL;
    }
    srv_job *g = job_new(e, r, 0);
    if (!g) {
        srv_fail(err, 500, NULL, "out of memory");
        return NULL;
    }
    g->wake = wake;
    g->wake_ctx = ctx;
    g->refs = 2;                       /* the HTTP side; the engine (n = 1: g is the job it runs) */
    g->prompt_total = prompt_total;
    int ok = 1;
    if (n > 1) {                       /* the choices: jobs of their own, the engine holding each and g */
        g->refs = 1 + n;
        g->n_choice = n;
        g->pleft = np == 1 ? n - 1 : 0;
        g->pshare = np == 1 && !g->r.echo; /* one prompt: computed once (choice 0), the others start from it */
        ok = (g->choice = calloc((size_t)n, sizeof *g->choice)) != NULL;
        for (int i = 0; ok && i < n; i++) {
            srv_job *c = job_new(e, &g->r, 1);
            if (!(ok = c != NULL)) break;
            srv_request_pick(&c->r, i / per, e->o.context);
            c->grp = g;
            c->index = i;
            c->refs = 2;               /* the engine, the group */
            c->created = g->created;
            if (g->r.has_seed) c->r.sp.seed = g->r.sp.seed + (uint64_t)(i % per) * 0x9E3779B97F4A7C15ull; /* distinct */
            if (!c->r.sp.seed) c->r.sp.seed = 1;
            g->choice[i] = c;
        }
    }
    pthread_mutex_lock(&e->lock);
    if (!ok || e->stopping || e->n_running + e->n_queued + n > cap) {
        const long long q = (long long)e->n_queued, run = (long long)e->n_running;
        const int stopping = e->stopping;
        pthread_mutex_unlock(&e->lock);
        if (!ok) srv_fail(err, 500, NULL, "out of memory");
        else if (stopping) srv_fail(err, 503, NULL, "the server is shutting down");
        else srv_fail(err, 429, NULL, "the server is busy: %lld requests running and %lld waiting, the most it takes "
                      "(%lld: --max-seqs x ranks + --max-queue); retry later", run, q, cap);
        for (int i = 0; g->choice && i < n; i++)
            if (g->choice[i]) g->choice[i]->refs = 1; /* never queued: the group's reference is the only one */
        job_free(g);
        return NULL;
    }
    const unsigned long long id = (unsigned long long)mix64(e->id_base + ++e->n_ids);
    snprintf(g->id, sizeof g->id, "%s-%016llx", g->r.kind == SRV_CHAT ? "chatcmpl" : "cmpl", id);
    for (int i = 0; i < n; i++) {
        srv_job *j = g->choice ? g->choice[i] : g;
        memcpy(j->id, g->id, sizeof j->id);
        if (e->qtail) e->qtail->next = j;
        else e->qhead = j;
        e->qtail = j;
        e->n_queued++;
    }
    e->events++;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->lock);
    return g;
}

size_t srv_job_read(srv_job *j, char *buf, size_t max, int *done, int *waiting) {
    srv_engine *e = j->e;
    pthread_mutex_lock(&e->lock);
    size_t n = j->out.n - j->n_read;
    if (n > max) n = max;
    if (n) memcpy(buf, j->out.p + j->n_read, n);
    j->n_read += n;
    *done = j->done && j->n_read == j->out.n;
    *waiting = n == 0 && !*done;
    pthread_mutex_unlock(&e->lock);
    return n;
}

int srv_job_done(srv_job *j, int *http) {
    pthread_mutex_lock(&j->e->lock);
    const int d = j->done;
    *http = j->http ? j->http : 200;
    pthread_mutex_unlock(&j->e->lock);
    return d;
}

int srv_job_arm(srv_job *j, void (*suspend)(void *), void *ctx) {
    pthread_mutex_lock(&j->e->lock);
    const int ready = j->r.stream ? (j->n_read < j->out.n || j->done) : j->done;
    if (!ready) {
        j->armed = 1;
        suspend(ctx);
    }
    pthread_mutex_unlock(&j->e->lock);
    return ready;
}

/* Marks group g and its running choices cancelled (e->lock held). */
static void cancel_group(srv_job *g) {
    g->cancelled = 1;
    for (int i = 0; g->choice && i < g->n_choice; i++)
        if (!g->choice[i]->fin) g->choice[i]->cancelled = 1;
    g->e->events++;
    pthread_cond_broadcast(&g->e->cv);
}

void srv_job_cancel(srv_job *j) {
    pthread_mutex_lock(&j->e->lock);
    if (!j->done) cancel_group(j); /* the wake stays armed: the engine wakes the waiting connection when it has
                                      dropped the job */
    pthread_mutex_unlock(&j->e->lock);
}

void srv_job_release(srv_job *j) {
    if (!j) return;
    srv_engine *e = j->e;
    pthread_mutex_lock(&e->lock);
    if (!j->done) {
        cancel_group(j);
        j->armed = 0;
    }
    j->wake = NULL;
    job_unref_locked(j);
    pthread_mutex_unlock(&e->lock);
}

static void count_http_locked(srv_engine *e, int http) {
    int i = 0;
    while (i < e->n_codes && e->http_code[i] != http) i++;
    if (i == e->n_codes && e->n_codes < 16) e->http_code[e->n_codes++] = http;
    if (i < 16) e->http_count[i]++;
}

void srv_engine_count_http(srv_engine *e, int http) {
    if (http == 499) return; /* counted by the engine when it cancels (no response reaches a client that left) */
    pthread_mutex_lock(&e->lock);
    count_http_locked(e, http);
    pthread_mutex_unlock(&e->lock);
}

void srv_engine_load(srv_engine *e, int64_t *queued, int64_t *running) {
    pthread_mutex_lock(&e->lock);
    *queued = e->n_queued;
    *running = e->n_running;
    pthread_mutex_unlock(&e->lock);
}

static void put_histo(srv_buf *b, const char *name, const char *help, const histo *h) {
    srv_buf_printf(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    for (int i = 0; i < h->nb; i++) srv_buf_printf(b, "%s_bucket{le=\"%g\"} %llu\n", name, h->b[i], (unsigned long long)h->count[i]);
    srv_buf_printf(b, "%s_bucket{le=\"+Inf\"} %llu\n%s_sum %.6f\n%s_count %llu\n", name, (unsigned long long)h->n, name,
        h->sum, name, (unsigned long long)h->n);
}

char *srv_engine_metrics(srv_engine *e) {
    srv_buf b = {0};
    pthread_mutex_lock(&e->lock);
    size_t cache_bytes = 0;
    int64_t n_cache = 0;
    for (int r = 0; r < e->n_ranks; r++) {
        cache_bytes += e->ranks[r].cache_bytes;
        n_cache += e->ranks[r].n_cache;
    }
    srv_buf_printf(&b, "# HELP fp4moe_requests_total HTTP responses by status code (a stream counts 200 when its headers go "
                       "out, also if its client leaves later: fp4moe_generations_total{reason=\"cancelled\"} counts "
                       "those; 499: a non-stream client that left).\n# TYPE fp4moe_requests_total counter\n");
    for (int i = 0; i < e->n_codes; i++)
        srv_buf_printf(&b, "fp4moe_requests_total{code=\"%d\"} %llu\n", e->http_code[i], (unsigned long long)e->http_count[i]);
    static const char *const fin[] = {"stop", "length", "cancelled", "error"};
    srv_buf_printf(&b, "# HELP fp4moe_generations_total Generations ended, by reason.\n# TYPE fp4moe_generations_total counter\n");
    for (int i = 0; i < 4; i++)
        srv_buf_printf(&b, "fp4moe_generations_total{reason=\"%s\"} %llu\n", fin[i], (unsigned long long)e->finish[i]);
    srv_buf_printf(&b,
        "# HELP fp4moe_prompt_tokens_total Prompt tokens of admitted requests (once for the choices of a request that "
        "start from the state of its choice 0).\n# TYPE fp4moe_prompt_tokens_total counter\n"
        "fp4moe_prompt_tokens_total %llu\n"
        "# HELP fp4moe_prompt_tokens_cached_total Prompt tokens restored from the prefix cache instead of computed.\n"
        "# TYPE fp4moe_prompt_tokens_cached_total counter\nfp4moe_prompt_tokens_cached_total %llu\n"
        "# HELP fp4moe_generation_tokens_total Tokens generated.\n# TYPE fp4moe_generation_tokens_total counter\n"
        "fp4moe_generation_tokens_total %llu\n"
        "# HELP fp4moe_steps_total Batch steps run.\n# TYPE fp4moe_steps_total counter\nfp4moe_steps_total %llu\n"
        "# HELP fp4moe_queue_depth Requests waiting for a sequence slot.\n# TYPE fp4moe_queue_depth gauge\n"
        "fp4moe_queue_depth %lld\n"
        "# HELP fp4moe_running_sequences Requests being computed.\n# TYPE fp4moe_running_sequences gauge\n"
        "fp4moe_running_sequences %lld\n"
        "# HELP fp4moe_prefix_cache_bytes Bytes held by kept snapshots.\n# TYPE fp4moe_prefix_cache_bytes gauge\n"
        "fp4moe_prefix_cache_bytes %zu\n"
        "# HELP fp4moe_prefix_cache_entries Kept snapshots.\n# TYPE fp4moe_prefix_cache_entries gauge\n"
        "fp4moe_prefix_cache_entries %lld\n"
        "# HELP fp4moe_ranks Expert-parallel ranks, each with its own requests (1: none).\n# TYPE fp4moe_ranks gauge\n"
        "fp4moe_ranks %d\n",
        (unsigned long long)e->prompt_tokens, (unsigned long long)e->cached_tokens, (unsigned long long)e->gen_tokens,
        (unsigned long long)e->steps, (long long)e->n_queued, (long long)e->n_running, cache_bytes,
        (long long)n_cache, e->n_ranks);
    if (e->n_ranks > 1) {
        srv_buf_printf(&b, "# HELP fp4moe_rank_sequences Requests held by each expert-parallel rank.\n"
                       "# TYPE fp4moe_rank_sequences gauge\n");
        for (int r = 0; r < e->n_ranks; r++)
            srv_buf_printf(&b, "fp4moe_rank_sequences{rank=\"%d\"} %lld\n", r, (long long)e->ranks[r].n_load);
    }
    put_histo(&b, "fp4moe_batch_rows", "Token rows per batch step.", &e->rows);
    put_histo(&b, "fp4moe_step_seconds", "Wall time of one batch step (forward + outputs).", &e->step_s);
    put_histo(&b, "fp4moe_time_to_first_token_seconds", "Time from request to its first token.", &e->ttft);
    put_histo(&b, "fp4moe_inter_token_latency_seconds", "Time between consecutive tokens of a request.", &e->itl);
    pthread_mutex_unlock(&e->lock);
    return b.p;
}
