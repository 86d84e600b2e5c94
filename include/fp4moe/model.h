/* fp4moe/model.h: nemotron_h models on the CPU and (CUDA builds) the GPU: config, checkpoint
 * loading, synthetic weights, forward pass, sampling.
 *
 * The model is specified in docs/spec/NEMOTRON_H.md (the reference implementation is HF
 * transformers' NemotronHForCausalLM, torch path); the NVFP4 format in docs/spec/NVFP4.md.
 *
 * A model is a directory: config.json, *.safetensors (+ model.safetensors.index.json when sharded),
 * optionally hf_quant_config.json (ModelOpt) and tokenizer files. Three checkpoint formats load
 * into one internal layout:
 *   MLX nvfp4      config "quantization": {"mode": "nvfp4", "group_size": 16, "bits": 4};
 *                  quantized modules carry .weight (U32) + .scales (U8), experts stacked as
 *                  mixer.switch_mlp.fc1/fc2; codes and scales are used in place (mmap, no copy).
 *   ModelOpt NVFP4 hf_quant_config.json or config "quantization_config" with quant_algo NVFP4;
 *                  .weight (U8) + .weight_scale (F8_E4M3) + .weight_scale_2 (F32 decode multiplier);
 *                  excluded modules stay BF16; experts are stacked on load (a copy).
 *   dense          bf16/f16/f32 (transformers save_pretrained): every linear layer (and lm_head) is
 *                  NVFP4-quantized on load (spec NVFP4.md section 3, no global scale) unless
 *                  quantize = 0; the embedding is always used in place.
 * Activations: fp32 everywhere, rounded to act_dtype (bf16 or f32) at the input and output of every
 * matmul except the output of lm_head: the logits are fp32 on every device; norms, router, softmax
 * and the SSM state stay fp32.
 *
 * Errors: every function that can fail returns an int fp4moe_status (the others say what they return);
 * fp4moe_last_error() names the file, tensor or field (the message is per thread). A NULL pointer argument is
 * FP4MOE_EINVAL wherever a status is returned, and a function with an `out` parameter sets *out to NULL on every
 * error; every *_free accepts NULL. Threading: a model (and a tokenizer) may be shared by several sessions and
 * batches, each session or batch used by one thread at a time. Two threads running CPU steps at once each start
 * an OpenMP team of their own (all the cores by default): call fp4moe_set_threads(cores / threads) in each of them
 * (OpenMP's team size is per calling thread) or run their steps in turn. */
#ifndef FP4MOE_MODEL_H
#define FP4MOE_MODEL_H

#include <signal.h>
#include <stdint.h>
#include "fp4moe/gather_qmm.h"
#include "fp4moe/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- config --------------------------------------------------------------------------------- */

/* Layer (block) types, one char each, as in `hybrid_override_pattern`. */
#define FP4MOE_LAYER_MAMBA 'M'
#define FP4MOE_LAYER_ATTENTION '*'
#define FP4MOE_LAYER_MOE 'E'
#define FP4MOE_LAYER_MLP '-'

typedef enum {
    FP4MOE_QUANT_NONE = 0,        /* dense checkpoint */
    FP4MOE_QUANT_MLX_NVFP4 = 1,   /* config "quantization": {"mode": "nvfp4"} */
    FP4MOE_QUANT_MODELOPT_NVFP4 = 2 /* quant_algo "NVFP4" (hf_quant_config.json / quantization_config) */
} fp4moe_quant_mode;

/* "dense", "mlx-nvfp4", "modelopt-nvfp4". */
const char *fp4moe_quant_mode_name(fp4moe_quant_mode q);

/* The fields of config.json that the nemotron_h forward pass uses (spec NEMOTRON_H.md "Config
 * fields"). Sizes are element counts. Fields of layer types absent from the pattern are 0. */
typedef struct {
    int64_t n_layers;           /* num_hidden_layers == strlen(layer_types) */
    char *layer_types;          /* n_layers chars of M * E -, NUL-terminated (owned) */
    int64_t hidden;             /* hidden_size H */
    int64_t vocab;              /* vocab_size V */
    float eps;                  /* layer_norm_epsilon (default 1e-5) */
    int tie_embeddings;         /* tie_word_embeddings (default 0) */
    /* Mamba-2 */
    int64_t mamba_heads;        /* mamba_num_heads nh */
    int64_t mamba_head_dim;     /* mamba_head_dim hd; d_inner = nh*hd */
    int64_t ssm_state;          /* ssm_state_size S */
    int64_t mamba_groups;       /* n_groups G (divides nh) */
    int64_t conv_kernel;        /* conv_kernel Kc >= 1 */
    int64_t chunk_size;         /* chunk_size (informational: the scan here is sequential) */
    int conv_bias;              /* use_conv_bias (default 1) */
    int mamba_proj_bias;        /* mamba_proj_bias, else use_bias (default 0): in/out_proj biases */
    float time_step_min;        /* initialisation parameter (synthetic dt_bias); default 1e-3 */
    float time_step_limit[2];   /* time_step_limit [lo, hi] (default [0, inf]): dt is clamped to it
                                   in prefill and decode (src/model/mamba2.c); lo <= hi, no NaN */
    /* attention */
    int64_t attn_heads;         /* num_attention_heads nq */
    int64_t kv_heads;           /* num_key_value_heads nkv (divides nq) */
    int64_t head_dim;           /* head_dim dh (default H / nq) */
    /* MoE */
    int64_t n_experts;          /* n_routed_experts E */
    int64_t top_k;              /* num_experts_per_tok k */
    int64_t moe_inter;          /* moe_intermediate_size I */
    int64_t shared_inter;       /* moe_shared_expert_intermediate_size Is (0: no shared expert) */
    int64_t n_shared;           /* n_shared_experts (0 or 1 supported; default 1) */
    int64_t n_group;            /* n_group (default 1) */
    int64_t topk_group;         /* topk_group (default 1) */
    int norm_topk_prob;         /* default 1 */
    float routed_scaling;       /* routed_scaling_factor (default 1) */
    int64_t moe_latent;         /* moe_latent_size (0 when null/absent) */
    /* dense MLP */
    int64_t mlp_inter;          /* intermediate_size */
    int mlp_bias;               /* mlp_bias (default 0) */
    /* special tokens (-1 when absent) */
    int64_t bos_id, eos_id, pad_id;
    /* quantization as config.json declares it (hf_quant_config.json is read by the loader) */
    fp4moe_quant_mode quant;
    int64_t quant_group_size;   /* 16 for NVFP4 */
    int64_t max_position;       /* max_position_embeddings: the trained context (0 when absent) */
} fp4moe_config;

