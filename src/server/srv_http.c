/* The HTTP side of fp4moe serve over libmicrohttpd (srv.h): routes, API key, body limit, SSE.
 *
 * A daemon with an internal polling thread pool and suspend/resume: a request waiting for the
 * engine (a non-stream answer, or the next chunk of a stream) suspends its connection inside the
 * engine lock (srv_job_arm), and the engine resumes it when output arrives. A stream's response
 * is a content-reader callback; when the client goes away MHD frees the response and the job is
 * cancelled (its sequence is freed at the engine's next step). Suspended connections are not
 * watched by MHD, so a stream's disconnect is seen at its next write (within one engine step), and a
 * non-stream client waiting for its whole answer is watched by a thread of ours (watch_main: its socket
 * polled for the peer's close every WATCH_MS; then srv_job_cancel). */
#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "server/srv.h"

#define WATCH_MS 100 /* how often the sockets of non-stream clients waiting for their answer are polled */

struct conn_ctx;

typedef struct {
    srv_engine *e;
    const srv_parse_ctx *pc;
    const srv_http_options *o;
    atomic_int suspended;
    atomic_int attached;   /* jobs held by a connection (stream or not), until the connection releases them */
    atomic_int stopping;
    /* non-stream connections waiting for their job (watch_main) */
    pthread_mutex_t wlock;
    struct conn_ctx *watched; /* a list through conn_ctx.wnext / wprev (wlock) */
    int wstop;                /* wlock */
} srv_http;

/* Both per-connection contexts start with these, so one wake function serves them. */
typedef struct {
    srv_http *h;
    struct MHD_Connection *c;
} wake_ctx;

typedef struct conn_ctx {
    wake_ctx w;
    srv_buf body;
    int too_big, answered;
    srv_job *job;                 /* non-stream job waiting for its body */
    /* in h->watched while the job runs (wlock): the socket, and whether the job was cancelled */
    struct conn_ctx *wnext, *wprev;
    int watched, fd, cancelled;
} conn_ctx;

typedef struct {
    wake_ctx w;
    srv_job *job;
} stream_ctx;

static void do_suspend(void *ctx) {
    wake_ctx *w = ctx;
    atomic_fetch_add(&w->h->suspended, 1);
    MHD_suspend_connection(w->c);
}

static void do_wake(void *ctx) {
    wake_ctx *w = ctx;
    atomic_fetch_sub(&w->h->suspended, 1);
    MHD_resume_connection(w->c);
}

/* CORS (the Fetch standard's CORS protocol): the Access-Control-Allow-Origin value for this request - "*" when every
 * origin is allowed, the request's Origin when it is in --allowed-origins' list - or NULL (no Origin header, CORS
 * off, an origin not listed). vLLM allows every origin by default (--allowed-origins '["*"]'). */
static const char *cors_origin(const srv_http *h, struct MHD_Connection *c) {
    const char *list = h->o->allowed_origins;
    if (!list || !*list) return NULL;
    const char *origin = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Origin");
    if (!origin || !*origin) return NULL;
    if (!strcmp(list, "*")) return "*";
    const size_t n = strlen(origin);
    for (const char *p = list; *p;) {
        while (*p == ' ' || *p == ',') p++;
        const char *e = p;
        while (*e && *e != ',') e++;
        const char *t = e;
        while (t > p && t[-1] == ' ') t--;
        if ((size_t)(t - p) == n && !strncmp(p, origin, n)) return origin;
        p = e;
    }
    return NULL;
}

static void add_cors(const srv_http *h, struct MHD_Connection *c, struct MHD_Response *r) {
    const char *o = cors_origin(h, c);
    if (!o) return;
    MHD_add_response_header(r, "Access-Control-Allow-Origin", o);
    if (strcmp(o, "*")) MHD_add_response_header(r, "Vary", "Origin");
}

/* The request being answered on this HTTP thread (its method and path), for the error lines (log_errors). */
static _Thread_local const char *t_method, *t_url;

