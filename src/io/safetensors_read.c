/* safetensors reader: mmap a file, validate its header, give views of its tensors.
 * Format: https://github.com/huggingface/safetensors ("Format"); the checks mirror the reference
 * crate's Metadata::validate (header bound 100 MB, known dtypes, shape x size == span, spans in
 * bounds), except that gaps between spans are accepted here (they are harmless for a reader). */
#include "fp4moe/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/error.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "fp4moe reads safetensors data in place and supports little-endian hosts only"
#endif

struct fp4moe_st_file {
    char *path;
    const uint8_t *image;     /* the whole file */
    size_t size;
    int mapped;               /* 1: munmap(image) on close */
    const uint8_t *data;      /* image + 8 + header length */
    int64_t data_size;
    fp4moe_st_tensor *tensors; /* file order (by offset) */
    int64_t count;
    int64_t *by_name;         /* indices into tensors, sorted by name */
    char **meta_key, **meta_val;
    int64_t meta_count;
};

/* ---- dtypes ------------------------------------------------------------------------------------- */

static const struct { const char *name; size_t size; } k_dtypes[FP4MOE_ST_DTYPE_COUNT] = {
    [FP4MOE_ST_BOOL] = {"BOOL", 1}, [FP4MOE_ST_U8] = {"U8", 1},     [FP4MOE_ST_I8] = {"I8", 1},
    [FP4MOE_ST_U16] = {"U16", 2},   [FP4MOE_ST_I16] = {"I16", 2},   [FP4MOE_ST_U32] = {"U32", 4},
    [FP4MOE_ST_I32] = {"I32", 4},   [FP4MOE_ST_U64] = {"U64", 8},   [FP4MOE_ST_I64] = {"I64", 8},
    [FP4MOE_ST_F16] = {"F16", 2},   [FP4MOE_ST_BF16] = {"BF16", 2}, [FP4MOE_ST_F32] = {"F32", 4},
    [FP4MOE_ST_F64] = {"F64", 8},   [FP4MOE_ST_F8_E4M3] = {"F8_E4M3", 1},
    [FP4MOE_ST_F8_E5M2] = {"F8_E5M2", 1},
};

const char *fp4moe_st_dtype_name(fp4moe_st_dtype dtype) {
    return (unsigned)dtype < FP4MOE_ST_DTYPE_COUNT ? k_dtypes[dtype].name : "?";
}

size_t fp4moe_st_dtype_size(fp4moe_st_dtype dtype) {
    return (unsigned)dtype < FP4MOE_ST_DTYPE_COUNT ? k_dtypes[dtype].size : 0;
}

int fp4moe_st_dtype_parse(const char *s, fp4moe_st_dtype *out) {
    if (!s || !out) return fp4moe_set_error(FP4MOE_EINVAL, "st_dtype_parse: NULL argument");
    for (int i = 0; i < FP4MOE_ST_DTYPE_COUNT; i++) {
        if (!strcmp(s, k_dtypes[i].name)) {
            *out = (fp4moe_st_dtype)i;
            return FP4MOE_OK;
        }
    }
    return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "unknown dtype \"%.40s\"", s);
}

fp4moe_st_dtype fp4moe_st_dtype_from(fp4moe_dtype dtype) {
    switch (dtype) {
    case FP4MOE_F16: return FP4MOE_ST_F16;
    case FP4MOE_BF16: return FP4MOE_ST_BF16;
    default: return FP4MOE_ST_F32;
    }
}

int fp4moe_st_dtype_to(fp4moe_st_dtype st, fp4moe_dtype *out) {
    switch (st) {
    case FP4MOE_ST_F32: *out = FP4MOE_F32; return FP4MOE_OK;
    case FP4MOE_ST_F16: *out = FP4MOE_F16; return FP4MOE_OK;
    case FP4MOE_ST_BF16: *out = FP4MOE_BF16; return FP4MOE_OK;
    default: return FP4MOE_EUNSUPPORTED;
    }
}

/* ---- header parsing ------------------------------------------------------------------------------ */

/* A JSON number that must be an exact non-negative integer. `what` names it in the message. */
static int json_index(const cJSON *v, const char *path, const char *tensor, const char *what,
                      int64_t *out) {
    if (!cJSON_IsNumber(v))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: tensor '%s': %s is not a number", path, tensor,
                                what);
    const double d = v->valuedouble;
    if (!isfinite(d) || d != floor(d))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: tensor '%s': %s = %.15g is not an integer", path,
                                tensor, what, d);
    if (d < 0)
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: tensor '%s': %s = %.0f is negative", path,
                                tensor, what, d);
    if (d > 9007199254740992.0) /* 2^53: beyond it a double no longer holds every integer */
        return fp4moe_set_error(FP4MOE_EOVERFLOW, "%s: tensor '%s': %s = %.0f is too large", path,
                                tensor, what, d);
    *out = (int64_t)d;
    return FP4MOE_OK;
}