/* Parses the text of a config.json. `label` names it in messages (e.g. the path; NULL -> "config").
 * Accepts both layer-pattern spellings (hybrid_override_pattern, layers_block_type with
 * mamba/linear_attention, attention/full_attention, moe, mlp; when both are present they must
 * agree), numbers written as {"__float__": "Infinity"} (also -Infinity, NaN), mtp fields ignored.
 * Errors (cfg left zeroed): FP4MOE_EFORMAT (bad JSON, missing or ill-typed field, inconsistent
 * sizes: message names the field), FP4MOE_EUNSUPPORTED (model_type other than nemotron_h, unknown
 * quantization mode or algorithm, n_shared_experts > 1), FP4MOE_ENOMEM. */
int fp4moe_config_parse(const char *json, const char *label, fp4moe_config *cfg);

/* Reads and parses DIR/config.json, and DIR/hf_quant_config.json when present (which then sets
 * quant to FP4MOE_QUANT_MODELOPT_NVFP4 or fails for another quant_algo). Errors: FP4MOE_EIO (cannot
 * read config.json, naming the path) and those of fp4moe_config_parse. */
int fp4moe_config_load(const char *dir, fp4moe_config *cfg);

/* Frees what the config owns and zeroes it; NULL and zeroed configs are fine. */
void fp4moe_config_free(fp4moe_config *cfg);

/* "mamba", "attention", "moe", "mlp" for a layer type char; "?" otherwise. */
const char *fp4moe_layer_type_name(char type);

/* ---- devices ------------------------------------------------------------------------------ */

/* Where weights live and a session runs. DEFAULT: for loading, the CPU only; for a session, CUDA
 * when the model's weights were uploaded to the GPU, else the CPU. */
typedef enum { FP4MOE_DEVICE_DEFAULT = 0, FP4MOE_DEVICE_CPU = 1, FP4MOE_DEVICE_CUDA = 2 } fp4moe_device;

/* "default", "cpu", "cuda". */
const char *fp4moe_device_name(fp4moe_device d);
/* "cpu", "cuda", or "auto" (-> CUDA when fp4moe_cuda_available(), else CPU). FP4MOE_OK or EINVAL. */
int fp4moe_device_parse(const char *s, fp4moe_device *out);

/* ---- model ---------------------------------------------------------------------------------- */

/* Progress of loading: called with (done, total) weight bytes, from the loading thread. */
typedef void (*fp4moe_progress_fn)(void *ctx, int64_t done, int64_t total);

typedef struct {
    int quantize;                 /* dense checkpoints: 1 = NVFP4-quantize linears on load (default) */
    fp4moe_progress_fn progress;  /* NULL: none */
    void *progress_ctx;
    fp4moe_device device;         /* CUDA: after loading, upload every weight once to the current
                                     GPU (the progress callback then runs a second time, 0 .. the
                                     bytes uploaded); the host weights stay usable by CPU sessions.
                                     DEFAULT/CPU: host only */
    int expert_share;             /* expert parallelism: 1 = keep only the routed experts
                                     [expert_lo, expert_hi) of every MoE layer (a rank's share:
                                     fp4moe_ep_range; it may be empty); such a model runs only in a
                                     batch that is that rank of an fp4moe_ep_group. 0 (default): all */
    int64_t expert_lo, expert_hi;
} fp4moe_load_options;

/* quantize = 1, no progress. */
void fp4moe_load_options_default(fp4moe_load_options *o);

typedef struct fp4moe_model fp4moe_model;

/* Loads the model in directory `dir` (opts NULL = defaults). Validates every tensor the config
 * implies: a missing tensor, a wrong dtype or shape, a NaN E4M3 scale byte (0x7F/0xFF) or an
 * unknown global-scale convention is an error naming the tensor (and the position for NaN scales).
 * Tensors the model does not use (mtp.*, input_scale, ...) are ignored.
 * Errors: FP4MOE_EINVAL (dir or out NULL, dir a file), FP4MOE_EIO, FP4MOE_EFORMAT, FP4MOE_EUNSUPPORTED,
 * FP4MOE_EOVERFLOW, FP4MOE_ENOMEM; *out is NULL after any error. */