/* allow: the Allow header of a 405 (RFC 9110 section 15.5.6: the methods the route takes), or NULL */
static enum MHD_Result respond_allow(srv_http *h, struct MHD_Connection *c, int status, const char *type, char *body,
                                     size_t len, const char *allow) {
    if (status >= 400 && h->o->log_errors) { /* failed requests are logged too, with the client's address */
        char addr[64] = "?";
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
        if (ci && ci->client_addr) {
            const struct sockaddr *sa = ci->client_addr;
            if (sa->sa_family == AF_INET)
                inet_ntop(AF_INET, &((const struct sockaddr_in *)(const void *)sa)->sin_addr, addr, sizeof addr);
            else if (sa->sa_family == AF_INET6)
                inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)(const void *)sa)->sin6_addr, addr, sizeof addr);
        }
        fprintf(stderr, "serve: %s %s %s %d: %.*s\n", addr, t_method ? t_method : "?", t_url ? t_url : "?", status,
                (int)(len < 300 ? len : 300), body);
    }
    struct MHD_Response *r = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", type);
    if (status == 401) MHD_add_response_header(r, "WWW-Authenticate", "Bearer");
    if (status == 429) MHD_add_response_header(r, "Retry-After", "1"); /* busy: the queue moves within seconds */
    if (allow) MHD_add_response_header(r, "Allow", allow);
    add_cors(h, c, r);
    const enum MHD_Result ok = MHD_queue_response(c, (unsigned)status, r);
    MHD_destroy_response(r);
    srv_engine_count_http(h->e, status);
    return ok;
}

static enum MHD_Result respond(srv_http *h, struct MHD_Connection *c, int status, const char *type, char *body,
                               size_t len) {
    return respond_allow(h, c, status, type, body, len, NULL);
}

static enum MHD_Result respond_error(srv_http *h, struct MHD_Connection *c, const srv_error *er) {
    char *s = srv_error_json(er);
    if (!s) return MHD_NO;
    return respond(h, c, er->http, "application/json", s, strlen(s));
}

static enum MHD_Result fail(srv_http *h, struct MHD_Connection *c, int http, const char *fmt, const char *arg) {
    srv_error er;
    srv_fail(&er, http, NULL, fmt, arg);
    return respond_error(h, c, &er);
}

/* 405 for a route that takes only `allow` ("GET, HEAD" or "POST"): the error body and the Allow header */
static enum MHD_Result fail_method(srv_http *h, struct MHD_Connection *c, const char *allow, const char *fmt,
                                   const char *arg) {
    srv_error er;
    srv_fail(&er, 405, NULL, fmt, arg);
    char *s = srv_error_json(&er);
    return s ? respond_allow(h, c, 405, "application/json", s, strlen(s), allow) : MHD_NO;
}

/* ---- SSE ---------------------------------------------------------------------------------------- */

static ssize_t sse_read(void *cls, uint64_t pos, char *buf, size_t max) {
    stream_ctx *s = cls;
    int done = 0, waiting = 0;
    const size_t n = srv_job_read(s->job, buf, max, &done, &waiting);
    if (n) return (ssize_t)n;
    if (done) return MHD_CONTENT_READER_END_OF_STREAM;
    srv_job_arm(s->job, do_suspend, &s->w);   /* suspended unless output arrived meanwhile */
    return 0;
}

/* A connection lets go of its job (srv_job_release: cancels it when unfinished) and of the count
 * shutdown waits on. */
static void release_job(srv_http *h, srv_job *j) {
    srv_job_release(j);
    atomic_fetch_sub(&h->attached, 1);
}

static void sse_free(void *cls) {
    stream_ctx *s = cls;
    release_job(s->w.h, s->job);   /* cancels the job when it has not finished (client gone) */
    free(s);
}

/* ---- routes ------------------------------------------------------------------------------------- */

