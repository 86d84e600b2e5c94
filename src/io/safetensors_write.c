/* safetensors writer: header JSON padded with spaces to a multiple of 8 bytes (as the safetensors
 * library writes it), tensors contiguous and ordered by element size, largest first, so that each
 * one is aligned to its element size; temp file + rename so that a failure loses nothing. Sharded
 * models follow transformers' save_pretrained naming (model-00001-of-00002.safetensors + index). */
#include "fp4moe/safetensors.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/error.h"

typedef struct {
    char *name;
    fp4moe_st_dtype dtype;
    int ndim;
    int64_t shape[FP4MOE_ST_MAX_DIMS];
    int64_t nbytes;
    const void *data;
    fp4moe_st_fill_fn fill;
    void *ctx;
} wentry;

struct fp4moe_st_writer {
    wentry *e;
    int64_t n, cap;
    int64_t data_size;
    char **meta_key, **meta_val;
    int64_t nmeta, capmeta;
};

struct fp4moe_st_sink {
    FILE *fp;
    const char *path;
    const char *tensor;
    int64_t written, expected;
};

/* ---- a growable text buffer for the header ------------------------------------------------------- */

typedef struct { char *p; size_t n, cap; int oom; } sbuf;

static void sb_put(sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) { b->oom = 1; return; }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
}
static void sb_str(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }
static void sb_i64(sbuf *b, int64_t v) {
    char t[32];
    int k = snprintf(t, sizeof t, "%lld", (long long)v);
    sb_put(b, t, (size_t)k);
}
/* A JSON string literal (RFC 8259 escapes; bytes >= 0x80 pass through as UTF-8). */
static void sb_json(sbuf *b, const char *s) {
    sb_put(b, "\"", 1);
    for (; *s; s++) {
        const unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            char t[2] = {'\\', (char)c};
            sb_put(b, t, 2);
        } else if (c < 0x20) {
            char t[8];
            snprintf(t, sizeof t, "\\u%04x", c);
            sb_put(b, t, 6);
        } else {
            sb_put(b, (const char *)&c, 1);
        }
    }
    sb_put(b, "\"", 1);
}

/* ---- building ---------------------------------------------------------------------------------------- */

int fp4moe_st_writer_new(fp4moe_st_writer **out) {
    if (!out) return fp4moe_set_error(FP4MOE_EINVAL, "st_writer_new: NULL out");
    *out = calloc(1, sizeof **out);
    return *out ? FP4MOE_OK : fp4moe_set_error(FP4MOE_ENOMEM, "st_writer_new: out of memory");
}

void fp4moe_st_writer_free(fp4moe_st_writer *w) {
    if (!w) return;
    for (int64_t i = 0; i < w->n; i++) free(w->e[i].name);
    for (int64_t i = 0; i < w->nmeta; i++) {
        free(w->meta_key[i]);
        free(w->meta_val[i]);
    }
    free(w->e);
    free(w->meta_key);
    free(w->meta_val);
    free(w);
}

