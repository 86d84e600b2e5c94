/* A model's tensors as one view: a single .safetensors file, or a directory of shards described by
 * model.safetensors.index.json (transformers' save_pretrained layout: {"metadata": {...},
 * "weight_map": {"tensor name": "shard file name"}}), or all *.safetensors files of a directory. */
#include "fp4moe/safetensors.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "common/error.h"
#include "common/json.h"

#define INDEX_NAME "model.safetensors.index.json"
#define INDEX_MAX_BYTES (256LL << 20)

struct fp4moe_st_model {
    char *dir;
    int is_dir;
    fp4moe_st_file **files;
    int64_t nfiles;
    const fp4moe_st_tensor **tensors; /* model order */
    int64_t count;
    const fp4moe_st_tensor **by_name; /* sorted by name */
};

static char *join_path(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *p = malloc(a + b + 2);
    if (!p) return NULL;
    memcpy(p, dir, a);
    p[a] = '/';
    memcpy(p + a + 1, name, b + 1);
    return p;
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static int cmp_tensor_name(const void *a, const void *b) {
    const fp4moe_st_tensor *x = *(const fp4moe_st_tensor *const *)a;
    const fp4moe_st_tensor *y = *(const fp4moe_st_tensor *const *)b;
    return strcmp(x->name, y->name);
}

/* Reads a whole (small) text file into a NUL-terminated buffer. */
static int read_text(const char *path, int64_t max_bytes, char **out) {
    *out = NULL;
    FILE *fp = fopen(path, "rb");
    if (!fp) return fp4moe_set_error(FP4MOE_EIO, "%s: cannot open: %s", path, strerror(errno));
    int st = FP4MOE_OK;
    char *buf = NULL;
    if (fseek(fp, 0, SEEK_END) != 0) {
        st = fp4moe_set_error(FP4MOE_EIO, "%s: cannot seek: %s", path, strerror(errno));
        goto done;
    }
    long n = ftell(fp);
    if (n < 0 || n > max_bytes) {
        st = fp4moe_set_error(FP4MOE_EFORMAT, "%s: size %ld is not in [0, %lld]", path, n,
                              (long long)max_bytes);
        goto done;
    }
    rewind(fp);
    if (!(buf = malloc((size_t)n + 1))) {
        st = fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", path);
        goto done;
    }
    if (fread(buf, 1, (size_t)n, fp) != (size_t)n) {
        st = fp4moe_set_error(FP4MOE_EIO, "%s: read failed", path);
        goto done;
    }
    buf[n] = '\0';
    *out = buf;
    buf = NULL;
done:
    free(buf);
    fclose(fp);
    return st;
}

/* A shard name from an index must be a plain file name inside the model directory. */
static int check_shard_name(const char *index_path, const char *tensor, const char *file) {
    if (!file[0] || strchr(file, '/') || !strcmp(file, ".") || !strcmp(file, ".."))
        return fp4moe_set_error(FP4MOE_EFORMAT,
                                "%s: tensor '%s' is mapped to \"%.100s\", which is not a file name "
                                "in the model directory",
                                index_path, tensor, file);
    return FP4MOE_OK;
}

static int add_file(fp4moe_st_model *m, const char *path) {
    fp4moe_st_file *f;
    int st = fp4moe_st_open(path, &f);
    if (st) return st;
    m->files[m->nfiles++] = f;
    return FP4MOE_OK;
}

/* The file names of a directory ending in .safetensors, sorted. */
static int list_shards(const char *dir, char ***names_out, int64_t *n_out) {
    DIR *d = opendir(dir);
    if (!d) return fp4moe_set_error(FP4MOE_EIO, "%s: cannot open directory: %s", dir, strerror(errno));
    char **names = NULL;
    int64_t n = 0, cap = 0;
    int st = FP4MOE_OK;
    struct dirent *de;
    while ((de = readdir(d))) {
        size_t len = strlen(de->d_name);
        if (len <= 12 || strcmp(de->d_name + len - 12, ".safetensors") != 0) continue;
        if (de->d_name[0] == '.') continue; /* hidden and temporary files */
        if (n == cap) {
            cap = cap ? 2 * cap : 16;
            char **p = realloc(names, sizeof *names * (size_t)cap);
            if (!p) { st = fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", dir); break; }
            names = p;
        }
        if (!(names[n] = strdup(de->d_name))) { st = fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", dir); break; }
        n++;
    }
    closedir(d);
    if (st) {
        for (int64_t i = 0; i < n; i++) free(names[i]);
        free(names);
        return st;
    }
    if (n) qsort(names, (size_t)n, sizeof *names, cmp_str);
    *names_out = names;
    *n_out = n;
    return FP4MOE_OK;
}

/* Every tensor of every file, in order. */
static int collect_all(fp4moe_st_model *m) {
    int64_t total = 0;
    for (int64_t i = 0; i < m->nfiles; i++) total += fp4moe_st_count(m->files[i]);
    m->tensors = malloc(sizeof *m->tensors * (size_t)(total ? total : 1));
    if (!m->tensors) return fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", m->dir);
    for (int64_t i = 0; i < m->nfiles; i++)
        for (int64_t j = 0; j < fp4moe_st_count(m->files[i]); j++)
            m->tensors[m->count++] = fp4moe_st_at(m->files[i], j);
    return FP4MOE_OK;
}

/* Opens the shards named by the index and keeps exactly the tensors of its weight_map. */
static int open_indexed(fp4moe_st_model *m, const char *index_path) {
    char *text = NULL;
    int st = read_text(index_path, INDEX_MAX_BYTES, &text);
    if (st) return st;
    cJSON *root = NULL;
    const int pst = fp4moe_json_parse(text, strlen(text), index_path, &root);
    free(text);
    char **shards = NULL;
    int64_t nshards = 0;
    uint8_t **used = NULL;
    if (pst) {
        st = pst;
        goto done;
    }
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(wm)) {
        st = fp4moe_set_error(FP4MOE_EFORMAT, "%s: no \"weight_map\" object", index_path);
        goto done;
    }
    const int nmap = cJSON_GetArraySize(wm);
    shards = calloc((size_t)nmap + 1, sizeof *shards);
    if (!shards) { st = fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", index_path); goto done; }
    const cJSON *e;
    cJSON_ArrayForEach(e, wm) {
        const char *tname = e->string ? e->string : "";
        if (!cJSON_IsString(e)) {
            st = fp4moe_set_error(FP4MOE_EFORMAT, "%s: weight_map entry of tensor '%s' is not a file name",
                                  index_path, tname);
            goto done;
        }
        if ((st = check_shard_name(index_path, tname, e->valuestring))) goto done;
        shards[nshards++] = e->valuestring; /* borrowed from root until deduplicated below */
    }
    if (nshards == 0) {
        st = fp4moe_set_error(FP4MOE_EFORMAT, "%s: weight_map is empty", index_path);
        goto done;
    }
    qsort(shards, (size_t)nshards, sizeof *shards, cmp_str);
    int64_t u = 0;
    for (int64_t i = 0; i < nshards; i++)
        if (u == 0 || strcmp(shards[i], shards[u - 1])) shards[u++] = shards[i];
    nshards = u;
    m->files = calloc((size_t)nshards, sizeof *m->files);
    used = calloc((size_t)nshards, sizeof *used);
    if (!m->files || !used) { st = fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", index_path); goto done; }
    for (int64_t i = 0; i < nshards; i++) {
        char *p = join_path(m->dir, shards[i]);
        if (!p) { st = fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", index_path); goto done; }
        st = add_file(m, p);
        free(p);
        if (st) {
            fp4moe_error_context(st, "%s names shard '%s'", index_path, shards[i]);
            goto done;
        }
        used[i] = calloc((size_t)fp4moe_st_count(m->files[i]) + 1, 1);
        if (!used[i]) { st = fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", index_path); goto done; }
    }
    cJSON_ArrayForEach(e, wm) {
        char *key = e->valuestring;
        char **hit = bsearch(&key, shards, (size_t)nshards, sizeof *shards, cmp_str);
        const int64_t fi = hit - shards;
        const fp4moe_st_tensor *t = fp4moe_st_find(m->files[fi], e->string);
        if (!t) {
            st = fp4moe_set_error(FP4MOE_EFORMAT, "%s: tensor '%s' is mapped to '%s', but that file has no such tensor",
                                  index_path, e->string, shards[fi]);
            goto done;
        }
        used[fi][t - fp4moe_st_at(m->files[fi], 0)] = 1; /* a file's tensors are one array */
    }
    int64_t total = 0;
    for (int64_t i = 0; i < nshards; i++) total += fp4moe_st_count(m->files[i]);
    m->tensors = malloc(sizeof *m->tensors * (size_t)(total ? total : 1));
    if (!m->tensors) { st = fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", index_path); goto done; }
    for (int64_t i = 0; i < nshards; i++)
        for (int64_t j = 0; j < fp4moe_st_count(m->files[i]); j++)
            if (used[i][j]) m->tensors[m->count++] = fp4moe_st_at(m->files[i], j);
    if (m->count != nmap) /* a name twice in weight_map: cJSON keeps both entries */
        st = fp4moe_set_error(FP4MOE_EFORMAT, "%s: weight_map names a tensor twice", index_path);
done:
    if (used)
        for (int64_t i = 0; i < nshards; i++) free(used[i]);
    free(used);
    free(shards);
    cJSON_Delete(root);
    return st;
}

/* Builds the sorted name index; a name in two files is an error naming both. */
static int index_names(fp4moe_st_model *m) {
    m->by_name = malloc(sizeof *m->by_name * (size_t)(m->count ? m->count : 1));
    if (!m->by_name) return fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", m->dir);
    memcpy(m->by_name, m->tensors, sizeof *m->by_name * (size_t)m->count);
    qsort(m->by_name, (size_t)m->count, sizeof *m->by_name, cmp_tensor_name);
    for (int64_t i = 1; i < m->count; i++)
        if (!strcmp(m->by_name[i]->name, m->by_name[i - 1]->name))
            return fp4moe_set_error(FP4MOE_EFORMAT, "%s: tensor '%s' is in both '%s' and '%s'", m->dir,
                                    m->by_name[i]->name, m->by_name[i - 1]->file, m->by_name[i]->file);
    return FP4MOE_OK;
}

static int open_dir(fp4moe_st_model *m) {
    char *index = join_path(m->dir, INDEX_NAME);
    if (!index) return fp4moe_set_error(FP4MOE_ENOMEM, "out of memory");
    struct stat sb;
    int st;
    if (stat(index, &sb) == 0) {
        st = open_indexed(m, index);
        free(index);
        return st;
    }
    free(index);
    char **names = NULL;
    int64_t n = 0;
    if ((st = list_shards(m->dir, &names, &n))) return st;
    if (n == 0) {
        free(names);
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: no .safetensors files in the directory", m->dir);
    }
    /* model.safetensors alone when present (transformers' single-file layout) */
    int64_t only = -1;
    for (int64_t i = 0; i < n; i++)
        if (!strcmp(names[i], "model.safetensors")) only = i;
    m->files = calloc((size_t)n, sizeof *m->files);
    if (!m->files) st = fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", m->dir);
    for (int64_t i = 0; i < n && !st; i++) {
        if (only >= 0 && i != only) continue;
        char *p = join_path(m->dir, names[i]);
        if (!p) { st = fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", m->dir); break; }
        st = add_file(m, p);
        free(p);
    }
    for (int64_t i = 0; i < n; i++) free(names[i]);
    free(names);
    if (st) return st;
    return collect_all(m);
}

int fp4moe_st_model_open(const char *path, fp4moe_st_model **out) {
    if (!out) return fp4moe_set_error(FP4MOE_EINVAL, "st_model_open: NULL out");
    *out = NULL;
    if (!path) return fp4moe_set_error(FP4MOE_EINVAL, "st_model_open: NULL path");
    struct stat sb;
    if (stat(path, &sb) != 0)
        return fp4moe_set_error(FP4MOE_EIO, "%s: cannot stat: %s", path, strerror(errno));
    fp4moe_st_model *m = calloc(1, sizeof *m);
    if (!m) return fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", path);
    int st;
    if (S_ISDIR(sb.st_mode)) {
        m->is_dir = 1;
        if (!(m->dir = strdup(path))) { free(m); return fp4moe_set_error(FP4MOE_ENOMEM, "out of memory"); }
        size_t len = strlen(m->dir);
        while (len > 1 && m->dir[len - 1] == '/') m->dir[--len] = '\0';
        st = open_dir(m);
    } else {
        const char *slash = strrchr(path, '/');
        m->dir = slash ? strndup(path, slash == path ? 1 : (size_t)(slash - path)) : strdup(".");
        m->files = calloc(1, sizeof *m->files);
        if (!m->dir || !m->files) st = fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", path);
        else st = add_file(m, path);
        if (!st) st = collect_all(m);
    }
    if (!st) st = index_names(m);
    if (st) {
        fp4moe_st_model_close(m);
        return st;
    }
    *out = m;
    return FP4MOE_OK;
}

void fp4moe_st_model_close(fp4moe_st_model *m) {
    if (!m) return;
    for (int64_t i = 0; i < m->nfiles; i++) fp4moe_st_close(m->files[i]);
    free(m->files);
    free(m->tensors);
    free(m->by_name);
    free(m->dir);
    free(m);
}

const char *fp4moe_st_model_dir(const fp4moe_st_model *m) { return m ? m->dir : ""; }
int fp4moe_st_model_is_dir(const fp4moe_st_model *m) { return m ? m->is_dir : 0; }
int64_t fp4moe_st_model_count(const fp4moe_st_model *m) { return m ? m->count : 0; }
int64_t fp4moe_st_model_nfiles(const fp4moe_st_model *m) { return m ? m->nfiles : 0; }

const fp4moe_st_tensor *fp4moe_st_model_at(const fp4moe_st_model *m, int64_t i) {
    return (m && i >= 0 && i < m->count) ? m->tensors[i] : NULL;
}

const fp4moe_st_file *fp4moe_st_model_file(const fp4moe_st_model *m, int64_t i) {
    return (m && i >= 0 && i < m->nfiles) ? m->files[i] : NULL;
}

const fp4moe_st_tensor *fp4moe_st_model_find(const fp4moe_st_model *m, const char *name) {
    if (!m || !name) return NULL;
    int64_t lo = 0, hi = m->count;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        const int c = strcmp(name, m->by_name[mid]->name);
        if (c == 0) return m->by_name[mid];
        if (c < 0) hi = mid;
        else lo = mid + 1;
    }
    return NULL;
}
