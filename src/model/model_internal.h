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
    struct gpu_model *gpu;          /* the weights on the GPU (backend/cuda/placement.h), or NULL */
    int no_host_weights;            /* synthetic on the GPU: the host op_linears hold shapes only */
    int expert_share;               /* loaded as a rank's share: only the routed experts
                                       [expert_lo, expert_hi) are held (else all) */
    int64_t expert_lo, expert_hi;
};

struct fp4moe_session {
    const fp4moe_model *m;
    fp4moe_session_options opt;
    fp4moe_batch *batch;            /* a batch of one sequence */
    int64_t seq;
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

/* src/model/batch.c, for sessions: device timers (CUDA batches), and whether the batch runs on CUDA. */
int batch_profile(fp4moe_batch *b, double ms[FP4MOE_PROF_KINDS], int reset);
int batch_on_cuda(const fp4moe_batch *b);
/* Rows of logits one step can return (all-logits requests are chunked to it). */
int64_t batch_logit_rows(const fp4moe_batch *b);

#endif
