/* NVFP4 modules in checkpoints: which tensors belong together, and their shapes (nvfp4_ckpt.h). */
#include "fp4moe/checkpoint.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common/error.h"
#include "fp4moe/nvfp4.h"

const char *fp4moe_qformat_name(fp4moe_qformat f) {
    switch (f) {
    case FP4MOE_QFMT_PLAIN: return "plain";
    case FP4MOE_QFMT_MLX_NVFP4: return "MLX nvfp4";
    case FP4MOE_QFMT_MODELOPT_NVFP4: return "ModelOpt NVFP4";
    case FP4MOE_QFMT_MIXED: return "mixed";
    default: return "?";
    }
}

static int ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && !memcmp(s + a - b, suffix, b);
}

/* The tensor "<module><suffix>" where name = "<module><strip>", or NULL. */
static const fp4moe_st_tensor *sibling(const fp4moe_st_model *m, const char *name, const char *strip,
                                       const char *suffix) {
    char buf[1024];
    size_t base = strlen(name) - strlen(strip);
    if (base + strlen(suffix) + 1 > sizeof buf) return NULL;
    memcpy(buf, name, base);
    strcpy(buf + base, suffix);
    return fp4moe_st_model_find(m, buf);
}

fp4moe_qformat fp4moe_qformat_detect(const fp4moe_st_model *m) {
    int mlx = 0, modelopt = 0;
    for (int64_t i = 0; i < fp4moe_st_model_count(m); i++) {
        const char *n = fp4moe_st_model_at(m, i)->name;
        if (ends_with(n, ".scales") && sibling(m, n, ".scales", ".weight")) mlx = 1;
        if (ends_with(n, ".weight_scale") && sibling(m, n, ".weight_scale", ".weight")) modelopt = 1;
    }
    if (mlx && modelopt) return FP4MOE_QFMT_MIXED;
    return mlx ? FP4MOE_QFMT_MLX_NVFP4 : modelopt ? FP4MOE_QFMT_MODELOPT_NVFP4 : FP4MOE_QFMT_PLAIN;
}

/* codes (..., N, C) and scales (..., N, S) with K = C * per_word and S = K / 16. */
static int check_shapes(fp4moe_qtensor *q, int64_t per_unit) {
    const fp4moe_st_tensor *w = q->weight, *s = q->scales;
    if (w->ndim < 2 || s->ndim != w->ndim)
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: tensor '%s' (%d dims) and its scales '%s' (%d dims) "
                                "must have the same rank >= 2", w->file, w->name, w->ndim, s->name, s->ndim);
    for (int d = 0; d < w->ndim - 1; d++)
        if (w->shape[d] != s->shape[d])
            return fp4moe_set_error(FP4MOE_EFORMAT, "%s: tensor '%s' and its scales '%s' differ in dim %d "
                                    "(%lld vs %lld)", w->file, w->name, s->name, d,
                                    (long long)w->shape[d], (long long)s->shape[d]);
    const int64_t C = w->shape[w->ndim - 1];
    if (C > INT64_MAX / per_unit)
        return fp4moe_set_error(FP4MOE_EOVERFLOW, "%s: tensor '%s': K overflows", w->file, w->name);
    q->K = C * per_unit;
    if (s->shape[s->ndim - 1] * FP4MOE_NVFP4_BLOCK != q->K || q->K == 0)
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: scales '%s' have %lld per row, expected K/16 = %lld "
                                "for tensor '%s' (K = %lld)", s->file, s->name,
                                (long long)s->shape[s->ndim - 1], (long long)(q->K / 16), w->name,
                                (long long)q->K);
    q->ndim = w->ndim;
    q->E = 1;
    for (int d = 0; d < w->ndim; d++) q->shape[d] = w->shape[d];
    q->shape[w->ndim - 1] = q->K;
    for (int d = 0; d < w->ndim - 2; d++) q->E *= w->shape[d]; /* <= numel of w: no overflow */
    q->N = w->shape[w->ndim - 2];
    if (q->gs) {
        if (q->gs->dtype != FP4MOE_ST_F32 || (q->gs->numel != 1 && q->gs->numel != q->E))
            return fp4moe_set_error(FP4MOE_EFORMAT, "%s: global scale '%s' must be F32 with 1 or %lld "
                                    "elements (has %s, %lld)", q->gs->file, q->gs->name, (long long)q->E,
                                    fp4moe_st_dtype_name(q->gs->dtype), (long long)q->gs->numel);
    }
    return 1;
}