static int authorized(srv_http *h, struct MHD_Connection *c) {
    if (!h->o->api_key) return 1;
    const char *v = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!v || strncasecmp(v, "Bearer ", 7)) return 0; /* the scheme is case-insensitive (RFC 9110 11.1) */
    const char *k = v + 7, *want = h->o->api_key;
    while (*k == ' ') k++;
    const size_t lk = strlen(k), lw = strlen(want);
    unsigned diff = (unsigned)(lk != lw);
    for (size_t i = 0; i < lk && i < lw; i++) diff |= (unsigned)(k[i] ^ want[i]);
    return diff == 0;
}

/* the served model as an OpenAI model object */
static cJSON *model_object(const srv_http *h) {
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "id", h->pc->model_name);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", (double)time(NULL));
    cJSON_AddStringToObject(m, "owned_by", "fp4moe");
    cJSON_AddNumberToObject(m, "max_model_len", (double)h->pc->context);
    return m;
}

/* GET /v1/models: the list; GET /v1/models/ID: the model ID (OpenAI's "retrieve model"), 404 model_not_found for
 * another ID */
static enum MHD_Result get_models(srv_http *h, struct MHD_Connection *c, const char *id) {
    cJSON *o;
    if (id) {
        if (strcmp(id, h->pc->model_name)) {
            srv_error er;
            srv_fail(&er, 404, "model", "The model '%.200s' does not exist (this server serves '%.200s')", id,
                     h->pc->model_name);
            er.code = "model_not_found";
            return respond_error(h, c, &er);
        }
        o = model_object(h);
    } else {
        o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "object", "list");
        cJSON_AddItemToArray(cJSON_AddArrayToObject(o, "data"), model_object(h));
    }
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s ? respond(h, c, 200, "application/json", s, strlen(s)) : MHD_NO;
}

static enum MHD_Result get_health(srv_http *h, struct MHD_Connection *c) {
    int64_t q = 0, r = 0;
    srv_engine_load(h->e, &q, &r);
    char *s = malloc(128);
    if (!s) return MHD_NO;
    const int stopping = atomic_load(&h->stopping);
    snprintf(s, 128, "{\"status\":\"%s\",\"running\":%lld,\"queued\":%lld}", stopping ? "shutting down" : "ok",
             (long long)r, (long long)q);
    return respond(h, c, stopping ? 503 : 200, "application/json", s, strlen(s));
}

/* ---- non-stream clients that go away ------------------------------------------------------------- */

static void watch_add(srv_http *h, conn_ctx *cc) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(cc->w.c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return;
    pthread_mutex_lock(&h->wlock);
    cc->fd = ci->connect_fd;
    cc->wprev = NULL;
    cc->wnext = h->watched;
    if (h->watched) h->watched->wprev = cc;
    h->watched = cc;
    cc->watched = 1;
    pthread_mutex_unlock(&h->wlock);
}

/* Before the connection lets go of its job (idempotent). */
static void watch_del(srv_http *h, conn_ctx *cc) {
    pthread_mutex_lock(&h->wlock);
    if (cc->watched) {
        if (cc->wprev) cc->wprev->wnext = cc->wnext;
        else h->watched = cc->wnext;
        if (cc->wnext) cc->wnext->wprev = cc->wprev;
        cc->watched = 0;
    }
    pthread_mutex_unlock(&h->wlock);
}

/* Every WATCH_MS: the watched sockets whose peer has closed (end of input, hang-up, error) get their job
 * cancelled (srv_job_cancel: the engine frees the sequence and wakes the connection, which then lets go).
 * A pipelined next request is input, not a close. */
