/* config.json of a nemotron_h checkpoint -> fp4moe_config (spec NEMOTRON_H.md "Config fields";
 * field names and defaults as transformers' NemotronHConfig). */
#include "fp4moe/model.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <errno.h>
#include <string.h>
#include <sys/stat.h>

#include "common/error.h"
#include "common/json.h"
#include "model/model_internal.h"

#define MAX_DIM (1LL << 31)   /* any size field: 1 <= value < 2^31 */

const char *fp4moe_quant_mode_name(fp4moe_quant_mode q) {
    switch (q) {
    case FP4MOE_QUANT_NONE: return "dense";
    case FP4MOE_QUANT_MLX_NVFP4: return "mlx-nvfp4";
    case FP4MOE_QUANT_MODELOPT_NVFP4: return "modelopt-nvfp4";
    default: return "?";
    }
}

const char *fp4moe_layer_type_name(char type) {
    switch (type) {
    case FP4MOE_LAYER_MAMBA: return "mamba";
    case FP4MOE_LAYER_ATTENTION: return "attention";
    case FP4MOE_LAYER_MOE: return "moe";
    case FP4MOE_LAYER_MLP: return "mlp";
    default: return "?";
    }
}

/* ---- JSON value helpers -------------------------------------------------------------------- */

/* A number, or {"__float__": "Infinity" | "-Infinity" | "NaN"} (how some writers spell non-finite
 * floats). Returns 1 and sets *v when `it` is one of those, else 0. */
static int json_float(const cJSON *it, double *v) {
    if (cJSON_IsNumber(it)) { *v = it->valuedouble; return 1; }
    const cJSON *f = cJSON_IsObject(it) ? cJSON_GetObjectItemCaseSensitive(it, "__float__") : NULL;
    if (!cJSON_IsString(f)) return 0;
    const char *s = f->valuestring;
    if (!strcmp(s, "Infinity") || !strcmp(s, "inf")) { *v = INFINITY; return 1; }
    if (!strcmp(s, "-Infinity") || !strcmp(s, "-inf")) { *v = -INFINITY; return 1; }
    if (!strcmp(s, "NaN") || !strcmp(s, "nan")) { *v = NAN; return 1; }
    char *end;
    *v = strtod(s, &end);
    return *end == '\0' && end != s;
}

typedef struct {
    const cJSON *root;
    const char *label;
} cfg_src;

static const cJSON *field(const cfg_src *c, const char *name) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(c->root, name);
    return cJSON_IsNull(it) ? NULL : it;
}

/* Integer field in [lo, MAX_DIM). Absent: *v = def when `required` is 0, else an error. */
static int get_int(const cfg_src *c, const char *name, int required, int64_t def, int64_t lo,
                   int64_t *v) {
    const cJSON *it = field(c, name);
    if (!it) {
        if (required)
            return fp4moe_set_error(FP4MOE_EFORMAT, "%s: missing field '%s'", c->label, name);
        *v = def;
        return FP4MOE_OK;
    }
    double d;
    if (!json_float(it, &d) || d != floor(d) || d < (double)lo || d >= (double)MAX_DIM)
        return fp4moe_set_error(FP4MOE_EFORMAT,
                                "%s: field '%s' must be an integer in [%lld, 2^31)", c->label,
                                name, (long long)lo);
    *v = (int64_t)d;
    return FP4MOE_OK;
}

static int get_float(const cfg_src *c, const char *name, double def, float *v) {
    const cJSON *it = field(c, name);
    double d = def;
    if (it && !json_float(it, &d))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: field '%s' must be a number", c->label, name);
    *v = (float)d;
    return FP4MOE_OK;
}

static int get_bool(const cfg_src *c, const char *name, int def, int *v) {
    const cJSON *it = field(c, name);
    if (!it) { *v = def; return FP4MOE_OK; }
    if (!cJSON_IsBool(it))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: field '%s' must be true or false", c->label,
                                name);
    *v = cJSON_IsTrue(it);
    return FP4MOE_OK;
}

/* ---- layer pattern ------------------------------------------------------------------------- */

static char block_type_char(const char *s) {
    if (!strcmp(s, "mamba") || !strcmp(s, "linear_attention")) return FP4MOE_LAYER_MAMBA;
    if (!strcmp(s, "attention") || !strcmp(s, "full_attention")) return FP4MOE_LAYER_ATTENTION;
    if (!strcmp(s, "moe")) return FP4MOE_LAYER_MOE;
    if (!strcmp(s, "mlp")) return FP4MOE_LAYER_MLP;
    return 0;
}

