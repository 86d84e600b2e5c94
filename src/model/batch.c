/* Batches of sequences (include/fp4moe/model.h "batch"): the pools of per-sequence state, the
 * paged KV cache, the step (validation, page allocation, the ragged row layout, outputs) and
 * snapshots. The forward itself is src/model/forward.c, over the backend of the batch.
 *
 * Pools: for each Mamba layer a conv state ((Kc-1) x conv_dim) and an SSM state (nh x hd x S, fp32)
 * per slot; for each attention layer K and V pages of FW_PAGE tokens (act elements), one page
 * table per slot shared by the attention layers (page i of a slot holds its positions
 * i*FW_PAGE .. i*FW_PAGE+FW_PAGE-1). Page ids are allocated from a free list; a sequence holds
 * ceil(pos / FW_PAGE) pages. With max_kv_tokens <= 0 the page pool doubles when it runs out (the
 * rows are copied; CUDA graphs are dropped). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "kernels/cpu/ops.h"
#include "common/error.h"
#include "model/forward.h"
#include "model/ep.h"
#include "model/model_internal.h"

#define TRY(expr)                                                                                  \
    do {                                                                                           \
        const int try_st_ = (expr);                                                                \
        if (try_st_) return try_st_;                                                               \
    } while (0)

#define DEFAULT_CTX_LIMIT ((int64_t)1 << 20)
#define GROW_MIN_PAGES 32

typedef struct {
    int alive;
    int64_t id;                     /* generation * max_seqs + slot */
    int64_t pos;
    int64_t npages;
} seq_slot;

struct fp4moe_batch {
    const fp4moe_model *m;
    fp4moe_batch_options o;
    const be_ops *be;
    void *bc;
    int cuda;
    fw_weights wcpu;                /* CPU placement (CUDA: the model's device placement) */
    const fw_weights *w;
    fw_bufs bufs;
    fw_state *state;                /* per layer */
    int64_t conv_n, ssm_n, kvs;     /* floats per slot and layer; act elements per KV row */
    size_t kv_row;                  /* bytes per KV row (kv_dtype) */
    int64_t n_mamba, n_attn;
    float *conv_pool, *ssm_pool;    /* n_mamba x slots x conv_n / ssm_n */
    void **kpool, **vpool;          /* per attention layer (index into attn list) */
    int64_t n_pages;                /* pages in the pool */
    int32_t *free_pages;            /* stack of free page ids */
    int64_t n_free;
    int grow;
    int64_t ctx_limit, max_pages;
    int32_t *h_pages, *d_pages;     /* max_seqs x max_pages */
    seq_slot *slots;
    int64_t *gen;                   /* per slot: reuse count */
    int64_t alive;
    /* step staging */
    int32_t *h_meta;                /* 4 * cap */
    fw_seg *segs;
    int64_t *order;                 /* item order in the step */
    int32_t *h_next;                /* cap */
    void *ep_views;                 /* expert parallelism: this rank's expert views */
    fw_ep_scratch ep_ws;            /* and the buffers its MoE layers keep */
    int ep_left;                    /* fp4moe_ep_leave was called */
};

const char *fp4moe_cpu_act_name(fp4moe_cpu_act a) {
    return a == FP4MOE_CPU_ACT_Q8 ? "q8" : a == FP4MOE_CPU_ACT_FLOAT ? "float" : "?";
}

const char *fp4moe_kv_dtype_name(fp4moe_kv_dtype k) {
    return k == FP4MOE_KV_FP8 ? "fp8" : k == FP4MOE_KV_AUTO ? "auto" : "?";
}

int fp4moe_kv_dtype_parse(const char *s, fp4moe_kv_dtype *out) {
    if (s && !strcmp(s, "auto")) *out = FP4MOE_KV_AUTO;
    else if (s && !strcmp(s, "fp8")) *out = FP4MOE_KV_FP8;
    else return fp4moe_set_error(FP4MOE_EINVAL, "KV cache type '%s' (auto or fp8)", s ? s : "(null)");
    return FP4MOE_OK;
}

int fp4moe_cpu_act_parse(const char *s, fp4moe_cpu_act *out) {
    if (s && !strcmp(s, "float")) *out = FP4MOE_CPU_ACT_FLOAT;
    else if (s && !strcmp(s, "q8")) *out = FP4MOE_CPU_ACT_Q8;
    else return fp4moe_set_error(FP4MOE_EINVAL, "CPU activation mode '%s' (float or q8)", s ? s : "(null)");
    return FP4MOE_OK;
}

void fp4moe_batch_options_default(fp4moe_batch_options *o) {
    memset(o, 0, sizeof *o);
    o->max_seqs = 16;
    o->max_step_tokens = 256;
    o->act_dtype = FP4MOE_F32;
    o->route = FP4MOE_ROUTE_AUTO;
}

/* ---- creation ------------------------------------------------------------------------------ */

static int choose_device(const fp4moe_model *m, fp4moe_device d, int *cuda) {
    if (d == FP4MOE_DEVICE_DEFAULT) d = m->gpu ? FP4MOE_DEVICE_CUDA : FP4MOE_DEVICE_CPU;
    if (d == FP4MOE_DEVICE_CUDA) {
        if (!m->gpu)
            return fp4moe_set_error(FP4MOE_EINVAL, "device cuda needs a model whose weights are on the "
                                    "GPU (load it with device cuda)");
        *cuda = 1;
        return FP4MOE_OK;
    }
    if (d != FP4MOE_DEVICE_CPU) return fp4moe_set_error(FP4MOE_EINVAL, "unknown device %d", (int)d);
    if (m->no_host_weights)
        return fp4moe_set_error(FP4MOE_EINVAL, "this synthetic model was generated on the GPU and has no "
                                "host weights: use device cuda");
    *cuda = 0;
    return FP4MOE_OK;
}

