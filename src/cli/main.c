/* fp4moe: the command-line front end. `fp4moe <command> [options]`; each command lives in its own
 * cmd_*.c and is listed once in the table below. Exit codes (commands.h): 0 ok, 1 failure, 2 usage. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "fp4moe/fp4moe.h"

typedef struct {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary;
} command;

static const command k_commands[] = {
    {"quantize", cmd_quantize, "convert a float checkpoint (file or model dir) to MLX nvfp4"},
    {"dequantize", cmd_dequantize, "convert an MLX nvfp4 / ModelOpt NVFP4 checkpoint to bf16/f16/f32"},
    {"inspect", cmd_inspect, "list tensors, detect the format, validate every NVFP4 scale byte"},
    {"bench-kernel", cmd_bench_kernel, "time the gather_qmm routes on random expert weights"},
    {"generate", cmd_generate, "generate text with a nemotron_h model (streamed, tok/s on stderr)"},
    {"bench", cmd_bench, "prefill / decode tok/s of a nemotron_h model, hash of the greedy ids"},
    {"perplexity", cmd_perplexity, "perplexity of a nemotron_h model over a text file (llama.cpp rule)"},
    {"chat", cmd_chat, "multi-turn chat in the terminal with the model's chat template"},
    {"serve", cmd_serve, "OpenAI-compatible HTTP server (continuous batching, prefix reuse)"},
};
#define N_COMMANDS (int)(sizeof k_commands / sizeof k_commands[0])

static void usage(FILE *out) {
    fprintf(out,
            "fp4moe %s: NVFP4 Mixture-of-Experts inference (nemotron_h) on CPU and NVIDIA GPUs\n\n"
            "usage: fp4moe <command> [options]\n"
            "       fp4moe <command> --help     options of one command\n"
            "       fp4moe --version\n\ncommands:\n",
            FP4MOE_VERSION);
    for (int i = 0; i < N_COMMANDS; i++) fprintf(out, "  %-14s %s\n", k_commands[i].name, k_commands[i].summary);
}

/* The environment switches the library reads (fp4moe_env_*: one table): a value the library would
 * ignore is a usage error here, so that a typo cannot pass for a measurement. */
static int check_environment(void) {
    /* OMP_NUM_THREADS (OpenMP's; a list "N[,M...]", the first for our parallel regions): past 4096, --threads'
     * bound, libgomp crashes creating the threads (seen at 100,000) or takes minutes */
    const char *omp = getenv("OMP_NUM_THREADS");
    if (omp && *omp) {
        char *end = NULL;
        const long long n = strtoll(omp, &end, 10);
        if (end != omp && n > 4096) {
            fprintf(stderr, "fp4moe: OMP_NUM_THREADS=%s: more than 4096 threads (--threads takes 1 .. 4096)\n", omp);
            return FP4MOE_EXIT_USAGE;
        }
    }
    if (fp4moe_env_check() == FP4MOE_OK) return FP4MOE_EXIT_OK;
    fprintf(stderr, "fp4moe: %s\n", fp4moe_last_error());
    return FP4MOE_EXIT_USAGE;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return FP4MOE_EXIT_USAGE;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h") || !strcmp(cmd, "help")) {
        usage(stdout);
        return FP4MOE_EXIT_OK;
    }
    if (!strcmp(cmd, "--version") || !strcmp(cmd, "-V")) {
        printf("fp4moe %s\n", FP4MOE_VERSION);
        if (fflush(stdout) != 0 || ferror(stdout)) {
            fprintf(stderr, "fp4moe: cannot write the output: %s\n", strerror(errno));
            return FP4MOE_EXIT_FAIL;
        }
        return FP4MOE_EXIT_OK;
    }
    for (int i = 0; i < N_COMMANDS; i++) {
        if (strcmp(cmd, k_commands[i].name)) continue;
        const int env = check_environment();
        if (env) return env;
        const int rc = cli_json_finish(k_commands[i].name, k_commands[i].run(argc - 1, argv + 1));
        /* what the command printed must have reached stdout: a full disk / a closed file is an error (exit 1), as
           coreutils and Python report it, not a silent short result */
        errno = 0;
        if (fflush(stdout) != 0 || ferror(stdout)) {
            fprintf(stderr, "fp4moe %s: cannot write the output: %s\n", k_commands[i].name,
                    errno ? strerror(errno) : "write error");
            return rc ? rc : FP4MOE_EXIT_FAIL;
        }
        return rc;
    }
    fprintf(stderr, "fp4moe: unknown command '%s'\n\n", cmd);
    usage(stderr);
    return FP4MOE_EXIT_USAGE;
}