static void *watch_main(void *arg) {
    srv_http *h = arg;
    struct pollfd *pf = NULL;
    size_t cap = 0;
    pthread_mutex_lock(&h->wlock);
    while (!h->wstop) {
        size_t n = 0;
        for (conn_ctx *cc = h->watched; cc; cc = cc->wnext) n++;
        if (n > cap) {
            struct pollfd *p = realloc(pf, n * sizeof *pf);
            if (p) {
                pf = p;
                cap = n;
            }
        }
        n = 0;
        for (conn_ctx *cc = h->watched; cc && n < cap; cc = cc->wnext) pf[n++] = (struct pollfd){cc->fd, POLLRDHUP, 0};
        if (n && poll(pf, (nfds_t)n, 0) > 0) {
            size_t i = 0;
            for (conn_ctx *cc = h->watched; cc && i < n; cc = cc->wnext, i++)
                if (pf[i].fd == cc->fd && (pf[i].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) && !cc->cancelled) {
                    cc->cancelled = 1;
                    srv_job_cancel(cc->job);
                }
        }
        pthread_mutex_unlock(&h->wlock);
        usleep(WATCH_MS * 1000);
        pthread_mutex_lock(&h->wlock);
    }
    pthread_mutex_unlock(&h->wlock);
    free(pf);
    return NULL;
}

static enum MHD_Result body_of_job(srv_http *h, conn_ctx *cc) {
    int http = 200, done = 0, waiting = 0;
    watch_del(h, cc);
    srv_job_done(cc->job, &http);
    srv_buf b = {0};
    for (;;) {
        if (srv_buf_reserve(&b, 65536)) {
            srv_buf_free(&b);
            return MHD_NO;
        }
        const size_t k = srv_job_read(cc->job, b.p + b.n, 65536, &done, &waiting);
        if (!k) break;
        b.n += k;
    }
    release_job(h, cc->job);
    cc->job = NULL;
    cc->answered = 1;
    return respond(h, cc->w.c, http, "application/json", b.p ? b.p : strdup(""), b.n);
}