int fp4moe_model_load(const char *dir, const fp4moe_load_options *opts, fp4moe_model **out);

/* Frees everything (unmaps the files); NULL is a no-op. */
void fp4moe_model_free(fp4moe_model *m);

/* A model with the exact shapes of `cfg` (all layers, experts and vocabulary) and random weights,
 * for benchmarks without the checkpoint (fp4moe bench --synthetic). Every linear layer is NVFP4
 * (random data, never zeros) with realistic block scales: Gaussian-like weights of std 0.02
 * quantized as spec NVFP4.md section 3 (per-expert global scales when cfg->quant is ModelOpt, none
 * otherwise); the embedding is bf16; norms, Mamba parameters and the router are plausible fp32
 * values (src/model/synthetic.c). device CUDA: generated directly in GPU memory by a kernel (never
 * staged on the host; such a model runs CUDA sessions only); CPU: in host memory. The same seed
 * gives the same weights, bit for bit, on both devices. Errors: FP4MOE_EINVAL (bad config or
 * options), FP4MOE_EUNSUPPORTED (CUDA without a GPU / CUDA build), FP4MOE_ENOMEM, FP4MOE_ECUDA. */
typedef struct {
    fp4moe_device device;         /* CPU (DEFAULT) or CUDA */
    uint64_t seed;                /* 0: a fixed default */
    fp4moe_progress_fn progress;  /* NULL: none; (done, total) bytes generated */
    void *progress_ctx;
} fp4moe_synthetic_options;
int fp4moe_model_synthetic(const fp4moe_config *cfg, const fp4moe_synthetic_options *opts,
                           fp4moe_model **out);

/* 1 when the model's weights are on the GPU (loaded with device CUDA, or synthetic on CUDA). */
int fp4moe_model_on_gpu(const fp4moe_model *m);

/* The model's configuration (owned by m, valid while m lives). */
const fp4moe_config *fp4moe_model_config(const fp4moe_model *m);

/* The checkpoint format found on disk (FP4MOE_QUANT_NONE for dense, also when quantized on load). */
fp4moe_quant_mode fp4moe_model_format(const fp4moe_model *m);

/* Weight statistics, by component: parameter counts (weights of quantized modules count one
 * parameter per element) and bytes as held in memory (mapped or owned). */
typedef struct {
    int64_t params_total;
    int64_t params_active;      /* per token: everything but the E - k unused routed experts */
    int64_t bytes_embed, bytes_lm_head, bytes_mamba, bytes_attention, bytes_moe_experts,
        bytes_moe_shared, bytes_moe_router, bytes_mlp, bytes_norms;
    int64_t n_nvfp4_linears, n_dense_linears; /* linear modules (a stacked expert set counts once) */
    double load_seconds;        /* wall time of fp4moe_model_load */
    int64_t n_dense_unlisted;   /* ModelOpt: dense linear modules that its exclude_modules (config.json
                                   quantization_config, or hf_quant_config.json) does not list */
    char first_dense_unlisted[160]; /* the first such module's name ("" when none) */
} fp4moe_model_stats;
void fp4moe_model_get_stats(const fp4moe_model *m, fp4moe_model_stats *st);

/* ---- session: caches + forward -------------------------------------------------------------- */

/* How the CPU computes the NVFP4 matmuls (dense bf16 weights, norms, the router and the SSM are
 * not affected). FLOAT: activations at act_dtype, the f32/bf16 contract of gather_qmm.h. Q8:
 * W4A8 -- each activation row quantized to int8 per 16-element block (fp4moe_gather_qmm_cpu_w4a8),
 * integer dot products; other numerics than FLOAT (its perplexity cost is measured in
 * docs/PERFORMANCE.md). CPU only: a CUDA session or batch with Q8 is FP4MOE_EINVAL. */
typedef enum { FP4MOE_CPU_ACT_FLOAT = 0, FP4MOE_CPU_ACT_Q8 = 1 } fp4moe_cpu_act;

/* How the KV cache stores keys and values. AUTO (default): the backend's own types (CPU: fp32;
 * CUDA: K bf16, V fp16). FP8: E4M3 codes with one fp32 scale per (token, kv head): for the head's
 * head_dim values x, s = max|x| / 448 (s = 1 when every x is 0; NaN when one is), code =
 * e4m3(x / s) (round to nearest even, saturating: fp4moe_f32_to_e4m3), read back as
 * e4m3(code) * s: head_dim + 4 bytes per head and token instead of 4 * head_dim (CPU). The scale is
 * dynamic (computed from each token's values), not the static per-tensor k_scale / v_scale of
 * ModelOpt FP8-KV checkpoints, which it does not read. Accuracy: docs/PERFORMANCE.md. CPU only so
 * far (CUDA batches refuse it). */
typedef enum { FP4MOE_KV_AUTO = 0, FP4MOE_KV_FP8 = 1 } fp4moe_kv_dtype;

/* "auto", "fp8". */
const char *fp4moe_kv_dtype_name(fp4moe_kv_dtype k);
/* Parses the names above. Returns FP4MOE_OK or FP4MOE_EINVAL (message names the accepted ones). */
int fp4moe_kv_dtype_parse(const char *s, fp4moe_kv_dtype *out);