/* layers_block_type (a list of names) -> pattern string (malloc'd) or an error. */
static int pattern_from_list(const cfg_src *c, const cJSON *list, char **out) {
    const int n = cJSON_GetArraySize(list);
    char *p = malloc((size_t)n + 1);
    if (!p) return fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", c->label);
    for (int i = 0; i < n; i++) {
        const cJSON *it = cJSON_GetArrayItem(list, i);
        const char t = cJSON_IsString(it) ? block_type_char(it->valuestring) : 0;
        if (!t) {
            free(p);
            return fp4moe_set_error(FP4MOE_EFORMAT,
                                    "%s: layers_block_type[%d] is %s%s%s (expected mamba, "
                                    "linear_attention, attention, full_attention, moe or mlp)",
                                    c->label, i, cJSON_IsString(it) ? "'" : "not a string",
                                    cJSON_IsString(it) ? it->valuestring : "",
                                    cJSON_IsString(it) ? "'" : "");
        }
        p[i] = t;
    }
    p[n] = '\0';
    *out = p;
    return FP4MOE_OK;
}

static int pattern_from_string(const cfg_src *c, const char *s, char **out) {
    for (const char *q = s; *q; q++)
        if (!strchr("M*E-", *q))
            return fp4moe_set_error(FP4MOE_EFORMAT,
                                    "%s: hybrid_override_pattern has '%c' at %d (expected M, *, E "
                                    "or -)", c->label, *q, (int)(q - s));
    *out = strdup(s);
    return *out ? FP4MOE_OK : fp4moe_set_error(FP4MOE_ENOMEM, "%s: out of memory", c->label);
}

/* Both spellings; when both exist they must agree. */
static int parse_pattern(const cfg_src *c, fp4moe_config *cfg) {
    const cJSON *str = field(c, "hybrid_override_pattern");
    const cJSON *list = field(c, "layers_block_type");
    if (str && !cJSON_IsString(str))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: hybrid_override_pattern must be a string",
                                c->label);
    if (list && !cJSON_IsArray(list))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: layers_block_type must be a list", c->label);
    if (!str && !list)
        return fp4moe_set_error(FP4MOE_EFORMAT,
                                "%s: missing field 'hybrid_override_pattern' (or "
                                "'layers_block_type')", c->label);
    char *a = NULL, *b = NULL;
    int st = str ? pattern_from_string(c, str->valuestring, &a) : FP4MOE_OK;
    if (!st && list) st = pattern_from_list(c, list, &b);
    if (!st && a && b && strcmp(a, b))
        st = fp4moe_set_error(FP4MOE_EFORMAT,
                              "%s: hybrid_override_pattern '%s' and layers_block_type ('%s') "
                              "disagree", c->label, a, b);
    if (st) { free(a); free(b); return st; }
    cfg->layer_types = a ? a : b;
    if (a) free(b);
    cfg->n_layers = (int64_t)strlen(cfg->layer_types);
    if (cfg->n_layers == 0)
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: the layer pattern is empty", c->label);
    int64_t n = 0;
    st = get_int(c, "num_hidden_layers", 0, cfg->n_layers, 1, &n);
    if (st) return st;
    if (n != cfg->n_layers)
        return fp4moe_set_error(FP4MOE_EFORMAT,
                                "%s: num_hidden_layers=%lld but the layer pattern has %lld layers",
                                c->label, (long long)n, (long long)cfg->n_layers);
    return FP4MOE_OK;
}

static int has_layer(const fp4moe_config *cfg, char t) { return strchr(cfg->layer_types, t) != NULL; }

/* ---- quantization ------------------------------------------------------------------------- */

