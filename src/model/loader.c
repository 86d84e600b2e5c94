/* Checkpoint directory -> the internal weight layout (model_internal.h). One path for the three
 * formats: a module is NVFP4 exactly when its tensors say so (io/nvfp4_ckpt.h: MLX ".scales",
 * ModelOpt ".weight_scale"), else dense (bf16/f16/f32), which is NVFP4-quantized on load unless
 * the options say otherwise. Tensor names and shapes: spec NEMOTRON_H.md "Tensor names". */
#include "fp4moe/model.h"

#include <fnmatch.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "common/error.h"
#include "fp4moe/nvfp4.h"
#include "fp4moe/checkpoint.h"
#include "backend/cuda/placement.h"
#include "model/model_internal.h"

typedef struct {
    fp4moe_model *m;
    fp4moe_load_options opt;
    int quantized_ckpt;             /* the checkpoint is NVFP4: its dense modules stay dense */
    cJSON *exclude;                 /* ModelOpt exclude_modules (a list of fnmatch patterns) or NULL */
    int64_t done, total;            /* progress, in tensor bytes */
} loader;

/* ---- owned memory ------------------------------------------------------------------------- */

static void *owned_alloc(fp4moe_model *m, int64_t bytes) {
    if (bytes < 0 || (uint64_t)bytes > SIZE_MAX - sizeof(owned_block) - 64) {
        fp4moe_set_error(FP4MOE_EOVERFLOW, "model: allocation of %lld bytes", (long long)bytes);
        return NULL;
    }
    owned_block *b = malloc(sizeof *b + (size_t)bytes + 1);
    if (!b) {
        fp4moe_set_error(FP4MOE_ENOMEM, "model: cannot allocate %lld bytes", (long long)bytes);
        return NULL;
    }
    b->bytes = bytes;
    b->next = m->owned;
    m->owned = b;
    return b->data;
}

/* ---- tensor lookup and checks -------------------------------------------------------------- */

static const char *dir_of(const loader *L) { return fp4moe_st_model_dir(L->m->st); }

static void progress(loader *L, const fp4moe_st_tensor *t) {
    L->done += t->nbytes;
    if (L->opt.progress) L->opt.progress(L->opt.progress_ctx, L->done, L->total);
}

/* The tensor `name`, or an error naming it. */
static int need(loader *L, const char *name, const fp4moe_st_tensor **t) {
    *t = fp4moe_st_model_find(L->m->st, name);
    if (!*t) return fp4moe_set_error(FP4MOE_EFORMAT, "%s: missing tensor '%s'", dir_of(L), name);
    progress(L, *t);
    return FP4MOE_OK;
}

static void format_shape(char *buf, size_t n, int ndim, const int64_t *dims) {
    size_t o = (size_t)snprintf(buf, n, "[");
    for (int d = 0; d < ndim && o < n; d++)
        o += (size_t)snprintf(buf + o, n - o, "%s%lld", d ? ", " : "", (long long)dims[d]);
    if (o < n) snprintf(buf + o, n - o, "]");
}

static int shape_error(const fp4moe_st_tensor *t, int ndim, const int64_t *dims, const char *what) {
    char have[160], want[160];
    format_shape(have, sizeof have, t->ndim, t->shape);
    format_shape(want, sizeof want, ndim, dims);
    return fp4moe_set_error(FP4MOE_EFORMAT, "%s: tensor '%s' has %sshape %s, expected %s", t->file,
                            t->name, what, have, want);
}

/* An NVFP4 tensor whose logical shape (q: codes unpacked) is not dims: both the logical and the stored shape
 * are named (the stored one is packed: K / 8 U32 words or K / 2 bytes a row). */
static int qshape_error(const fp4moe_st_tensor *t, const fp4moe_qtensor *q, int ndim, const int64_t *dims) {
    char have[160], stored[160], want[160];
    format_shape(have, sizeof have, q->ndim, q->shape);
    format_shape(stored, sizeof stored, t->ndim, t->shape);
    format_shape(want, sizeof want, ndim, dims);
    return fp4moe_set_error(FP4MOE_EFORMAT, "%s: NVFP4 tensor '%s' has logical shape %s (stored %s %s), expected %s",
                            t->file, t->name, have, fp4moe_st_dtype_name(t->dtype), stored, want);
}

static int same_shape(int n1, const int64_t *a, int n2, const int64_t *b) {
    if (n1 != n2) return 0;
    for (int d = 0; d < n1; d++)
        if (a[d] != b[d]) return 0;
    return 1;
}

static int check_shape(const fp4moe_st_tensor *t, int ndim, const int64_t *dims) {
    return same_shape(t->ndim, t->shape, ndim, dims) ? FP4MOE_OK : shape_error(t, ndim, dims, "");
}

static int float_dtype(const fp4moe_st_tensor *t, fp4moe_dtype *dt) {
    if (fp4moe_st_dtype_to(t->dtype, dt) == FP4MOE_OK) return FP4MOE_OK;
    return fp4moe_set_error(FP4MOE_EFORMAT, "%s: tensor '%s' has dtype %s, expected F32, F16 or BF16",
                            t->file, t->name, fp4moe_st_dtype_name(t->dtype));
}

