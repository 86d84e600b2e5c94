/* Helpers shared by the fp4moe subcommands (cli_util.h). */
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "fp4moe/gather_qmm.h"
#include "fp4moe/tokenizer.h"

#include <cjson/cJSON.h>

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <omp.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "fp4moe/types.h"

/* ---- options -------------------------------------------------------------------------------------- */

void cli_print_usage(const cli_spec *spec, FILE *out) {
    fprintf(out, "usage: %s\n", spec->usage);
    if (spec->description) fprintf(out, "\n%s\n", spec->description);
    fprintf(out, "\noptions:\n");
    for (int i = 0; i < spec->nopts; i++) {
        const cli_opt *o = &spec->opts[i];
        char left[96];
        snprintf(left, sizeof left, "%s%s%s%s%s", o->alias ? o->alias : "", o->alias ? ", " : "",
                 o->name, o->metavar ? " " : "", o->metavar ? o->metavar : "");
        fprintf(out, "  %-28s %s\n", left, o->help ? o->help : "");
    }
    fprintf(out, "  %-28s %s\n", "-h, --help", "show this help and exit");
}

/* --json state (cli_util.h): the mode, whether the command printed its object, the last error message */
static int g_json_mode, g_json_printed;
static char g_last_error[1024];

void cli_json_mode_on(void) { g_json_mode = 1; }

void cli_json_print(const char *text) {
    printf("%s\n", text);
    fflush(stdout);
    g_json_printed = 1;
}

/* s (malloc'd by cJSON) as valid UTF-8: itself when it is, else a lossy copy (s freed); s as it was when out of
 * memory. */
static char *utf8_or_lossy(char *s) {
    const int64_t n = (int64_t)strlen(s);
    if (fp4moe_utf8_invalid_at(s, n) < 0) return s;
    char *t = malloc((size_t)n * 3 + 1);
    if (!t) return s;
    t[fp4moe_utf8_lossy(s, n, t)] = '\0';
    free(s);
    return t;
}

void cli_json_make_utf8(cJSON *o) {
    for (; o; o = o->next) {
        if (o->string && !(o->type & cJSON_StringIsConst)) o->string = utf8_or_lossy(o->string);
        if (cJSON_IsString(o) && o->valuestring && !(o->type & cJSON_IsReference))
            o->valuestring = utf8_or_lossy(o->valuestring);
        if (o->child) cli_json_make_utf8(o->child);
    }
}

void cli_json_print_obj(cJSON *o) {
    cli_json_make_utf8(o);
    char *s = cJSON_Print(o);
    if (s) cli_json_print(s);
    free(s);
}

static cJSON *error_object(const char *command, int exit_code) {
    cJSON *e = cJSON_CreateObject();
    if (!e) return NULL;
    cJSON_AddStringToObject(e, "command", command);
    cJSON_AddStringToObject(e, "message", g_last_error[0] ? g_last_error : "failed (the reason is on stderr)");
    cJSON_AddNumberToObject(e, "exit_code", exit_code);
    cli_json_make_utf8(e); /* a message may quote the bytes of a file or a request */
    return e;
}

char *cli_json_error_text(const char *command, int exit_code) {
    cJSON *e = error_object(command, exit_code);
    char *t = e ? cJSON_PrintUnformatted(e) : NULL;
    cJSON_Delete(e);
    return t;
}

int cli_json_finish(const char *command, int exit_code) {
    if (!g_json_mode || !exit_code || g_json_printed) return exit_code;
    cJSON *o = cJSON_CreateObject(), *e = error_object(command, exit_code);
    char *t = NULL;
    if (o && e) {
        cJSON_AddItemToObject(o, "error", e);
        e = NULL;
        t = cJSON_Print(o);
    }
    if (t) printf("%s\n", t);
    else printf("{\"error\": {\"exit_code\": %d}}\n", exit_code); /* out of memory */
    fflush(stdout);
    free(t);
    cJSON_Delete(e);
    cJSON_Delete(o);
    return exit_code;
}

void cli_json_note_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_last_error, sizeof g_last_error, fmt, ap);
    va_end(ap);
}

int cli_usage_error(const char *command, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_last_error, sizeof g_last_error, fmt, ap);
    va_end(ap);
    fprintf(stderr, "fp4moe %s: %s\nTry 'fp4moe %s --help'.\n", command, g_last_error, command);
    return CLI_USAGE;
}

int cli_error(const char *command, int exit_code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_last_error, sizeof g_last_error, fmt, ap);
    va_end(ap);
    fprintf(stderr, "fp4moe %s: error: %s\n", command, g_last_error);
    return exit_code;
}

int cli_fail(const char *command, int status) {
    const char *msg = fp4moe_last_error();
    snprintf(g_last_error, sizeof g_last_error, "%s", msg[0] ? msg : fp4moe_status_name(status));
    fprintf(stderr, "fp4moe %s: error: %s\n", command, g_last_error);
    return 1;
}