static enum MHD_Result post_generate(srv_http *h, conn_ctx *cc, srv_kind kind) {
    struct MHD_Connection *c = cc->w.c;
    srv_request r;
    srv_error er;
    if (srv_parse_request(h->pc, kind, cc->body.p ? cc->body.p : "", cc->body.n, &r, &er))
        return respond_error(h, c, &er);
    free(r.chat_text); /* the ids are what runs (the text is for /apply-template) */
    r.chat_text = NULL;
    const int stream = r.stream;
    if (stream) {
        stream_ctx *s = calloc(1, sizeof *s);
        if (!s) {
            srv_request_free(&r);
            return MHD_NO;
        }
        s->w = cc->w;
        atomic_fetch_add(&h->attached, 1); /* before the job exists: shutdown never sees it unaccounted */
        s->job = srv_engine_submit(h->e, &r, do_wake, &s->w, &er);
        if (!s->job) {
            atomic_fetch_sub(&h->attached, 1);
            srv_request_free(&r);
            free(s);
            return respond_error(h, c, &er);
        }
        struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, sse_read, s, sse_free);
        if (!resp) {
            release_job(h, s->job);
            free(s);
            return MHD_NO;
        }
        MHD_add_response_header(resp, "Content-Type", "text/event-stream");
        MHD_add_response_header(resp, "Cache-Control", "no-cache");
        add_cors(h, c, resp);
        const enum MHD_Result ok = MHD_queue_response(c, 200, resp);
        MHD_destroy_response(resp);
        srv_engine_count_http(h->e, 200);
        cc->answered = 1;
        return ok;
    }
    atomic_fetch_add(&h->attached, 1); /* before the job exists: shutdown never sees it unaccounted */
    cc->job = srv_engine_submit(h->e, &r, do_wake, &cc->w, &er);
    if (!cc->job) {
        atomic_fetch_sub(&h->attached, 1);
        srv_request_free(&r);
        return respond_error(h, c, &er);
    }
    if (srv_job_arm(cc->job, do_suspend, &cc->w)) return body_of_job(h, cc);
    /* suspended until the engine is done (or the client goes away: watch_main). The engine's wake resumes the
       connection, but only this worker thread processes it, after this function returns: cc stays valid */
    watch_add(h, cc);
    return MHD_YES;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **req_cls) {
    srv_http *h = cls;
    conn_ctx *cc = *req_cls;
    t_method = method; /* (valid during this call, as MHD's strings are) */
    t_url = url;
    if (!cc) {
        if (!(cc = calloc(1, sizeof *cc))) return MHD_NO;
        cc->w.h = h;
        cc->w.c = c;
        *req_cls = cc;
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl && strtoll(cl, NULL, 10) > h->o->max_body) cc->too_big = 1;
        return MHD_YES;
    }
    if (cc->answered) return MHD_YES;
    if (*upload_size) {
        if (!cc->too_big && cc->body.n + *upload_size > (size_t)h->o->max_body) cc->too_big = 1;
        if (!cc->too_big && srv_buf_add(&cc->body, upload, *upload_size)) return MHD_NO;
        *upload_size = 0;
        return MHD_YES;
    }
    if (cc->job) {   /* resumed: the non-stream answer is ready */
        int http;
        if (srv_job_done(cc->job, &http)) return body_of_job(h, cc);
        if (srv_job_arm(cc->job, do_suspend, &cc->w)) return body_of_job(h, cc);
        return MHD_YES;
    }
    cc->answered = 1;
    if (!strcmp(method, "OPTIONS")) { /* a CORS preflight (before the API key: browsers send none with it), or plain */
        struct MHD_Response *r = MHD_create_response_from_buffer(0, (void *)"", MHD_RESPMEM_PERSISTENT);
        if (!r) return MHD_NO;
        MHD_add_response_header(r, "Allow", "GET, HEAD, POST, OPTIONS");
        const char *rm = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Access-Control-Request-Method");
        if (rm && cors_origin(h, c)) {
            const char *rh = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Access-Control-Request-Headers");
            MHD_add_response_header(r, "Access-Control-Allow-Methods", "GET, HEAD, POST, OPTIONS");
            MHD_add_response_header(r, "Access-Control-Allow-Headers", rh && *rh ? rh : "Authorization, Content-Type");
            MHD_add_response_header(r, "Access-Control-Max-Age", "600");
            add_cors(h, c, r);
        }
        const enum MHD_Result ok = MHD_queue_response(c, 204, r);
        MHD_destroy_response(r);
        srv_engine_count_http(h->e, 204);
        return ok;
    }
    /* one trailing slash is the route without it (/v1/completions/: FastAPI servers such as vLLM's redirect it) */
    char route[64];
    const size_t ul = strlen(url);
    if (ul > 1 && ul < sizeof route && url[ul - 1] == '/') {
        memcpy(route, url, ul - 1);
        route[ul - 1] = 0;
        url = route;
    }
    /* HEAD wherever GET (RFC 9110 section 9.1; libmicrohttpd sends the headers of the GET answer without its body) */
    const int is_get = !strcmp(method, "GET") || !strcmp(method, "HEAD"), is_post = !strcmp(method, "POST");
    const int v1 = !strncmp(url, "/v1/", 4);
    if (!strcmp(url, "/health")) return is_get ? get_health(h, c) : fail_method(h, c, "GET, HEAD", "%s /health: use GET", method);
    if (!strcmp(url, "/metrics")) {
        if (!is_get) return fail_method(h, c, "GET, HEAD", "%s /metrics: use GET", method);
        char *s = srv_engine_metrics(h->e);
        return s ? respond(h, c, 200, "text/plain; version=0.0.4", s, strlen(s)) : MHD_NO;
    }
    const int tk = !strcmp(url, "/tokenize"), dtk = !strcmp(url, "/detokenize"), tinfo = !strcmp(url, "/tokenizer_info");
    const int apt = !strcmp(url, "/apply-template");
    if (v1 && !authorized(h, c)) /* (the tokenizer endpoints are open, as vLLM's: the key guards /v1 only) */
        return fail(h, c, 401, "%s", "missing or wrong API key (Authorization: Bearer KEY)");
    if (tinfo) {
        if (!is_get) return fail_method(h, c, "GET, HEAD", "%s /tokenizer_info: use GET", method);
        char *s = srv_tokenizer_info(h->pc);
        return s ? respond(h, c, 200, "application/json", s, strlen(s)) : MHD_NO;
    }
    if (tk || dtk || apt) { /* vLLM's tokenizer endpoints, llama.cpp's /apply-template: answered here, no engine */
        if (!is_post) return fail_method(h, c, "POST", "%s: use POST", url);
        if (cc->too_big) return fail(h, c, 413, "%s", "the request body is larger than --max-body");
        char *s = NULL;
        srv_error er;
        const char *b = cc->body.p ? cc->body.p : "";
        const int rc = tk ? srv_tokenize(h->pc, b, cc->body.n, &s, &er)
                     : dtk ? srv_detokenize(h->pc, b, cc->body.n, &s, &er) : srv_apply_template(h->pc, b, cc->body.n, &s, &er);
        if (rc) return respond_error(h, c, &er);
        return respond(h, c, 200, "application/json", s, strlen(s));
    }
    if (!strcmp(url, "/v1/models")) return is_get ? get_models(h, c, NULL) : fail_method(h, c, "GET, HEAD", "%s /v1/models: use GET", method);
    if (!strncmp(url, "/v1/models/", 11) && url[11])
        return is_get ? get_models(h, c, url + 11) : fail_method(h, c, "GET, HEAD", "%s /v1/models/ID: use GET", method);
    const int chat = !strcmp(url, "/v1/chat/completions"), comp = !strcmp(url, "/v1/completions");
    if (!chat && !comp) return fail(h, c, 404, "no route %s", url);
    if (!is_post) return fail_method(h, c, "POST", "%s: use POST", url);
    if (cc->too_big) {
        char lim[64];
        snprintf(lim, sizeof lim, "%lld", (long long)h->o->max_body);
        return fail(h, c, 413, "the request body is larger than %s bytes (--max-body)", lim);
    }
    if (atomic_load(&h->stopping)) return fail(h, c, 503, "%s", "the server is shutting down");
    cc->answered = 0;
    const enum MHD_Result r = post_generate(h, cc, chat ? SRV_CHAT : SRV_COMPLETION);
    if (!cc->job) cc->answered = 1;
    return r;
}

