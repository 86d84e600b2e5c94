/* fp4moe bench-kernel: times the CPU gather_qmm routes on random NVFP4 expert weights and random
 * sorted top-k expert indices (the MoE up / down projections of a prefill batch), and measures
 * this machine's memory bandwidth so that the weight-streaming rate can be compared with it.
 *
 * Reported per route: median wall time over --repeats calls (after one warm-up call; the routes
 * take turns, so that on a shared machine they all see the same background load), the fastest
 * call (the least disturbed one), effective
 * weight GB/s = bytes of the NVFP4 weights of the experts actually touched (codes + block scales)
 * / time, GFLOP/s = 2 * rows * N * K / time, and the speedup over the qmv route. */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "fp4moe/fp4moe.h"

#define CMD "bench-kernel"

typedef struct {
    int64_t E, N, K, tokens;
    int topk, repeats, both, json, w4a8, cold;
    fp4moe_dtype dtype;
    int routes[4]; /* routes[r] != 0: time route r (fp4moe_route) */
    uint64_t seed;
} bench_opts;

static void usage(FILE *f) {
    fprintf(f,
            "usage: fp4moe bench-kernel [--E 128] [--N 1856] [--K 2688] [--tokens 512] [--topk 6]\n"
            "                           [--dtype bf16|f16|f32] [--route all|qmv|batched|dequant_gemm|auto]\n"
            "                           [--repeats 5] [--seed 1] [--both] [--w4a8] [--cold] [--json] [--help]\n"
            "Times the CPU gather_qmm routes on random NVFP4 weights (E experts of N x K) and random\n"
            "sorted top-k indices (tokens * topk rows). --both runs the Nemotron MoE up (K=2688 -> N=1856)\n"
            "and down (K=1856 -> N=2688) shapes. Prints ms (median of repeats after a warm-up), effective\n"
            "weight GB/s (NVFP4 codes + scales of the experts touched), GFLOP/s, speedup over qmv, and\n"
            "the machine's measured memory bandwidth. --json prints one JSON object instead.\n\n"
            "options:\n"
            "  --E N                        experts (default 128)\n"
            "  --N N                        output features per expert (default 1856)\n"
            "  --K N                        input features, a multiple of 16 (default 2688)\n"
            "  --tokens N                   tokens; rows = tokens * topk (default 512)\n"
            "  --topk N                     experts per token (default 6)\n"
            "  --dtype T                    activations: bf16 | f16 | f32 (default bf16)\n"
            "  --route R                    all | qmv | batched | dequant_gemm | auto (default all)\n"
            "  --repeats N                  timed rounds after one warm-up, 1 .. 64; medians reported (default 5)\n"
            "  --seed S                     random seed (default 1)\n"
            "  --both                       also the transposed shape: up (N x K) then down (K x N)\n"
            "  --w4a8                       also time the W4A8 form (int8 activations, --cpu-act q8) of\n"
            "                               the qmv and batched routes\n"
            "  --cold                       every call draws other experts (16 index sets), so that the\n"
            "                               weights come from memory rather than the caches\n"
            "  --json                       one JSON object on stdout\n"
            "  -h, --help                   show this help and exit\n");
}

/* ---- random data ---------------------------------------------------------------------------- */

static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double uniform01(uint64_t *s) { return (double)(splitmix64(s) >> 11) * 0x1.0p-53; }

/* Weights as a global-scale NVFP4 quantizer leaves them (spec section 3): uniform random codes;
 * block scale e4m3(448 * block_amax / expert_amax) with the ratio in [0.15, 1], skewed low;
 * per-expert decode multiplier expert_amax / 2688 with expert_amax in [0.05, 0.5]. */
static int make_weights(int64_t E, int64_t N, int64_t K, uint64_t seed, fp4moe_nvfp4_weights *w) {
    const int64_t ncodes = E * N * (K / 2), nscales = E * N * (K / 16);
    uint8_t *codes = malloc((size_t)ncodes), *scales = malloc((size_t)nscales);
    float *gs = malloc((size_t)E * sizeof *gs);
    if (!codes || !scales || !gs) {
        free(codes); free(scales); free(gs);
        return FP4MOE_ENOMEM;
    }
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t e = 0; e < E; e++) {
        uint64_t s = seed * 1000003u + (uint64_t)e;
        uint8_t *c = codes + e * N * (K / 2), *sc = scales + e * N * (K / 16);
        for (int64_t i = 0; i < N * (K / 2); i += 8) {
            const uint64_t r = splitmix64(&s);
            memcpy(c + i, &r, 8); /* K/2 is a multiple of 8 */
        }
        for (int64_t i = 0; i < N * (K / 16); i++) {
            const double u = uniform01(&s);
            sc[i] = fp4moe_f32_to_e4m3((float)(448.0 * (0.15 + 0.85 * u * u)));
        }
        gs[e] = (float)((0.05 + 0.45 * uniform01(&s)) / 2688.0);
    }
    *w = (fp4moe_nvfp4_weights){codes, scales, gs, E, N, K};
    return FP4MOE_OK;
}