static int alloc_kv_pools(fp4moe_batch *b, int64_t pages, void **k, void **v) {
    const size_t bytes = (size_t)(pages * FW_PAGE) * b->kv_row;
    for (int64_t a = 0; a < b->n_attn; a++) {
        int st = b->be->alloc(b->bc, bytes, &k[a]);
        if (!st) st = b->be->alloc(b->bc, bytes, &v[a]);
        if (st) {
            for (int64_t j = 0; j <= a; j++) {
                if (k[j]) b->be->free(b->bc, k[j]);
                if (v[j]) b->be->free(b->bc, v[j]);
                k[j] = v[j] = NULL;
            }
            return fp4moe_error_context(st, "KV cache pool of %lld tokens", (long long)(pages * FW_PAGE));
        }
    }
    return FP4MOE_OK;
}

/* Points each layer's fw_state at its part of the pools. */
static void bind_state(fp4moe_batch *b) {
    const fp4moe_config *c = &b->m->cfg;
    int64_t im = 0, ia = 0;
    for (int64_t l = 0; l < c->n_layers; l++) {
        fw_state *s = &b->state[l];
        memset(s, 0, sizeof *s);
        if (c->layer_types[l] == FP4MOE_LAYER_MAMBA) {
            s->conv = b->conv_pool + im * b->o.max_seqs * b->conv_n;
            s->ssm = b->ssm_pool + im * b->o.max_seqs * b->ssm_n;
            s->conv_stride = b->conv_n;
            s->ssm_stride = b->ssm_n;
            im++;
        } else if (c->layer_types[l] == FP4MOE_LAYER_ATTENTION) {
            s->k = b->kpool[ia];
            s->v = b->vpool[ia];
            s->kv_fp8 = b->o.kv_dtype == FP4MOE_KV_FP8;
            ia++;
        }
    }
}

static int64_t ceil_div(int64_t a, int64_t d) { return (a + d - 1) / d; }

static int make_pools(fp4moe_batch *b) {
    const fp4moe_config *c = &b->m->cfg;
    const int64_t S = b->o.max_seqs;
    const int64_t di = c->mamba_heads * c->mamba_head_dim, cd = di + 2 * c->mamba_groups * c->ssm_state;
    b->conv_n = (c->conv_kernel - 1) * cd;
    b->ssm_n = di * c->ssm_state;
    b->kvs = c->kv_heads * c->head_dim;
    b->kv_row = b->o.kv_dtype == FP4MOE_KV_FP8 ? op_kv_fp8_row_bytes(c->kv_heads, c->head_dim)
                                               : (size_t)b->kvs * b->be->act_size;
    for (int64_t l = 0; l < c->n_layers; l++) {
        b->n_mamba += c->layer_types[l] == FP4MOE_LAYER_MAMBA;
        b->n_attn += c->layer_types[l] == FP4MOE_LAYER_ATTENTION;
    }
    int64_t t;
    if (fp4moe_mul_overflow(b->n_mamba * S, b->conv_n + b->ssm_n, &t))
        return fp4moe_set_error(FP4MOE_EOVERFLOW, "batch: Mamba state pool size overflows");
    if (b->n_mamba) {
        TRY(b->be->alloc(b->bc, (size_t)(b->n_mamba * S * (b->conv_n ? b->conv_n : 1)) * sizeof(float),
                         (void **)&b->conv_pool));
        TRY(b->be->alloc(b->bc, (size_t)(b->n_mamba * S * b->ssm_n) * sizeof(float), (void **)&b->ssm_pool));
    }
    b->ctx_limit = b->o.max_context > 0 ? b->o.max_context
                                        : (b->o.max_kv_tokens > 0 ? b->o.max_kv_tokens : DEFAULT_CTX_LIMIT);
    b->max_pages = ceil_div(b->ctx_limit, FW_PAGE);
    b->grow = b->o.max_kv_tokens <= 0;
    b->n_pages = b->grow ? GROW_MIN_PAGES : ceil_div(b->o.max_kv_tokens, FW_PAGE);
    if (b->grow && b->o.max_context > 0 && b->n_pages > b->max_pages * S) b->n_pages = b->max_pages * S;
    if (!b->n_attn) b->n_pages = 0;
    b->kpool = calloc((size_t)(b->n_attn + 1), sizeof(void *));
    b->vpool = calloc((size_t)(b->n_attn + 1), sizeof(void *));
    b->free_pages = malloc((size_t)(b->n_pages + 1) * sizeof(int32_t));
    b->h_pages = calloc((size_t)(S * b->max_pages), sizeof(int32_t));
    b->state = calloc((size_t)c->n_layers, sizeof *b->state);
    if (!b->kpool || !b->vpool || !b->free_pages || !b->h_pages || !b->state)
        return fp4moe_set_error(FP4MOE_ENOMEM, "batch: out of memory");
    if (b->n_attn) {
        if (b->n_pages > INT32_MAX) return fp4moe_set_error(FP4MOE_EOVERFLOW, "batch: KV pool too large");
        TRY(alloc_kv_pools(b, b->n_pages, b->kpool, b->vpool));
        TRY(b->be->alloc(b->bc, (size_t)(S * b->max_pages) * sizeof(int32_t), (void **)&b->d_pages));
    }
    for (int64_t i = 0; i < b->n_pages; i++) b->free_pages[i] = (int32_t)(b->n_pages - 1 - i);
    b->n_free = b->n_pages;
    bind_state(b);
    return FP4MOE_OK;
}

