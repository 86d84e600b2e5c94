/* Internal: fp4moe serve, the OpenAI-compatible HTTP server. Built on the public API only
 * (fp4moe/model.h batch + sampler, fp4moe/tokenizer.h, fp4moe/template.h); HTTP by libmicrohttpd.
 *
 *   srv_request.c  request JSON -> validated srv_request (pure: no model, no I/O; fuzzed)
 *   srv_text.c     generated text -> stop strings + reasoning/content split (pure)
 *   srv_engine.c   the engine thread: continuous batching over one fp4moe_batch, prefix cache
 *   srv_http.c     libmicrohttpd daemon: routes, auth, body limit, SSE, metrics
 *
 * Error bodies follow OpenAI: {"error": {"message", "type", "param", "code"}}. */
#ifndef FP4MOE_SRV_H
#define FP4MOE_SRV_H

#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "fp4moe/grammar.h"
#include "fp4moe/model.h"
#include "fp4moe/template.h"
#include "fp4moe/tokenizer.h"

#define SRV_MAX_STOP 16          /* stop strings per request (OpenAI allows 4; vLLM more) */
#define SRV_MAX_STOP_LEN 256     /* bytes per stop string */

/* ---- growable byte buffers (every text the server builds) ------------------------------------ */

typedef struct {
    char *p;                     /* NUL-terminated when non-NULL */
    size_t n, cap;
} srv_buf;

