/* The FP4MOE_* environment variables: one table, each read once (src/common/env.h). */
#include "common/env.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"

static const fp4moe_env_var k_vars[ENV_COUNT] = {
    [ENV_GATHER_EXPERT_BATCHED] = {"FP4MOE_GATHER_EXPERT_BATCHED", "0|1", "1",
                                   "0: no expert-batched gather_qmm route (qmv instead; byte-identical greedy "
                                   "output on the GPU)"},
    [ENV_GATHER_ROUTE] = {"FP4MOE_GATHER_ROUTE", "auto|qmv|batched|dequant_gemm", "auto",
                          "force one gather_qmm route where rows are sorted"},
    [ENV_CPU_ISA] = {"FP4MOE_CPU_ISA", "auto|portable|avx2|avx512", "auto",
                     "CPU kernels: the widest set the CPU has (auto), or portable C, AVX2 or AVX-512 "
                     "(a set the CPU lacks falls back to the widest it has)"},
    [ENV_CUDA_GRAPH] = {"FP4MOE_CUDA_GRAPH", "0|1", "1",
                        "0: decode steps launched op by op instead of replaying a CUDA graph"},
    [ENV_QUANTIZE_STASH_MB] = {"FP4MOE_QUANTIZE_STASH_MB", "integer >= 0", "1024",
                               "fp4moe quantize: MiB of block scales kept between its two passes (0: recompute)"},
    [ENV_CUDA_PDL] = {"FP4MOE_CUDA_PDL", "0|1|graph", "graph",
                      "CUDA programmatic dependent launch: on the launches captured into decode graphs "
                      "(graph), every launch (1) or none (0); same results"},
    [ENV_CUDA_SIDE_STREAM] = {"FP4MOE_CUDA_SIDE_STREAM", "0|1", "1",
                              "1: in decode steps the shared expert runs on a second CUDA stream, beside "
                              "the routed experts, and attention's k and v projections beside q; 0: one "
                              "stream; same results"},
    [ENV_CUDA_WEIGHT_LAYOUT] = {"FP4MOE_CUDA_WEIGHT_LAYOUT", "rows|tiled", "tiled",
                                "NVFP4 weights on the GPU re-laid at load for the kernels' loads (tiled) or as in "
                                "the checkpoint (rows); same results"},
    [ENV_CUDA_SIDE_DELAY_US] = {"FP4MOE_CUDA_SIDE_DELAY_US", "integer >= 0", "0",
                                "diagnostic: the side stream (FP4MOE_CUDA_SIDE_STREAM) waits this many "
                                "microseconds before its work, so that a missing join shows (tests); same results"},
    [ENV_CUDA_ATTENTION] = {"FP4MOE_CUDA_ATTENTION", "wgmma|mma", "wgmma",
                            "CUDA prefill attention of head_dim 128 (even query heads a kv head): the Hopper "
                            "warpgroup kernel (wgmma) or the mma.sync one (mma); results within the tolerance"},
    [ENV_CUDA_DENSE_BF16] = {"FP4MOE_CUDA_DENSE_BF16", "auto|0|1", "auto",
                             "bf16 copies of the plain NVFP4 linears (not the experts) made once at load, so "
                             "that prefill GEMMs skip their dequantization: 1 always, 0 never, auto when the "
                             "weights and copies take at most half of the free GPU memory; same results"},
    [ENV_CUDA_SSM] = {"FP4MOE_CUDA_SSM", "auto|tiled", "auto",
                      "CUDA Mamba-2 prefill scan: the chunked SSD on tensor cores from 128 tokens (auto) or the "
                      "recurrent tiled kernel at every length (tiled); results within the scan tolerance"},
    [ENV_CUDA_GATHER_SCHED] = {"FP4MOE_CUDA_GATHER_SCHED", "dynamic|static", "dynamic",
                               "CUDA expert-batched gather over experts: work items handed out by a counter "
                               "as blocks finish (dynamic) or strided by block number (static); the same results"},
    [ENV_API_KEY] = {"FP4MOE_API_KEY", "any text", "",
                     "fp4moe serve: the API key when --api-key / --api-key-file are not given (as vLLM's "
                     "VLLM_API_KEY; unlike the option, not visible in the process list)"},
    [ENV_CUDA_MOE_FUSED] = {"FP4MOE_CUDA_MOE_FUSED", "0|1", "1",
                            "1: a MoE layer's routed up and down projections in one CUDA kernel where both run "
                            "32-row tiles (prefills of ~86-1,024 tokens); 0: two launches; the same results"},
    [ENV_CUDA_MOE_BIG] = {"FP4MOE_CUDA_MOE_BIG", "0|1|all", "1",
                          "1: a MoE layer's routed up and down projections on 128-row x 256-feature tiles where the "
                          "experts' runs are long (128-1,023 rows an expert on average: prefills of 2,731-21,845 "
                          "tokens of top-6 over 128 experts; dequant_gemm from 1,024, 512 with 0), a run's remainder of <= 64 rows on the 64-row tiles; all: "
                          "every row on the big tiles; 0: the 64-row tiles; the same results"},
};