int fp4moe_batch_new(const fp4moe_model *m, const fp4moe_batch_options *opts, fp4moe_batch **out) {
    if (out) *out = NULL;
    if (!m || !out) return fp4moe_set_error(FP4MOE_EINVAL, "batch_new: NULL %s", !m ? "model" : "out");
    fp4moe_batch_options o;
    if (opts) o = *opts;
    else fp4moe_batch_options_default(&o);
    int cuda = 0;
    TRY(choose_device(m, o.device, &cuda));
    if (!opts && cuda) o.act_dtype = FP4MOE_BF16;
    if (o.act_dtype != FP4MOE_F32 && o.act_dtype != FP4MOE_BF16)
        return fp4moe_set_error(FP4MOE_EINVAL, "activation dtype %s (supported: f32, bf16)",
                                fp4moe_dtype_name(o.act_dtype));
    if ((int)o.route < FP4MOE_ROUTE_AUTO || (int)o.route > FP4MOE_ROUTE_DEQUANT_GEMM)
        return fp4moe_set_error(FP4MOE_EINVAL, "route %d (auto, qmv, batched or dequant_gemm)", (int)o.route);
    if (o.cpu_act != FP4MOE_CPU_ACT_FLOAT && o.cpu_act != FP4MOE_CPU_ACT_Q8)
        return fp4moe_set_error(FP4MOE_EINVAL, "cpu_act %d (float or q8)", (int)o.cpu_act);
    if (cuda && o.cpu_act == FP4MOE_CPU_ACT_Q8)
        return fp4moe_set_error(FP4MOE_EINVAL, "the q8 activation mode (--cpu-act q8) is a CPU mode; "
                                "this batch runs on CUDA");
    if (o.kv_dtype != FP4MOE_KV_AUTO && o.kv_dtype != FP4MOE_KV_FP8)
        return fp4moe_set_error(FP4MOE_EINVAL, "kv_dtype %d (auto or fp8)", (int)o.kv_dtype);
    if (cuda && o.kv_dtype == FP4MOE_KV_FP8)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "the FP8 KV cache (--kv-cache-dtype fp8) runs on the CPU "
                                "only so far; this batch runs on CUDA");
    if (cuda && o.act_dtype != FP4MOE_BF16)
        return fp4moe_set_error(FP4MOE_EINVAL, "CUDA computes with bf16 activations (act_dtype bf16, "
                                "--dtype bf16); %s asked", fp4moe_dtype_name(o.act_dtype));
    if (o.max_step_tokens < 1)
        return fp4moe_set_error(FP4MOE_EINVAL, "max_step_tokens (max_chunk)=%lld < 1", (long long)o.max_step_tokens);
    if (o.max_seqs < 1 || o.max_seqs > (1 << 20))
        return fp4moe_set_error(FP4MOE_EINVAL, "max_seqs=%lld (1 .. 1048576)", (long long)o.max_seqs);
    if (o.max_context > 0 && o.max_step_tokens > o.max_context) o.max_step_tokens = o.max_context;
    if (o.ep && !ep_group_rank(o.ep, o.ep_rank))
        return fp4moe_set_error(FP4MOE_EINVAL, "ep_rank %d is not a rank of the expert-parallel group", o.ep_rank);
    const int sliced = m->expert_share;
    if (sliced) { /* a model loaded as a rank's share runs only as that rank */
        int64_t lo = 0, hi = 0;
        const ep_transport *t = o.ep ? ep_group_rank(o.ep, o.ep_rank) : NULL;
        if (t) ep_expert_range(m->cfg.n_experts, t->world, t->rank, &lo, &hi);
        if (!t || lo != m->expert_lo || hi != m->expert_hi)
            return fp4moe_set_error(FP4MOE_EINVAL, "the model holds the routed experts [%lld, %lld) only: it runs as "
                                    "the rank of an expert-parallel group that owns them%s", (long long)m->expert_lo,
                                    (long long)m->expert_hi, t ? " (this rank owns others)" : " (no group given)");
    }
    fp4moe_batch *b = calloc(1, sizeof *b);
    if (!b) return fp4moe_set_error(FP4MOE_ENOMEM, "batch_new: out of memory");
    b->m = m;
    b->o = o;
    b->cuda = cuda;
    int st;
    if (cuda) {
        st = be_cuda_new(m, o.route, o.max_step_tokens, o.max_seqs, o.profile, &b->be, &b->bc);
        if (!st) b->w = be_cuda_weights(m);
        if (!st && o.ep) be_cuda_graphs_off(b->bc);
        if (!st && o.ep && !sliced) { /* this rank sees only its experts: views on the device */
            const ep_transport *t = ep_group_rank(o.ep, o.ep_rank);
            int64_t lo, hi;
            ep_expert_range(m->cfg.n_experts, t->world, t->rank, &lo, &hi);
            b->ep_views = calloc((size_t)(2 * m->cfg.n_layers + 1), be_cuda_linear_size());
            b->wcpu.layers = calloc((size_t)m->cfg.n_layers + 1, sizeof *b->wcpu.layers);
            if (!b->ep_views || !b->wcpu.layers) st = fp4moe_set_error(FP4MOE_ENOMEM, "batch_new: out of memory");
            else st = be_cuda_weights_experts(m, lo, hi, &b->wcpu, b->wcpu.layers, b->ep_views);
            if (!st) b->w = &b->wcpu;
        }
    } else {
        st = be_cpu_new(o.act_dtype, o.route, o.cpu_act, &b->be, &b->bc);
        if (!st) st = be_cpu_weights(m, &b->wcpu);
        b->w = &b->wcpu;
        if (!st && o.ep) { /* this rank sees only its experts: local ids, views of the weights */
            const ep_transport *t = ep_group_rank(o.ep, o.ep_rank);
            int64_t lo, hi;
            ep_expert_range(m->cfg.n_experts, t->world, t->rank, &lo, &hi);
            if (!sliced) { /* (a model loaded as the share has only these experts already) */
                b->ep_views = calloc((size_t)(2 * m->cfg.n_layers + 1), be_cpu_linear_size());
                if (!b->ep_views) st = fp4moe_set_error(FP4MOE_ENOMEM, "batch_new: out of memory");
                else be_cpu_weights_experts(&b->wcpu, m->cfg.n_layers, lo, hi, b->ep_views);
            }
        }
    }
    const int64_t cap = o.max_step_tokens;
    const int64_t lg_rows = cap < (o.max_seqs > 256 ? o.max_seqs : 256) ? cap : (o.max_seqs > 256 ? o.max_seqs : 256);
    if (!st) st = fw_bufs_alloc(b->be, b->bc, &m->cfg, cap, lg_rows, &b->bufs);
    if (!st) st = make_pools(b);
    if (!st) {
        b->slots = calloc((size_t)o.max_seqs, sizeof *b->slots);
        b->gen = calloc((size_t)o.max_seqs, sizeof *b->gen);
        b->h_meta = malloc((size_t)(4 * cap) * sizeof(int32_t));
        b->segs = malloc((size_t)cap * sizeof *b->segs);
        b->h_next = malloc((size_t)lg_rows * sizeof(int32_t));
        if (!b->slots || !b->gen || !b->h_meta || !b->segs || !b->h_next)
            st = fp4moe_set_error(FP4MOE_ENOMEM, "batch_new: out of memory");
    }
    if (!st && b->be->sync) st = b->be->sync(b->bc);
    if (st) {
        fp4moe_batch_free(b);
        return st;
    }
    *out = b;
    return FP4MOE_OK;
}