static int add_entry(fp4moe_st_writer *w, const char *name, fp4moe_st_dtype dtype, int ndim,
                     const int64_t *shape, const void *data, fp4moe_st_fill_fn fill, void *ctx) {
    if (!w || !name) return fp4moe_set_error(FP4MOE_EINVAL, "st_writer_add: NULL argument");
    if (!name[0] || !strcmp(name, "__metadata__"))
        return fp4moe_set_error(FP4MOE_EINVAL, "st_writer_add: invalid tensor name \"%s\"", name);
    if (fp4moe_st_dtype_size(dtype) == 0)
        return fp4moe_set_error(FP4MOE_EINVAL, "st_writer_add: tensor '%s': invalid dtype %d", name, (int)dtype);
    if (ndim < 0 || ndim > FP4MOE_ST_MAX_DIMS || (ndim > 0 && !shape))
        return fp4moe_set_error(FP4MOE_EINVAL, "st_writer_add: tensor '%s': invalid ndim %d", name, ndim);
    for (int64_t i = 0; i < w->n; i++)
        if (!strcmp(w->e[i].name, name))
            return fp4moe_set_error(FP4MOE_EINVAL, "st_writer_add: tensor '%s' added twice", name);
    wentry e = {.dtype = dtype, .ndim = ndim, .data = data, .fill = fill, .ctx = ctx};
    int64_t numel = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return fp4moe_set_error(FP4MOE_EINVAL, "st_writer_add: tensor '%s': shape[%d] = %lld < 0",
                                    name, i, (long long)shape[i]);
        if (fp4moe_mul_overflow(numel, shape[i], &numel))
            return fp4moe_set_error(FP4MOE_EOVERFLOW, "st_writer_add: tensor '%s': shape overflows", name);
        e.shape[i] = shape[i];
    }
    if (fp4moe_mul_overflow(numel, (int64_t)fp4moe_st_dtype_size(dtype), &e.nbytes) ||
        e.nbytes > INT64_MAX - w->data_size)
        return fp4moe_set_error(FP4MOE_EOVERFLOW, "st_writer_add: tensor '%s': size overflows", name);
    if (!fill && !data && e.nbytes > 0)
        return fp4moe_set_error(FP4MOE_EINVAL, "st_writer_add: tensor '%s': NULL data", name);
    if (w->n == w->cap) {
        int64_t cap = w->cap ? 2 * w->cap : 64;
        wentry *p = realloc(w->e, sizeof *p * (size_t)cap);
        if (!p) return fp4moe_set_error(FP4MOE_ENOMEM, "st_writer_add: out of memory");
        w->e = p;
        w->cap = cap;
    }
    if (!(e.name = strdup(name))) return fp4moe_set_error(FP4MOE_ENOMEM, "st_writer_add: out of memory");
    w->e[w->n++] = e;
    w->data_size += e.nbytes;
    return FP4MOE_OK;
}

int fp4moe_st_writer_add(fp4moe_st_writer *w, const char *name, fp4moe_st_dtype dtype, int ndim,
                         const int64_t *shape, const void *data) {
    return add_entry(w, name, dtype, ndim, shape, data, NULL, NULL);
}

int fp4moe_st_writer_add_fn(fp4moe_st_writer *w, const char *name, fp4moe_st_dtype dtype, int ndim,
                            const int64_t *shape, fp4moe_st_fill_fn fill, void *ctx) {
    if (!fill) return fp4moe_set_error(FP4MOE_EINVAL, "st_writer_add_fn: NULL fill function");
    return add_entry(w, name, dtype, ndim, shape, NULL, fill, ctx);
}

int fp4moe_st_writer_set_metadata(fp4moe_st_writer *w, const char *key, const char *value) {
    if (!w || !key || !value) return fp4moe_set_error(FP4MOE_EINVAL, "st_writer_set_metadata: NULL argument");
    char *v = strdup(value);
    if (!v) return fp4moe_set_error(FP4MOE_ENOMEM, "st_writer_set_metadata: out of memory");
    for (int64_t i = 0; i < w->nmeta; i++) {
        if (!strcmp(w->meta_key[i], key)) {
            free(w->meta_val[i]);
            w->meta_val[i] = v;
            return FP4MOE_OK;
        }
    }
    if (w->nmeta == w->capmeta) {
        int64_t cap = w->capmeta ? 2 * w->capmeta : 8;
        char **k2 = realloc(w->meta_key, sizeof *k2 * (size_t)cap);
        if (k2) w->meta_key = k2;
        char **v2 = k2 ? realloc(w->meta_val, sizeof *v2 * (size_t)cap) : NULL;
        if (v2) w->meta_val = v2;
        if (!k2 || !v2) {
            free(v);
            return fp4moe_set_error(FP4MOE_ENOMEM, "st_writer_set_metadata: out of memory");
        }
        w->capmeta = cap;
    }
    char *k = strdup(key);
    if (!k) {
        free(v);
        return fp4moe_set_error(FP4MOE_ENOMEM, "st_writer_set_metadata: out of memory");
    }
    w->meta_key[w->nmeta] = k;
    w->meta_val[w->nmeta] = v;
    w->nmeta++;
    return FP4MOE_OK;
}