static const cli_opt *find_opt(const cli_spec *spec, const char *arg, size_t len) {
    for (int i = 0; i < spec->nopts; i++) {
        const cli_opt *o = &spec->opts[i];
        if ((strlen(o->name) == len && !strncmp(o->name, arg, len)) ||
            (o->alias && strlen(o->alias) == len && !strncmp(o->alias, arg, len)))
            return o;
    }
    return NULL;
}

static int set_value(const cli_spec *spec, const cli_opt *o, const char *v) {
    char *end = NULL;
    errno = 0;
    switch (o->kind) {
    case CLI_STRING:
        *(const char **)o->dst = v;
        return CLI_OK;
    case CLI_STRINGS: {
        cli_strings *l = o->dst;
        if (l->n == CLI_MAX_STRINGS)
            return cli_usage_error(spec->command, "%s is given more than %d times", o->name, CLI_MAX_STRINGS);
        l->v[l->n++] = v;
        return CLI_OK;
    }
    case CLI_INT: {
        long long x = strtoll(v, &end, 10);
        if (errno || end == v || *end)
            return cli_usage_error(spec->command, "%s expects an integer, got '%s'", o->name, v);
        if (x == INT64_MIN) /* the options' "not given" value (e.g. --seed: a random seed) */
            return cli_usage_error(spec->command, "%s %s is out of range", o->name, v);
        *(int64_t *)o->dst = x;
        return CLI_OK;
    }
    case CLI_DOUBLE: {
        double x = strtod(v, &end);
        if (errno || end == v || *end || !isfinite(x))
            return cli_usage_error(spec->command, "%s expects a number, got '%s'", o->name, v);
        *(double *)o->dst = x;
        return CLI_OK;
    }
    default:
        return CLI_USAGE;
    }
}

/* --json among argv (a --json flag of spec given before "--"; the values of other options skipped) */
static int argv_sets_json(const cli_spec *spec, int argc, char **argv) {
    const cli_opt *json = find_opt(spec, "--json", 6);
    if (!json || json->kind != CLI_FLAG) return 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--")) return 0;
        if (a[0] != '-' || a[1] == '\0') continue;
        const char *eq = a[1] == '-' ? strchr(a, '=') : NULL;
        const cli_opt *o = find_opt(spec, a, eq ? (size_t)(eq - a) : strlen(a));
        if (o == json && !eq) return 1;
        if (o && o->kind != CLI_FLAG && !eq) i++; /* its value */
    }
    return 0;
}

int cli_check_environment(const char *cmd, int help) {
    /* OMP_NUM_THREADS (OpenMP's; a list "N[,M...]", the first for our parallel regions): past 4096, --threads'
     * bound, libgomp crashes creating the threads (seen at 100,000) or takes minutes */
    const char *omp = getenv("OMP_NUM_THREADS");
    char msg[512] = "";
    if (omp && *omp) {
        char *end = NULL;
        const long long n = strtoll(omp, &end, 10);
        if (end != omp && n > 4096)
            snprintf(msg, sizeof msg, "OMP_NUM_THREADS=%.64s: more than 4096 threads (--threads takes 1 .. 4096)", omp);
    }
    if (!msg[0] && fp4moe_env_check() != FP4MOE_OK) snprintf(msg, sizeof msg, "%s", fp4moe_last_error());
    if (!msg[0]) return CLI_OK;
    if (help) {
        fprintf(stderr, "fp4moe %s: warning: %s (any other use of the command stops at it)\n", cmd, msg);
        return CLI_OK;
    }
    return cli_usage_error(cmd, "%s", msg);
}

int cli_parse(const cli_spec *spec, int argc, char **argv) {
    int npos = 0, only_pos = 0;
    if (argv_sets_json(spec, argc, argv)) cli_json_mode_on();
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!only_pos && !strcmp(a, "--")) {
            only_pos = 1;
            continue;
        }
        if (!only_pos && a[0] == '-' && a[1] != '\0') {
            if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
                cli_check_environment(spec->command, 1);
                cli_print_usage(spec, stdout);
                return CLI_HELP;
            }
            const char *eq = a[1] == '-' ? strchr(a, '=') : NULL;
            const size_t len = eq ? (size_t)(eq - a) : strlen(a);
            const cli_opt *o = find_opt(spec, a, len);
            if (!o) return cli_usage_error(spec->command, "unknown option '%.*s'", (int)len, a);
            if (o->kind == CLI_FLAG) {
                if (eq) return cli_usage_error(spec->command, "%s takes no value", o->name);
                *(int *)o->dst = 1;
                continue;
            }
            const char *v = eq ? eq + 1 : NULL;
            if (!v) {
                if (i + 1 >= argc) return cli_usage_error(spec->command, "%s needs a value", o->name);
                v = argv[++i];
            }
            int st = set_value(spec, o, v);
            if (st) return st;
            continue;
        }
        if (npos >= spec->max_positional)
            return cli_usage_error(spec->command, "unexpected argument '%s'", a);
        spec->positional[npos++] = a;
    }
    if (spec->npositional) *spec->npositional = npos;
    return cli_check_environment(spec->command, 0); /* after the options: --json known, --help answered */
}