static int allowed(const fp4moe_env_var *v, const char *val) {
    if (!strcmp(v->allowed, "any text")) return 1;
    if (!strcmp(v->allowed, "integer >= 0")) {
        if (!*val) return 0;
        for (const char *p = val; *p; p++)
            if (*p < '0' || *p > '9') return 0;
        return strlen(val) <= 12;
    }
    const size_t n = strlen(val);
    for (const char *p = v->allowed; *p;) {
        const char *bar = strchr(p, '|');
        const size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == n && !strncmp(p, val, n)) return 1;
        p += len + (bar ? 1 : 0);
    }
    return 0;
}

/* the value of each variable once read (NULL: not yet). Threads may read one at the same time (expert-parallel ranks
 * start together): each computes the same value and publishes it with one atomic store, and a reader sees either
 * NULL or the whole value - a separate "read" flag set beside a plain store could be seen before the value (a NULL
 * dereference that crashed 1 run in ~60 of `fp4moe bench --ep-ranks 7` on a busy 2-core machine). */
static const char *cache[ENV_COUNT];

void env_reload(void) {
    for (int i = 0; i < ENV_COUNT; i++) __atomic_store_n(&cache[i], (const char *)NULL, __ATOMIC_RELEASE);
}

const char *env_get(env_id id) {
    if ((int)id < 0 || id >= ENV_COUNT) return "";
    const char *c = __atomic_load_n(&cache[id], __ATOMIC_ACQUIRE);
    if (!c) {
        const char *v = getenv(k_vars[id].name);
        c = v && *v && allowed(&k_vars[id], v) ? v : k_vars[id].def;
        __atomic_store_n(&cache[id], c, __ATOMIC_RELEASE);
    }
    return c;
}

long long env_get_int(env_id id) { return atoll(env_get(id)); }

int fp4moe_env_count(void) { return ENV_COUNT; }

const fp4moe_env_var *fp4moe_env_var_at(int i) { return i >= 0 && i < ENV_COUNT ? &k_vars[i] : NULL; }

int fp4moe_env_check(void) {
    for (int i = 0; i < ENV_COUNT; i++) {
        const char *v = getenv(k_vars[i].name);
        if (v && *v && !allowed(&k_vars[i], v))
            return fp4moe_set_error(FP4MOE_EINVAL, "environment %s='%s' is not one of: %s", k_vars[i].name, v,
                                    k_vars[i].allowed);
    }
    return FP4MOE_OK;
}

const char *fp4moe_env_value(const char *name) {
    for (int i = 0; name && i < ENV_COUNT; i++)
        if (!strcmp(name, k_vars[i].name)) return env_get((env_id)i);
    return NULL;
}
