/* Internal: the one weight layout every checkpoint format loads into, the per-layer weights, the
 * session (caches + scratch), and the functions shared by the files of src/model/. */
#ifndef FP4MOE_MODEL_INTERNAL_H
#define FP4MOE_MODEL_INTERNAL_H

#include <stdint.h>

#include "fp4moe/model.h"
#include "fp4moe/safetensors.h"
#include "kernels/cpu/ops.h"

struct cJSON;

/* One layer's weights. Unused members of other layer types are zero. */
typedef struct {
    char type;                      /* FP4MOE_LAYER_* */
    const float *norm;              /* H: the block's pre-norm weight */
    /* Mamba-2 */
    op_linear in_proj, out_proj;    /* (2*d_inner + 2GS + nh, H), (H, d_inner) */
    const float *conv_w;            /* conv_dim x Kc (channel-major) */
    const float *conv_b;            /* conv_dim or NULL */
    const float *A;                 /* nh: -exp(A_log) */
    const float *D, *dt_bias;       /* nh */
    const float *gnorm;             /* d_inner: gated grouped RMSNorm weight */
    /* attention */
    op_linear q_proj, k_proj, v_proj, o_proj;
    /* MoE */
    const float *router_w;          /* E x H, fp32 */
    const float *router_bias;       /* E: e_score_correction_bias (choice only) */
    op_linear experts_up;           /* E stacked (I, Hl) */
    op_linear experts_down;         /* E stacked (Hl, I) */
    op_linear shared_up, shared_down; /* (Is, H), (H, Is); N = 0 when there is no shared expert */
    op_linear latent_in, latent_out;  /* (Hl, H), (H, Hl) when moe_latent_size, else N = 0 */
    /* dense MLP */
    op_linear up, down;
} layer_weights;

/* A block of memory the model owns (converted or quantized weights). */
typedef struct owned_block {
    struct owned_block *next;
    int64_t bytes;
    max_align_t data[];
} owned_block;

struct fp4moe_model {
    fp4moe_config cfg;
    fp4moe_quant_mode format;       /* on disk */
    fp4moe_st_model *st;            /* the mapped files */
    op_linear embed;                /* (V, H): dense in place, or NVFP4 (MLX) */
    layer_weights *layers;          /* cfg.n_layers */
    const float *norm_f;            /* H */
    op_linear lm_head;              /* (V, H) */
    owned_block *owned;             /* everything allocated for the weights */
    fp4moe_model_stats stats;
    struct gpu_model *gpu;          /* the weights on the GPU (model_cuda.h), or NULL */
    int no_host_weights;            /* synthetic on the GPU: the host op_linears hold shapes only */
};

/* Bump allocator of scratch memory for one forward chunk; blocks are kept and reused. */
typedef struct arena_block {
    struct arena_block *next;
    size_t cap, used;
    max_align_t data[];
} arena_block;
typedef struct {
    arena_block *head, *cur;
} arena;
/* 64-byte aligned, uninitialized; NULL (with a message) when out of memory. */
void *arena_alloc(arena *a, size_t bytes);
void arena_reset(arena *a);
void arena_free(arena *a);

/* Per-layer decode state. */
typedef struct {
    float *conv_state;              /* (Kc-1) x conv_dim: the last Kc-1 inputs of the conv, oldest first */
    float *ssm_state;               /* nh x hd x S, fp32 */
    float *k_cache, *v_cache;       /* cap x (nkv*dh) */
    int64_t cap;                    /* KV rows allocated */
} layer_state;

struct fp4moe_session {
    const fp4moe_model *m;
    fp4moe_session_options opt;
    ops_ctx ops;                    /* act dtype, route, scratch */
    int64_t pos;
    layer_state *ls;
    arena scratch;
    struct gpu_session *gpu;        /* a CUDA session (model_cuda.h): the forward runs there */
};

/* ---- src/model/ functions shared between files ---------------------------------------------- */

/* Whole text file; NULL and *status set on failure (message names the path). */
char *fp4moe_read_text_file(const char *path, int *status);
/* The argument checks of fp4moe_session_forward (NULL, T < 1, token ids, max_context). */
int session_check_input(const fp4moe_session *s, const int32_t *tokens, int64_t T);
/* Fills m->stats from the loaded weights' shapes (loader.c; also used for synthetic models). */
void model_compute_stats(fp4moe_model *m);
/* ModelOpt quantization object -> cfg->quant (errors name `label`). */
int fp4moe_parse_modelopt_quant(const struct cJSON *q, const char *label, fp4moe_config *cfg);

/* Mixers: x is the normed input (T x H, fp32), out receives the mixer output (T x H).
 * They allocate their temporaries from s->scratch. */
int mamba2_forward(fp4moe_session *s, int64_t l, const float *x, int64_t T, float *out);
int attention_forward(fp4moe_session *s, int64_t l, const float *x, int64_t T, float *out);
int moe_forward(fp4moe_session *s, int64_t l, const float *x, int64_t T, float *out);
int mlp_forward(fp4moe_session *s, const op_linear *up, const op_linear *down, const float *x,
                int64_t T, float *out);

#endif