void fp4moe_batch_free(fp4moe_batch *b) {
    if (!b) return;
    if (b->be) {
        if (b->be->sync) (void)b->be->sync(b->bc);
        fw_bufs_free(b->be, b->bc, &b->m->cfg, &b->bufs);
        for (int64_t a = 0; b->kpool && a < b->n_attn; a++) {
            if (b->kpool[a]) b->be->free(b->bc, b->kpool[a]);
            if (b->vpool[a]) b->be->free(b->bc, b->vpool[a]);
        }
        if (b->conv_pool) b->be->free(b->bc, b->conv_pool);
        if (b->ssm_pool) b->be->free(b->bc, b->ssm_pool);
        if (b->d_pages) b->be->free(b->bc, b->d_pages);
        fw_ep_scratch_free(b->be, b->bc, &b->ep_ws);
        if (b->cuda) be_cuda_free(b->bc);
        else be_cpu_free(b->bc);
    }
    free(b->wcpu.layers);
    free(b->ep_views);
    free(b->kpool);
    free(b->vpool);
    free(b->free_pages);
    free(b->h_pages);
    free(b->state);
    free(b->slots);
    free(b->gen);
    free(b->h_meta);
    free(b->segs);
    free(b->order);
    free(b->h_next);
    free(b);
}

/* ---- sequences ------------------------------------------------------------------------------- */

static seq_slot *find(const fp4moe_batch *b, int64_t id) {
    if (!b || id < 0) return NULL;
    seq_slot *s = &b->slots[id % b->o.max_seqs];
    return s->alive && s->id == id ? s : NULL;
}

static int32_t slot_of(const fp4moe_batch *b, const seq_slot *s) { return (int32_t)(s - b->slots); }

static void release_pages(fp4moe_batch *b, seq_slot *s, int64_t keep) {
    const int32_t slot = slot_of(b, s);
    while (s->npages > keep) {
        s->npages--;
        b->free_pages[b->n_free++] = b->h_pages[(int64_t)slot * b->max_pages + s->npages];
    }
}

/* Doubles the page pool (grow mode): new pools, rows copied, graphs dropped. */
static int grow_pool(fp4moe_batch *b, int64_t need) {
    int64_t np = b->n_pages ? b->n_pages : GROW_MIN_PAGES;
    while (np < b->n_pages + need) np *= 2;
    if (np > INT32_MAX) return fp4moe_set_error(FP4MOE_EOVERFLOW, "KV cache pool exhausted (limit)");
    void **k = calloc((size_t)(b->n_attn + 1), sizeof(void *)), **v = calloc((size_t)(b->n_attn + 1), sizeof(void *));
    int32_t *fp = malloc((size_t)np * sizeof(int32_t));
    if (!k || !v || !fp) {
        free(k); free(v); free(fp);
        return fp4moe_set_error(FP4MOE_ENOMEM, "KV cache: out of memory");
    }
    int st = alloc_kv_pools(b, np, k, v);
    const size_t old = (size_t)(b->n_pages * FW_PAGE) * b->kv_row;
    for (int64_t a = 0; !st && a < b->n_attn; a++) {
        if ((st = b->be->copy(b->bc, k[a], b->kpool[a], old))) break;
        st = b->be->copy(b->bc, v[a], b->vpool[a], old);
    }
    if (!st) st = b->be->sync(b->bc);
    if (st) {
        for (int64_t a = 0; a < b->n_attn; a++) {
            if (k[a]) b->be->free(b->bc, k[a]);
            if (v[a]) b->be->free(b->bc, v[a]);
        }
        free(k); free(v); free(fp);
        return st;
    }
    for (int64_t a = 0; a < b->n_attn; a++) {
        b->be->free(b->bc, b->kpool[a]);
        b->be->free(b->bc, b->vpool[a]);
    }
    free(b->kpool);
    free(b->vpool);
    b->kpool = k;
    b->vpool = v;
    memcpy(fp, b->free_pages, (size_t)b->n_free * sizeof(int32_t));
    for (int64_t i = np - 1; i >= b->n_pages; i--) fp[b->n_free++] = (int32_t)i;
    free(b->free_pages);
    b->free_pages = fp;
    b->n_pages = np;
    b->be->invalidate(b->bc);
    bind_state(b);
    return FP4MOE_OK;
}