int cli_require_model_dir(const char *command, const char *dir) {
    if (!dir || cli_is_dir(dir)) return CLI_OK;
    struct stat sb;
    if (stat(dir, &sb) != 0) return cli_error(command, 1, "model directory %s does not exist", dir);
    return cli_error(command, 1, "%s is a file; a model is a directory (config.json, *.safetensors, tokenizer.json): "
                     "give its directory", dir);
}

int cli_set_threads(const char *command, int64_t n) {
    if (n < 0 || n > 4096) return cli_usage_error(command, "--threads must be in [1, 4096] (0: one per core)");
    const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    if (cpus > 0 && n > cpus) /* OpenMP threads past the cores wait on each other at every barrier */
        fprintf(stderr, "%s: warning: --threads %lld is more than the %ld CPUs online; every step waits on "
                "threads that share a core (slower, not faster)\n", command, (long long)n, cpus);
    if (n > 0) fp4moe_set_threads((int)n);
    else if (cpus > 0 && getenv("OMP_NUM_THREADS") && omp_get_max_threads() > cpus)
        fprintf(stderr, "%s: warning: OMP_NUM_THREADS gives %d threads, more than the %ld CPUs online; every step waits "
                "on threads that share a core (slower, not faster)\n", command, omp_get_max_threads(), cpus);
    return CLI_OK;
}

/* ---- time and progress --------------------------------------------------------------------------- */

double cli_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

const char *cli_format_bytes(int64_t bytes, char buf[32]) {
    static const char *unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)bytes;
    int u = 0;
    while (v >= 1024.0 && u < 4) {
        v /= 1024.0;
        u++;
    }
    if (u == 0) snprintf(buf, 32, "%lld B", (long long)bytes);
    else snprintf(buf, 32, "%.2f %s", v, unit[u]);
    return buf;
}

void cli_progress_start(cli_progress *p, const char *label, int64_t total) {
    p->label = label;
    p->total = total;
    p->t0 = p->last = cli_now();
    p->tty = isatty(STDERR_FILENO);
    p->shown = 0;
    p->quiet = 0;
}

void cli_progress_update(cli_progress *p, int64_t done, const char *item) {
    const double now = cli_now();
    if (p->quiet || now - p->t0 < 1.0 || now - p->last < (p->tty ? 0.1 : 10.0)) return;
    p->last = now;
    char pct[48] = "";
    if (p->total > 0 && done > 0 && done < p->total)   /* percentage and the time left at this rate */
        snprintf(pct, sizeof pct, "%5.1f%% (ETA %.0f s) ", 100.0 * (double)done / (double)p->total,
                 (now - p->t0) * (double)(p->total - done) / (double)done);
    else if (p->total > 0)
        snprintf(pct, sizeof pct, "%5.1f%% ", 100.0 * (double)done / (double)p->total);
    if (p->tty)
        fprintf(stderr, "\r\033[K%s: %s%6.1f s  %.60s", p->label, pct, now - p->t0, item ? item : "");
    else
        fprintf(stderr, "%s: %s%6.1f s  %s\n", p->label, pct, now - p->t0, item ? item : "");
    fflush(stderr);
    p->shown = 1;
}

void cli_progress_finish(cli_progress *p) {
    const double dt = cli_now() - p->t0;
    if (p->shown && p->tty) fprintf(stderr, "\r\033[K");
    if (dt >= 1.0 && !p->quiet) fprintf(stderr, "%s: done in %.1f s\n", p->label, dt);
}

/* ---- files ------------------------------------------------------------------------------------------ */

int cli_is_dir(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
}

int cli_same_file(const char *a, const char *b) {
    struct stat x, y;
    return stat(a, &x) == 0 && stat(b, &y) == 0 && x.st_dev == y.st_dev && x.st_ino == y.st_ino;
}

char *cli_join(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

int cli_mkdirs(const char *path) {
    char *p = strdup(path);
    if (!p) return fp4moe_set_error(FP4MOE_ENOMEM, "out of memory");
    for (char *s = p + 1;; s++) {
        if (*s != '/' && *s != '\0') continue;
        const char c = *s;
        *s = '\0';
        if (mkdir(p, 0777) != 0 && errno != EEXIST) {
            int err = errno;
            int st = fp4moe_set_error(FP4MOE_EIO, "%s: cannot create directory: %s", p, strerror(err));
            free(p);
            return st;
        }
        *s = c;
        if (c == '\0') break;
    }
    free(p);
    if (!cli_is_dir(path)) return fp4moe_set_error(FP4MOE_EIO, "%s: exists and is not a directory", path);
    return FP4MOE_OK;
}

int cli_copy_file(const char *src, const char *dst) {
    FILE *in = fopen(src, "rb");
    if (!in) return fp4moe_set_error(FP4MOE_EIO, "%s: cannot open: %s", src, strerror(errno));
    FILE *out = fopen(dst, "wb");
    if (!out) {
        int err = errno;
        fclose(in);
        return fp4moe_set_error(FP4MOE_EIO, "%s: cannot create: %s", dst, strerror(err));
    }
    char buf[1 << 16];
    size_t n;
    int st = FP4MOE_OK;
    while ((n = fread(buf, 1, sizeof buf, in)) > 0) {
        if (fwrite(buf, 1, n, out) != n) {
            st = fp4moe_set_error(FP4MOE_EIO, "%s: write failed: %s", dst, strerror(errno));
            break;
        }
    }
    if (!st && ferror(in)) st = fp4moe_set_error(FP4MOE_EIO, "%s: read failed", src);
    fclose(in);
    if (fclose(out) != 0 && !st) st = fp4moe_set_error(FP4MOE_EIO, "%s: close failed: %s", dst, strerror(errno));
    return st;
}

int cli_text_add(cli_text *b, const char *t, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = realloc(b->s, cap);
        if (!p) return fp4moe_set_error(FP4MOE_ENOMEM, "out of memory for %zu bytes of text", cap);
        b->s = p;
        b->cap = cap;
    }
    memcpy(b->s + b->n, t, n);
    b->n += n;
    b->s[b->n] = 0;
    return FP4MOE_OK;
}