int fp4moe_qtensor_of(const fp4moe_st_model *m, const fp4moe_st_tensor *w, fp4moe_qtensor *q) {
    if (!m || !w || !q) return fp4moe_set_error(FP4MOE_EINVAL, "qtensor_of: NULL argument");
    if (!ends_with(w->name, ".weight")) return 0;
    memset(q, 0, sizeof *q);
    q->weight = w;
    const fp4moe_st_tensor *s;
    if ((s = sibling(m, w->name, ".weight", ".scales"))) {
        q->format = FP4MOE_QFMT_MLX_NVFP4;
        if (sibling(m, w->name, ".weight", ".biases"))
            return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: tensor '%s' has \".biases\": MLX affine "
                                    "quantization, not nvfp4", w->file, w->name);
        if (w->dtype != FP4MOE_ST_U32 || s->dtype != FP4MOE_ST_U8)
            return fp4moe_set_error(FP4MOE_EFORMAT, "%s: MLX nvfp4 tensor '%s' must be U32 (is %s) and "
                                    "'%s' U8 (is %s)", w->file, w->name, fp4moe_st_dtype_name(w->dtype),
                                    s->name, fp4moe_st_dtype_name(s->dtype));
        q->scales = s;
        q->gs = sibling(m, w->name, ".weight", ".global_scale");
        return check_shapes(q, 8);
    }
    if ((s = sibling(m, w->name, ".weight", ".weight_scale"))) {
        q->format = FP4MOE_QFMT_MODELOPT_NVFP4;
        if (w->dtype != FP4MOE_ST_U8 || (s->dtype != FP4MOE_ST_F8_E4M3 && s->dtype != FP4MOE_ST_U8))
            return fp4moe_set_error(FP4MOE_EFORMAT, "%s: ModelOpt NVFP4 tensor '%s' must be U8 (is %s) and "
                                    "'%s' F8_E4M3 (is %s)", w->file, w->name, fp4moe_st_dtype_name(w->dtype),
                                    s->name, fp4moe_st_dtype_name(s->dtype));
        q->scales = s;
        q->gs = sibling(m, w->name, ".weight", ".weight_scale_2");
        q->input_scale = sibling(m, w->name, ".weight", ".input_scale");
        if (!q->gs) /* ModelOpt always writes it; a silent 1.0 would decode weights ~1000x too large */
            return fp4moe_set_error(FP4MOE_EFORMAT, "%s: ModelOpt NVFP4 tensor '%s' has no global scale "
                                    "'%.*s.weight_scale_2' (the decode multiplier of its block scales)",
                                    w->file, w->name, (int)(strlen(w->name) - strlen(".weight")), w->name);
        return check_shapes(q, 2);
    }
    return 0;
}

int fp4moe_qtensor_gs(const fp4moe_qtensor *q, int64_t e, float *gs) {
    if (!q || !gs || e < 0 || e >= q->E)
        return fp4moe_set_error(FP4MOE_EINVAL, "qtensor_gs: index %lld out of range", (long long)e);
    if (!q->gs) {
        *gs = 1.0f;
        return FP4MOE_OK;
    }
    float v;
    memcpy(&v, (const uint8_t *)q->gs->data + 4 * (q->gs->numel == 1 ? 0 : e), 4); /* may be unaligned */
    if (!isfinite(v) || v < 0)
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: global scale '%s'[%lld] = %g is not a finite value >= 0",
                                q->gs->file, q->gs->name, (long long)e, v);
    *gs = q->format == FP4MOE_QFMT_MLX_NVFP4 ? v / FP4MOE_NVFP4_GS_DENOM : v;
    return FP4MOE_OK;
}

int fp4moe_qtensor_is_aux(const fp4moe_st_model *m, const char *name) {
    static const struct { const char *suffix; fp4moe_qformat fmt; } aux[] = {
        {".scales", FP4MOE_QFMT_MLX_NVFP4},           {".global_scale", FP4MOE_QFMT_MLX_NVFP4},
        {".weight_scale", FP4MOE_QFMT_MODELOPT_NVFP4}, {".weight_scale_2", FP4MOE_QFMT_MODELOPT_NVFP4},
        {".input_scale", FP4MOE_QFMT_MODELOPT_NVFP4},
    };
    for (size_t i = 0; i < sizeof aux / sizeof aux[0]; i++) {
        if (!ends_with(name, aux[i].suffix)) continue;
        const fp4moe_st_tensor *w = sibling(m, name, aux[i].suffix, ".weight");
        fp4moe_qtensor q;
        if (w && fp4moe_qtensor_of(m, w, &q) == 1 && q.format == aux[i].fmt) return 1;
    }
    return 0;
}