/* MLX: {"group_size": 16, "bits": 4, "mode": "nvfp4"} (mode absent means MLX's "affine"). */
static int parse_mlx_quant(const cfg_src *c, const char *name, const cJSON *q, fp4moe_config *cfg) {
    const cJSON *mode = cJSON_GetObjectItemCaseSensitive(q, "mode");
    const char *m = cJSON_IsString(mode) ? mode->valuestring : "affine";
    if (strcmp(m, "nvfp4"))
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED,
                                "%s: unknown quantization mode '%s' in '%s' (supported: nvfp4)",
                                c->label, m, name);
    const cJSON *gs = cJSON_GetObjectItemCaseSensitive(q, "group_size");
    const cJSON *bits = cJSON_GetObjectItemCaseSensitive(q, "bits");
    if ((gs && (!cJSON_IsNumber(gs) || gs->valuedouble != 16)) ||
        (bits && (!cJSON_IsNumber(bits) || bits->valuedouble != 4)))
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED,
                                "%s: '%s' nvfp4 needs group_size 16 and bits 4", c->label, name);
    cfg->quant = FP4MOE_QUANT_MLX_NVFP4;
    cfg->quant_group_size = 16;
    return FP4MOE_OK;
}

int fp4moe_parse_modelopt_quant(const cJSON *q, const char *label, fp4moe_config *cfg) {
    const cJSON *algo = cJSON_GetObjectItemCaseSensitive(q, "quant_algo");
    if (!cJSON_IsString(algo))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: ModelOpt quantization without 'quant_algo'",
                                label);
    if (strcmp(algo->valuestring, "NVFP4"))
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED,
                                "%s: unknown quantization mode: quant_algo '%s' (supported: NVFP4)",
                                label, algo->valuestring);
    const cJSON *gs = cJSON_GetObjectItemCaseSensitive(q, "group_size");
    if (gs && (!cJSON_IsNumber(gs) || gs->valuedouble != 16))
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: NVFP4 group_size must be 16", label);
    cfg->quant = FP4MOE_QUANT_MODELOPT_NVFP4;
    cfg->quant_group_size = 16;
    return FP4MOE_OK;
}

/* "quantization" (MLX) and "quantization_config" (MLX mirror, ModelOpt, or anything else). */
static int parse_quant(const cfg_src *c, fp4moe_config *cfg) {
    const cJSON *q = field(c, "quantization");
    if (q) {
        if (!cJSON_IsObject(q))
            return fp4moe_set_error(FP4MOE_EFORMAT, "%s: 'quantization' must be an object", c->label);
        return parse_mlx_quant(c, "quantization", q, cfg);
    }
    q = field(c, "quantization_config");
    if (!q) return FP4MOE_OK;
    if (!cJSON_IsObject(q))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: 'quantization_config' must be an object",
                                c->label);
    const cJSON *method = cJSON_GetObjectItemCaseSensitive(q, "quant_method");
    if (cJSON_GetObjectItemCaseSensitive(q, "quant_algo") &&
        (!method || (cJSON_IsString(method) && !strcmp(method->valuestring, "modelopt"))))
        return fp4moe_parse_modelopt_quant(q, c->label, cfg);
    if (!method && cJSON_GetObjectItemCaseSensitive(q, "mode"))
        return parse_mlx_quant(c, "quantization_config", q, cfg);
    return fp4moe_set_error(FP4MOE_EUNSUPPORTED,
                            "%s: unknown quantization mode: quantization_config.quant_method '%s' "
                            "(supported: MLX nvfp4, ModelOpt NVFP4)", c->label,
                            cJSON_IsString(method) ? method->valuestring : "?");
}

/* ---- per layer type ------------------------------------------------------------------------ */

static int parse_mamba(const cfg_src *c, fp4moe_config *cfg) {
    int st;
    if ((st = get_int(c, "mamba_num_heads", 1, 0, 1, &cfg->mamba_heads)) ||
        (st = get_int(c, "mamba_head_dim", 1, 0, 1, &cfg->mamba_head_dim)) ||
        (st = get_int(c, "ssm_state_size", 1, 0, 1, &cfg->ssm_state)) ||
        (st = get_int(c, "n_groups", 1, 0, 1, &cfg->mamba_groups)) ||
        (st = get_int(c, "conv_kernel", 1, 0, 1, &cfg->conv_kernel)) ||
        (st = get_int(c, "chunk_size", 0, 128, 1, &cfg->chunk_size)) ||
        (st = get_bool(c, "use_conv_bias", 1, &cfg->conv_bias)))
        return st;
    int use_bias;
    if ((st = get_bool(c, "use_bias", 0, &use_bias)) ||
        (st = get_bool(c, "mamba_proj_bias", use_bias, &cfg->mamba_proj_bias)) ||
        (st = get_float(c, "time_step_min", 1e-3, &cfg->time_step_min)))
        return st;
    cfg->time_step_limit[0] = 0.0f;
    cfg->time_step_limit[1] = INFINITY;
    const cJSON *lim = field(c, "time_step_limit");
    if (lim) {
        double a, b;
        if (!cJSON_IsArray(lim) || cJSON_GetArraySize(lim) != 2 ||
            !json_float(cJSON_GetArrayItem(lim, 0), &a) || !json_float(cJSON_GetArrayItem(lim, 1), &b))
            return fp4moe_set_error(FP4MOE_EFORMAT,
                                    "%s: time_step_limit must be [lo, hi] (numbers or "
                                    "{\"__float__\": \"Infinity\"})", c->label);
        if (isnan(a) || isnan(b) || a > b)
            return fp4moe_set_error(FP4MOE_EFORMAT, "%s: time_step_limit [%g, %g] must have lo <= hi",
                                    c->label, a, b);
        cfg->time_step_limit[0] = (float)a;
        cfg->time_step_limit[1] = (float)b;
    }
    if (cfg->mamba_heads % cfg->mamba_groups)
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: mamba_num_heads=%lld is not a multiple of "
                                "n_groups=%lld", c->label, (long long)cfg->mamba_heads,
                                (long long)cfg->mamba_groups);
    return FP4MOE_OK;
}