/* fp32 copy of a float tensor with n elements (shape already checked). */
static int to_owned_f32(loader *L, const fp4moe_st_tensor *t, const float **out) {
    fp4moe_dtype dt;
    int st = float_dtype(t, &dt);
    if (st) return st;
    float *f = owned_alloc(L->m, t->numel * 4);
    if (!f) return fp4moe_error_context(FP4MOE_ENOMEM, "tensor '%s'", t->name);
    const size_t esz = fp4moe_dtype_size(dt);
    if ((uintptr_t)t->data % esz) {               /* unaligned in the file: copy first */
        memcpy(f, t->data, (size_t)t->nbytes);
        if (dt != FP4MOE_F32) {
            uint16_t *tmp = malloc((size_t)t->nbytes);
            if (!tmp) return fp4moe_set_error(FP4MOE_ENOMEM, "tensor '%s': out of memory", t->name);
            memcpy(tmp, t->data, (size_t)t->nbytes);
            fp4moe_to_f32(tmp, dt, t->numel, f);
            free(tmp);
        }
    } else {
        fp4moe_to_f32(t->data, dt, t->numel, f);
    }
    *out = f;
    return FP4MOE_OK;
}

/* A small float tensor of shape dims[ndim] (or the alternative shape alt when given), as fp32. */
static int load_f32(loader *L, const char *name, int ndim, const int64_t *dims, int alt_ndim,
                    const int64_t *alt, const float **out) {
    const fp4moe_st_tensor *t;
    int st = need(L, name, &t);
    if (st) return st;
    if (!same_shape(t->ndim, t->shape, ndim, dims) &&
        !(alt && same_shape(t->ndim, t->shape, alt_ndim, alt)))
        return shape_error(t, ndim, dims, "");
    return to_owned_f32(L, t, out);
}

static int load_vec(loader *L, const char *name, int64_t n, const float **out) {
    return load_f32(L, name, 1, &n, 0, NULL, out);
}

/* ---- NVFP4 modules ------------------------------------------------------------------------ */

/* A NaN E4M3 scale byte (0x7F/0xFF) is corrupt data (spec NVFP4.md section 1). */
static int check_nan_scales(const fp4moe_st_tensor *s, const uint8_t *scales, int64_t n,
                            int64_t K) {
    const int64_t i = fp4moe_nvfp4_find_nan_scale(scales, n);
    if (i < 0) return FP4MOE_OK;
    const int64_t nb = K / FP4MOE_NVFP4_BLOCK;
    return fp4moe_set_error(FP4MOE_EFORMAT,
                            "%s: tensor '%s' holds the NaN E4M3 scale byte 0x%02X at index %lld "
                            "(row %lld, block %lld): corrupt checkpoint", s->file, s->name,
                            scales[i], (long long)i, (long long)(i / nb), (long long)(i % nb));
}

/* Per-expert decode multipliers (owned), or NULL when the module has no global scale. */
static int load_gs(loader *L, const fp4moe_qtensor *q, const float **out) {
    *out = NULL;
    if (!q->gs) return FP4MOE_OK;
    float *gs = owned_alloc(L->m, q->E * 4);
    if (!gs) return FP4MOE_ENOMEM;
    for (int64_t e = 0; e < q->E; e++) {
        int st = fp4moe_qtensor_gs(q, e, &gs[e]);
        if (st) return st;
    }
    progress(L, q->gs);
    *out = gs;
    return FP4MOE_OK;
}

/* An NVFP4 module used in place (codes and scales point into the mapping). */
static int nvfp4_in_place(loader *L, const fp4moe_qtensor *q, op_linear *lin) {
    const int64_t n = q->E * q->N * (q->K / FP4MOE_NVFP4_BLOCK);
    int st = check_nan_scales(q->scales, q->scales->data, n, q->K);
    if (st) return st;
    progress(L, q->scales);
    lin->nvfp4 = 1;
    lin->E = q->E; lin->N = q->N; lin->K = q->K;
    lin->q.codes = q->weight->data;
    lin->q.scales = q->scales->data;
    lin->q.E = q->E; lin->q.N = q->N; lin->q.K = q->K;
    return load_gs(L, q, &lin->q.global_scale);
}

/* Stacked NVFP4 buffers (owned) for E experts of N x K. */
static int nvfp4_alloc(loader *L, int64_t E, int64_t N, int64_t K, int with_gs, op_linear *lin) {
    int64_t n, nc;
    if (fp4moe_mul_overflow(E, N, &n) || fp4moe_mul_overflow(n, K, &n))
        return fp4moe_set_error(FP4MOE_EOVERFLOW, "model: %lld x %lld x %lld weights overflow",
                                (long long)E, (long long)N, (long long)K);
    nc = n / 2;
    uint8_t *codes = owned_alloc(L->m, nc), *scales = owned_alloc(L->m, n / FP4MOE_NVFP4_BLOCK);
    float *gs = with_gs ? owned_alloc(L->m, E * 4) : NULL;
    if (!codes || !scales || (with_gs && !gs)) return FP4MOE_ENOMEM;
    lin->nvfp4 = 1;
    lin->E = E; lin->N = N; lin->K = K;
    lin->q = (fp4moe_nvfp4_weights){codes, scales, gs, E, N, K};
    return FP4MOE_OK;
}

/* A NaN / Inf weight of a tensor quantized on load (element `at` of rows of K): NVFP4 has none (spec section 3
 * would saturate it to a finite code, i.e. change the model silently), so the load stops, as fp4moe quantize
 * does. */