int cli_read_stream(FILE *f, char **out) {
    size_t cap = 4096, n = 0;
    char *b = malloc(cap);
    while (b) {
        const size_t got = fread(b + n, 1, cap - n - 1, f);
        const char *z = memchr(b + n, 0, got); /* at once: a stream of NULs (/dev/zero) is not read to its limit */
        if (z) {
            const long long at = (long long)(z - b);
            free(b);
            return fp4moe_set_error(FP4MOE_EFORMAT, "standard input: a NUL byte at offset %lld: not text", at);
        }
        n += got;
        if (got == 0) break;
        if (n + 1 == cap) {
            if (cap >= ((size_t)1 << 30)) {
                free(b);
                return fp4moe_set_error(FP4MOE_EIO, "standard input: more than 1 GiB");
            }
            char *p = realloc(b, cap *= 2);
            if (!p) {
                free(b);
                b = NULL;
                break;
            }
            b = p;
        }
    }
    if (!b) return fp4moe_set_error(FP4MOE_ENOMEM, "standard input: out of memory");
    if (ferror(f)) {
        free(b);
        return fp4moe_set_error(FP4MOE_EIO, "standard input: read error");
    }
    const char *nul = memchr(b, 0, n);
    if (nul) {
        const long long at = (long long)(nul - b);
        free(b);
        return fp4moe_set_error(FP4MOE_EFORMAT, "standard input: a NUL byte at offset %lld: not text", at);
    }
    b[n] = 0;
    *out = b;
    return FP4MOE_OK;
}

/* A stream (a pipe, /dev/stdin, a process substitution) read to its end, up to max_bytes. */
static int read_stream_text(FILE *fp, const char *path, int64_t max_bytes, char **out) {
    cli_text t = {0};
    char chunk[65536];
    size_t k;
    int st = FP4MOE_OK;
    while (!st && (k = fread(chunk, 1, sizeof chunk, fp)) > 0) {
        const char *z = memchr(chunk, 0, k); /* at once: a stream of NULs (/dev/zero) is not read to its limit */
        if (z) st = fp4moe_set_error(FP4MOE_EFORMAT, "%s: a NUL byte at offset %lld: not text", path,
                                     (long long)t.n + (long long)(z - chunk));
        else if ((int64_t)(t.n + k) > max_bytes) st = fp4moe_set_error(FP4MOE_EFORMAT, "%s: more than %lld bytes", path,
                                                                       (long long)max_bytes);
        else st = cli_text_add(&t, chunk, k);
    }
    if (!st && ferror(fp)) st = fp4moe_set_error(FP4MOE_EIO, "%s: read failed", path);
    if (!st && !t.s) st = cli_text_add(&t, "", 0);
    const char *nul = st ? NULL : memchr(t.s, 0, t.n);
    if (nul) st = fp4moe_set_error(FP4MOE_EFORMAT, "%s: a NUL byte at offset %lld: not text", path, (long long)(nul - t.s));
    if (st) free(t.s);
    else *out = t.s;
    return st;
}

int cli_read_utf8_text(const char *what, const char *path, int64_t max_bytes, char **out) {
    const int st = cli_read_text(path, max_bytes, out);
    if (st) return st;
    const int64_t bad = fp4moe_utf8_invalid_at(*out, (int64_t)strlen(*out));
    if (bad < 0) return FP4MOE_OK;
    const unsigned byte = (unsigned char)(*out)[bad];
    free(*out);
    *out = NULL;
    return fp4moe_set_error(FP4MOE_EFORMAT, "%s %s is not UTF-8 text (an invalid byte 0x%02X at byte %lld)", what,
                            strcmp(path, "-") ? path : "standard input (-)", byte, (long long)bad);
}

void cli_drop_final_newline(char *text) {
    size_t n = text ? strlen(text) : 0;
    if (n && text[n - 1] == '\n') {
        text[--n] = '\0';
        if (n && text[n - 1] == '\r') text[--n] = '\0';
    }
}