/* Fills t from one header entry (everything but data/file). */
static int parse_entry(const cJSON *e, const char *path, const char *name, int64_t data_size,
                       fp4moe_st_tensor *t, int64_t *end_out) {
    if (!cJSON_IsObject(e))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: tensor '%s': header entry is not an object",
                                path, name);
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    const cJSON *sh = cJSON_GetObjectItemCaseSensitive(e, "shape");
    const cJSON *of = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    if (!cJSON_IsString(dt))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: tensor '%s': missing or non-string \"dtype\"",
                                path, name);
    if (fp4moe_st_dtype_parse(dt->valuestring, &t->dtype) != FP4MOE_OK)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: tensor '%s': unknown dtype \"%.40s\"",
                                path, name, dt->valuestring);
    if (!cJSON_IsArray(sh))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: tensor '%s': missing or non-array \"shape\"",
                                path, name);
    if (!cJSON_IsArray(of) || cJSON_GetArraySize(of) != 2)
        return fp4moe_set_error(FP4MOE_EFORMAT,
                                "%s: tensor '%s': missing \"data_offsets\" [begin, end]", path, name);
    const int ndim = cJSON_GetArraySize(sh);
    if (ndim > FP4MOE_ST_MAX_DIMS)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: tensor '%s': %d dims (at most %d)", path,
                                name, ndim, FP4MOE_ST_MAX_DIMS);
    t->ndim = ndim;
    int64_t numel = 1;
    for (int i = 0; i < ndim; i++) {
        char what[32];
        snprintf(what, sizeof what, "shape[%d]", i);
        int st = json_index(cJSON_GetArrayItem(sh, i), path, name, what, &t->shape[i]);
        if (st) return st;
        if (fp4moe_mul_overflow(numel, t->shape[i], &numel))
            return fp4moe_set_error(FP4MOE_EOVERFLOW,
                                    "%s: tensor '%s': the product of the shape overflows int64",
                                    path, name);
    }
    t->numel = numel;
    if (fp4moe_mul_overflow(numel, (int64_t)fp4moe_st_dtype_size(t->dtype), &t->nbytes))
        return fp4moe_set_error(FP4MOE_EOVERFLOW,
                                "%s: tensor '%s': %lld elements x %zu bytes overflows int64", path,
                                name, (long long)numel, fp4moe_st_dtype_size(t->dtype));
    int64_t begin, end;
    int st = json_index(cJSON_GetArrayItem(of, 0), path, name, "data_offsets[0]", &begin);
    if (!st) st = json_index(cJSON_GetArrayItem(of, 1), path, name, "data_offsets[1]", &end);
    if (st) return st;
    if (end < begin)
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: tensor '%s': data_offsets [%lld, %lld] end < begin",
                                path, name, (long long)begin, (long long)end);
    if (end > data_size)
        return fp4moe_set_error(FP4MOE_EFORMAT,
                                "%s: tensor '%s': data_offsets [%lld, %lld] run past the end of the "
                                "data area (%lld bytes; file truncated?)",
                                path, name, (long long)begin, (long long)end, (long long)data_size);
    if (end - begin != t->nbytes)
        return fp4moe_set_error(FP4MOE_EFORMAT,
                                "%s: tensor '%s': shape x %s needs %lld bytes but data_offsets "
                                "[%lld, %lld] span %lld",
                                path, name, k_dtypes[t->dtype].name, (long long)t->nbytes,
                                (long long)begin, (long long)end, (long long)(end - begin));
    t->offset = begin;
    *end_out = end;
    return FP4MOE_OK;
}