static void free_weights(fp4moe_nvfp4_weights *w) {
    free((void *)w->codes);
    free((void *)w->scales);
    free((void *)w->global_scale);
}

static int cmp_u32(const void *a, const void *b) {
    const uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* tokens x topk expert indices, distinct within a token (when E >= topk), sorted. */
static void make_idx(int64_t tokens, int topk, int64_t E, uint64_t seed, uint32_t *idx) {
    uint64_t s = seed ^ 0x5EEDull;
    for (int64_t t = 0; t < tokens; t++)
        for (int j = 0; j < topk; j++) {
            uint32_t e;
            int again;
            do {
                e = (uint32_t)(uniform01(&s) * (double)E);
                again = 0;
                for (int i = 0; i < j && E >= topk; i++) again |= idx[t * topk + i] == e;
            } while (again);
            idx[t * topk + j] = e;
        }
    qsort(idx, (size_t)(tokens * topk), sizeof *idx, cmp_u32);
}

static void *make_x(int64_t B, int64_t K, fp4moe_dtype dtype, uint64_t seed) {
    float *f = malloc((size_t)(B * K) * sizeof *f);
    void *x = malloc((size_t)(B * K) * fp4moe_dtype_size(dtype));
    if (!f || !x) {
        free(f); free(x);
        return NULL;
    }
    uint64_t s = seed ^ 0xACDCull;
    for (int64_t i = 0; i < B * K; i++) /* Box-Muller normal */
        f[i] = (float)(sqrt(-2.0 * log(1.0 - uniform01(&s))) * cos(6.283185307179586 * uniform01(&s)));
    fp4moe_from_f32(f, B * K, dtype, x);
    free(f);
    return x;
}

/* ---- memory bandwidth ----------------------------------------------------------------------- */

/* Best of 3 parallel memcpy of bytes/2 (counted as read + write = `bytes`). */
static double measure_copy_gbs(size_t bytes) {
    const size_t half = bytes / 2;
    char *a = malloc(half), *b = malloc(half);
    if (!a || !b) {
        free(a); free(b);
        return 0;
    }
    const int nt = omp_get_max_threads();
    double best = 0;
    for (int rep = 0; rep < 4; rep++) { /* rep 0 touches the pages */
        const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(nt)
        {
            const size_t per = half / (size_t)omp_get_num_threads(), off = per * (size_t)omp_get_thread_num();
            if (rep == 0) memset(a + off, 1, per);
            memcpy(b + off, a + off, per);
        }
        const double dt = omp_get_wtime() - t0;
        if (rep > 0 && (double)bytes / dt / 1e9 > best) best = (double)bytes / dt / 1e9;
    }
    free(a);
    free(b);
    return best;
}

/* ---- timing --------------------------------------------------------------------------------- */

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *t, int n) {
    qsort(t, (size_t)n, sizeof *t, cmp_double);
    return n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

/* Times the routes listed in routes[0..nr) round-robin: one warm-up round, then `repeats` rounds,
 * so that on a shared machine every route samples the same background load. t[r][i] = seconds of
 * route r in round i. Returns 0, or -1 on a failed call (message printed). */
static int time_routes(const fp4moe_nvfp4_weights *w, const void *x, fp4moe_dtype dtype, const uint32_t *idx,
                       int nsets, int64_t B, const fp4moe_route *routes, const int *w4a8, int nr, void *y,
                       int repeats, double t[][64]) {
    for (int i = -1, call = 0; i < repeats; i++)
        for (int r = 0; r < nr; r++, call++) {
            const uint32_t *ix = idx + (int64_t)(call % nsets) * B;
            const double t0 = omp_get_wtime();
            const int st = w4a8[r] ? fp4moe_gather_qmm_cpu_w4a8(w, x, dtype, ix, B, 1, routes[r], y)
                                   : fp4moe_gather_qmm_cpu_route(w, x, dtype, ix, B, 1, routes[r], y);
            const double dt = omp_get_wtime() - t0;
            if (st) {
                cli_error(CMD, FP4MOE_EXIT_FAIL, "route %s: %s", fp4moe_route_name(routes[r]), fp4moe_last_error());
                return -1;
            }
            if (i >= 0) t[r][i] = dt;
        }
    return 0;
}

/* One shape: all requested routes. Adds a "shapes" entry to json (when non-NULL) or prints rows. */
static int bench_shape(const bench_opts *o, const char *label, int64_t N, int64_t K, cJSON *jshapes) {
    const int64_t B = o->tokens * o->topk;
    fp4moe_nvfp4_weights w;
    if (make_weights(o->E, N, K, o->seed, &w)) {
        return cli_error(CMD, FP4MOE_EXIT_FAIL, "out of memory for E=%lld N=%lld K=%lld weights", (long long)o->E,
                         (long long)N, (long long)K);
    }
    const int nsets = o->cold ? 16 : 1;
    uint32_t *idx = malloc((size_t)(B ? B * nsets : 1) * sizeof *idx);
    void *x = make_x(B, K, o->dtype, o->seed);
    void *y = malloc((size_t)(B * N) * fp4moe_dtype_size(o->dtype) + 1);
    if (!idx || !x || !y) {
        free(idx); free(x); free(y); free_weights(&w);
        return cli_error(CMD, FP4MOE_EXIT_FAIL, "out of memory for %lld rows", (long long)B);
    }
    for (int i = 0; i < nsets; i++) make_idx(o->tokens, o->topk, o->E, o->seed + (uint64_t)i, idx + (int64_t)i * B);
    int64_t touched = 0;
    for (int64_t b = 0; b < B; b++) touched += b == 0 || idx[b] != idx[b - 1];
    const double wbytes = (double)touched * (double)N * (double)(K / 2 + K / 16);
    const double flops = 2.0 * (double)B * (double)N * (double)K;
    const fp4moe_route chosen = fp4moe_gather_route_choose_cpu(&w, B, 1);

    cJSON *js = NULL, *jr = NULL;
    if (jshapes) {
        js = cJSON_CreateObject();
        cJSON_AddStringToObject(js, "shape", label);
        cJSON_AddNumberToObject(js, "E", (double)o->E);
        cJSON_AddNumberToObject(js, "N", (double)N);
        cJSON_AddNumberToObject(js, "K", (double)K);
        cJSON_AddNumberToObject(js, "rows", (double)B);
        cJSON_AddNumberToObject(js, "experts_touched", (double)touched);
        cJSON_AddNumberToObject(js, "weight_bytes_touched", wbytes);
        cJSON_AddStringToObject(js, "auto_route", fp4moe_route_name(chosen));
        jr = cJSON_AddArrayToObject(js, "routes");
        cJSON_AddItemToArray(jshapes, js);
    } else {
        printf("\n%s: E=%lld N=%lld K=%lld, %lld rows (%lld tokens x top-%d, sorted), %lld experts touched "
               "(%.1f MB of NVFP4 weights); auto route: %s\n",
               label, (long long)o->E, (long long)N, (long long)K, (long long)B, (long long)o->tokens, o->topk,
               (long long)touched, wbytes / 1e6, fp4moe_route_name(chosen));
        printf("  %-13s %10s %10s %12s %10s %8s\n", "route", "ms", "best ms", "weight GB/s", "GFLOP/s", "vs qmv");
    }
    fp4moe_route routes[8];
    int w4a8[8], nr = 0;
    for (int q = 0; q <= o->w4a8; q++)
        for (int r = FP4MOE_ROUTE_QMV; r <= FP4MOE_ROUTE_DEQUANT_GEMM + 1; r++) {
            const fp4moe_route route = r <= FP4MOE_ROUTE_DEQUANT_GEMM ? (fp4moe_route)r : FP4MOE_ROUTE_AUTO;
            if (!o->routes[route] || (q && route == FP4MOE_ROUTE_DEQUANT_GEMM)) continue;
            w4a8[nr] = q;
            routes[nr++] = route;
        }
    double t[8][64];
    const int rc = time_routes(&w, x, o->dtype, idx, nsets, B, routes, w4a8, nr, y, o->repeats, t)
                       ? FP4MOE_EXIT_FAIL : FP4MOE_EXIT_OK;
    double t_qmv = 0;
    for (int r = 0; r < nr && rc == FP4MOE_EXIT_OK; r++) {
        const double med = median(t[r], o->repeats), best = t[r][0]; /* t[r] is sorted now */
        if (routes[r] == FP4MOE_ROUTE_QMV && !w4a8[r]) t_qmv = med;
        const double speedup = t_qmv > 0 ? t_qmv / med : 0;
        char name[32];
        snprintf(name, sizeof name, "%s%s", fp4moe_route_name(routes[r]), w4a8[r] ? " w4a8" : "");
        if (jr) {
            cJSON *e = cJSON_CreateObject();
            cJSON_AddStringToObject(e, "route", fp4moe_route_name(routes[r]));
            cJSON_AddStringToObject(e, "activations", w4a8[r] ? "q8" : "float");
            cJSON_AddNumberToObject(e, "ms", med * 1e3);
            cJSON_AddNumberToObject(e, "best_ms", best * 1e3);
            cJSON_AddNumberToObject(e, "weight_gbs", wbytes / med / 1e9);
            cJSON_AddNumberToObject(e, "gflops", flops / med / 1e9);
            if (speedup > 0) cJSON_AddNumberToObject(e, "speedup_vs_qmv", speedup);
            cJSON_AddItemToArray(jr, e);
        } else {
            char sp[32] = "-";
            if (speedup > 0) snprintf(sp, sizeof sp, "%.2fx", speedup);
            printf("  %-13s %10.2f %10.2f %12.2f %10.1f %8s\n", name, med * 1e3,
                   best * 1e3, wbytes / med / 1e9, flops / med / 1e9, sp);
        }
    }
    free(idx); free(x); free(y); free_weights(&w);
    return rc;
}

/* ---- command -------------------------------------------------------------------------------- */

static int parse_i64(const char *name, const char *s, int64_t lo, int64_t hi, int64_t *out) {
    char *end;
    const long long v = strtoll(s, &end, 10);
    if (!*s || *end || v < lo || v > hi) {
        cli_usage_error(CMD, "--%s %s: expected an integer in [%lld, %lld]", name, s, (long long)lo, (long long)hi);
        return -1;
    }
    *out = v;
    return 0;
}

int cmd_bench_kernel(int argc, char **argv) {
    bench_opts o = {.E = 128, .N = 1856, .K = 2688, .tokens = 512, .topk = 6, .repeats = 5,
                    .dtype = FP4MOE_BF16, .routes = {0, 1, 1, 1}, .seed = 1};
    static const struct option longopts[] = {
        {"E", required_argument, 0, 'E'},      {"N", required_argument, 0, 'N'},
        {"K", required_argument, 0, 'K'},      {"tokens", required_argument, 0, 't'},
        {"topk", required_argument, 0, 'k'},   {"dtype", required_argument, 0, 'd'},
        {"route", required_argument, 0, 'r'},  {"repeats", required_argument, 0, 'n'},
        {"seed", required_argument, 0, 's'},   {"both", no_argument, 0, 'b'},
        {"json", no_argument, 0, 'j'},         {"help", no_argument, 0, 'h'},
        {"w4a8", no_argument, 0, 'q'},         {"cold", no_argument, 0, 'c'},
        {0, 0, 0, 0}};
    int c;
    int64_t v;
    optind = 1;
    opterr = 0;
    /* --json (or -json, as getopt_long_only takes it) anywhere before "--": usage errors are JSON too */
    for (int i = 1; i < argc && strcmp(argv[i], "--"); i++) {
        if (!strcmp(argv[i], "--json") || !strcmp(argv[i], "-json")) cli_json_mode_on();
        const char *n = argv[i] + (argv[i][0] == '-') + (argv[i][0] == '-' && argv[i][1] == '-');
        for (int j = 0; longopts[j].name; j++)
            if (argv[i][0] == '-' && longopts[j].has_arg == required_argument && !strcmp(n, longopts[j].name)) i++;
    }
    while ((c = getopt_long_only(argc, argv, "h", longopts, NULL)) != -1) {
        switch (c) {
        case 'E': if (parse_i64("E", optarg, 1, 1 << 20, &v)) return FP4MOE_EXIT_USAGE; o.E = v; break;
        case 'N': if (parse_i64("N", optarg, 1, 1 << 20, &v)) return FP4MOE_EXIT_USAGE; o.N = v; break;
        case 'K': if (parse_i64("K", optarg, 16, 1 << 20, &v)) return FP4MOE_EXIT_USAGE; o.K = v; break;
        case 't': if (parse_i64("tokens", optarg, 1, 1 << 24, &v)) return FP4MOE_EXIT_USAGE; o.tokens = v; break;
        case 'k': if (parse_i64("topk", optarg, 1, 64, &v)) return FP4MOE_EXIT_USAGE; o.topk = (int)v; break;
        case 'n': if (parse_i64("repeats", optarg, 1, 64, &v)) return FP4MOE_EXIT_USAGE; o.repeats = (int)v; break;
        case 's': if (parse_i64("seed", optarg, 0, INT64_MAX, &v)) return FP4MOE_EXIT_USAGE; o.seed = (uint64_t)v; break;
        case 'd':
            if (fp4moe_dtype_parse(optarg, &o.dtype)) {
                return cli_usage_error(CMD, "--dtype: %s", fp4moe_last_error());
            }
            break;
        case 'r': {
            fp4moe_route r;
            memset(o.routes, 0, sizeof o.routes);
            if (!strcmp(optarg, "all")) {
                o.routes[FP4MOE_ROUTE_QMV] = o.routes[FP4MOE_ROUTE_BATCHED] = o.routes[FP4MOE_ROUTE_DEQUANT_GEMM] = 1;
            } else if (fp4moe_route_parse(optarg, &r) == FP4MOE_OK) {
                o.routes[r] = 1;
            } else {
                return cli_usage_error(CMD, "--route: %s (or all)", fp4moe_last_error());
            }
            break;
        }
        case 'b': o.both = 1; break;
        case 'q': o.w4a8 = 1; break;
        case 'c': o.cold = 1; break;
        case 'j': o.json = 1; break;
        case 'h': cli_check_environment(CMD, 1); usage(stdout); return FP4MOE_EXIT_OK;
        default:
            return cli_usage_error(CMD, "unknown or incomplete option '%s'", argv[optind - 1]);
        }
    }
    if (optind < argc) {
        return cli_usage_error(CMD, "unexpected argument '%s'", argv[optind]);
    }
    if (cli_check_environment(CMD, 0)) return FP4MOE_EXIT_USAGE;
    if (o.K % 16) {
        return cli_usage_error(CMD, "--K %lld is not a multiple of 16", (long long)o.K);
    }
    if (o.topk > o.E) {
        return cli_usage_error(CMD, "--topk %d is more than the %lld experts (--E)", o.topk, (long long)o.E);
    }
    if (o.both && (o.K % 16 || o.N % 16)) {
        return cli_usage_error(CMD, "--both swaps N and K, so N must be a multiple of 16 too");
    }

    const double read_gbs = cli_measure_read_gbs((size_t)512 << 20), copy_gbs = measure_copy_gbs((size_t)512 << 20);
    const char *isa = fp4moe_gather_cpu_isa();
    const int threads = omp_get_max_threads();
    cJSON *root = NULL, *jshapes = NULL;
    if (o.json) {
        root = cJSON_CreateObject();
        cJSON *m = cJSON_AddObjectToObject(root, "machine");
        cJSON_AddNumberToObject(m, "threads", threads);
        cJSON_AddStringToObject(m, "kernels", isa);
        cJSON_AddNumberToObject(m, "mem_read_gbs", read_gbs);
        cJSON_AddNumberToObject(m, "mem_copy_gbs", copy_gbs);
        cJSON_AddNumberToObject(root, "tokens", (double)o.tokens);
        cJSON_AddNumberToObject(root, "topk", o.topk);
        cJSON_AddStringToObject(root, "dtype", fp4moe_dtype_name(o.dtype));
        cJSON_AddNumberToObject(root, "repeats", o.repeats);
        jshapes = cJSON_AddArrayToObject(root, "shapes");
    } else {
        printf("fp4moe bench-kernel: CPU gather_qmm, %s activations, %d threads, %s kernels, median of %d\n",
               fp4moe_dtype_name(o.dtype), threads, isa, o.repeats);
        printf("memory bandwidth (512 MB, %d threads): read %.1f GB/s, copy (read+write) %.1f GB/s\n", threads,
               read_gbs, copy_gbs);
    }
    char one[48]; /* without --both: the shape is named by its size */
    snprintf(one, sizeof one, "%lldx%lld", (long long)o.N, (long long)o.K);
    int rc = bench_shape(&o, o.both ? "up" : one, o.N, o.K, jshapes);
    if (rc == FP4MOE_EXIT_OK && o.both) rc = bench_shape(&o, "down", o.K, o.N, jshapes);
    if (root) {
        if (rc) { /* the shapes measured before the failure, and the error */
            char *e = cli_json_error_text(CMD, rc);
            if (e) cJSON_AddItemToObject(root, "error", cJSON_Parse(e));
            free(e);
        }
        cli_json_print_obj(root);
        cJSON_Delete(root);
    }
    return rc;
}