int cli_read_text(const char *path, int64_t max_bytes, char **out) {
    *out = NULL;
    const char *name = path; /* in messages */
    if (!strcmp(path, "-")) { /* the convention of -f - */
        path = "/dev/stdin";
        name = "standard input (-)";
    }
    struct stat sb;
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) return fp4moe_set_error(FP4MOE_EIO, "%s: a directory", name);
    if (stat(path, &sb) == 0 && !S_ISREG(sb.st_mode) && !S_ISFIFO(sb.st_mode) && !S_ISCHR(sb.st_mode))
        return fp4moe_set_error(FP4MOE_EIO, "%s: not a regular file, pipe or character device", name);
    /* a named pipe waits for its writer, as cat does (session 32 opened it without waiting: a writer that came a
       moment later was lost, the text read as empty, and the writer then blocked for ever) */
    const int fd = open(path, O_RDONLY);
    FILE *fp = fd >= 0 ? fdopen(fd, "rb") : NULL;
    if (!fp) {
        const int err = errno;
        if (fd >= 0) close(fd);
        return fp4moe_set_error(FP4MOE_EIO, "%s: cannot open: %s", name, strerror(err));
    }
    if (fstat(fd, &sb) == 0 && !S_ISREG(sb.st_mode)) { /* a pipe / stdin / <(...): read to its end */
        const int st = read_stream_text(fp, name, max_bytes, out);
        fclose(fp);
        return st;
    }
    int st = FP4MOE_OK;
    char *buf = NULL;
    long n = -1;
    if (fseek(fp, 0, SEEK_END) == 0) n = ftell(fp);
    if (n < 0 || n > max_bytes) {
        st = fp4moe_set_error(FP4MOE_EFORMAT, "%s: cannot read (size %ld, limit %lld)", name, n,
                              (long long)max_bytes);
    } else if (!(buf = malloc((size_t)n + 1))) {
        st = fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", name);
    } else {
        rewind(fp);
        if (fread(buf, 1, (size_t)n, fp) != (size_t)n) st = fp4moe_set_error(FP4MOE_EIO, "%s: read failed", name);
        buf[n] = '\0';
        const char *nul = st ? NULL : memchr(buf, 0, (size_t)n); /* the text would end there without a word */
        if (nul) st = fp4moe_set_error(FP4MOE_EFORMAT, "%s: a NUL byte at offset %lld: not text", name, (long long)(nul - buf));
    }
    fclose(fp);
    if (st) free(buf);
    else *out = buf;
    return st;
}

int cli_write_text(const char *path, const char *text) {
    char *tmp = malloc(strlen(path) + 8);
    if (!tmp) return fp4moe_set_error(FP4MOE_ENOMEM, "out of memory");
    sprintf(tmp, "%s.tmp", path);
    FILE *fp = fopen(tmp, "wb");
    int st = FP4MOE_OK;
    if (!fp) {
        st = fp4moe_set_error(FP4MOE_EIO, "%s: cannot create: %s", tmp, strerror(errno));
    } else {
        size_t n = strlen(text);
        if (fwrite(text, 1, n, fp) != n) st = fp4moe_set_error(FP4MOE_EIO, "%s: write failed", tmp);
        if (fclose(fp) != 0 && !st) st = fp4moe_set_error(FP4MOE_EIO, "%s: close failed", tmp);
        if (!st && rename(tmp, path) != 0)
            st = fp4moe_set_error(FP4MOE_EIO, "%s: cannot rename into place: %s", path, strerror(errno));
        if (st) unlink(tmp);
    }
    free(tmp);
    return st;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

int cli_for_each_file(const char *dir, int (*fn)(const char *name, void *ctx), void *ctx) {
    DIR *d = opendir(dir);
    if (!d) return fp4moe_set_error(FP4MOE_EIO, "%s: cannot open directory: %s", dir, strerror(errno));
    char **names = NULL;
    size_t n = 0, cap = 0;
    int st = FP4MOE_OK;
    struct dirent *de;
    while ((de = readdir(d))) {
        char *p = cli_join(dir, de->d_name);
        struct stat sb;
        int regular = p && stat(p, &sb) == 0 && S_ISREG(sb.st_mode);
        free(p);
        if (!regular) continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 32;
            char **q = realloc(names, cap * sizeof *q);
            if (!q) { st = fp4moe_set_error(FP4MOE_ENOMEM, "out of memory"); break; }
            names = q;
        }
        if (!(names[n] = strdup(de->d_name))) { st = fp4moe_set_error(FP4MOE_ENOMEM, "out of memory"); break; }
        n++;
    }
    closedir(d);
    if (!st && n) qsort(names, n, sizeof *names, cmp_str);
    for (size_t i = 0; i < n && !st; i++) st = fn(names[i], ctx);
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
    return st;
}

typedef struct { const char *in, *out; const char *const *skip; } copy_ctx;

static int copy_one(const char *name, void *vctx) {
    const copy_ctx *c = vctx;
    size_t len = strlen(name);
    if (name[0] == '.') return FP4MOE_OK;
    if (len >= 12 && !strcmp(name + len - 12, ".safetensors")) return FP4MOE_OK;
    if (!strcmp(name, "model.safetensors.index.json")) return FP4MOE_OK;
    for (const char *const *s = c->skip; s && *s; s++)
        if (!strcmp(name, *s)) return FP4MOE_OK;
    char *src = cli_join(c->in, name), *dst = cli_join(c->out, name);
    int st = (src && dst) ? cli_copy_file(src, dst) : fp4moe_set_error(FP4MOE_ENOMEM, "out of memory");
    free(src);
    free(dst);
    return st;
}