static int nonfinite_error(const char *name, int64_t at, int64_t K) {
    return fp4moe_set_error(FP4MOE_EFORMAT, "tensor '%s' holds a NaN or infinite value at row %lld, column %lld: "
                            "refusing to quantize it on load (NVFP4 has no NaN; the codes would be silently finite; "
                            "fp4moe inspect lists such values, --no-quantize keeps the weights as they are)", name,
                            (long long)(at / K), (long long)(at % K));
}

/* Quantizes rows [row0, row0 + rows) of the dense tensor t (K columns; rows < 0: all its rows,
 * N or E*N) into lin from expert slot e on (spec NVFP4.md section 3, no global scale). */
static int quantize_into(const fp4moe_st_tensor *t, fp4moe_dtype dt, op_linear *lin, int64_t e, int64_t row0,
                         int64_t rows) {
    const int64_t N = lin->N, K = lin->K;
    if (rows < 0) rows = t->numel / K - row0;
    uint8_t *codes = (uint8_t *)lin->q.codes + e * N * (K / 2);
    uint8_t *scales = (uint8_t *)lin->q.scales + e * N * (K / FP4MOE_NVFP4_BLOCK);
    const size_t esz = fp4moe_dtype_size(dt), bytes = (size_t)(rows * K) * esz;
    const void *src = (const uint8_t *)t->data + (size_t)(row0 * K) * esz;
    void *tmp = NULL;
    if ((uintptr_t)src % esz) {                          /* unaligned in the file */
        if (!(tmp = malloc(bytes ? bytes : 1)))
            return fp4moe_set_error(FP4MOE_ENOMEM, "tensor '%s': out of memory", t->name);
        memcpy(tmp, src, bytes);
        src = tmp;
    }
    int64_t bad = -1;
    int st = fp4moe_count_nonfinite(src, dt, rows * K, &bad) ? nonfinite_error(t->name, row0 * K + bad, K)
                                                              : fp4moe_nvfp4_quantize(src, dt, rows, K, 0.0f, codes,
                                                                                      scales, NULL);
    free(tmp);
    return st ? fp4moe_error_context(st, "quantizing '%s'", t->name) : FP4MOE_OK;
}

/* ---- dense modules ------------------------------------------------------------------------ */

/* Pointer to usable dense data: in place when aligned, else an owned copy. */
static const void *dense_data(loader *L, const fp4moe_st_tensor *t, fp4moe_dtype dt) {
    if ((uintptr_t)t->data % fp4moe_dtype_size(dt) == 0) return t->data;
    void *p = owned_alloc(L->m, t->nbytes);
    if (p) memcpy(p, t->data, (size_t)t->nbytes);
    return p;
}

static int dense_alloc(loader *L, int64_t E, int64_t N, int64_t K, fp4moe_dtype dt, op_linear *lin) {
    const void **ptrs = owned_alloc(L->m, E * (int64_t)sizeof(void *));
    if (!ptrs) return FP4MOE_ENOMEM;
    lin->nvfp4 = 0;
    lin->E = E; lin->N = N; lin->K = K;
    lin->dtype = dt;
    lin->dense = ptrs;
    return FP4MOE_OK;
}

/* Expert e of a dense module: quantized on load or referenced in place. */
static int dense_expert(loader *L, const fp4moe_st_tensor *t, fp4moe_dtype dt, op_linear *lin,
                        int64_t e) {
    if (lin->nvfp4) return quantize_into(t, dt, lin, e, 0, -1);
    if (dt != lin->dtype)
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: tensor '%s' is %s, its siblings are %s",
                                t->file, t->name, fp4moe_st_dtype_name(t->dtype),
                                fp4moe_dtype_name(lin->dtype));
    const void *p = dense_data(L, t, dt);
    if (!p) return FP4MOE_ENOMEM;
    ((const void **)lin->dense)[e] = p;
    return FP4MOE_OK;
}

/* Quantize-on-load applies to dense checkpoints only: the dense modules of an NVFP4 checkpoint
 * (ModelOpt exclude_modules, MLX per-module overrides) were left unquantized on purpose. */
static int want_quantize(const loader *L, int64_t K) {
    return L->opt.quantize && !L->quantized_ckpt && K % FP4MOE_NVFP4_BLOCK == 0;
}

/* ---- linear modules ----------------------------------------------------------------------- */

/* A dense module of a ModelOpt checkpoint that its exclude_modules does not list (kept dense on
 * purpose, or quantized and lost?): counted for the caller's warning. */
static void note_unlisted(loader *L, const char *module) {
    if (!L->exclude) return;
    const cJSON *p;
    cJSON_ArrayForEach(p, L->exclude)
        if (cJSON_IsString(p) && fnmatch(p->valuestring, module, 0) == 0) return;
    fp4moe_model_stats *s = &L->m->stats;
    if (!s->n_dense_unlisted++) snprintf(s->first_dense_unlisted, sizeof s->first_dense_unlisted, "%s", module);
}

/* exclude_modules of a ModelOpt checkpoint in dir: config.json's quantization_config, else
 * hf_quant_config.json's quantization (NULL when neither lists it). */