static int parse_metadata(fp4moe_st_file *f, const cJSON *meta) {
    if (cJSON_IsNull(meta)) return FP4MOE_OK;
    if (!cJSON_IsObject(meta))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: \"__metadata__\" is not an object", f->path);
    const int n = cJSON_GetArraySize(meta);
    f->meta_key = calloc((size_t)n + 1, sizeof *f->meta_key);
    f->meta_val = calloc((size_t)n + 1, sizeof *f->meta_val);
    if (!f->meta_key || !f->meta_val)
        return fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory for metadata", f->path);
    const cJSON *kv;
    cJSON_ArrayForEach(kv, meta) {
        if (!cJSON_IsString(kv))
            return fp4moe_set_error(FP4MOE_EFORMAT, "%s: \"__metadata__\" value of \"%.60s\" is not a string",
                                    f->path, kv->string ? kv->string : "");
        char *k = strdup(kv->string ? kv->string : ""), *v = strdup(kv->valuestring);
        if (!k || !v) {
            free(k);
            free(v);
            return fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory for metadata", f->path);
        }
        f->meta_key[f->meta_count] = k;
        f->meta_val[f->meta_count] = v;
        f->meta_count++;
    }
    return FP4MOE_OK;
}

/* Sort keys (qsort has no context argument, so each key carries what it is compared by). */
typedef struct { int64_t begin, end, seq; } span_key;
static int cmp_span(const void *a, const void *b) {
    const span_key *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

typedef struct { const char *name; int64_t index; } name_key;
static int cmp_name(const void *a, const void *b) {
    const name_key *x = a, *y = b;
    return strcmp(x->name, y->name);
}

/* Orders the tensors by offset, checks overlaps, builds the name index, checks duplicates. */
static int index_tensors(fp4moe_st_file *f, fp4moe_st_tensor *hdr_order, const int64_t *ends) {
    const int64_t n = f->count;
    span_key *spans = malloc(sizeof *spans * (size_t)(n ? n : 1));
    name_key *names = malloc(sizeof *names * (size_t)(n ? n : 1));
    f->tensors = malloc(sizeof *f->tensors * (size_t)(n ? n : 1));
    f->by_name = malloc(sizeof *f->by_name * (size_t)(n ? n : 1));
    int st = FP4MOE_OK;
    if (!spans || !names || !f->tensors || !f->by_name) {
        st = fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory for %lld tensors", f->path, (long long)n);
        goto done;
    }
    for (int64_t i = 0; i < n; i++) spans[i] = (span_key){hdr_order[i].offset, ends[i], i};
    qsort(spans, (size_t)n, sizeof *spans, cmp_span);
    int64_t max_end = 0, max_end_at = -1;
    for (int64_t i = 0; i < n; i++) {
        const fp4moe_st_tensor *t = &hdr_order[spans[i].seq];
        if (t->nbytes > 0 && t->offset < max_end && !strcmp(t->name, hdr_order[max_end_at].name)) {
            st = fp4moe_set_error(FP4MOE_EFORMAT, "%s: tensor '%s' appears twice in the header", f->path, t->name);
            goto done; /* (the same name over the same bytes: the duplicate is the fault, not the overlap) */
        }
        if (t->nbytes > 0 && t->offset < max_end) {
            st = fp4moe_set_error(FP4MOE_EFORMAT,
                                  "%s: tensor '%s' (bytes [%lld, %lld)) overlaps tensor '%s' "
                                  "(bytes up to %lld)",
                                  f->path, t->name, (long long)t->offset,
                                  (long long)spans[i].end, hdr_order[max_end_at].name,
                                  (long long)max_end);
            goto done;
        }
        if (spans[i].end > max_end) {
            max_end = spans[i].end;
            max_end_at = spans[i].seq;
        }
        f->tensors[i] = *t;
        f->tensors[i].data = f->data + t->offset;
        f->tensors[i].file = f->path;
    }
    for (int64_t i = 0; i < n; i++) names[i] = (name_key){f->tensors[i].name, i};
    qsort(names, (size_t)n, sizeof *names, cmp_name);
    for (int64_t i = 0; i < n; i++) {
        if (i > 0 && !strcmp(names[i].name, names[i - 1].name)) {
            st = fp4moe_set_error(FP4MOE_EFORMAT, "%s: tensor '%s' appears twice in the header",
                                  f->path, names[i].name);
            goto done;
        }
        f->by_name[i] = names[i].index;
    }
done:
    free(spans);
    free(names);
    return st;
}

/* Validates the image and fills f (path, image, size already set). */
static int parse_image(fp4moe_st_file *f) {
    const char *path = f->path;
    if (f->size < 8)
        return fp4moe_set_error(FP4MOE_EFORMAT,
                                "%s: truncated file: %zu bytes, less than the 8-byte header length",
                                path, f->size);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | f->image[i];
    if (hlen > (uint64_t)FP4MOE_ST_MAX_HEADER)
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: not a safetensors file? Its first 8 bytes, read as the header "
                                "length, give %llu, over the %lld-byte limit", path, (unsigned long long)hlen,
                                (long long)FP4MOE_ST_MAX_HEADER);
    if (hlen > f->size - 8)
        return fp4moe_set_error(FP4MOE_EFORMAT,
                                "%s: header length %llu runs past the end of the file (%zu bytes; "
                                "truncated?)",
                                path, (unsigned long long)hlen, f->size);
    const char *hdr = (const char *)f->image + 8;
    f->data = f->image + 8 + hlen;
    f->data_size = (int64_t)(f->size - 8 - hlen);
    if (hlen == 0 || hdr[0] != '{')
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: header is not a JSON object (does not start with '{')",
                                path);

    /* a \u0000 escape would end a tensor name early once parsed (cJSON keeps NUL-terminated strings): "a\u0000b"
     * would be read as tensor "a" */
    const char *z = memmem(hdr, (size_t)hlen, "\\u0000", 6);
    for (; z; z = memmem(z + 1, (size_t)(hdr + hlen - z - 1), "\\u0000", 6)) {
        ptrdiff_t bs = 0; /* backslashes just before it: an even count makes this one an escape's start */
        while (z - bs > hdr && z[-1 - bs] == '\\') bs++;
        if (bs % 2 == 0)
            return fp4moe_set_error(FP4MOE_EFORMAT, "%s: header has a \\u0000 (NUL) character in a string at byte %ld; "
                                    "tensor names and metadata cannot contain NUL", path, (long)(z - hdr));
    }
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(hdr, (size_t)hlen, &end, 0);
    if (!root) {
        const char *at = cJSON_GetErrorPtr();
        long pos = (at && at >= hdr && at <= hdr + hlen) ? (long)(at - hdr) : -1;
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: header is not valid JSON (error near byte %ld of %llu)",
                                path, pos, (unsigned long long)hlen);
    }
    int st = FP4MOE_OK;
    fp4moe_st_tensor *hdr_order = NULL;
    int64_t *ends = NULL;
    for (const char *p = end; p && p < hdr + hlen; p++) {
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            st = fp4moe_set_error(FP4MOE_EFORMAT, "%s: header has data after its JSON object (byte %ld)",
                                  path, (long)(p - hdr));
            goto done;
        }
    }
    if (!cJSON_IsObject(root)) {
        st = fp4moe_set_error(FP4MOE_EFORMAT, "%s: header is not a JSON object", path);
        goto done;
    }
    const int n_entries = cJSON_GetArraySize(root);
    hdr_order = calloc((size_t)n_entries + 1, sizeof *hdr_order);
    ends = calloc((size_t)n_entries + 1, sizeof *ends);
    if (!hdr_order || !ends) {
        st = fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory for %d header entries", path, n_entries);
        goto done;
    }
    const cJSON *e;
    int seen_meta = 0;
    cJSON_ArrayForEach(e, root) {
        const char *name = e->string ? e->string : "";
        if (!strcmp(name, "__metadata__")) {
            if (seen_meta++) {
                st = fp4moe_set_error(FP4MOE_EFORMAT, "%s: \"__metadata__\" appears twice", path);
                goto done;
            }
            if ((st = parse_metadata(f, e))) goto done;
            continue;
        }
        if (!name[0]) {
            st = fp4moe_set_error(FP4MOE_EFORMAT, "%s: a tensor has an empty name (entry %lld)", path,
                                  (long long)f->count);
            goto done;
        }
        fp4moe_st_tensor *t = &hdr_order[f->count];
        if (!(t->name = strdup(name))) {
            st = fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", path);
            goto done;
        }
        f->count++;
        if ((st = parse_entry(e, path, name, f->data_size, t, &ends[f->count - 1]))) goto done;
    }
    st = index_tensors(f, hdr_order, ends);
