/* Internal: the one table of FP4MOE_* environment variables (src/common/env.c; the public face is
 * fp4moe_env_* in fp4moe/types.h). Each variable is read once, on first use; a value outside its
 * allowed set gives the default (and fp4moe_env_check reports it). */
#ifndef FP4MOE_COMMON_ENV_H
#define FP4MOE_COMMON_ENV_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    ENV_GATHER_EXPERT_BATCHED = 0, /* "0" | "1" */
    ENV_GATHER_ROUTE,              /* "auto" | "qmv" | "batched" | "dequant_gemm" */
    ENV_CPU_ISA,                   /* "auto" | "portable" | "avx2" | "avx512" */
    ENV_CUDA_GRAPH,                /* "0" | "1" */
    ENV_QUANTIZE_STASH_MB,         /* integer >= 0 */
    ENV_CUDA_PDL,                  /* "0" | "1" | "graph" */
    ENV_CUDA_SIDE_STREAM,          /* "0" | "1" */
    ENV_CUDA_WEIGHT_LAYOUT,        /* "rows" | "tiled" */
    ENV_CUDA_SIDE_DELAY_US,        /* integer >= 0 */
    ENV_CUDA_ATTENTION,            /* "wgmma" | "mma" */
    ENV_CUDA_DENSE_BF16,           /* "auto" | "0" | "1" */
    ENV_CUDA_SSM,                  /* "auto" | "tiled" */
    ENV_CUDA_GATHER_SCHED,         /* "dynamic" | "static" */
    ENV_API_KEY,                   /* any text: fp4moe serve's API key */
    ENV_CUDA_MOE_FUSED,            /* "0" | "1" */
    ENV_CUDA_MOE_BIG,              /* "0" | "1" */
    ENV_COUNT
} env_id;

/* The value in force (the variable's value when allowed, else the default). Never NULL. */
const char *env_get(env_id id);
/* env_get as an integer (ENV_QUANTIZE_STASH_MB). */
long long env_get_int(env_id id);

/* Forgets the values read (the next env_get reads the environment again): for tests that change
 * a variable inside one process (tests/common/testutil.h tu_setenv), never for the library. */
void env_reload(void);

#ifdef __cplusplus
}
#endif
#endif