/* Pages for positions [0, need) of s; the new table entries are uploaded. */
static int reserve_pages(fp4moe_batch *b, seq_slot *s, int64_t need_tokens) {
    if (!b->n_attn) return FP4MOE_OK;
    const int64_t need = ceil_div(need_tokens, FW_PAGE), add = need - s->npages;
    if (add <= 0) return FP4MOE_OK;
    if (add > b->n_free) {
        if (!b->grow)
            return fp4moe_set_error(FP4MOE_EOVERFLOW, "KV cache pool exhausted: %lld more tokens needed, "
                                    "%lld of %lld tokens free (max_kv_tokens)", (long long)(add * FW_PAGE),
                                    (long long)(b->n_free * FW_PAGE), (long long)(b->n_pages * FW_PAGE));
        TRY(grow_pool(b, add - b->n_free));
    }
    const int32_t slot = slot_of(b, s);
    int32_t *row = b->h_pages + (int64_t)slot * b->max_pages;
    const int64_t first = s->npages;
    while (s->npages < need) row[s->npages++] = b->free_pages[--b->n_free];
    return b->be->upload(b->bc, b->d_pages + (int64_t)slot * b->max_pages + first, row + first,
                         (size_t)(need - first) * sizeof(int32_t));
}

static int zero_slot_state(fp4moe_batch *b, int32_t slot) {
    const fp4moe_config *c = &b->m->cfg;
    for (int64_t l = 0; l < c->n_layers; l++) {
        const fw_state *s = &b->state[l];
        if (c->layer_types[l] != FP4MOE_LAYER_MAMBA) continue;
        if (b->conv_n) TRY(b->be->zero(b->bc, s->conv + slot * s->conv_stride, (size_t)b->conv_n * sizeof(float)));
        TRY(b->be->zero(b->bc, s->ssm + slot * s->ssm_stride, (size_t)b->ssm_n * sizeof(float)));
    }
    return FP4MOE_OK;
}

int fp4moe_batch_add(fp4moe_batch *b, int64_t *seq) {
    if (!b || !seq) return fp4moe_set_error(FP4MOE_EINVAL, "batch_add: NULL argument");
    int64_t slot = -1;
    for (int64_t i = 0; i < b->o.max_seqs && slot < 0; i++)
        if (!b->slots[i].alive) slot = i;
    if (slot < 0)
        return fp4moe_set_error(FP4MOE_EOVERFLOW, "batch: %lld sequences are running, the most this batch "
                                "holds (max_seqs)", (long long)b->o.max_seqs);
    TRY(zero_slot_state(b, (int32_t)slot));
    seq_slot *s = &b->slots[slot];
    s->alive = 1;
    s->id = b->gen[slot]++ * b->o.max_seqs + slot;
    s->pos = 0;
    s->npages = 0;
    b->alive++;
    *seq = s->id;
    return FP4MOE_OK;
}

int fp4moe_batch_remove(fp4moe_batch *b, int64_t seq) {
    if (!b) return fp4moe_set_error(FP4MOE_EINVAL, "batch_remove: NULL batch");
    seq_slot *s = find(b, seq);
    if (!s) return fp4moe_set_error(FP4MOE_EINVAL, "batch_remove: no sequence %lld", (long long)seq);
    release_pages(b, s, 0);
    s->alive = 0;
    b->alive--;
    return FP4MOE_OK;
}

int64_t fp4moe_batch_pos(const fp4moe_batch *b, int64_t seq) {
    const seq_slot *s = find(b, seq);
    return s ? s->pos : -1;
}

int64_t fp4moe_batch_count(const fp4moe_batch *b) { return b ? b->alive : 0; }

void fp4moe_batch_kv_usage(const fp4moe_batch *b, int64_t *used, int64_t *pool) {
    if (used) *used = b ? (b->n_pages - b->n_free) * FW_PAGE : 0;
    if (pool) *pool = b ? b->n_pages * FW_PAGE : 0;
}

/* ---- step ------------------------------------------------------------------------------------ */

static void item_fail(fp4moe_batch_item *it, int st) {
    it->status = st;
    snprintf(it->error, sizeof it->error, "%s", fp4moe_last_error());
}

/* The checks of one item that need no state change. */
static int check_item(const fp4moe_batch *b, const fp4moe_batch_item *it, const unsigned char *seen) {
    const fp4moe_config *c = &b->m->cfg;
    const seq_slot *s = find(b, it->seq);
    if (!s) return fp4moe_set_error(FP4MOE_EINVAL, "step: no sequence %lld", (long long)it->seq);
    if (seen[slot_of(b, s)])
        return fp4moe_set_error(FP4MOE_EINVAL, "step: sequence %lld is given twice", (long long)it->seq);
    if (!it->tokens && it->n >= 1)
        return fp4moe_set_error(FP4MOE_EINVAL, "step: sequence %lld: NULL tokens (n=%lld)", (long long)it->seq,
                                (long long)it->n);
    if (!it->tokens || it->n < 1)
        return fp4moe_set_error(FP4MOE_EINVAL, "step: sequence %lld: %lld tokens", (long long)it->seq,
                                (long long)it->n);
    if (it->logits != FP4MOE_LOGITS_NONE && !it->out_logits)
        return fp4moe_set_error(FP4MOE_EINVAL, "step: sequence %lld asks for logits without a buffer",
                                (long long)it->seq);
    if (it->logits < 0 || it->logits > FP4MOE_LOGITS_ALL)
        return fp4moe_set_error(FP4MOE_EINVAL, "step: logits mode %d", it->logits);
    for (int64_t t = 0; t < it->n; t++)
        if (it->tokens[t] < 0 || it->tokens[t] >= c->vocab)
            return fp4moe_set_error(FP4MOE_EINVAL, "forward: token %lld is id %d, outside [0, %lld)",
                                    (long long)t, it->tokens[t], (long long)c->vocab);
    if (s->pos + it->n > b->ctx_limit)
        return fp4moe_set_error(FP4MOE_EOVERFLOW, "forward: %lld + %lld tokens exceed the context limit "
                                "%lld", (long long)s->pos, (long long)it->n, (long long)b->ctx_limit);
    return FP4MOE_OK;
}

static int head_rows_of(const fp4moe_batch_item *it) {
    if (it->logits == FP4MOE_LOGITS_ALL) return (int)(it->n > INT32_MAX ? INT32_MAX : it->n);
    return it->logits == FP4MOE_LOGITS_LAST || it->out_token ? 1 : 0;
}