int cli_copy_model_files(const char *in_dir, const char *out_dir, const char *const *skip) {
    copy_ctx c = {in_dir, out_dir, skip};
    return cli_for_each_file(in_dir, copy_one, &c);
}

int cli_output_overwrites_input(const fp4moe_st_model *m, const char *input, const char *output) {
    const int out_dir = cli_is_dir(output);
    for (int64_t i = 0; i < fp4moe_st_model_nfiles(m); i++) {
        const char *f = fp4moe_st_path(fp4moe_st_model_file(m, i));
        if (cli_same_file(f, output))
            return fp4moe_set_error(FP4MOE_EINVAL, "--output %s is the input file %s: it would be overwritten",
                                    output, f);
        if (!out_dir) continue;
        char *dir = strdup(f), *slash = dir ? strrchr(dir, '/') : NULL;
        if (slash) *slash = 0;
        const int same = dir && cli_same_file(slash ? dir : ".", output);
        free(dir);
        if (same)
            return fp4moe_set_error(FP4MOE_EINVAL, "--output directory %s holds the input file %s, which the "
                                    "output would overwrite: write to another directory", output, f);
    }
    (void)input;
    return FP4MOE_OK;
}

/* "out/" -> "out" (a copy; "/" stays "/"); NULL when out of memory */
static char *without_trailing_slashes(const char *path) {
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--;
    return strndup(path, n);
}

int cli_write_file(const char *cmd, fp4moe_st_writer *w, const char *input, const char *output) {
    char *path = NULL;
    const size_t olen = strlen(output);
    if (olen > 1 && output[olen - 1] == '/' && !cli_is_dir(output)) { /* "newdir/": a directory to make */
        const int st = cli_mkdirs(output);
        if (st) return st;
    }
    if (cli_is_dir(output)) {
        const char *base = strrchr(input, '/');
        char *dir = without_trailing_slashes(output);
        path = dir ? cli_join(dir, base ? base + 1 : input) : NULL;
        free(dir);
        if (!path) return FP4MOE_ENOMEM;
    }
    const char *target = path ? path : output;
    int st = FP4MOE_OK;
    const char *slash = strrchr(target, '/');
    if (slash && slash != target) { /* missing parent directories are created, as for a directory output */
        char *parent = strndup(target, (size_t)(slash - target));
        if (!parent) st = FP4MOE_ENOMEM;
        else if (!cli_is_dir(parent)) st = cli_mkdirs(parent);
        free(parent);
    }
    struct stat sb;
    if (!st && stat(target, &sb) == 0 && !S_ISREG(sb.st_mode))
        st = fp4moe_set_error(FP4MOE_EINVAL, "%s exists and is not a regular file (a device, a pipe, ...): give a "
                              "file or directory path", target);
    else if (!st && stat(target, &sb) == 0)
        fprintf(stderr, "%s: replacing the existing file %s\n", cmd, target);
    if (!st) st = fp4moe_st_writer_write(w, target);
    free(path);
    return st;
}

/* The number lexemes of JSON text, in document order (strings skipped). Returns the count, or -1
 * when there are more than cap. */
static int64_t json_number_lexemes(const char *t, const char **start, int *len, int64_t cap) {
    int64_t n = 0;
    for (const char *p = t; *p;) {
        if (*p == '"') {
            for (p++; *p && *p != '"'; p++)
                if (*p == '\\' && p[1]) p++;
            if (*p) p++;
        } else if (*p == '-' || (*p >= '0' && *p <= '9')) {
            const char *b = p;
            while (*p && strchr("+-0123456789.eE", *p)) p++;
            if (n == cap) return -1;
            start[n] = b;
            len[n++] = (int)(p - b);
        } else {
            p++;
        }
    }
    return n;
}

/* Replaces the number nodes below `node` (document order) by raw nodes holding their source text,
 * so that 0.0 stays 0.0 (cJSON would print 0, which transformers' strict config types reject). */
static int keep_lexemes(cJSON *node, const char *const *start, const int *len, int64_t n, int64_t *i) {
    for (cJSON *c = node->child; c; c = c->next) {
        if (cJSON_IsNumber(c)) {
            if (*i >= n || len[*i] > 63) return 0;
            char *lex = malloc((size_t)len[*i] + 1);   /* freed by cJSON_Delete (cJSON_Raw) */
            if (!lex) return 0;
            memcpy(lex, start[*i], (size_t)len[*i]);
            lex[len[*i]] = 0;
            (*i)++;
            c->type = cJSON_Raw;                        /* keeps the key and the position */
            c->valuestring = lex;
        } else if (c->child && !keep_lexemes(c, start, len, n, i)) {
            return 0;
        }
    }
    return 1;
}