static int parse_attention(const cfg_src *c, fp4moe_config *cfg) {
    int st;
    if ((st = get_int(c, "num_attention_heads", 1, 0, 1, &cfg->attn_heads)) ||
        (st = get_int(c, "num_key_value_heads", 0, cfg->attn_heads, 1, &cfg->kv_heads)))
        return st;
    if (cfg->hidden % cfg->attn_heads && !field(c, "head_dim"))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: missing field 'head_dim'", c->label);
    if ((st = get_int(c, "head_dim", 0, cfg->hidden / cfg->attn_heads, 1, &cfg->head_dim)))
        return st;
    if (cfg->attn_heads % cfg->kv_heads)
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: num_attention_heads=%lld is not a multiple "
                                "of num_key_value_heads=%lld", c->label,
                                (long long)cfg->attn_heads, (long long)cfg->kv_heads);
    return FP4MOE_OK;
}

static int parse_moe(const cfg_src *c, fp4moe_config *cfg) {
    int st;
    if ((st = get_int(c, "n_routed_experts", 1, 0, 1, &cfg->n_experts)) ||
        (st = get_int(c, "num_experts_per_tok", 1, 0, 1, &cfg->top_k)) ||
        (st = get_int(c, "moe_intermediate_size", 1, 0, 1, &cfg->moe_inter)) ||
        (st = get_int(c, "n_shared_experts", 0, 1, 0, &cfg->n_shared)) ||
        (st = get_int(c, "n_group", 0, 1, 1, &cfg->n_group)) ||
        (st = get_int(c, "topk_group", 0, 1, 1, &cfg->topk_group)) ||
        (st = get_bool(c, "norm_topk_prob", 1, &cfg->norm_topk_prob)) ||
        (st = get_float(c, "routed_scaling_factor", 1.0, &cfg->routed_scaling)) ||
        (st = get_int(c, "moe_latent_size", 0, 0, 1, &cfg->moe_latent)))
        return st;
    if (cfg->n_shared > 1)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: n_shared_experts=%lld (supported: 0 or 1)",
                                c->label, (long long)cfg->n_shared);
    if (cfg->n_shared &&
        (st = get_int(c, "moe_shared_expert_intermediate_size", 1, 0, 1, &cfg->shared_inter)))
        return st;
    const int64_t E = cfg->n_experts, g = cfg->n_group;
    if (E % g)
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: n_routed_experts=%lld is not a multiple of "
                                "n_group=%lld", c->label, (long long)E, (long long)g);
    if (cfg->topk_group > g)
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: topk_group=%lld > n_group=%lld", c->label,
                                (long long)cfg->topk_group, (long long)g);
    if (g > 1 && E / g < 2)
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: n_group=%lld leaves fewer than 2 experts per "
                                "group (the group score sums the top 2)", c->label, (long long)g);
    if (cfg->top_k > cfg->topk_group * (E / g))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: num_experts_per_tok=%lld exceeds the %lld "
                                "experts of the topk_group chosen groups", c->label,
                                (long long)cfg->top_k, (long long)(cfg->topk_group * (E / g)));
    if (!isfinite(cfg->routed_scaling))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: routed_scaling_factor is not finite", c->label);
    return FP4MOE_OK;
}