/* Expert parallelism: every step of an expert-parallel batch starts with a one-byte status from every
 * rank (EP_STEP: this rank steps; EP_IDLE: it follows, fp4moe_ep_follow; EP_LEFT: it has left,
 * fp4moe_ep_leave), so that ranks without sequences know when to take part. */
enum { EP_IDLE = 0, EP_STEP = 1, EP_LEFT = 2 };

/* Sends `mine`; *any_step = 1 when some rank sends EP_STEP; *all_left (optional) = 1 when every rank
 * sends EP_LEFT. */
static int ep_flags2(fp4moe_batch *b, int mine, int *any_step, int *all_left) {
    ep_transport *t = ep_group_rank(b->o.ep, b->o.ep_rank);
    int64_t sb[64], rb[64];
    unsigned char out[64], in[64];
    for (int r = 0; r < t->world; r++) {
        out[r] = (unsigned char)mine;
        sb[r] = 1;
    }
    const int st = t->alltoallv(t, out, sb, in, (int64_t)sizeof in, rb);
    *any_step = 0;
    int left = 0;
    for (int r = 0; !st && r < t->world; r++) {
        *any_step |= in[r] == EP_STEP;
        left += in[r] == EP_LEFT;
    }
    if (all_left) *all_left = !st && left == t->world;
    return st;
}

static int ep_flags(fp4moe_batch *b, int mine, int *any_step) { return ep_flags2(b, mine, any_step, NULL); }

static int batch_step_body(fp4moe_batch *b, fp4moe_batch_item *items, int64_t n);

int fp4moe_batch_step(fp4moe_batch *b, fp4moe_batch_item *items, int64_t n) {
    if (!b || (!items && n)) return fp4moe_set_error(FP4MOE_EINVAL, "batch_step: NULL %s", b ? "items" : "batch");
    if (n < 0) return fp4moe_set_error(FP4MOE_EINVAL, "batch_step: n=%lld items < 0", (long long)n);
    if (b->o.ep) {
        if (b->ep_left) return fp4moe_set_error(FP4MOE_EINVAL, "batch_step: this rank has left its expert-parallel group");
        int any;
        const int st = ep_flags(b, EP_STEP, &any);
        if (st) return st;
    }
    return batch_step_body(b, items, n);
}

int fp4moe_ep_follow(fp4moe_batch *b, int64_t *steps) {
    if (steps) *steps = 0;
    if (!b || !b->o.ep) return fp4moe_set_error(FP4MOE_EINVAL, "ep_follow: not an expert-parallel batch");
    if (b->ep_left) return fp4moe_set_error(FP4MOE_EINVAL, "ep_follow: this rank has left its group");
    for (;;) {
        int any;
        int st = ep_flags(b, EP_IDLE, &any);
        if (st) return st;
        if (!any) return FP4MOE_OK; /* nobody steps: every rank follows or has left */
        if ((st = batch_step_body(b, NULL, 0))) return st;
        if (steps) (*steps)++;
    }
}

int fp4moe_ep_leave(fp4moe_batch *b) {
    if (!b || !b->o.ep) return fp4moe_set_error(FP4MOE_EINVAL, "ep_leave: not an expert-parallel batch");
    if (b->ep_left) return FP4MOE_OK;
    int any;
    const int st = ep_flags(b, EP_LEFT, &any);
    b->ep_left = 1;
    return st;
}

int fp4moe_ep_idle(fp4moe_batch *b, int stop, int *stepped, int *done) {
    if (stepped) *stepped = 0;
    if (done) *done = 0;
    if (!b || !b->o.ep) return fp4moe_set_error(FP4MOE_EINVAL, "ep_idle: not an expert-parallel batch");
    if (b->ep_left) return fp4moe_set_error(FP4MOE_EINVAL, "ep_idle: this rank has left its group");
    int any, all;
    int st = ep_flags2(b, stop ? EP_LEFT : EP_IDLE, &any, &all);
    if (st) return st;
    if (all) {                     /* every rank is stopping: nobody steps again */
        b->ep_left = 1;
        if (done) *done = 1;
        return FP4MOE_OK;
    }
    if (!any) return FP4MOE_OK;
    if ((st = batch_step_body(b, NULL, 0))) return st;
    if (stepped) *stepped = 1;
    return FP4MOE_OK;
}