/* Parses config text keeping each number's spelling; NULL when it is not JSON. */
static cJSON *parse_keeping_numbers(const char *text) {
    cJSON *root = cJSON_Parse(text);
    if (!root) return NULL;
    enum { CAP = 1 << 16 };
    const char **start = malloc(CAP * sizeof *start);
    int *len = malloc(CAP * sizeof *len);
    const int64_t n = start && len ? json_number_lexemes(text, start, len, CAP) : -1;
    int64_t i = 0;
    if (n >= 0 && !keep_lexemes(root, start, len, n, &i)) {   /* cannot happen for valid JSON */
        cJSON_Delete(root);
        root = cJSON_Parse(text);
    }
    free(start);
    free(len);
    return root;
}

int cli_copy_config(const char *in_dir, const char *out_dir, int nvfp4) {
    static const char *keys[] = {"quantization", "quantization_config"};
    char *in = cli_join(in_dir, "config.json"), *out = cli_join(out_dir, "config.json"), *text = NULL;
    int st = (in && out) ? FP4MOE_OK : fp4moe_set_error(FP4MOE_ENOMEM, "out of memory");
    cJSON *root = NULL;
    struct stat sb;
    const int exists = in && stat(in, &sb) == 0;
    if (!st && exists && !S_ISREG(sb.st_mode)) {
        st = fp4moe_set_error(FP4MOE_EFORMAT, "%s is not a regular file", in);
    } else if (!st && exists) {
        if ((st = cli_read_text(in, 64 << 20, &text)) == FP4MOE_OK) {
            root = parse_keeping_numbers(text);   /* floats stay floats (transformers, mlx-lm) */
            if (!cJSON_IsObject(root))
                st = fp4moe_set_error(FP4MOE_EFORMAT, "%s: %s", in, root ? "not a JSON object" : "not valid JSON");
        }
    } else if (!st && nvfp4) {
        root = cJSON_CreateObject();     /* no config: write just the quantization entry */
        fprintf(stderr, "quantize: warning: %s has no config.json: the output's config.json holds only the quantization entry "
                "(add the model's fields before loading it)\n", in_dir);
    }
    if (!st && root) {
        for (int k = 0; k < 2; k++) {
            cJSON_DeleteItemFromObjectCaseSensitive(root, keys[k]);
            if (!nvfp4) continue;
            cJSON *q = cJSON_AddObjectToObject(root, keys[k]);
            cJSON_AddNumberToObject(q, "group_size", 16);
            cJSON_AddNumberToObject(q, "bits", 4);
            cJSON_AddStringToObject(q, "mode", "nvfp4");
        }
        char *js = cJSON_Print(root);
        st = js ? cli_write_text(out, js) : fp4moe_set_error(FP4MOE_ENOMEM, "out of memory");
        free(js);
    }
    cJSON_Delete(root);
    free(text);
    free(in);
    free(out);
    return st;
}