/* Appends n bytes (keeps a NUL after them). Returns 0, or -1 when out of memory (b unchanged). */
int srv_buf_add(srv_buf *b, const void *s, size_t n);
/* Room for `extra` more bytes (+ the NUL) without moving. Returns 0 or -1. */
int srv_buf_reserve(srv_buf *b, size_t extra);
/* Appends printf output. Returns 0 or -1. */
int srv_buf_printf(srv_buf *b, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void srv_buf_free(srv_buf *b);

/* Appends bytes s[0..n) as valid UTF-8 (RFC 3629): each maximal invalid subsequence becomes one U+FFFD, as
 * Rust's String::from_utf8_lossy and Python's bytes.decode("utf-8", "replace") (a token's text in logprobs: a
 * token may hold part of a character). Returns the code points appended, or -1 when out of memory. */
int64_t srv_utf8_lossy(srv_buf *b, const char *s, size_t n);

/* ---- errors --------------------------------------------------------------------------------- */

typedef struct {
    int http;                    /* 400, 401, 404, 413, 429, 500, 503 */
    const char *type;            /* "invalid_request_error", "authentication_error", ... (static) */
    char param[64];              /* the request field, "" when none */
    const char *code;            /* OpenAI "code" (static) or NULL */
    char message[512];
} srv_error;

/* Fills e and returns -1 (so parsers can `return srv_fail(...)`). */
int srv_fail(srv_error *e, int http, const char *param, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;
/* The OpenAI error body of e, malloc'd JSON text. */
char *srv_error_json(const srv_error *e);

typedef enum {
    SRV_TOOLS_NONE = 0,
    SRV_TOOLS_XML = 1,  /* <tool_call><function=NAME><parameter=P>VALUE</parameter></function></tool_call> */
    SRV_TOOLS_JSON = 2  /* <TOOLCALL>[{"name": ..., "arguments": {...}}]</TOOLCALL> */
} srv_tool_format;


/* ---- requests ------------------------------------------------------------------------------- */

typedef enum { SRV_CHAT = 0, SRV_COMPLETION = 1 } srv_kind;

/* What the parser needs from the server (all borrowed). */
typedef struct {
    const char *model_name;            /* the served name (/v1/models) */
    const fp4moe_tokenizer *tok;
    const fp4moe_template *tmpl;       /* NULL: chat requests are refused with a clear error */
    const char *chat_template;         /* its source (GET /tokenizer_info), NULL when none */
    const char *bos_token, *eos_token; /* strings for the template context ("" when unknown) */
    const char *pad_token;             /* tokenizer_config.json's (GET /tokenizer_info; NULL or "": none) */
    int64_t vocab;                     /* the model's vocabulary (ids of completion prompts) */
    int64_t context;                   /* tokens per sequence: prompt + output */
    fp4moe_sampler_params defaults;    /* sampling when the request says nothing (+ stop ids) */
    int reasoning;                     /* split <think>...</think> into reasoning_content */
    srv_tool_format tools;             /* how the model writes tool calls (chat requests with tools: the
                                          answer's calls become tool_calls); SRV_TOOLS_NONE: left as content */
} srv_parse_ctx;

/* A compiled structured-output grammar, shared by a request's copies (its choices): refs counted atomically. */
typedef struct {
    fp4moe_grammar *g;
    int refs;
    int json;                          /* 1: JSON (a schema / json_object); 0: guided_choice text */
} srv_grammar;

typedef struct {
    srv_kind kind;
    int stream, include_usage, ignore_eos;
    int continuous_usage;              /* stream_options.continuous_usage_stats (with include_usage): usage in every chunk */
    int has_seed;                      /* the request gave a seed (else the engine draws one) */
    int64_t max_tokens;                /* after defaults: >= 1 (>= 0 with echo), prompt + max_tokens <= context */
    fp4moe_sampler_params sp;
    char *stop[SRV_MAX_STOP];          /* stop strings (malloc'd) */
    int n_stop;
    int32_t *ids;                      /* prompt token ids (malloc'd) */
    int64_t n_ids;
    int64_t history;                   /* chat: prompt tokens before the generation prompt (a
                                          prefix-cache point), else 0 */
    int reasoning_start;               /* 1: the output starts inside <think> (the prompt opened
                                          it); 0: in content */
    int reasoning;                     /* split reasoning at all (chat and ctx->reasoning) */
    int logprobs;                      /* return each output token's log-probability (chat
                                          logprobs true, completion logprobs given) */
    int top_logprobs;                  /* and its most likely alternatives: 0..SRV_MAX_TOP_LOGPROBS */
    int tokens_as_ids;                 /* vLLM's return_tokens_as_token_ids: tokens as "token_id:N" */
    int n;                             /* choices: 1..SRV_MAX_N, each its own sequence and sampler (seed
                                          + i when a seed is given) */
    int n_prompts;                     /* completion: prompts (a list of prompts: choice p x n + k is
                                          choice k of prompt p); ids / n_ids hold prompt 0 */
    int32_t **more_ids;                /* prompts 1.. (malloc'd), more_n[p - 1] tokens each */
    int64_t *more_n;
    int has_max;                       /* max_tokens was given (2: as max_completion_tokens; 0: srv_default_max_tokens
                                          for each prompt) */
    int64_t truncate;                  /* truncate_prompt_tokens: keep each prompt's last `truncate` tokens (0: no) */
    int echo;                          /* completion: the prompt's text (and with logprobs its tokens'
                                          log-probabilities, the first one null) before the output;
                                          max_tokens may then be 0 */
    int32_t *bias_ids;                 /* logit_bias (malloc'd; sp.bias_ids / sp.bias point here) */
    float *bias;
    srv_tool_format tools_fmt;         /* chat with tools (tool_choice auto): the answer's calls in this format
                                          become tool_calls; SRV_TOOLS_NONE: none */
    char *tools_json;                  /* the request's tools (JSON text, malloc'd): the parameters' types */
    char *chat_text;                   /* a chat request's rendered prompt (malloc'd; POST /apply-template) */
    size_t chat_text_len;
    char *tool_forced;                 /* tool_choice naming a function (malloc'd): the output is its arguments
                                          (grammar: its parameters schema), returned as that one call */
    int tool_single;                   /* parallel_tool_calls false: the first call only */
    int tool_required;                 /* tool_choice "required": the output is [{"name", "parameters"}, ...]
                                          (grammar: fp4moe_grammar_from_tools), returned as those calls */
    srv_grammar *grammar;              /* structured output (response_format json_object / json_schema, vLLM's
                                          guided_json / guided_choice / structured_outputs): the output is
                                          constrained to it (after the reasoning, when the output starts in it);
                                          NULL: free text */
} srv_request;

#define SRV_MAX_TOP_LOGPROBS 20        /* vLLM's default max_logprobs */
#define SRV_MAX_N 64                   /* choices of one request */
#define SRV_MAX_LOGIT_BIAS 4096        /* entries of logit_bias */

/* The byte offset of a NUL character in a JSON text (a raw 0 byte or the escape \u0000), or -1. */
long long srv_json_nul_at(const char *body, size_t len);
/* The brackets of a JSON text p[0..n), strings skipped: the offset just past where the first array / object closes
 * (0: none closes); *deepest (may be NULL): the greatest nesting depth up to there (or in the whole text). */
size_t srv_json_span(const char *p, size_t n, size_t *deepest);
/* A JSON string of n bytes of UTF-8 that may hold NUL bytes (written as \u0000; cJSON's strings end at the first):
 * a cJSON string, or a raw item of the escaped literal. NULL when out of memory. */
cJSON *srv_json_string(const char *s, size_t n);

/* Parses and validates one request body (len bytes of JSON) of kind `kind`. Chat: renders the
 * messages with the template (tools, chat_template_kwargs, add_generation_prompt true) and
 * tokenizes without adding special tokens (the template writes them, as transformers'
 * apply_chat_template); completion: `prompt` is a string (encoded with the tokenizer's special
 * tokens, as vLLM does), a list of token ids, or a list holding one of those.
 * Returns 0 with *out filled (free with srv_request_free) or -1 with *err (4xx). */
int srv_parse_request(const srv_parse_ctx *ctx, srv_kind kind, const char *body, size_t len,
                      srv_request *out, srv_error *err);
void srv_request_free(srv_request *r);
/* A deep copy of a parsed request (*b owns its own arrays; sp's bias pointers point at them). Returns 0, or -1 when
 * out of memory (*b then holds nothing). */
int srv_request_copy(const srv_request *a, srv_request *b);
/* Makes prompt p of r its only prompt (the others freed), with its own default max_tokens (srv_default_max_tokens,
 * unless max_tokens was given) and repetition window. */
void srv_request_pick(srv_request *r, int p, int64_t context);
/* The max_tokens of a request that gives none (tokens): chat, context - r->n_ids (vLLM); completions, 16 (the OpenAI
 * legacy Completions API's and vLLM's default), at most context - r->n_ids. */
int64_t srv_default_max_tokens(const srv_request *r, int64_t context);

/* ---- vLLM's tokenizer endpoints (lm-evaluation-harness's remote tokenizer) -------------------------------- */

/* POST /tokenize: {"prompt": TEXT, "add_special_tokens": bool (default true)} or {"messages": [...] (rendered by
 * the chat template as a chat request is, "add_generation_prompt" default true), "add_special_tokens" (default
 * false)}, "return_token_strs" (the tokens' vocab strings), "model" (the served name, else 404) -> {"count",
 * "max_model_len", "tokens", "token_strs"}. POST /detokenize: {"tokens": [ids]} -> {"prompt": TEXT} (special tokens
 * kept, as vLLM). A NUL character in any string is a 400 (as every request). Each returns 0 with *out (malloc'd
 * JSON) or -1 with *err (4xx). */
int srv_tokenize(const srv_parse_ctx *c, const char *body, size_t len, char **out, srv_error *err);
int srv_detokenize(const srv_parse_ctx *c, const char *body, size_t len, char **out, srv_error *err);
/* POST /apply-template (llama.cpp's server): the body of a chat request (messages, tools, chat_template_kwargs,
 * add_generation_prompt, continue_final_message) -> {"prompt": the text the chat template renders for it}, exactly
 * what /v1/chat/completions would tokenize. Errors as /tokenize's (400 naming the template's error). */
int srv_apply_template(const srv_parse_ctx *c, const char *body, size_t len, char **out, srv_error *err);
/* GET /tokenizer_info: {"tokenizer_class", "bos_token", "eos_token", "pad_token", "model_max_length",
 * "chat_template"} (null where unknown), malloc'd JSON (NULL: out of memory). */
char *srv_tokenizer_info(const srv_parse_ctx *c);

/* ---- tool calls in a chat answer (srv_tools.c) ------------------------------------------------------------ */

/* The format a chat template asks for (from its text: "<function=" with "<parameter=", or "<TOOLCALL>"). */
srv_tool_format srv_tool_format_of_template(const char *src);

/* Content -> (content before the first call marker, the calls' text). Content that could still begin a marker is
 * held back; after a marker everything goes to `calls`. */
typedef struct {
    srv_tool_format fmt;
    int in_calls;
    srv_buf held, calls;
} srv_tool_split;
void srv_tool_split_init(srv_tool_split *t, srv_tool_format fmt);
/* Appends to `content` what passed; 0, or -1 when out of memory. */
int srv_tool_split_feed(srv_tool_split *t, const char *s, size_t n, srv_buf *content);
/* The end of the answer: the held-back text is content after all. */
int srv_tool_split_flush(srv_tool_split *t, srv_buf *content);
void srv_tool_split_free(srv_tool_split *t);
/* The calls of text (the calls' text of a split) as an OpenAI tool_calls array ({"id": "call_...", "type":
 * "function", "function": {"name", "arguments": JSON text}}); tools: the request's tools (the parameters' types),
 * may be NULL; cut: the answer was cut by max_tokens - only the calls that were closed count (a call cut in its
 * arguments would otherwise read as a whole one with other values); rng: the ids' state. NULL when no call parses
 * (the text is then content). */
cJSON *srv_tool_calls_parse(srv_tool_format fmt, const char *text, size_t n, const cJSON *tools, int cut,
                            uint64_t *rng);
/* A tool call id: "call_" + 24 hex digits from the state *rng (advanced). */
void srv_tool_call_id(char out[32], uint64_t *rng);
/* tool_choice "required": the output [{"name": N, "parameters": {...}}, ...] as a tool_calls array; an output cut
 * short (max_tokens) gives its complete leading calls (NULL: not such an array, or not one call complete). */
cJSON *srv_tool_calls_required(const char *text, size_t n, uint64_t *rng);

/* ---- generated text: stop strings and the reasoning split ------------------------------------ */

/* Feeds the detokenized output of one request through (1) the stop strings (matched anywhere in
 * the whole generated text, as vLLM/OpenAI: the text from the match on is dropped and the request
 * ends), holding back the bytes that could start a stop string; (2) the reasoning split (text
 * before "</think>" is reasoning when the request starts inside <think>, or when the output
 * itself opens with "<think>"; the tags are not returned), holding back a possible partial tag. */
typedef struct {
    char *stop[SRV_MAX_STOP];          /* borrowed */
    int n_stop;
    size_t max_stop;                   /* longest stop string */
    srv_buf all;                       /* every byte generated so far (stop matching) */
    size_t released;                   /* bytes of all passed on to the split */
    int stopped;                       /* a stop string matched: nothing more is accepted */
    int split;                         /* reasoning split on */
    int in_reasoning, content_started;
    srv_buf pend;                      /* released bytes the split still holds back */
    srv_buf out_r, out_c;              /* the output of the last call (reasoning, content) */
} srv_text;

/* The output of one feed: views valid until the next call. */
typedef struct {
    const char *reasoning, *content;
    size_t n_reasoning, n_content;
} srv_delta;

void srv_text_init(srv_text *t, char *const *stop, int n_stop, int split, int reasoning_start);
void srv_text_free(srv_text *t);
/* Accepts n bytes of generated text; *d receives what became final. Returns 1 when a stop string
 * matched (the request is done; *d holds the text before the match), else 0, -1 on ENOMEM. */
int srv_text_feed(srv_text *t, const char *s, size_t n, srv_delta *d);
/* The end of the output: everything still held back. */
int srv_text_finish(srv_text *t, srv_delta *d);
/* 1 when t holds back none of the bytes fed so far (every one was returned, or dropped as a tag / after a stop). */
int srv_text_idle(const srv_text *t);

/* ---- the engine ----------------------------------------------------------------------------- */

typedef struct srv_engine srv_engine;
typedef struct srv_job srv_job;

typedef struct {
    int64_t max_seqs, max_step_tokens, max_queue, context;
    int64_t prefix_cache_bytes;        /* 0: no prefix cache */
    int64_t prefix_min_tokens;         /* shortest prefix worth a snapshot */
    int64_t kv_tokens;                 /* KV pool tokens over all sequences; 0: grown on demand */
    int warmup;                        /* CUDA: run decode steps of 1..max_seqs rows first (graphs) */
    int log;                           /* one line per finished request on stderr */
    fp4moe_device device;
    fp4moe_dtype act_dtype;
    fp4moe_cpu_act cpu_act;     /* CPU: float or q8 (W4A8) */
    fp4moe_kv_dtype kv_dtype;   /* KV cache storage (FP8: CPU) */
    /* expert parallelism (docs/EP.md): ep_ranks > 1 ranks of group ep, rank r on model ep_models[r]
       (its share of the experts, on its device); max_seqs and max_step_tokens are per rank, the
       prefix cache is split over them; no CUDA graph warm-up (EP batches run without graphs) */
    int ep_ranks;
    fp4moe_ep_group *ep;
    const fp4moe_model *const *ep_models;
    int ep_gpus;                       /* 1: rank r on CUDA device r (its model's; NCCL group) */
} srv_engine_options;

/* The engine: one thread per rank (one without expert parallelism), each with its own batch on
 * its model (m, or ep_models[r]). The HTTP layer reads jobs' output through srv_job_read. Errors:
 * fp4moe_batch_new's, FP4MOE_EINVAL (ep_ranks > 1 without a group or models), FP4MOE_ENOMEM. */
int srv_engine_new(const fp4moe_model *m, const fp4moe_tokenizer *tok, const char *model_name,
                   const srv_engine_options *o, srv_engine **out);
/* Stops the engine thread (pending jobs end with an error) and frees it. */
void srv_engine_free(srv_engine *e);
/* Asks the engine to stop: new submissions get 503, every job ends with a 503 error. */
void srv_engine_shutdown(srv_engine *e);

/* Hands a parsed request to the engine (ownership of *r moves into the job; r is zeroed).
 * `wake(ctx)` is called (engine thread, no lock held by the caller's side) whenever the job has
 * new output or is done. Returns the job (a reference owned by the caller: srv_job_release) or
 * NULL with *err (429 queue full, 503 shutting down). */
srv_job *srv_engine_submit(srv_engine *e, srv_request *r, void (*wake)(void *ctx), void *ctx,
                           srv_error *err);
/* Copies up to max bytes of the job's pending output (SSE bytes for a stream, the JSON body when
 * done otherwise) to buf; *done = 1 when the job has finished and everything was read. Returns the
 * bytes copied. *waiting = 1 when nothing is available yet (the caller should wait for wake). */
size_t srv_job_read(srv_job *j, char *buf, size_t max, int *done, int *waiting);
/* 1 when the job has finished (non-stream: the body is complete); *http the status to send. */
int srv_job_done(srv_job *j, int *http);
/* The client went away while the connection still holds the job (a non-stream client's socket seen closed):
 * the engine drops the job at its next step (freeing its sequence), logs it (499, "cancelled") and, when the
 * connection is waiting (srv_job_arm), wakes it; srv_job_done then gives 499 and an error body. No-op on a
 * finished job. (srv_job_release cancels too, for a connection that lets go of an unfinished job.) */
void srv_job_cancel(srv_job *j);
/* Arms the wake-up: returns 1 when output is already available (do not wait); else calls
 * suspend(ctx) (MHD_suspend_connection) under the engine lock, so that the engine's next output
 * (or the end, for a non-stream job) calls wake only after it, and returns 0. */
int srv_job_arm(srv_job *j, void (*suspend)(void *), void *ctx);
void srv_job_release(srv_job *j);

/* Prometheus text of the engine's metrics (malloc'd); `http_codes` counters are appended by the
 * HTTP layer's own lines. */
char *srv_engine_metrics(srv_engine *e);
/* Counts one HTTP response by status code (for /metrics); 499 (a non-stream client that left) is counted by the engine
 * when it cancels the job, not here. */
void srv_engine_count_http(srv_engine *e, int http);
/* Queue depth and running sequences (for /health). */
void srv_engine_load(srv_engine *e, int64_t *queued, int64_t *running);

/* ---- the HTTP server ------------------------------------------------------------------------ */

typedef struct {
    const char *host;                  /* "127.0.0.1" */
    int port;                          /* 0: an ephemeral port (printed) */
    const char *api_key;               /* NULL: no auth */
    const char *allowed_origins;       /* CORS: "*" (any origin), a comma-separated list of origins, or NULL / "": off */
    int log_errors;                    /* 1: a line on stderr per 4xx / 5xx answer of the HTTP side */
    int64_t max_body;                  /* bytes */
    int http_threads;
    const volatile int *stop;          /* set by a signal handler: shut down */
} srv_http_options;

/* Checks before the model loads that host:port can be bound (a socket bound and closed again; port 0: the host
 * resolved only), so that a busy port fails at once. Errors: FP4MOE_EINVAL (host), FP4MOE_EIO with the system's reason. */
int srv_http_probe(const char *host, int port);

/* Serves until *o->stop. Prints "listening on http://HOST:PORT" on stdout when ready.
 * Returns 0, or -1 with fp4moe_last_error() set (bind failure). */
int srv_http_run(const srv_http_options *o, srv_engine *e, const srv_parse_ctx *pc);

#endif