static cJSON *modelopt_exclude(const char *dir) {
    const char *files[2] = {"config.json", "hf_quant_config.json"}, *keys[2] = {"quantization_config", "quantization"};
    for (int i = 0; i < 2; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, files[i]);
        int status = 0;
        char *text = fp4moe_read_text_file(path, &status);
        cJSON *j = text ? cJSON_Parse(text) : NULL;
        free(text);
        cJSON *q = cJSON_GetObjectItemCaseSensitive(j, keys[i]);
        cJSON *ex = cJSON_DetachItemFromObjectCaseSensitive(q, "exclude_modules");
        cJSON_Delete(j);
        if (cJSON_IsArray(ex)) return ex;
        cJSON_Delete(ex);
    }
    return NULL;
}

/* A packed NVFP4 tensor whose scales are missing would otherwise be blamed on its dtype/shape. */
static int packed_without_scales(const fp4moe_st_tensor *t) {
    const int n = (int)strlen(t->name) - (int)strlen(".weight");
    if (t->dtype == FP4MOE_ST_U32)
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: tensor '%s' holds packed MLX nvfp4 codes (U32) but its block "
                                "scales '%.*s.scales' are missing", t->file, t->name, n, t->name);
    if (t->dtype == FP4MOE_ST_U8)
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: tensor '%s' holds packed NVFP4 codes (U8) but its block scales "
                                "'%.*s.weight_scale' (ModelOpt) or '%.*s.scales' (MLX) are missing", t->file, t->name,
                                n, t->name, n, t->name);
    return FP4MOE_OK;
}

static int load_bias(loader *L, const char *module, int64_t N, op_linear *lin) {
    char name[512];
    snprintf(name, sizeof name, "%s.bias", module);
    return load_vec(L, name, N, &lin->bias);
}

/* `module`.weight as an (N, K) linear layer (E = 1), with `module`.bias when has_bias. */
static int load_linear(loader *L, const char *module, int64_t N, int64_t K, int has_bias,
                       op_linear *lin) {
    char name[512];
    snprintf(name, sizeof name, "%s.weight", module);
    const fp4moe_st_tensor *t;
    fp4moe_qtensor q;
    int st = need(L, name, &t);
    if (st) return st;
    const int64_t dims[2] = {N, K};
    const int isq = fp4moe_qtensor_of(L->m->st, t, &q);
    if (isq < 0) return isq;
    if (isq) {
        if (!same_shape(q.ndim, q.shape, 2, dims)) return qshape_error(t, &q, 2, dims);
        st = nvfp4_in_place(L, &q, lin);
    } else {
        fp4moe_dtype dt;
        if ((st = packed_without_scales(t)) || (st = check_shape(t, 2, dims)) || (st = float_dtype(t, &dt))) return st;
        note_unlisted(L, module);
        if (want_quantize(L, K)) st = nvfp4_alloc(L, 1, N, K, 0, lin);
        else st = dense_alloc(L, 1, N, K, dt, lin);
        if (!st) st = dense_expert(L, t, dt, lin, 0);
    }
    if (!st && has_bias) st = load_bias(L, module, N, lin);
    return st;
}

/* ---- stacked experts ---------------------------------------------------------------------- */

/* MLX: one stacked NVFP4 tensor (E, N, K) used in place. */
static int load_experts_stacked(loader *L, const fp4moe_st_tensor *t, int64_t E, int64_t N,
                                int64_t K, op_linear *lin) {
    fp4moe_qtensor q;
    const int64_t dims[3] = {E, N, K};
    const int isq = fp4moe_qtensor_of(L->m->st, t, &q);
    if (isq < 0) return isq;
    progress(L, t);
    if (isq) {
        if (!same_shape(q.ndim, q.shape, 3, dims)) return qshape_error(t, &q, 3, dims);
        const int st = nvfp4_in_place(L, &q, lin);
        if (!st) op_linear_experts(lin, L->m->expert_lo, L->m->expert_hi, lin); /* the rank's share */
        return st;
    }
    fp4moe_dtype dt;
    int st;
    if ((st = packed_without_scales(t)) || (st = check_shape(t, 3, dims)) || (st = float_dtype(t, &dt))) return st;
    const int64_t lo = L->m->expert_lo, n = L->m->expert_hi - lo; /* the rank's share */
    if (want_quantize(L, K)) { /* the share's n x N rows at once */
        if ((st = nvfp4_alloc(L, n, N, K, 0, lin))) return st;
        return quantize_into(t, dt, lin, 0, lo * N, n * N);
    }
    if ((st = dense_alloc(L, n, N, K, dt, lin))) return st;
    const void *p = dense_data(L, t, dt);
    if (!p) return FP4MOE_ENOMEM;
    for (int64_t e = 0; e < n; e++)
        ((const void **)lin->dense)[e] = (const uint8_t *)p + (lo + e) * N * K * fp4moe_dtype_size(dt);
    return FP4MOE_OK;
}

/* One unstacked NVFP4 expert (ModelOpt) copied into slot e of the stacked buffers. */
static int copy_nvfp4_expert(loader *L, const fp4moe_qtensor *q, op_linear *lin, int64_t e) {
    const int64_t N = lin->N, K = lin->K, nc = N * (K / 2), ns = N * (K / FP4MOE_NVFP4_BLOCK);
    int st = check_nan_scales(q->scales, q->scales->data, ns, K);
    if (st) return st;
    progress(L, q->scales);
    memcpy((uint8_t *)lin->q.codes + e * nc, q->weight->data, (size_t)nc);
    memcpy((uint8_t *)lin->q.scales + e * ns, q->scales->data, (size_t)ns);
    float gs = 1.0f;
    if ((st = fp4moe_qtensor_gs(q, 0, &gs))) return st;
    if (q->gs) progress(L, q->gs);
    ((float *)lin->q.global_scale)[e] = gs;
    return FP4MOE_OK;
}