static void on_completed(void *cls, struct MHD_Connection *c, void **req_cls, enum MHD_RequestTerminationCode code) {
    conn_ctx *cc = *req_cls;
    if (!cc) return;
    watch_del(cc->w.h, cc);
    if (cc->job) release_job(cc->w.h, cc->job); /* cancels an unfinished job */
    srv_buf_free(&cc->body);
    free(cc);
    *req_cls = NULL;
}

int srv_http_probe(const char *host, int port) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV}, *ai = NULL;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    const int gai = getaddrinfo(host, ps, &hints, &ai);
    if (gai || !ai) return fp4moe_set_error(FP4MOE_EINVAL, "cannot resolve --host '%s': %s", host, gai_strerror(gai));
    int st = FP4MOE_OK;
    if (port != 0) { /* port 0: any free one - the host alone is checked */
        const int fd = socket(ai->ai_family, SOCK_STREAM, 0);
        if (fd < 0) {
            st = fp4moe_set_error(FP4MOE_EIO, "cannot listen on %s:%d: socket: %s", host, port, strerror(errno));
        } else {
            const int one = 1;
            setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one); /* as libmicrohttpd's listen socket */
            if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0)
                st = fp4moe_set_error(FP4MOE_EIO, "cannot listen on %s:%d: %s", host, port, strerror(errno));
            close(fd);
        }
    }
    freeaddrinfo(ai);
    return st;
}