/* "float", "q8". */
const char *fp4moe_cpu_act_name(fp4moe_cpu_act a);
/* Parses the names above. Returns FP4MOE_OK or FP4MOE_EINVAL (message names the accepted ones). */
int fp4moe_cpu_act_parse(const char *s, fp4moe_cpu_act *out);

typedef struct {
    fp4moe_dtype act_dtype;     /* FP4MOE_F32 or FP4MOE_BF16: matmul inputs/outputs (default F32) */
    fp4moe_route route;         /* NVFP4 matmuls: FP4MOE_ROUTE_AUTO (default) or a forced route;
                                   a forced BATCHED/DEQUANT_GEMM is used where rows are sorted and
                                   falls back to QMV for unsorted calls */
    int64_t max_chunk;          /* tokens per forward chunk (bounds activation memory); default 256 */
    int64_t max_context;        /* KV cache limit in tokens; <= 0: grow without limit */
    const volatile sig_atomic_t *interrupt; /* when non-NULL and set: forward stops with
                                               FP4MOE_EINTERRUPTED between chunks and layers
                                               (CUDA: between chunks) */
    fp4moe_device device;       /* DEFAULT: CUDA when the model is on the GPU, else CPU. CUDA needs
                                   a model on the GPU and act_dtype BF16 (activations bf16 at every
                                   matmul, fp32 accumulation, fp32 residual/norms/SSM/router);
                                   decode (T = 1) is captured once as a CUDA graph and replayed
                                   (FP4MOE_CUDA_GRAPH=0: launched op by op) */
    int profile;                /* CUDA: time each layer kind with device events (see
                                   fp4moe_session_profile); off by default: it adds event records */
    fp4moe_cpu_act cpu_act;     /* CPU: FLOAT (default here: fp32 activations, the reference) or Q8 (W4A8 NVFP4
                                   matmuls; the fp4moe CLI's default on the CPU: faster, +0.03% perplexity) */
    fp4moe_kv_dtype kv_dtype;   /* KV cache storage: AUTO (default) or FP8 (CPU) */
    struct fp4moe_ep_group *ep; /* NULL (default); else the session is rank ep_rank of that
                                   expert-parallel group (as fp4moe_batch_options.ep): the other
                                   ranks follow it (fp4moe_ep_follow) and it leaves the group with
                                   fp4moe_session_ep_leave before they can stop */
    int ep_rank;
} fp4moe_session_options;

/* *o = the defaults: every field zero (device DEFAULT, the CPU's default activation mode, KV AUTO, no EP, no
 * profiling) but act_dtype f32, route AUTO, max_chunk 256 tokens. */
void fp4moe_session_options_default(fp4moe_session_options *o);

typedef struct fp4moe_session fp4moe_session;

/* A new empty session (position 0) over model m (m must outlive it). opts NULL = defaults.
 * Errors: FP4MOE_EINVAL (act_dtype not f32/bf16, max_chunk < 1), FP4MOE_ENOMEM. */
int fp4moe_session_new(const fp4moe_model *m, const fp4moe_session_options *opts,
                       fp4moe_session **out);
/* Frees the session and its caches (NULL: nothing). */
void fp4moe_session_free(fp4moe_session *s);
/* An expert-parallel session's fp4moe_ep_leave (see there). Errors: as fp4moe_ep_leave. */
int fp4moe_session_ep_leave(fp4moe_session *s);

/* Back to position 0 (clears the KV cache, the conv and SSM states). */
void fp4moe_session_reset(fp4moe_session *s);

/* Number of tokens consumed so far; -1 for a NULL session. */
int64_t fp4moe_session_pos(const fp4moe_session *s);

/* Runs tokens[0..T) (T >= 1) after everything consumed so far (prefill when T > 1, decode when
 * T == 1; long inputs are processed in chunks of max_chunk). logits: when all_logits, T x V floats
 * (one row per input token), else V floats for the last token; NULL skips lm_head.
 * Errors: FP4MOE_EINVAL (token id outside [0, V), T < 1), FP4MOE_EOVERFLOW (context over
 * max_context), FP4MOE_EINTERRUPTED, FP4MOE_ENOMEM, kernel errors. After an error the session
 * must be reset before further use. */
int fp4moe_session_forward(fp4moe_session *s, const int32_t *tokens, int64_t T, float *logits,
                           int all_logits);

/* Runs tokens[0..T) like fp4moe_session_forward and returns the greedy next token (argmax of the
 * last row of logits, lowest id on ties) without handing the logits to the host: on CUDA the
 * argmax runs on the device and only 4 bytes come back. Errors: those of fp4moe_session_forward. */
int fp4moe_session_forward_argmax(fp4moe_session *s, const int32_t *tokens, int64_t T,
                                  int32_t *next);

/* The device a session runs on (FP4MOE_DEVICE_CPU or FP4MOE_DEVICE_CUDA). */
fp4moe_device fp4moe_session_device(const fp4moe_session *s);

/* Time by layer kind (needs session option profile on a CUDA session): milliseconds of device time
 * since the last reset, measured with CUDA events recorded between the parts of each forward
 * (inside the decode graph too). A layer's pre-norm and residual add count with its kind; in a MoE
 * layer the shared expert (up, relu^2, down) is "moe shared" and the rest "moe routed"; the final
 * norm, lm_head and argmax are "lm_head"; the embedding and dense MLP layers are "other".
 * reset != 0 zeroes the totals after reading.
 * Errors: FP4MOE_EINVAL (profiling off or a CPU session). */