/* transformers / ModelOpt: experts.{e}.{proj}.weight, one tensor per expert, stacked here. */
static int load_experts_unstacked(loader *L, const char *prefix, const char *proj, int64_t E,
                                  int64_t N, int64_t K, op_linear *lin) {
    const int64_t dims[2] = {N, K};
    const int64_t lo = L->m->expert_lo, hi = L->m->expert_hi; /* the rank's share only */
    int first_q = -1, st;
    (void)E;
    for (int64_t e = lo; e < hi; e++) {
        char name[512];
        snprintf(name, sizeof name, "%sexperts.%lld.%s.weight", prefix, (long long)e, proj);
        const fp4moe_st_tensor *t;
        fp4moe_qtensor q;
        if ((st = need(L, name, &t))) return st;
        const int isq = fp4moe_qtensor_of(L->m->st, t, &q);
        if (isq < 0) return isq;
        if (e == lo) {
            first_q = isq;
            fp4moe_dtype dt = FP4MOE_BF16;
            if (!isq && (st = float_dtype(t, &dt))) return st;
            if (isq) st = nvfp4_alloc(L, hi - lo, N, K, 1, lin);
            else if (want_quantize(L, K)) st = nvfp4_alloc(L, hi - lo, N, K, 0, lin);
            else st = dense_alloc(L, hi - lo, N, K, dt, lin);
            if (st) return st;
        }
        if (isq != first_q)
            return fp4moe_set_error(FP4MOE_EFORMAT, "%s: tensor '%s' is %s but expert %lld is %s",
                                    t->file, name, isq ? "NVFP4" : "dense", (long long)lo,
                                    first_q ? "NVFP4" : "dense");
        if (isq) {
            if (!same_shape(q.ndim, q.shape, 2, dims)) return qshape_error(t, &q, 2, dims);
            st = copy_nvfp4_expert(L, &q, lin, e - lo);
        } else {
            fp4moe_dtype dt;
            if ((st = check_shape(t, 2, dims)) || (st = float_dtype(t, &dt))) return st;
            st = dense_expert(L, t, dt, lin, e - lo);
        }
        if (st) return st;
    }
    return FP4MOE_OK;
}

/* Routed experts of layer `prefix` ("backbone.layers.L.mixer."): up (fc1) or down (fc2). */
static int load_experts(loader *L, const char *prefix, int up, int64_t E, int64_t N, int64_t K,
                        op_linear *lin) {
    char name[512];
    snprintf(name, sizeof name, "%sswitch_mlp.%s.weight", prefix, up ? "fc1" : "fc2");
    const fp4moe_st_tensor *t = fp4moe_st_model_find(L->m->st, name);
    if (!t) {   /* transformers may also store the stacked parameter experts.{up,down}_proj */
        snprintf(name, sizeof name, "%sexperts.%s", prefix, up ? "up_proj" : "down_proj");
        t = fp4moe_st_model_find(L->m->st, name);
    }
    if (t) return load_experts_stacked(L, t, E, N, K, lin);
    return load_experts_unstacked(L, prefix, up ? "up_proj" : "down_proj", E, N, K, lin);
}

/* ---- layers ------------------------------------------------------------------------------- */

static int load_mamba(loader *L, const char *p, layer_weights *w) {
    const fp4moe_config *c = &L->m->cfg;
    const int64_t H = c->hidden, di = c->mamba_heads * c->mamba_head_dim, nh = c->mamba_heads;
    const int64_t conv_dim = di + 2 * c->mamba_groups * c->ssm_state, Kc = c->conv_kernel;
    char n[512];
    int st;
    snprintf(n, sizeof n, "%sin_proj", p);
    if ((st = load_linear(L, n, 2 * di + 2 * c->mamba_groups * c->ssm_state + nh, H,
                          c->mamba_proj_bias, &w->in_proj)))
        return st;
    snprintf(n, sizeof n, "%sout_proj", p);
    if ((st = load_linear(L, n, H, di, c->mamba_proj_bias, &w->out_proj))) return st;
    const int64_t cw[3] = {conv_dim, 1, Kc}, cw_mlx[3] = {conv_dim, Kc, 1};
    snprintf(n, sizeof n, "%sconv1d.weight", p);
    if ((st = load_f32(L, n, 3, cw, 3, cw_mlx, &w->conv_w))) return st;
    if (c->conv_bias) {
        snprintf(n, sizeof n, "%sconv1d.bias", p);
        if ((st = load_vec(L, n, conv_dim, &w->conv_b))) return st;
    }
    const float *A_log;
    snprintf(n, sizeof n, "%sA_log", p);
    if ((st = load_vec(L, n, nh, &A_log))) return st;
    float *A = (float *)A_log;                     /* owned copy: A = -exp(A_log) in place */
    for (int64_t h = 0; h < nh; h++) A[h] = -expf(A[h]);
    w->A = A;
    snprintf(n, sizeof n, "%sD", p);
    if ((st = load_vec(L, n, nh, &w->D))) return st;
    snprintf(n, sizeof n, "%sdt_bias", p);
    if ((st = load_vec(L, n, nh, &w->dt_bias))) return st;
    snprintf(n, sizeof n, "%snorm.weight", p);
    return load_vec(L, n, di, &w->gnorm);
}