static int batch_step_body(fp4moe_batch *b, fp4moe_batch_item *items, int64_t n) {
    const fp4moe_config *c = &b->m->cfg;
    const int64_t cap = b->o.max_step_tokens, V = c->vocab;
    unsigned char *seen = calloc((size_t)b->o.max_seqs, 1);
    int64_t *order = malloc((size_t)(n ? n : 1) * sizeof *order);
    if (!seen || !order) {
        free(seen); free(order);
        return fp4moe_set_error(FP4MOE_ENOMEM, "batch_step: out of memory");
    }
    /* 1. checks, then the order: decode items first (rows [0, nd)), then prefill, input order */
    int64_t n_ok = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int64_t i = 0; i < n; i++) {
            fp4moe_batch_item *it = &items[i];
            if (pass == 0) {
                it->status = FP4MOE_OK;
                it->error[0] = 0;
                const int st = check_item(b, it, seen);
                if (st) {
                    item_fail(it, st);
                    continue;
                }
                seen[slot_of(b, find(b, it->seq))] = 1;
            }
            if (it->status || (pass == 0) != (it->n == 1)) continue;
            order[n_ok++] = i;
        }
    /* 2. room in the step and KV pages, in that order; a failing item leaves no trace */
    int64_t R = 0, nh = 0, nseg = 0, nd = 0;
    int32_t *tok = b->h_meta;
    for (int64_t j = 0; j < n_ok; j++) {
        fp4moe_batch_item *it = &items[order[j]];
        seq_slot *s = find(b, it->seq);
        if (R + it->n > cap) {
            item_fail(it, fp4moe_set_error(FP4MOE_EOVERFLOW, "step: %lld tokens of sequence %lld do not fit "
                                           "in the step (%lld of max_step_tokens %lld used)", (long long)it->n,
                                           (long long)it->seq, (long long)R, (long long)cap));
            continue;
        }
        const int64_t hrows = head_rows_of(it);
        if (nh + hrows > b->bufs.lg_rows) {
            item_fail(it, fp4moe_set_error(FP4MOE_EOVERFLOW, "step: %lld rows of logits of sequence %lld do not "
                                           "fit in the step (%lld of %lld used)", (long long)hrows,
                                           (long long)it->seq, (long long)nh, (long long)b->bufs.lg_rows));
            continue;
        }
        const int64_t had = s->npages;
        int st = reserve_pages(b, s, s->pos + it->n);
        if (st) {
            release_pages(b, s, had);
            item_fail(it, st);
            continue;
        }
        b->segs[nseg] = (fw_seg){slot_of(b, s), s->pos, it->n, R};
        memcpy(tok + R, it->tokens, (size_t)it->n * sizeof(int32_t));
        nd += it->n == 1 && nd == nseg;
        order[nseg++] = order[j];
        R += it->n;
        nh += hrows;
    }
    nh = 0;
    int st = FP4MOE_OK;
    if (!nseg && !b->o.ep) goto done; /* an expert-parallel rank steps even with no rows: collectives */
    /* 3. row metadata: tokens | slot | position | head rows, packed for one upload */
    const int pure_decode = nd == nseg;
    int32_t *rs = tok + R, *rp = rs + R, *hr = rp + R;
    for (int64_t g = 0; g < nseg; g++) {
        const fw_seg *sg = &b->segs[g];
        const fp4moe_batch_item *it = &items[order[g]];
        for (int64_t t = 0; t < sg->n; t++) {
            rs[sg->row0 + t] = sg->slot;
            rp[sg->row0 + t] = (int32_t)(sg->pos0 + t);
        }
        const int64_t h = pure_decode ? 1 : head_rows_of(it);  /* decode steps: every row (graphs) */
        for (int64_t t = sg->n - h; t < sg->n; t++) hr[nh++] = (int32_t)(sg->row0 + t);
    }
    if ((st = b->be->upload(b->bc, b->bufs.meta, b->h_meta, (size_t)(3 * R + nh) * sizeof(int32_t))))
        goto done;
    const fw_step step = {
        .R = R, .nd = nd, .nseg = nseg, .seg = b->segs, .n_head = nh,
        .d_tokens = b->bufs.meta, .d_row_slot = b->bufs.meta + R, .d_row_pos = b->bufs.meta + 2 * R,
        .d_head_rows = b->bufs.meta + 3 * R, .d_pages = b->d_pages, .h_pages = b->h_pages,
        .max_pages = b->max_pages,
    };
    int want_argmax = 0;
    for (int64_t g = 0; g < nseg; g++) want_argmax |= items[order[g]].out_token != NULL;
    const fw_ctx f = {&b->m->cfg, b->be, b->bc, b->w, &b->bufs, b->state, &step,
                      want_argmax || pure_decode, b->o.interrupt, ep_group_rank(b->o.ep, b->o.ep_rank),
                      &b->ep_ws};
    if ((st = b->be->run(b->bc, &step, fw_forward, (void *)&f))) goto done;
    /* 4. outputs: head rows are in segment order */
    if (want_argmax && (st = b->be->download(b->bc, b->h_next, b->bufs.next, (size_t)nh * sizeof(int32_t))))
        goto done;
    int64_t h0 = 0;
    for (int64_t g = 0; g < nseg && !st; g++) {
        fp4moe_batch_item *it = &items[order[g]];
        const int64_t h = pure_decode ? 1 : head_rows_of(it);
        if (it->logits == FP4MOE_LOGITS_ALL || it->logits == FP4MOE_LOGITS_LAST) {
            const int64_t rows = it->logits == FP4MOE_LOGITS_ALL ? h : 1;
            st = b->be->download(b->bc, it->out_logits, b->bufs.lg + (h0 + h - rows) * V,
                                 (size_t)(rows * V) * sizeof(float));
        }
        h0 += h;
    }
    if (!st) st = b->be->sync(b->bc);
    if (st) goto done;
    h0 = 0;
    for (int64_t g = 0; g < nseg; g++) {
        fp4moe_batch_item *it = &items[order[g]];
        const int64_t h = pure_decode ? 1 : head_rows_of(it);
        if (it->out_token) *it->out_token = b->h_next[h0 + h - 1];
        h0 += h;
        find(b, it->seq)->pos += it->n;
    }
done:
    free(seen);
    free(order);
    return st;
}

/* ---- snapshots ------------------------------------------------------------------------------- */

struct fp4moe_snapshot {
    const fp4moe_model *m;
    size_t act_size, kv_row;
    int64_t pos;
    size_t bytes;
    unsigned char *data;            /* backend memory (GPU memory for CUDA batches): per Mamba layer
                                       conv + ssm floats; per attention layer K rows, V rows */
    void (*free_data)(void *p);
};

int64_t fp4moe_snapshot_pos(const fp4moe_snapshot *s) { return s ? s->pos : -1; }
size_t fp4moe_snapshot_bytes(const fp4moe_snapshot *s) { return s ? s->bytes : 0; }
void fp4moe_snapshot_free(fp4moe_snapshot *s) {
    if (!s) return;
    if (s->data) s->free_data(s->data);
    free(s);
}

static size_t snapshot_size(const fp4moe_batch *b, int64_t pos) {
    return (size_t)(b->n_mamba * (b->conv_n + b->ssm_n)) * sizeof(float) +
           (size_t)(2 * b->n_attn * pos) * b->kv_row;
}

/* Copies the state of slot `slot` (positions [0, pos)) to (out != 0) or from backend memory `data`:
 * device-to-device copies on CUDA, in stream order. */