typedef enum {
    FP4MOE_PROF_MAMBA = 0, FP4MOE_PROF_ATTENTION, FP4MOE_PROF_MOE_ROUTED, FP4MOE_PROF_MOE_SHARED,
    FP4MOE_PROF_LM_HEAD, FP4MOE_PROF_OTHER, FP4MOE_PROF_KINDS
} fp4moe_prof_kind;
/* "mamba", "attention", "moe routed", "moe shared", "lm_head", "other". */
const char *fp4moe_prof_kind_name(fp4moe_prof_kind k);
int fp4moe_session_profile(fp4moe_session *s, double ms[FP4MOE_PROF_KINDS], int reset);

/* ---- expert parallelism (issue 13, docs/EP.md) ---------------------------------------------------- */

/* A group of `world` ranks in this process (1..64) that split the routed experts of every MoE
 * layer: rank r runs the experts [floor(r E / world), floor((r+1) E / world)) for the rows of every
 * rank (all-to-all dispatch and combine over an in-process loopback transport), and its own
 * sequences through the rest of the model. A rank is a batch (fp4moe_batch_options.ep, .ep_rank)
 * driven by its own thread; every rank's batch must run the same number of steps (a rank with
 * nothing to do steps with n = 0), because each MoE layer of a step is a collective. Greedy ids are
 * those of one rank (the CPU computes each row's experts the same wherever it runs). CPU and CUDA
 * batches (CUDA: the rows of a MoE layer are staged through host memory for the exchange, and decode
 * steps run without CUDA graphs; docs/EP.md). Errors: FP4MOE_EINVAL (world), FP4MOE_ENOMEM. */
typedef struct fp4moe_ep_group fp4moe_ep_group;
int fp4moe_ep_group_new(int world, fp4moe_ep_group **out);
/* The same group with NCCL as the transport (ncclSend / ncclRecv in a group per exchange, the ranks
 * of this process on CUDA devices devices[r], NULL: device r; one device per rank; NVLink multicast
 * off). libnccl.so.2 is opened at run time (LD_LIBRARY_PATH: the CUDA image's NCCL or the
 * nvidia-nccl wheel's nvidia/nccl/lib). The exchange moves host memory, staged through a device
 * buffer per rank (docs/EP.md). Errors: FP4MOE_EUNSUPPORTED (no CUDA build; NCCL not found),
 * FP4MOE_EINVAL (world, a device out of range or used twice), FP4MOE_ECUDA, FP4MOE_ENOMEM. */
int fp4moe_ep_group_new_nccl(int world, const int *devices, fp4moe_ep_group **out);
/* NCCL's version code (NCCL_VERSION_CODE, e.g. 22703 = 2.27.3), 0 when libnccl.so.2 cannot be opened. */
int fp4moe_nccl_version(void);
/* The routed experts [*lo, *hi) that rank `rank` of `world` owns among E: floor(rank E / world) ..
 * floor((rank + 1) E / world) (uneven splits differ by one expert; world > E leaves ranks none).
 * For fp4moe_load_options.expert_lo / expert_hi. */
void fp4moe_ep_range(int64_t E, int world, int rank, int64_t *lo, int64_t *hi);
/* After every batch that uses it is freed. */
void fp4moe_ep_group_free(fp4moe_ep_group *g);
/* Every step of an expert-parallel batch (fp4moe_batch_step) is announced to the other ranks first.
 * fp4moe_ep_follow(b): a rank without sequences of its own takes part in every step the others take
 * (its experts run the rows sent to it) and returns when no rank steps any more, i.e. every rank
 * follows or has left (*steps, optional: the steps taken). fp4moe_ep_leave(b): this rank will step
 * no more (tell the followers; call it when done, before the followers can return; b can still be
 * freed, not stepped). Ranks that step all together (a bench) need neither. Errors: FP4MOE_EINVAL
 * (not an expert-parallel batch, stepped after leaving), the exchange's. */
typedef struct fp4moe_batch fp4moe_batch;
int fp4moe_ep_follow(fp4moe_batch *b, int64_t *steps);
int fp4moe_ep_leave(fp4moe_batch *b);
/* One round of that protocol for a rank with nothing to step now, for ranks that each get work at
 * any time (a server: each rank its own requests). Every round, every rank calls exactly one of
 * fp4moe_batch_step (it steps) and fp4moe_ep_idle (it does not): this one announces "idle", or
 * "stopping" with stop = 1 (this rank will step no more; it keeps calling fp4moe_ep_idle(b, 1, ..)),
 * takes part in the step of the ranks that step in this round, if any (*stepped = 1, optional), and
 * sets *done = 1 (optional) when every rank announced "stopping" in this round: the group has ended
 * and b has left it (as after fp4moe_ep_leave). A rank without work should wait for work between
 * rounds in which nobody stepped (rather than spin). Errors: as fp4moe_ep_follow. */
int fp4moe_ep_idle(fp4moe_batch *b, int stop, int *stepped, int *done);

/* ---- batch: many sequences in one forward (continuous batching) ---------------------------------- */