static int load_attention(loader *L, const char *p, layer_weights *w) {
    const fp4moe_config *c = &L->m->cfg;
    const int64_t H = c->hidden, q = c->attn_heads * c->head_dim, kv = c->kv_heads * c->head_dim;
    char n[512];
    int st;
    snprintf(n, sizeof n, "%sq_proj", p);
    if ((st = load_linear(L, n, q, H, 0, &w->q_proj))) return st;
    snprintf(n, sizeof n, "%sk_proj", p);
    if ((st = load_linear(L, n, kv, H, 0, &w->k_proj))) return st;
    snprintf(n, sizeof n, "%sv_proj", p);
    if ((st = load_linear(L, n, kv, H, 0, &w->v_proj))) return st;
    snprintf(n, sizeof n, "%so_proj", p);
    return load_linear(L, n, H, q, 0, &w->o_proj);
}

static int load_mlp_pair(loader *L, const char *p, const char *sub, int64_t I, int64_t H, int bias,
                         op_linear *up, op_linear *down) {
    char n[512];
    int st;
    snprintf(n, sizeof n, "%s%sup_proj", p, sub);
    if ((st = load_linear(L, n, I, H, bias, up))) return st;
    snprintf(n, sizeof n, "%s%sdown_proj", p, sub);
    return load_linear(L, n, H, I, bias, down);
}

static int load_moe(loader *L, const char *p, layer_weights *w) {
    const fp4moe_config *c = &L->m->cfg;
    const int64_t H = c->hidden, E = c->n_experts, Hl = c->moe_latent ? c->moe_latent : H;
    char n[512];
    int st;
    const int64_t gdims[2] = {E, H};
    snprintf(n, sizeof n, "%sgate.weight", p);
    if ((st = load_f32(L, n, 2, gdims, 0, NULL, &w->router_w))) return st;
    snprintf(n, sizeof n, "%sgate.e_score_correction_bias", p);
    if ((st = load_vec(L, n, E, &w->router_bias))) return st;
    if ((st = load_experts(L, p, 1, E, c->moe_inter, Hl, &w->experts_up)) ||
        (st = load_experts(L, p, 0, E, Hl, c->moe_inter, &w->experts_down)))
        return st;
    if (c->n_shared &&
        (st = load_mlp_pair(L, p, "shared_experts.", c->shared_inter, H, c->mlp_bias, &w->shared_up,
                            &w->shared_down)))
        return st;
    if (c->moe_latent) {
        snprintf(n, sizeof n, "%sfc1_latent_proj", p);
        if ((st = load_linear(L, n, Hl, H, c->mlp_bias, &w->latent_in))) return st;
        snprintf(n, sizeof n, "%sfc2_latent_proj", p);
        if ((st = load_linear(L, n, H, Hl, c->mlp_bias, &w->latent_out))) return st;
    }
    return FP4MOE_OK;
}

static int load_layer(loader *L, int64_t l) {
    const fp4moe_config *c = &L->m->cfg;
    layer_weights *w = &L->m->layers[l];
    char p[128], n[160];
    snprintf(p, sizeof p, "backbone.layers.%lld.mixer.", (long long)l);
    snprintf(n, sizeof n, "backbone.layers.%lld.norm.weight", (long long)l);
    w->type = c->layer_types[l];
    int st = load_vec(L, n, c->hidden, &w->norm);
    if (st) return st;
    switch (w->type) {
    case FP4MOE_LAYER_MAMBA: st = load_mamba(L, p, w); break;
    case FP4MOE_LAYER_ATTENTION: st = load_attention(L, p, w); break;
    case FP4MOE_LAYER_MOE: st = load_moe(L, p, w); break;
    default: st = load_mlp_pair(L, p, "", c->mlp_inter, c->hidden, c->mlp_bias, &w->up, &w->down);
    }
    return st ? fp4moe_error_context(st, "layer %lld (%s)", (long long)l,
                                     fp4moe_layer_type_name(w->type))
              : FP4MOE_OK;
}

/* ---- embedding and head ------------------------------------------------------------------- */

/* The embedding is always used as stored: dense in place, or NVFP4 (MLX quantizes it). */
static int load_embedding(loader *L) {
    const fp4moe_config *c = &L->m->cfg;
    const fp4moe_st_tensor *t;
    fp4moe_qtensor q;
    int st = need(L, "backbone.embeddings.weight", &t);
    if (st) return st;
    const int64_t dims[2] = {c->vocab, c->hidden};
    const int isq = fp4moe_qtensor_of(L->m->st, t, &q);
    if (isq < 0) return isq;
    if (isq) {
        if (!same_shape(q.ndim, q.shape, 2, dims)) return qshape_error(t, &q, 2, dims);
        return nvfp4_in_place(L, &q, &L->m->embed);
    }
    fp4moe_dtype dt;
    if ((st = check_shape(t, 2, dims)) || (st = float_dtype(t, &dt))) return st;
    if ((st = dense_alloc(L, 1, c->vocab, c->hidden, dt, &L->m->embed))) return st;
    const void *p = dense_data(L, t, dt);
    if (!p) return FP4MOE_ENOMEM;
    ((const void **)L->m->embed.dense)[0] = p;
    return FP4MOE_OK;
}