int64_t fp4moe_st_writer_count(const fp4moe_st_writer *w) { return w ? w->n : 0; }
int64_t fp4moe_st_writer_data_size(const fp4moe_st_writer *w) { return w ? w->data_size : 0; }

/* ---- writing --------------------------------------------------------------------------------------- */

int fp4moe_st_sink_write(fp4moe_st_sink *s, const void *buf, int64_t n) {
    if (!s || n < 0 || (n > 0 && !buf)) return fp4moe_set_error(FP4MOE_EINVAL, "st_sink_write: bad argument");
    if (n > s->expected - s->written)
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: tensor '%s': producer wrote more than its %lld bytes",
                                s->path, s->tensor, (long long)s->expected);
    if (n && fwrite(buf, 1, (size_t)n, s->fp) != (size_t)n)
        return fp4moe_set_error(FP4MOE_EIO, "%s: write failed in tensor '%s': %s", s->path, s->tensor,
                                strerror(errno));
    s->written += n;
    return FP4MOE_OK;
}

/* Orders a subset stably by element size, largest first (8, 4, 2, 1): contiguous tensors in this
 * order are each aligned to their element size when the data area starts 8-aligned. */
static int order_subset(const fp4moe_st_writer *w, int64_t *idx, int64_t n) {
    int64_t *tmp = malloc(sizeof *tmp * (size_t)(n ? n : 1)), k = 0;
    if (!tmp) return fp4moe_set_error(FP4MOE_ENOMEM, "st_writer: out of memory");
    for (size_t size = 8; size >= 1; size /= 2)
        for (int64_t i = 0; i < n; i++)
            if (fp4moe_st_dtype_size(w->e[idx[i]].dtype) == size) tmp[k++] = idx[i];
    memcpy(idx, tmp, sizeof *idx * (size_t)n);
    free(tmp);
    return FP4MOE_OK;
}

/* Header JSON for the tensors idx[0..n) (already ordered), padded to a multiple of 8 bytes. */
static int build_header(const fp4moe_st_writer *w, const int64_t *idx, int64_t n, sbuf *b) {
    sb_str(b, "{");
    int first = 1;
    if (w->nmeta) {
        sb_str(b, "\"__metadata__\":{");
        for (int64_t i = 0; i < w->nmeta; i++) {
            if (i) sb_str(b, ",");
            sb_json(b, w->meta_key[i]);
            sb_str(b, ":");
            sb_json(b, w->meta_val[i]);
        }
        sb_str(b, "}");
        first = 0;
    }
    int64_t off = 0;
    for (int64_t k = 0; k < n; k++) {
        const wentry *e = &w->e[idx[k]];
        if (!first) sb_str(b, ",");
        first = 0;
        sb_json(b, e->name);
        sb_str(b, ":{\"dtype\":\"");
        sb_str(b, fp4moe_st_dtype_name(e->dtype));
        sb_str(b, "\",\"shape\":[");
        for (int d = 0; d < e->ndim; d++) {
            if (d) sb_str(b, ",");
            sb_i64(b, e->shape[d]);
        }
        sb_str(b, "],\"data_offsets\":[");
        sb_i64(b, off);
        sb_str(b, ",");
        sb_i64(b, off + e->nbytes);
        sb_str(b, "]}");
        off += e->nbytes;
    }
    sb_str(b, "}");
    while (b->n % 8) sb_str(b, " ");
    if (b->oom) return fp4moe_set_error(FP4MOE_ENOMEM, "st_writer: out of memory for the header");
    if ((int64_t)b->n > FP4MOE_ST_MAX_HEADER)
        return fp4moe_set_error(FP4MOE_EINVAL, "st_writer: header of %zu bytes exceeds the limit", b->n);
    return FP4MOE_OK;
}

/* Writes `text` of n bytes, or a safetensors image of the tensors idx[0..n), to path via a
 * temporary file in the same directory and rename(2). */