/* A batch runs many sequences through ONE forward per step: every row of every sequence goes
 * through one router and one sort by expert (the expert-batched gather route sees the whole
 * batch), while the Mamba conv/scan and attention keep sequences apart. Sequences are added and
 * removed at any step; each has its own conv/SSM state (a pool slot) and KV cache (pages of 32
 * tokens from a pool shared by all sequences). A step takes a ragged set of (sequence, tokens):
 * prefill chunks of some sequences and single decode tokens of others together. Results per
 * sequence are those the sequence gets alone within the fp32 tolerance, not bitwise: the rows a
 * step holds decide some summation orders (on the CPU the dense fp32 matmuls - the router, bf16
 * linears, the lm_head - take OpenBLAS from 8 rows and large enough products, their own loops
 * below; on CUDA the gather route's row grouping), so logits move at the ~1e-6 relative level
 * with the step's make-up (measured: 8.6e-6 in a logprob when a prompt's chunks change); the
 * tests check every sequence's greedy ids equal its solo run's. A session
 * (fp4moe_session_*) is a batch of one. Sampling is per sequence: greedy sequences take out_token
 * (the argmax on the device, only 4 bytes back), the others their logits (FP4MOE_LOGITS_LAST) and
 * their own fp4moe_sampler (temperature, top-p, top-k, min-p, seed, stop ids). Threading: one
 * thread per batch. */
typedef struct {
    int64_t max_seqs;           /* sequences alive at once (pool slots); default 16 */
    int64_t max_kv_tokens;      /* KV tokens over all sequences (the page pool); <= 0: grown on
                                   demand (default) */
    int64_t max_step_tokens;    /* rows per step (bounds activation memory); default 256 */
    int64_t max_context;        /* tokens per sequence; <= 0: max_kv_tokens or 1 << 20 */
    fp4moe_dtype act_dtype;     /* as fp4moe_session_options (CUDA: bf16) */
    fp4moe_route route;
    fp4moe_device device;
    int profile;
    const volatile sig_atomic_t *interrupt;
    fp4moe_cpu_act cpu_act;     /* as fp4moe_session_options */
    fp4moe_kv_dtype kv_dtype;   /* as fp4moe_session_options */
    fp4moe_ep_group *ep;        /* NULL (default): all experts here; else this batch is rank ep_rank
                                   of that expert-parallel group (CPU or CUDA) */
    int ep_rank;
} fp4moe_batch_options;

/* max_seqs 16, max_step_tokens 256, act f32 (CPU) / bf16 (CUDA) by device, route auto. */
void fp4moe_batch_options_default(fp4moe_batch_options *o);


/* A batch over model m (m outlives it). opts NULL: defaults. Device choice and its errors as
 * fp4moe_session_new. Errors: FP4MOE_EINVAL (m or out NULL, bad option: the message names it), FP4MOE_ENOMEM,
 * FP4MOE_ECUDA; *out is NULL after any error. */
int fp4moe_batch_new(const fp4moe_model *m, const fp4moe_batch_options *opts, fp4moe_batch **out);
/* Frees the batch, its sequences and KV pool (NULL: nothing). */
void fp4moe_batch_free(fp4moe_batch *b);

/* A new empty sequence (position 0, zero states); *seq is its id (never reused by this batch).
 * Errors: FP4MOE_EINVAL (b or seq NULL), FP4MOE_EOVERFLOW (max_seqs sequences alive: the message says so). */
int fp4moe_batch_add(fp4moe_batch *b, int64_t *seq);
/* Frees the sequence's slot and KV pages at once. Errors: FP4MOE_EINVAL (b NULL, unknown or removed id). */
int fp4moe_batch_remove(fp4moe_batch *b, int64_t seq);
/* Tokens consumed by the sequence, or -1 for an unknown id. */
int64_t fp4moe_batch_pos(const fp4moe_batch *b, int64_t seq);
/* Sequences alive; KV tokens held (pages x 32) and the pool's size in tokens. */
int64_t fp4moe_batch_count(const fp4moe_batch *b);
void fp4moe_batch_kv_usage(const fp4moe_batch *b, int64_t *used_tokens, int64_t *pool_tokens);

enum { FP4MOE_LOGITS_NONE = 0, FP4MOE_LOGITS_LAST = 1, FP4MOE_LOGITS_ALL = 2 };

/* One sequence's part of a step. */
typedef struct {
    int64_t seq;                /* in: the sequence */
    const int32_t *tokens;      /* in: n >= 1 token ids, consumed after its position */
    int64_t n;
    int logits;                 /* in: FP4MOE_LOGITS_*: out_logits gets V (LAST) or n x V (ALL)
                                   fp32 values */
    float *out_logits;
    int32_t *out_token;         /* in (optional): receives the greedy next token (argmax of the
                                   last row, lowest id on ties; computed on the device) */
    int status;                 /* out: FP4MOE_OK, or this item's error (then nothing of it ran
                                   and the sequence is unchanged) */
    char error[192];            /* out: the message of a failed item */
} fp4moe_batch_item;

/* Runs one step over items[0..n): at most max_step_tokens tokens in all, each sequence at most
 * once. An item that cannot run gets its own status and message and the others go on: unknown
 * sequence, a token id outside [0, V), n < 1, a sequence given twice, tokens beyond max_context
 * (FP4MOE_EOVERFLOW), the KV pool exhausted (FP4MOE_EOVERFLOW: "KV cache pool exhausted"), or
 * no room left in the step (FP4MOE_EOVERFLOW). Returns FP4MOE_OK when the step ran (check each
 * item's status; n = 0 runs nothing and is OK, items may then be NULL), FP4MOE_EINVAL for a NULL b,
 * NULL items with n > 0 or n < 0, or the error of the forward itself (kernel
 * error, FP4MOE_EINTERRUPTED, FP4MOE_ENOMEM): then the sequences of the step are in an undefined
 * state and must be removed. */