done:
    if (st && hdr_order) {
        for (int64_t i = 0; i < f->count; i++) free((char *)hdr_order[i].name);
        f->count = 0;
        free(f->tensors);
        f->tensors = NULL;
    }
    free(hdr_order);
    free(ends);
    cJSON_Delete(root);
    return st;
}

static int new_file(const char *label, fp4moe_st_file **out) {
    fp4moe_st_file *f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(label))) {
        free(f);
        return fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", label);
    }
    *out = f;
    return FP4MOE_OK;
}

int fp4moe_st_open_memory(const void *image, size_t size, const char *label, fp4moe_st_file **out) {
    if (!out) return fp4moe_set_error(FP4MOE_EINVAL, "st_open_memory: NULL out");
    *out = NULL;
    if (!label) label = "<memory>";
    if (!image && size) return fp4moe_set_error(FP4MOE_EINVAL, "%s: NULL image", label);
    fp4moe_st_file *f = NULL;
    int st = new_file(label, &f);
    if (st) return st;
    f->image = image ? image : (const uint8_t *)"";
    f->size = size;
    if ((st = parse_image(f))) {
        fp4moe_st_close(f);
        return st;
    }
    *out = f;
    return FP4MOE_OK;
}

int fp4moe_st_open(const char *path, fp4moe_st_file **out) {
    if (!out) return fp4moe_set_error(FP4MOE_EINVAL, "st_open: NULL out");
    *out = NULL;
    if (!path) return fp4moe_set_error(FP4MOE_EINVAL, "st_open: NULL path");
    /* O_NONBLOCK: a named pipe would block the open until a writer came; it is refused below as not regular */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return fp4moe_set_error(FP4MOE_EIO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int err = errno;
        close(fd);
        return fp4moe_set_error(FP4MOE_EIO, "%s: cannot stat: %s", path, strerror(err));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return fp4moe_set_error(FP4MOE_EIO, "%s: not a regular file", path);
    }
    fp4moe_st_file *f = NULL;
    int st = new_file(path, &f);
    if (st) {
        close(fd);
        return st;
    }
    f->size = (size_t)sb.st_size;
    if (f->size >= 8) {
        void *p = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            int err = errno;
            close(fd);
            fp4moe_st_close(f);
            return fp4moe_set_error(FP4MOE_EIO, "%s: cannot mmap %zu bytes: %s", path,
                                    (size_t)sb.st_size, strerror(err));
        }
        f->image = p;
        f->mapped = 1;
    } else {
        f->image = (const uint8_t *)"";
    }
    close(fd);
    if ((st = parse_image(f))) {
        fp4moe_st_close(f);
        return st;
    }
    *out = f;
    return FP4MOE_OK;
}