/* Removes the regular files directly in dir and dir itself (best effort). */
static void remove_flat_dir(const char *dir) {
    DIR *d = opendir(dir);
    for (struct dirent *e; d && (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char *p = cli_join(dir, e->d_name);
        if (p) unlink(p);
        free(p);
    }
    if (d) closedir(d);
    rmdir(dir);
}

int cli_stage_dir(const char *output, char **stage) {
    *stage = NULL;
    struct stat sb;
    if (stat(output, &sb) == 0 && !S_ISDIR(sb.st_mode))
        return fp4moe_set_error(FP4MOE_EINVAL, "%s exists and is not a directory", output);
    char *base = without_trailing_slashes(output);
    if (!base) return fp4moe_set_error(FP4MOE_ENOMEM, "out of memory");
    char *slash = strrchr(base, '/');
    const char *name = slash ? slash + 1 : base;
    char *parent = slash ? (slash == base ? strdup("/") : strndup(base, (size_t)(slash - base))) : strdup(".");
    int st = parent ? FP4MOE_OK : fp4moe_set_error(FP4MOE_ENOMEM, "out of memory");
    if (!st && !cli_is_dir(parent)) st = cli_mkdirs(parent);
    if (!st) {
        const size_t len = strlen(parent) + strlen(name) + 32;
        char *tmpl = malloc(len);
        if (!tmpl) st = fp4moe_set_error(FP4MOE_ENOMEM, "out of memory");
        else {
            snprintf(tmpl, len, "%s/.%s.fp4moe-XXXXXX", parent, name);
            if (!mkdtemp(tmpl)) {
                st = fp4moe_set_error(FP4MOE_EIO, "%s: cannot create a directory beside %s to write into: %s", parent,
                                      name, strerror(errno));
                free(tmpl);
            } else {
                const mode_t um = umask(0); /* mkdtemp makes 0700: the mode mkdir would give (the umask's) */
                umask(um);
                chmod(tmpl, 0777 & ~um);
                *stage = tmpl;
            }
        }
    }
    free(parent);
    free(base);
    return st;
}

/* A weight file of a model directory: model.safetensors, model-NNNNN-of-NNNNN.safetensors or the index. */
static int is_weight_file(const char *n) {
    int a = 0, b = 0, len = 0;
    if (!strcmp(n, "model.safetensors") || !strcmp(n, "model.safetensors.index.json")) return 1;
    return sscanf(n, "model-%5d-of-%5d.safetensors%n", &a, &b, &len) == 2 && len == (int)strlen(n);
}

int cli_stage_commit(const char *stage, const char *output) {
    if (!cli_is_dir(output)) {
        if (rename(stage, output) != 0)
            return fp4moe_set_error(FP4MOE_EIO, "%s: cannot move the written directory %s into place: %s", output,
                                    stage, strerror(errno));
        return FP4MOE_OK;
    }
    /* an existing directory: its old weights out, then every new file in (no Ctrl-C check: this is quick) */
    DIR *d = opendir(output);
    if (!d) return fp4moe_set_error(FP4MOE_EIO, "%s: %s", output, strerror(errno));
    for (struct dirent *e; (e = readdir(d));) {
        if (!is_weight_file(e->d_name)) continue;
        char *p = cli_join(output, e->d_name);
        if (p) unlink(p);
        free(p);
    }
    closedir(d);
    d = opendir(stage);
    if (!d) return fp4moe_set_error(FP4MOE_EIO, "%s: %s", stage, strerror(errno));
    int st = FP4MOE_OK;
    for (struct dirent *e; !st && (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char *src = cli_join(stage, e->d_name), *dst = cli_join(output, e->d_name);
        if (!src || !dst) st = fp4moe_set_error(FP4MOE_ENOMEM, "out of memory");
        else if (rename(src, dst) != 0)
            st = fp4moe_set_error(FP4MOE_EIO, "%s: cannot move %s into place: %s", dst, src, strerror(errno));
        free(src);
        free(dst);
    }
    closedir(d);
    if (!st) rmdir(stage);
    return st;
}

void cli_stage_remove(const char *stage) {
    if (stage) remove_flat_dir(stage);
}

int cli_convert_failed(const char *cmd, int status, const char *output, char *stage) {
    cli_stage_remove(stage);
    free(stage);
    if (status == FP4MOE_EINTERRUPTED) {
        fprintf(stderr, "fp4moe %s: interrupted (Ctrl-C or a termination signal): nothing was written to %s\n", cmd,
                output);
        return 130;
    }
    const int rc = cli_fail(cmd, status);
    fprintf(stderr, "fp4moe %s: nothing was written to %s\n", cmd, output);
    return rc;
}

/* Best of 3 parallel sums over `bytes` (GB/s, 1 GB = 1e9 bytes). Returns 0 if out of memory. */
/* sum of a[0..n), with AVX-512 or AVX2 where the CPU has it: a baseline SSE2 loop reads only ~14 of the ~21
 * GB/s a 2-core AVX-512 VM delivers (the adds, not the memory, would be measured). */
static uint64_t sum_u64_plain(const uint64_t *a, int64_t n) {
    uint64_t sum = 0;
    for (int64_t i = 0; i < n; i++) sum += a[i];
    return sum;
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2"))) static uint64_t sum_u64_avx2(const uint64_t *a, int64_t n) {
    uint64_t sum = 0;
    for (int64_t i = 0; i < n; i++) sum += a[i];
    return sum;
}

__attribute__((target("avx512f"))) static uint64_t sum_u64_avx512(const uint64_t *a, int64_t n) {
    uint64_t sum = 0;
    for (int64_t i = 0; i < n; i++) sum += a[i];
    return sum;
}
#endif

static uint64_t sum_u64(const uint64_t *a, int64_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("avx512f")) return sum_u64_avx512(a, n);
    if (__builtin_cpu_supports("avx2")) return sum_u64_avx2(a, n);
#endif
    return sum_u64_plain(a, n);
}

static uint64_t sum_u64_parallel(const uint64_t *a, int64_t n) {
    uint64_t sum = 0;
#pragma omp parallel reduction(+ : sum)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t lo = n * t / nt, hi = n * (t + 1) / nt;
        sum += sum_u64(a + lo, hi - lo);
    }
    return sum;
}

double cli_measure_read_gbs(size_t bytes) {
    const int64_t n = (int64_t)(bytes / sizeof(uint64_t));
    uint64_t *a = malloc((size_t)n * sizeof *a);
    if (!a) return 0;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) a[i] = (uint64_t)i; /* first touch by the reading thread */
    double best = 0;
    volatile uint64_t sink = 0;
    for (int rep = 0; rep < 3; rep++) {
        const double t0 = omp_get_wtime();
        const uint64_t sum = sum_u64_parallel(a, n);
        const double dt = omp_get_wtime() - t0;
        sink += sum;
        if ((double)bytes / dt / 1e9 > best) best = (double)bytes / dt / 1e9;
    }
    (void)sink;
    free(a);
    return best;
}

int cli_bad_logits(const float *lg, int64_t V) {
    for (int64_t i = 0; i < V; i++)
        if (!isfinite(lg[i])) return 1;
    return 0;
}

void cli_warn_ctx(const char *cmd, int64_t ctx, int64_t max_position) {
    if (ctx > 0 && max_position > 0 && ctx > max_position)
        fprintf(stderr, "%s: warning: --ctx %lld is above the model's max_position_embeddings %lld (it was not "
                "trained that long)\n", cmd, (long long)ctx, (long long)max_position);
}