int fp4moe_batch_step(fp4moe_batch *b, fp4moe_batch_item *items, int64_t n);

/* Rows of logits one step can return over all its items (an item takes 1 with FP4MOE_LOGITS_LAST or an
 * out_token, n with FP4MOE_LOGITS_ALL, else 0; an item beyond them fails with FP4MOE_EOVERFLOW):
 * min(max_step_tokens, max(max_seqs, 256)). */
int64_t fp4moe_batch_logit_rows(const fp4moe_batch *b);

/* The fixed KV cache pool (max_kv_tokens > 0) of b: the tokens of its free pages, and its page size in tokens
 * (*page, may be NULL). -1 when the pool grows on demand (max_kv_tokens <= 0), the model has no attention layer or b
 * is NULL: no limit to plan for. A sequence of T positions holds ceil(T / page) pages. */
int64_t fp4moe_batch_kv_free(const fp4moe_batch *b, int64_t *page);

/* Device time by layer kind of the batch's steps (option profile, CUDA): as fp4moe_session_profile.
 * Errors: FP4MOE_EINVAL (profiling off, or a CPU batch). */
int fp4moe_batch_profile(fp4moe_batch *b, double ms[FP4MOE_PROF_KINDS], int reset);

/* A copy of a sequence's state at its current position p: the KV rows 0..p-1 of every attention
 * layer and the conv and SSM states of every Mamba layer, in the memory of the batch's device
 * (host memory for a CPU batch, GPU memory for a CUDA batch: taking and restoring a snapshot are
 * device-to-device copies, ~60 MB in well under a millisecond of copy time at the 30B-A3B shape and
 * 2k tokens). The primitive of prefix reuse: a hybrid model's SSM state cannot be truncated, so a
 * prefix is reused by restoring the snapshot taken at its end. A snapshot may outlive its batch
 * (fp4moe_snapshot_free needs none); fp4moe_snapshot_bytes is the device memory it holds. */
typedef struct fp4moe_snapshot fp4moe_snapshot;
/* Errors: FP4MOE_EINVAL (unknown sequence), FP4MOE_ENOMEM, FP4MOE_ECUDA. */
int fp4moe_batch_snapshot(fp4moe_batch *b, int64_t seq, fp4moe_snapshot **out);
/* A new sequence starting from snapshot s (position fp4moe_snapshot_pos(s)). Errors: those of
 * fp4moe_batch_add, FP4MOE_EOVERFLOW (KV pool exhausted), FP4MOE_EINVAL (a snapshot of another
 * model or device kind). */
int fp4moe_batch_add_from_snapshot(fp4moe_batch *b, const fp4moe_snapshot *s, int64_t *seq);
/* The snapshot's position (tokens it holds), -1 for NULL. */
int64_t fp4moe_snapshot_pos(const fp4moe_snapshot *s);
/* Bytes of device (or host) memory the snapshot holds, 0 for NULL. */
size_t fp4moe_snapshot_bytes(const fp4moe_snapshot *s);
/* Frees the snapshot (its batch need not exist any more); NULL: nothing. */
void fp4moe_snapshot_free(fp4moe_snapshot *s);

/* ---- sampling ------------------------------------------------------------------------------- */

typedef struct {
    float p;
    int32_t id;
} fp4moe_prob_id;

#define FP4MOE_MAX_STOP_IDS 16

/* One sequence's sampling settings (each sequence of a batch has its own sampler). */
typedef struct {
    float temperature;          /* <= 0: greedy (argmax, ties -> lowest id) */
    float top_p;                /* nucleus mass in (0, 1]; 1 = no cut */
    int64_t top_k;              /* keep the k most likely tokens; 0 = no cut */
    float min_p;                /* keep tokens with p >= min_p * p_max, in [0, 1]; 0 = no cut */
    uint64_t seed;              /* 0: a fixed default */
    int32_t stop_ids[FP4MOE_MAX_STOP_IDS]; /* token ids that end the sequence (e.g. every EOS id) */
    int n_stop;
    float repeat_penalty;       /* > 0; 1 (or 0) = off: the logit of every token among the last
                                   repeat_last_n accepted ids becomes l / p if l > 0, else l * p
                                   (CTRL / HF RepetitionPenaltyLogitsProcessor, llama.cpp) */
    int64_t repeat_last_n;      /* window of fp4moe_sampler_accept'ed ids; 0: 64 */
    float presence_penalty;     /* finite; 0 = off: every id the output holds (the ids given to
                                   fp4moe_sampler_accept_output) loses presence_penalty from its
                                   logit (OpenAI / vLLM presence_penalty, -2..2 there) */
    float frequency_penalty;    /* finite; 0 = off: each such id loses frequency_penalty x the
                                   times it occurs in the output (OpenAI / vLLM) */
    const int32_t *bias_ids;    /* logit_bias (OpenAI): n_bias ids in [0, vocab) whose logits get
                                   bias[i] (finite) added; both arrays copied by init (an id given
                                   twice: its biases add) */
    const float *bias;
    int64_t n_bias;
} fp4moe_sampler_params;