static int write_atomic(const fp4moe_st_writer *w, const int64_t *idx, int64_t n, const char *text,
                        const char *path) {
    size_t plen = strlen(path);
    char *tmp = malloc(plen + 16);
    if (!tmp) return fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", path);
    /* a hidden name so that a directory scan for *.safetensors never picks it up */
    const char *slash = strrchr(path, '/');
    size_t dlen = slash ? (size_t)(slash - path + 1) : 0;
    snprintf(tmp, plen + 16, "%.*s.%s.XXXXXX", (int)dlen, path, path + dlen);
    int fd = mkstemp(tmp);
    if (fd < 0) {
        int err = errno;
        free(tmp);
        return fp4moe_set_error(FP4MOE_EIO, "%s: cannot create a temporary file: %s", path, strerror(err));
    }
    FILE *fp = fdopen(fd, "wb");
    int st = FP4MOE_OK;
    sbuf hdr = {0};
    if (!fp) {
        close(fd);
        st = fp4moe_set_error(FP4MOE_EIO, "%s: fdopen failed: %s", path, strerror(errno));
        goto fail;
    }
    setvbuf(fp, NULL, _IOFBF, 1 << 20);
    if (text) {
        if (fwrite(text, 1, strlen(text), fp) != strlen(text))
            st = fp4moe_set_error(FP4MOE_EIO, "%s: write failed: %s", path, strerror(errno));
    } else {
        if ((st = build_header(w, idx, n, &hdr))) goto fail_open;
        uint8_t len8[8];
        for (int i = 0; i < 8; i++) len8[i] = (uint8_t)((uint64_t)hdr.n >> (8 * i));
        if (fwrite(len8, 1, 8, fp) != 8 || fwrite(hdr.p, 1, hdr.n, fp) != hdr.n) {
            st = fp4moe_set_error(FP4MOE_EIO, "%s: write failed: %s", path, strerror(errno));
            goto fail_open;
        }
        for (int64_t k = 0; k < n && !st; k++) {
            const wentry *e = &w->e[idx[k]];
            fp4moe_st_sink sink = {fp, path, e->name, 0, e->nbytes};
            if (e->fill) {
                st = e->fill(e->ctx, &sink, e->nbytes);
                if (!st && sink.written != e->nbytes)
                    st = fp4moe_set_error(FP4MOE_EFORMAT, "%s: tensor '%s': producer wrote %lld of %lld bytes",
                                          path, e->name, (long long)sink.written, (long long)e->nbytes);
            } else {
                st = fp4moe_st_sink_write(&sink, e->data, e->nbytes);
            }
        }
    }
    if (!st && (fflush(fp) != 0 || fsync(fileno(fp)) != 0))
        st = fp4moe_set_error(FP4MOE_EIO, "%s: flush failed: %s", path, strerror(errno));
fail_open:
    if (fclose(fp) != 0 && !st) st = fp4moe_set_error(FP4MOE_EIO, "%s: close failed: %s", path, strerror(errno));
    if (!st) {
        mode_t mask = umask(0); /* mkstemp made it 0600; give it the usual 0666 & ~umask */
        umask(mask);
        if (chmod(tmp, 0666 & ~mask) != 0 || rename(tmp, path) != 0)
            st = fp4moe_set_error(FP4MOE_EIO, "%s: cannot rename the temporary file into place: %s", path,
                                  strerror(errno));
    }
fail:
    if (st) unlink(tmp);
    free(tmp);
    free(hdr.p);
    return st;
}

int fp4moe_st_writer_write(const fp4moe_st_writer *w, const char *path) {
    if (!w || !path) return fp4moe_set_error(FP4MOE_EINVAL, "st_writer_write: NULL argument");
    int64_t *idx = malloc(sizeof *idx * (size_t)(w->n ? w->n : 1));
    if (!idx) return fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", path);
    for (int64_t i = 0; i < w->n; i++) idx[i] = i;
    int st = order_subset(w, idx, w->n);
    if (!st) st = write_atomic(w, idx, w->n, NULL, path);
    free(idx);
    return st;
}

static char *join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *p = malloc(a + b + 2);
    if (p) snprintf(p, a + b + 2, "%s/%s", dir, name);
    return p;
}

