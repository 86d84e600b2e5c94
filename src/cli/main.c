/* fp4moe: the command-line front end. `fp4moe <command> [options]`; each command lives in its own
 * cmd_*.c and is listed once in the table below. Exit codes (commands.h): 0 ok, 1 failure, 2 usage. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

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

/* A failed command ends here without the libraries' exit handlers: after an allocation failure an OpenBLAS worker
 * thread may retry its own buffer forever, and OpenBLAS's exit handler waits to join it (a long-context user's
 * trial: "out of memory" printed, then a hang until killed). stdout / stderr are flushed first; builds with
 * AddressSanitizer still run the leak check. */
static void failed_exit(int rc) {
    fflush(stdout);
    fflush(stderr);
#if defined(__SANITIZE_ADDRESS__)
    __lsan_do_leak_check();
#endif
    _exit(rc);
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
        const int rc = cli_json_finish(k_commands[i].name, k_commands[i].run(argc - 1, argv + 1));
        /* what the command printed must have reached stdout: a full disk / a closed file is an error (exit 1), as
           coreutils and Python report it, not a silent short result */
        errno = 0;
        if (fflush(stdout) != 0 || ferror(stdout)) {
            fprintf(stderr, "fp4moe %s: cannot write the output: %s\n", k_commands[i].name,
                    errno ? strerror(errno) : "write error");
            return rc ? rc : FP4MOE_EXIT_FAIL;
        }
        if (rc) failed_exit(rc);
        return rc;
    }
    fprintf(stderr, "fp4moe: unknown command '%s'\n\n", cmd);
    usage(stderr);
    /* --json anywhere after it: the error object on stdout too, as every command gives it (a user's trial) */
    for (int i = 2; i < argc; i++)
        if (!strcmp(argv[i], "--json")) {
            cli_json_mode_on();
            cli_json_note_error("unknown command '%s' (fp4moe --help lists them)", cmd);
            break;
        }
    return cli_json_finish("fp4moe", FP4MOE_EXIT_USAGE);
}