static int parse_mlp(const cfg_src *c, fp4moe_config *cfg) {
    int st = get_int(c, "intermediate_size", 1, 0, 1, &cfg->mlp_inter);
    return st ? st : get_bool(c, "mlp_bias", 0, &cfg->mlp_bias);
}

static int parse_special_tokens(const cfg_src *c, fp4moe_config *cfg) {
    const cJSON *mp = field(c, "max_position_embeddings");
    cfg->max_position = 0;
    if (mp && !cJSON_IsNull(mp)) {
        if (!cJSON_IsNumber(mp) || !(mp->valuedouble >= 1 && mp->valuedouble < 4294967296.0) ||
            mp->valuedouble != (double)(int64_t)mp->valuedouble)
            return fp4moe_set_error(FP4MOE_EFORMAT, "%s: max_position_embeddings must be an integer in [1, 2^32)",
                                    c->label);
        cfg->max_position = (int64_t)mp->valuedouble;
    }
    int64_t *dst[3] = {&cfg->bos_id, &cfg->eos_id, &cfg->pad_id};
    const char *names[3] = {"bos_token_id", "eos_token_id", "pad_token_id"};
    for (int i = 0; i < 3; i++) {
        const cJSON *f = field(c, names[i]), *it;
        *dst[i] = -1;
        /* absent, null or negative: none; a list (eos): every entry an id, the first kept */
        for (it = cJSON_IsArray(f) ? f->child : f; it; it = cJSON_IsArray(f) ? it->next : NULL) {
            if (cJSON_IsNull(it) || (cJSON_IsNumber(it) && it->valuedouble < 0)) continue;
            const double v = cJSON_IsNumber(it) ? it->valuedouble : NAN; /* range first: no overflowing cast */
            if (!(v < (double)cfg->vocab) || v != (double)(int64_t)v) {
                char *t = cJSON_PrintUnformatted(it);
                fp4moe_set_error(FP4MOE_EFORMAT, "%s: %s %s is not a token id (an integer below vocab_size %lld)",
                                 c->label, names[i], t ? t : "?", (long long)cfg->vocab);
                free(t);
                return FP4MOE_EFORMAT;
            }
            if (*dst[i] < 0) *dst[i] = (int64_t)v;
        }
    }
    /* fields that would change the math, which this forward does not implement */
    const char *acts[2][2] = {{"mlp_hidden_act", "relu2"}, {"mamba_hidden_act", "silu"}};
    for (int i = 0; i < 2; i++) {
        const cJSON *a = field(c, acts[i][0]);
        if (a && !cJSON_IsNull(a) && (!cJSON_IsString(a) || strcmp(a->valuestring, acts[i][1])))
            return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: %s = %s: nemotron_h here supports only \"%s\"",
                                    c->label, acts[i][0], cJSON_IsString(a) ? a->valuestring : "(not a string)",
                                    acts[i][1]);
    }
    const cJSON *sw = field(c, "sliding_window");
    if (sw && !cJSON_IsNull(sw))
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: sliding_window is set: nemotron_h attention here is "
                                "full causal attention (sliding_window must be null)", c->label);
    return FP4MOE_OK;
}

static int parse_root(const cfg_src *c, fp4moe_config *cfg) {
    const cJSON *mt = field(c, "model_type");
    if (!mt) return fp4moe_set_error(FP4MOE_EFORMAT, "%s: missing field 'model_type'", c->label);
    if (!cJSON_IsString(mt) || strcmp(mt->valuestring, "nemotron_h"))
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED,
                                "%s: unknown model_type '%s' (supported: nemotron_h)", c->label,
                                cJSON_IsString(mt) ? mt->valuestring : "(not a string)");
    int st;
    if ((st = get_int(c, "hidden_size", 1, 0, 1, &cfg->hidden)) ||
        (st = get_int(c, "vocab_size", 1, 0, 1, &cfg->vocab)) ||
        (st = get_float(c, "layer_norm_epsilon", 1e-5, &cfg->eps)) ||
        (st = get_bool(c, "tie_word_embeddings", 0, &cfg->tie_embeddings)) ||
        (st = parse_pattern(c, cfg)) || (st = parse_special_tokens(c, cfg)) ||
        (st = parse_quant(c, cfg)))
        return st;
    if (!(cfg->eps > 0.0f) || !isfinite(cfg->eps))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: layer_norm_epsilon must be > 0", c->label);
    if (has_layer(cfg, FP4MOE_LAYER_MAMBA) && (st = parse_mamba(c, cfg))) return st;
    if (has_layer(cfg, FP4MOE_LAYER_ATTENTION) && (st = parse_attention(c, cfg))) return st;
    if (has_layer(cfg, FP4MOE_LAYER_MOE) && (st = parse_moe(c, cfg))) return st;
    if (has_layer(cfg, FP4MOE_LAYER_MLP) && (st = parse_mlp(c, cfg))) return st;
    return FP4MOE_OK;
}