static int load_head(loader *L) {
    fp4moe_model *m = L->m;
    const fp4moe_config *c = &m->cfg;
    if (!c->tie_embeddings || fp4moe_st_model_find(m->st, "lm_head.weight"))
        return load_linear(L, "lm_head", c->vocab, c->hidden, 0, &m->lm_head);
    m->lm_head = m->embed;                             /* tied */
    if (m->embed.nvfp4 || !want_quantize(L, c->hidden)) return FP4MOE_OK;
    int st = nvfp4_alloc(L, 1, c->vocab, c->hidden, 0, &m->lm_head);
    if (st) return st;
    int64_t bad = -1;
    if (fp4moe_count_nonfinite(m->embed.dense[0], m->embed.dtype, c->vocab * c->hidden, &bad))
        st = nonfinite_error("backbone.embeddings.weight (the tied lm_head)", bad, c->hidden);
    else
        st = fp4moe_nvfp4_quantize(m->embed.dense[0], m->embed.dtype, c->vocab, c->hidden, 0.0f,
                                   (uint8_t *)m->lm_head.q.codes, (uint8_t *)m->lm_head.q.scales, NULL);
    return st ? fp4moe_error_context(st, "quantizing the tied lm_head") : FP4MOE_OK;
}

/* ---- statistics --------------------------------------------------------------------------- */

static int64_t linear_bytes(const op_linear *w) {
    if (w->N == 0) return 0;
    const int64_t n = w->E * w->N * w->K;
    int64_t b = w->nvfp4 ? n / 2 + n / FP4MOE_NVFP4_BLOCK + (w->q.global_scale ? w->E * 4 : 0)
                         : n * (int64_t)fp4moe_dtype_size(w->dtype);
    return b + (w->bias ? w->N * 4 : 0);
}

static int64_t linear_params(const op_linear *w) { return w->N ? w->E * w->N * w->K : 0; }

static void count_linear(fp4moe_model_stats *s, const op_linear *w) {
    if (!w->N) return;
    if (w->nvfp4) s->n_nvfp4_linears++;
    else s->n_dense_linears++;
    s->params_total += linear_params(w);
    s->params_active += linear_params(w);
}

static void compute_stats(fp4moe_model *m) {
    const fp4moe_config *c = &m->cfg;
    fp4moe_model_stats *s = &m->stats;
    const int64_t H = c->hidden;
    s->bytes_embed = linear_bytes(&m->embed);
    s->params_total = s->params_active = linear_params(&m->embed) + H;
    s->bytes_norms = H * 4;
    if (m->lm_head.q.codes != m->embed.q.codes || m->lm_head.dense != m->embed.dense) {
        s->bytes_lm_head = linear_bytes(&m->lm_head);
        count_linear(s, &m->lm_head);
    }
    for (int64_t l = 0; l < c->n_layers; l++) {
        const layer_weights *w = &m->layers[l];
        s->bytes_norms += H * 4;
        s->params_total += H;
        s->params_active += H;
        const op_linear *lins[] = {&w->in_proj, &w->out_proj, &w->q_proj, &w->k_proj, &w->v_proj,
                                   &w->o_proj, &w->shared_up, &w->shared_down, &w->latent_in,
                                   &w->latent_out, &w->up, &w->down};
        for (size_t i = 0; i < sizeof lins / sizeof lins[0]; i++) count_linear(s, lins[i]);
        if (w->type == FP4MOE_LAYER_MAMBA) {
            const int64_t di = c->mamba_heads * c->mamba_head_dim;
            const int64_t cd = di + 2 * c->mamba_groups * c->ssm_state;
            const int64_t small = cd * c->conv_kernel + (c->conv_bias ? cd : 0) + 3 * c->mamba_heads + di;
            s->bytes_mamba += linear_bytes(&w->in_proj) + linear_bytes(&w->out_proj) + small * 4;
            s->params_total += small;
            s->params_active += small;
        } else if (w->type == FP4MOE_LAYER_ATTENTION) {
            s->bytes_attention += linear_bytes(&w->q_proj) + linear_bytes(&w->k_proj) +
                                  linear_bytes(&w->v_proj) + linear_bytes(&w->o_proj);
        } else if (w->type == FP4MOE_LAYER_MOE) {
            const int64_t r = c->n_experts * (H + 1);
            s->bytes_moe_router += r * 4;
            s->bytes_moe_experts += linear_bytes(&w->experts_up) + linear_bytes(&w->experts_down);
            s->bytes_moe_shared += linear_bytes(&w->shared_up) + linear_bytes(&w->shared_down) +
                                   linear_bytes(&w->latent_in) + linear_bytes(&w->latent_out);
            const int64_t pe = linear_params(&w->experts_up) + linear_params(&w->experts_down);
            s->params_total += r + pe;
            const int64_t held = w->experts_up.E > 0 ? w->experts_up.E : 1; /* a rank's share: fewer */
            s->params_active += r + pe / held * c->top_k;
            if (w->experts_up.nvfp4) s->n_nvfp4_linears += 2;
            else s->n_dense_linears += 2;
        } else {
            s->bytes_mlp += linear_bytes(&w->up) + linear_bytes(&w->down);
        }
    }
}