/* After a model was written into dir as nshards shards (0: one model.safetensors): removes the weight files of an
 * earlier, other split - model.safetensors, model-XXXXX-of-YYYYY.safetensors not among the new ones - which loaders
 * that glob "model*.safetensors" (mlx-lm, transformers) would read beside the new ones. Best effort. */
static void remove_stale_weights(const char *dir, int64_t nshards) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *de;
    while ((de = readdir(d))) {
        const char *n = de->d_name;
        int a = 0, b = 0, len = 0;
        int stale = 0;
        if (!strcmp(n, "model.safetensors")) stale = nshards > 0;
        else if (sscanf(n, "model-%5d-of-%5d.safetensors%n", &a, &b, &len) == 2 && len == (int)strlen(n))
            stale = nshards == 0 || b != nshards || a < 1 || a > nshards;
        if (!stale) continue;
        char *path = join(dir, n);
        if (path) unlink(path);
        free(path);
    }
    closedir(d);
}

int fp4moe_st_writer_write_model(const fp4moe_st_writer *w, const char *dir, int64_t max_shard_bytes) {
    if (!w || !dir) return fp4moe_set_error(FP4MOE_EINVAL, "st_writer_write_model: NULL argument");
    if (max_shard_bytes <= 0 || w->data_size <= max_shard_bytes) {
        char *path = join(dir, "model.safetensors");
        if (!path) return fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", dir);
        int st = fp4moe_st_writer_write(w, path);
        free(path);
        if (!st) { /* a stale index would take precedence over the new file when the dir is read */
            char *index = join(dir, "model.safetensors.index.json");
            if (index) unlink(index);
            free(index);
            remove_stale_weights(dir, 0);
        }
        return st;
    }
    /* shards in order of addition: a new shard when the next tensor would overflow this one */
    int64_t *shard_of = malloc(sizeof *shard_of * (size_t)w->n), *idx = malloc(sizeof *idx * (size_t)w->n);
    int st = FP4MOE_OK;
    int64_t nshards = 0;
    sbuf index = {0};
    if (!shard_of || !idx) { st = fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", dir); goto done; }
    int64_t cur = 0;
    for (int64_t i = 0; i < w->n; i++) {
        if (nshards == 0 || (cur > 0 && w->e[i].nbytes > max_shard_bytes - cur)) {
            nshards++;
            cur = 0;
        }
        shard_of[i] = nshards - 1;
        cur += w->e[i].nbytes;
    }
    for (int64_t s = 0; s < nshards && !st; s++) {
        int64_t n = 0;
        for (int64_t i = 0; i < w->n; i++)
            if (shard_of[i] == s) idx[n++] = i;
        if ((st = order_subset(w, idx, n))) break;
        char name[64];
        snprintf(name, sizeof name, "model-%05lld-of-%05lld.safetensors", (long long)s + 1, (long long)nshards);
        char *path = join(dir, name);
        if (!path) { st = fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", dir); break; }
        st = write_atomic(w, idx, n, NULL, path);
        free(path);
    }
    if (st) goto done;
    sb_str(&index, "{\n  \"metadata\": {\n    \"total_size\": ");
    sb_i64(&index, w->data_size);
    sb_str(&index, "\n  },\n  \"weight_map\": {");
    for (int64_t i = 0; i < w->n; i++) {
        char name[64];
        snprintf(name, sizeof name, "model-%05lld-of-%05lld.safetensors", (long long)shard_of[i] + 1,
                 (long long)nshards);
        sb_str(&index, i ? ",\n    " : "\n    ");
        sb_json(&index, w->e[i].name);
        sb_str(&index, ": ");
        sb_json(&index, name);
    }
    sb_str(&index, "\n  }\n}\n");
    if (index.oom) { st = fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory for the index", dir); goto done; }
    char *path = join(dir, "model.safetensors.index.json");
    if (!path) { st = fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", dir); goto done; }
    st = write_atomic(w, NULL, 0, index.p, path);
    free(path);
    if (!st) remove_stale_weights(dir, nshards);
done:
    free(shard_of);
    free(idx);
    free(index.p);
    return st;
}