int srv_http_run(const srv_http_options *o, srv_engine *e, const srv_parse_ctx *pc) {
    srv_http h = {.e = e, .pc = pc, .o = o};
    pthread_mutex_init(&h.wlock, NULL);
    atomic_init(&h.suspended, 0);
    atomic_init(&h.attached, 0);
    atomic_init(&h.stopping, 0);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV}, *ai = NULL;
    char port[16];
    snprintf(port, sizeof port, "%d", o->port);
    const int gai = getaddrinfo(o->host, port, &hints, &ai);
    if (gai || !ai) return fp4moe_set_error(FP4MOE_EINVAL, "cannot resolve --host '%s': %s", o->host, gai_strerror(gai));
    /* poll, not epoll (MHD_USE_AUTO_INTERNAL_THREAD picks epoll on Linux): libmicrohttpd 0.9.75 in epoll mode leaves a
     * connection whose client closed it mid-request in CLOSE-WAIT until the connection timeout (600 s), so ~1,000
     * aborted requests exhausted the connection limit and the server answered nothing for 10 minutes (a helper's
     * trial, session 32; tests/server/test_server.py checks that such connections are freed at once) */
    unsigned flags = MHD_USE_POLL_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME;
    if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    struct MHD_Daemon *d = MHD_start_daemon(
        flags, (uint16_t)o->port, NULL, NULL, on_request, &h, MHD_OPTION_SOCK_ADDR, ai->ai_addr,
        MHD_OPTION_NOTIFY_COMPLETED, on_completed, NULL, MHD_OPTION_THREAD_POOL_SIZE,
        (unsigned)(o->http_threads > 0 ? o->http_threads : 4), MHD_OPTION_CONNECTION_LIMIT, 1024u,
        MHD_OPTION_CONNECTION_TIMEOUT, 600u, MHD_OPTION_LISTEN_BACKLOG_SIZE, 512u, MHD_OPTION_END);
    if (!d) {
        freeaddrinfo(ai);
        pthread_mutex_destroy(&h.wlock);
        const int err = errno;
        return fp4moe_set_error(FP4MOE_EIO, "cannot listen on %s:%d%s%s", o->host, o->port, err ? ": " : "",
                                err ? strerror(err) : "");
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
    const int bound = info ? (int)info->port : o->port;
    freeaddrinfo(ai);
    const int v6 = strchr(o->host, ':') != NULL;
    pthread_t wthr;
    const int watching = pthread_create(&wthr, NULL, watch_main, &h) == 0;
    if (!watching) fprintf(stderr, "serve: warning: no watcher thread: non-stream clients that go away are seen only "
                           "when their answer is sent\n");
    printf("fp4moe serve: listening on http://%s%s%s:%d\n", v6 ? "[" : "", o->host, v6 ? "]" : "", bound);
    fflush(stdout);
    while (!*o->stop) usleep(50 * 1000);
    /* shutdown: refuse new work, end every job (503), let the woken connections send, then stop.
     * Wait (at most 5 s) until every connection has also released its job: a connection the
     * engine woke may still sit in MHD's suspended list until a worker thread resumes it, and
     * MHD_stop_daemon with a suspended connection aborts the process (libmicrohttpd's panic: the
     * likely cause of a SIGABRT seen once in the --ep-ranks shutdown test under load) */
    atomic_store(&h.stopping, 1);
    srv_engine_shutdown(e);
    for (int i = 0; i < 250; i++) {
        int64_t q = 0, r = 0;
        srv_engine_load(e, &q, &r);
        if (q == 0 && r == 0 && atomic_load(&h.suspended) == 0 && atomic_load(&h.attached) == 0) break;
        usleep(20 * 1000);
    }
    usleep(100 * 1000); /* the last responses' bytes (a job is released before MHD has sent its body) */
    if (watching) {
        pthread_mutex_lock(&h.wlock);
        h.wstop = 1;
        pthread_mutex_unlock(&h.wlock);
        pthread_join(wthr, NULL);
    }
    MHD_stop_daemon(d);
    pthread_mutex_destroy(&h.wlock);
    return 0;
}