void fp4moe_st_close(fp4moe_st_file *f) {
    if (!f) return;
    for (int64_t i = 0; i < f->count; i++) free((char *)f->tensors[i].name);
    for (int64_t i = 0; i < f->meta_count; i++) {
        free(f->meta_key[i]);
        free(f->meta_val[i]);
    }
    free(f->meta_key);
    free(f->meta_val);
    free(f->tensors);
    free(f->by_name);
    if (f->mapped) munmap((void *)f->image, f->size);
    free(f->path);
    free(f);
}

/* ---- accessors -------------------------------------------------------------------------------------- */

const char *fp4moe_st_path(const fp4moe_st_file *f) { return f ? f->path : ""; }
int64_t fp4moe_st_count(const fp4moe_st_file *f) { return f ? f->count : 0; }
int64_t fp4moe_st_data_size(const fp4moe_st_file *f) { return f ? f->data_size : 0; }

const fp4moe_st_tensor *fp4moe_st_at(const fp4moe_st_file *f, int64_t i) {
    return (f && i >= 0 && i < f->count) ? &f->tensors[i] : NULL;
}

const fp4moe_st_tensor *fp4moe_st_find(const fp4moe_st_file *f, const char *name) {
    if (!f || !name) return NULL;
    int64_t lo = 0, hi = f->count;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        const fp4moe_st_tensor *t = &f->tensors[f->by_name[mid]];
        const int c = strcmp(name, t->name);
        if (c == 0) return t;
        if (c < 0) hi = mid;
        else lo = mid + 1;
    }
    return NULL;
}

const char *fp4moe_st_metadata(const fp4moe_st_file *f, const char *key) {
    if (!f || !key) return NULL;
    for (int64_t i = 0; i < f->meta_count; i++)
        if (!strcmp(f->meta_key[i], key)) return f->meta_val[i];
    return NULL;
}

int64_t fp4moe_st_metadata_count(const fp4moe_st_file *f) { return f ? f->meta_count : 0; }

int fp4moe_st_metadata_at(const fp4moe_st_file *f, int64_t i, const char **key, const char **value) {
    if (!f || i < 0 || i >= f->meta_count)
        return fp4moe_set_error(FP4MOE_EINVAL, "st_metadata_at: index %lld out of range", (long long)i);
    if (key) *key = f->meta_key[i];
    if (value) *value = f->meta_val[i];
    return FP4MOE_OK;
}