static int transfer(fp4moe_batch *b, int32_t slot, int64_t pos, unsigned char *data, int to_host) {
    const fp4moe_config *c = &b->m->cfg;
    int (*xfer)(void *, void *, const void *, size_t) = b->be->copy;
    const size_t row = b->kv_row;
    size_t off = 0;
    for (int64_t l = 0; l < c->n_layers; l++) {
        const fw_state *s = &b->state[l];
        if (c->layer_types[l] == FP4MOE_LAYER_MAMBA) {
            void *pc = s->conv + slot * s->conv_stride, *ps = s->ssm + slot * s->ssm_stride;
            const size_t nc = (size_t)b->conv_n * sizeof(float), ns = (size_t)b->ssm_n * sizeof(float);
            if (nc) TRY(to_host ? xfer(b->bc, data + off, pc, nc) : xfer(b->bc, pc, data + off, nc));
            off += nc;
            TRY(to_host ? xfer(b->bc, data + off, ps, ns) : xfer(b->bc, ps, data + off, ns));
            off += ns;
        } else if (c->layer_types[l] == FP4MOE_LAYER_ATTENTION) {
            for (int kv = 0; kv < 2; kv++) {
                char *pool = kv ? s->v : s->k;
                for (int64_t p0 = 0; p0 < pos; p0 += FW_PAGE) {
                    const int64_t m = pos - p0 < FW_PAGE ? pos - p0 : FW_PAGE;
                    const int64_t page = b->h_pages[(int64_t)slot * b->max_pages + p0 / FW_PAGE];
                    char *dev = pool + (size_t)(page * FW_PAGE) * row;
                    TRY(to_host ? xfer(b->bc, data + off, dev, (size_t)m * row)
                                : xfer(b->bc, dev, data + off, (size_t)m * row));
                    off += (size_t)m * row;
                }
            }
        }
    }
    return b->be->sync(b->bc);
}

int fp4moe_batch_snapshot(fp4moe_batch *b, int64_t seq, fp4moe_snapshot **out) {
    if (!b || !out) return fp4moe_set_error(FP4MOE_EINVAL, "snapshot: NULL argument");
    *out = NULL;
    seq_slot *s = find(b, seq);
    if (!s) return fp4moe_set_error(FP4MOE_EINVAL, "snapshot: no sequence %lld", (long long)seq);
    fp4moe_snapshot *sn = calloc(1, sizeof *sn);
    const size_t bytes = snapshot_size(b, s->pos);
    if (!sn) return fp4moe_set_error(FP4MOE_ENOMEM, "snapshot: out of memory");
    sn->free_data = b->be->free_detached;
    void *data = NULL;
    if (b->be->alloc(b->bc, bytes ? bytes : 1, &data)) {
        free(sn);
        return fp4moe_error_context(FP4MOE_ENOMEM, "snapshot of %zu bytes", bytes);
    }
    sn->data = data;
    sn->m = b->m;
    sn->act_size = b->be->act_size;
    sn->kv_row = b->kv_row;
    sn->pos = s->pos;
    sn->bytes = bytes;
    const int st = transfer(b, slot_of(b, s), s->pos, sn->data, 1);
    if (st) {
        fp4moe_snapshot_free(sn);
        return st;
    }
    *out = sn;
    return FP4MOE_OK;
}

int fp4moe_batch_add_from_snapshot(fp4moe_batch *b, const fp4moe_snapshot *sn, int64_t *seq) {
    if (!b || !sn || !seq) return fp4moe_set_error(FP4MOE_EINVAL, "snapshot restore: NULL argument");
    if (sn->m != b->m || sn->act_size != b->be->act_size)
        return fp4moe_set_error(FP4MOE_EINVAL, "snapshot restore: the snapshot is of another model or device");
    if (sn->kv_row != b->kv_row)
        return fp4moe_set_error(FP4MOE_EINVAL, "snapshot restore: the snapshot's KV cache type differs from "
                                "this batch's (kv_dtype)");
    if (sn->pos > b->ctx_limit)
        return fp4moe_set_error(FP4MOE_EOVERFLOW, "snapshot restore: %lld tokens exceed the context limit %lld",
                                (long long)sn->pos, (long long)b->ctx_limit);
    TRY(fp4moe_batch_add(b, seq));
    seq_slot *s = find(b, *seq);
    int st = reserve_pages(b, s, sn->pos);
    if (!st) st = transfer(b, slot_of(b, s), sn->pos, sn->data, 0);
    if (st) {
        fp4moe_batch_remove(b, *seq);
        *seq = -1;
        return st;
    }
    s->pos = sn->pos;
    return FP4MOE_OK;
}

/* ---- internal accessors (sessions) ------------------------------------------------------------- */

int fp4moe_batch_profile(fp4moe_batch *b, double ms[FP4MOE_PROF_KINDS], int reset) {
    if (!b || !ms) return fp4moe_set_error(FP4MOE_EINVAL, "batch profile: NULL argument");
    return batch_profile(b, ms, reset);
}

int batch_profile(fp4moe_batch *b, double ms[FP4MOE_PROF_KINDS], int reset) {
    if (!b->cuda) return fp4moe_set_error(FP4MOE_EINVAL, "session profile: only CUDA sessions keep device timers");
    return be_cuda_profile(b->bc, ms, reset);
}

int batch_on_cuda(const fp4moe_batch *b) { return b->cuda; }

int64_t batch_logit_rows(const fp4moe_batch *b) { return b->bufs.lg_rows; }
int64_t fp4moe_batch_logit_rows(const fp4moe_batch *b) { return b ? b->bufs.lg_rows : 0; }

int64_t fp4moe_batch_kv_free(const fp4moe_batch *b, int64_t *page) {
    if (page) *page = FW_PAGE;
    if (!b || !b->n_attn || b->grow) return -1;
    return b->n_free * FW_PAGE;
}