/* ---- entry points ------------------------------------------------------------------------- */

void fp4moe_load_options_default(fp4moe_load_options *o) {
    memset(o, 0, sizeof *o);
    o->quantize = 1;
}

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int load_all(loader *L) {
    fp4moe_model *m = L->m;
    for (int64_t i = 0; i < fp4moe_st_model_count(m->st); i++)
        L->total += fp4moe_st_model_at(m->st, i)->nbytes;
    m->layers = calloc((size_t)m->cfg.n_layers, sizeof *m->layers);
    if (!m->layers) return fp4moe_set_error(FP4MOE_ENOMEM, "model: out of memory");
    int st = load_embedding(L);
    for (int64_t l = 0; !st && l < m->cfg.n_layers; l++) st = load_layer(L, l);
    if (!st) st = load_vec(L, "backbone.norm_f.weight", m->cfg.hidden, &m->norm_f);
    if (!st) st = load_head(L);
    if (!st && L->opt.progress) L->opt.progress(L->opt.progress_ctx, L->total, L->total);
    return st;
}

int fp4moe_model_load(const char *dir, const fp4moe_load_options *opts, fp4moe_model **out) {
    if (out) *out = NULL;
    if (!dir || !out) return fp4moe_set_error(FP4MOE_EINVAL, "model_load: NULL %s", !dir ? "directory" : "out");
    struct stat sb;
    if (stat(dir, &sb) == 0 && !S_ISDIR(sb.st_mode))
        return fp4moe_set_error(FP4MOE_EINVAL, "%s is a file; a model is a directory (config.json, *.safetensors, "
                                "tokenizer.json): give its directory%s", dir,
                                strstr(dir, ".safetensors") ? " (fp4moe inspect FILE lists one safetensors file)" : "");
    const double t0 = now_seconds();
    fp4moe_model *m = calloc(1, sizeof *m);
    if (!m) return fp4moe_set_error(FP4MOE_ENOMEM, "model_load: out of memory");
    loader L = {.m = m};
    if (opts) L.opt = *opts;
    else fp4moe_load_options_default(&L.opt);
    if (L.opt.device != FP4MOE_DEVICE_DEFAULT && L.opt.device != FP4MOE_DEVICE_CPU && L.opt.device != FP4MOE_DEVICE_CUDA) {
        free(m);
        return fp4moe_set_error(FP4MOE_EINVAL, "model_load: unknown device %d (cpu, cuda or default)", (int)L.opt.device);
    }
    int st = fp4moe_config_load(dir, &m->cfg);
    if (!st) { /* the routed experts to keep: a rank's share, or all */
        const int64_t E = m->cfg.n_experts, lo = L.opt.expert_lo, hi = L.opt.expert_hi;
        if (!L.opt.expert_share) {
            m->expert_lo = 0;
            m->expert_hi = E;
        } else if (lo < 0 || hi < lo || hi > E || (E > 0 && !strchr(m->cfg.layer_types, FP4MOE_LAYER_MOE))) {
            st = fp4moe_set_error(FP4MOE_EINVAL, "load: expert range [%lld, %lld) of a model with %lld routed "
                                  "experts", (long long)lo, (long long)hi, (long long)E);
        } else {
            m->expert_share = 1;
            m->expert_lo = lo;
            m->expert_hi = hi;
        }
    }
    if (!st) st = fp4moe_st_model_open(dir, &m->st);
    if (!st) {
        m->format = m->cfg.quant;
        if (m->format == FP4MOE_QUANT_MODELOPT_NVFP4) L.exclude = modelopt_exclude(dir);
        L.quantized_ckpt = m->format != FP4MOE_QUANT_NONE ||
                           fp4moe_qformat_detect(m->st) != FP4MOE_QFMT_PLAIN;
        st = load_all(&L);
    }
    cJSON_Delete(L.exclude);
    if (st) {
        fp4moe_model_free(m);
        return st;
    }
    const fp4moe_model_stats unlisted = m->stats;   /* compute_stats starts from zero */
    compute_stats(m);
    m->stats.n_dense_unlisted = unlisted.n_dense_unlisted;
    memcpy(m->stats.first_dense_unlisted, unlisted.first_dense_unlisted, sizeof unlisted.first_dense_unlisted);
    if (L.opt.device == FP4MOE_DEVICE_CUDA &&
        (st = gpu_model_upload(m, L.opt.progress, L.opt.progress_ctx))) {
        fp4moe_model_free(m);
        return st;
    }
    m->stats.load_seconds = now_seconds() - t0;
    *out = m;
    return FP4MOE_OK;
}

void model_compute_stats(fp4moe_model *m) { compute_stats(m); }

void fp4moe_model_free(fp4moe_model *m) {
    if (!m) return;
    gpu_model_free(m->gpu);
    while (m->owned) {
        owned_block *b = m->owned;
        m->owned = b->next;
        free(b);
    }
    free(m->layers);
    fp4moe_st_model_close(m->st);
    fp4moe_config_free(&m->cfg);
    free(m);
}

const fp4moe_config *fp4moe_model_config(const fp4moe_model *m) { return &m->cfg; }

fp4moe_quant_mode fp4moe_model_format(const fp4moe_model *m) { return m->format; }

void fp4moe_model_get_stats(const fp4moe_model *m, fp4moe_model_stats *st) { *st = m->stats; }