int fp4moe_config_parse(const char *json, const char *label, fp4moe_config *cfg) {
    if (!cfg) return fp4moe_set_error(FP4MOE_EINVAL, "config_parse: cfg is NULL");
    memset(cfg, 0, sizeof *cfg);
    if (!label) label = "config";
    if (!json) return fp4moe_set_error(FP4MOE_EINVAL, "config_parse: json is NULL");
    cJSON *root = NULL;
    const int pst = fp4moe_json_parse(json, strlen(json), label, &root);
    if (pst) return pst;
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: not a JSON object", label);
    }
    cfg_src c = {root, label};
    int st = parse_root(&c, cfg);
    cJSON_Delete(root);
    if (st) fp4moe_config_free(cfg);
    return st;
}

void fp4moe_config_free(fp4moe_config *cfg) {
    if (!cfg) return;
    free(cfg->layer_types);
    memset(cfg, 0, sizeof *cfg);
}

/* Whole file into a NUL-terminated malloc'd string; NULL with errno-style message on failure. */
char *fp4moe_read_text_file(const char *path, int *status) {
    struct stat sb;
    if (stat(path, &sb) == 0 && !S_ISREG(sb.st_mode)) { /* a directory, or a pipe fopen would wait on */
        *status = fp4moe_set_error(FP4MOE_EIO, "%s: not a regular file", path);
        return NULL;
    }
    FILE *f = fopen(path, "rb");
    if (!f) { *status = fp4moe_set_error(FP4MOE_EIO, "%s: cannot open: %s", path, strerror(errno)); return NULL; }
    char *buf = NULL;
    long n = -1;
    if (fseek(f, 0, SEEK_END) == 0) n = ftell(f);
    if (n >= 0 && n < (1L << 30) && fseek(f, 0, SEEK_SET) == 0 && (buf = malloc((size_t)n + 1)) &&
        fread(buf, 1, (size_t)n, f) == (size_t)n) {
        buf[n] = '\0';
        fclose(f);
        *status = FP4MOE_OK;
        return buf;
    }
    free(buf);
    fclose(f);
    *status = fp4moe_set_error(FP4MOE_EIO, "%s: cannot read", path);
    return NULL;
}

/* hf_quant_config.json: {"quantization": {"quant_algo": "NVFP4", ...}} (or the fields at top level). */
static int apply_hf_quant_config(const char *path, fp4moe_config *cfg) {
    int st;
    char *text = fp4moe_read_text_file(path, &st);
    if (!text) return st;
    cJSON *root = NULL;
    st = fp4moe_json_parse(text, strlen(text), path, &root);
    free(text);
    if (st) return st;
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: not a JSON object", path);
    }
    const cJSON *q = cJSON_GetObjectItemCaseSensitive(root, "quantization");
    st = fp4moe_parse_modelopt_quant(cJSON_IsObject(q) ? q : root, path, cfg);
    cJSON_Delete(root);
    return st;
}

int fp4moe_config_load(const char *dir, fp4moe_config *cfg) {
    if (!dir || !cfg) return fp4moe_set_error(FP4MOE_EINVAL, "config_load: NULL argument");
    memset(cfg, 0, sizeof *cfg);
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    int st;
    char *text = fp4moe_read_text_file(path, &st);
    if (!text) return st;
    st = fp4moe_config_parse(text, path, cfg);
    free(text);
    if (st) return st;
    snprintf(path, sizeof path, "%s/hf_quant_config.json", dir);
    FILE *f = fopen(path, "rb");
    if (f) {
        fclose(f);
        if (cfg->quant == FP4MOE_QUANT_MLX_NVFP4)
            st = fp4moe_set_error(FP4MOE_EFORMAT, "%s: present, but config.json declares MLX nvfp4",
                                  path);
        else
            st = apply_hf_quant_config(path, cfg);
        if (st) fp4moe_config_free(cfg);
    }
    return st;
}