/* temperature 0 (greedy), top_p 1, top_k 0, min_p 0, seed 0, no stop ids. */
void fp4moe_sampler_params_default(fp4moe_sampler_params *p);

typedef struct {
    int64_t vocab;
    float temperature;
    float top_p;
    int64_t top_k;
    float min_p;
    int32_t stop_ids[FP4MOE_MAX_STOP_IDS];
    int n_stop;
    float repeat_penalty;
    int64_t repeat_last_n, n_recent, recent_head;
    int32_t *recent;            /* ring of the last repeat_last_n accepted ids (owned; NULL: off) */
    uint32_t *mark;             /* vocab: the pass that last penalized each id (owned; with recent) */
    uint32_t pass;
    float presence_penalty, frequency_penalty;
    int32_t *count;             /* vocab: times each id occurs in the output (owned; NULL: both
                                   penalties off) */
    int32_t *out_ids;           /* the distinct ids of the output, first occurrence first (owned) */
    int64_t n_out_ids;
    int32_t *bias_ids;          /* logit_bias (owned copies; NULL: none) */
    float *bias;
    int64_t n_bias;
    float *pen;                 /* vocab scratch: the logits after bias and penalties (owned) */
    uint64_t rng;               /* xorshift64* state */
    float *probs;               /* vocab scratch (owned) */
    fp4moe_prob_id *cand;       /* vocab scratch (owned) */
} fp4moe_sampler;

/* Errors: FP4MOE_EINVAL (vocab < 1, top_p outside (0, 1], min_p outside [0, 1], top_k < 0, NaN or
 * infinite temperature, n_stop outside [0, FP4MOE_MAX_STOP_IDS], a stop id outside [0, vocab),
 * repeat_penalty negative, NaN or infinite, repeat_last_n < 0, a NaN or infinite presence /
 * frequency penalty, n_bias < 0, n_bias > 0 with a NULL array, a bias id outside [0, vocab) or a
 * bias NaN or infinite: the message names it; s or p NULL), FP4MOE_ENOMEM. After any error but a NULL s,
 * *s is zeroed (fp4moe_sampler_free on it is safe). */
int fp4moe_sampler_init_params(fp4moe_sampler *s, int64_t vocab, const fp4moe_sampler_params *p);
/* fp4moe_sampler_init_params with only temperature, top_p and seed set. */
int fp4moe_sampler_init(fp4moe_sampler *s, int64_t vocab, float temperature, float top_p,
                        uint64_t seed);
/* Frees the sampler's buffers (their pointers set to NULL; s itself is the caller's); NULL, or twice: nothing. */
void fp4moe_sampler_free(fp4moe_sampler *s);

/* Records a token of the sequence (prompt or generated) for the repetition penalty; a no-op when
 * the penalty is off (and for ids outside [0, vocab)). */
void fp4moe_sampler_accept(fp4moe_sampler *s, int32_t id);
/* Records a generated token: fp4moe_sampler_accept, and its count in the output for the presence
 * and frequency penalties. */
void fp4moe_sampler_accept_output(fp4moe_sampler *s, int32_t id);
/* Empties that window and the output's counts (a new sequence with the same sampler). */
void fp4moe_sampler_forget(fp4moe_sampler *s);

/* The next token id from V logits, after (in vLLM's order) the logit bias is added, the repetition
 * penalty applied (once per distinct id of the window) and the presence / frequency penalties
 * subtracted (l - frequency_penalty x count - presence_penalty for the output's ids), each only
 * when on: greedy when temperature <= 0; else probs = softmax(logits / T),
 * candidates by probability (descending; ties: lower id first), cut to the top_k first, then to
 * those with p >= min_p * p_max, then to the smallest prefix whose mass reaches top_p (the order of
 * vLLM's and llama.cpp's samplers), and one draw from the renormalised rest. logits: V fp32 values
 * (read only). Returns the id, or -1 with FP4MOE_EINVAL set when s or logits is NULL or s is not
 * initialised. */
int32_t fp4moe_sample(fp4moe_sampler *s, const float *logits);

/* 1 when id is one of the sampler's stop ids. */
int fp4moe_sampler_is_stop(const fp4moe_sampler *s, int32_t id);

/* argmax over n logits, lowest index on ties; NaN never wins (all NaN: 0). n >= 1; n <= 0 returns 0 without
 * reading logits. */
int32_t fp4moe_argmax(const float *logits, int64_t n);

/* Log-probabilities of the model's distribution over V tokens: log_softmax(logits)_i = l_i - max -
 * log(sum_j exp(l_j - max)), the sum in double (NaN logits count as -inf; the logits are those of
 * the model, before temperature, penalties and bias: vLLM's default "raw" logprobs). *lp (when lp
 * is not NULL) receives token id's; top[0..k) the k = min(top_n, V) most likely tokens, .p their
 * log-probability (descending; ties: lower id first). Returns k, or -1 with FP4MOE_EINVAL (NULL
 * logits, V < 1, id outside [0, V), top_n < 0, top_n > 0 with a NULL top). O(V x (1 + k)) at worst,
 * ~2V typically. */
int64_t fp4moe_logprobs(const float *logits, int64_t V, int32_t id, float *lp, int64_t top_n, fp4moe_prob_id *top);

#ifdef __cplusplus
}
#endif
#endif
