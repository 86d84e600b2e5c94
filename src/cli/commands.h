/* Internal: the fp4moe subcommands. Each takes the arguments after the command name
 * (argv[0] is the command name) and returns the process exit code:
 *   0 success, 1 runtime failure (bad file, failed kernel, ...), 2 usage error (bad flags).
 * Every command prints its usage for --help / -h and exits 0. */
#ifndef FP4MOE_CLI_COMMANDS_H
#define FP4MOE_CLI_COMMANDS_H

#define FP4MOE_EXIT_OK 0
#define FP4MOE_EXIT_FAIL 1
#define FP4MOE_EXIT_USAGE 2
#define FP4MOE_EXIT_INTERRUPTED 130   /* stopped by Ctrl-C (the shell convention, 128 + SIGINT) */

int cmd_quantize(int argc, char **argv);
int cmd_dequantize(int argc, char **argv);
int cmd_inspect(int argc, char **argv);
int cmd_bench_kernel(int argc, char **argv);
int cmd_generate(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_perplexity(int argc, char **argv);
int cmd_chat(int argc, char **argv);
int cmd_serve(int argc, char **argv);

/* Shared by generate and bench (cmd_generate.c). */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include "fp4moe/model.h"
/* Loads model dir `dir` (quantize: NVFP4-quantize dense checkpoints on load), a progress bar on a
 * terminal when it takes over a second, the load time and a summary on stderr. Returns an exit code. */
int cli_load_model(const char *cmd, const char *dir, int quantize, fp4moe_model **out);
/* Same, with the weights also uploaded to the GPU when device is FP4MOE_DEVICE_CUDA. */
int cli_load_model_on(const char *cmd, const char *dir, int quantize, fp4moe_device device,
                      fp4moe_model **out);
/* "cpu"/"cuda"/"auto" -> device, else a usage error (exit code 2). */
int cli_parse_device(const char *cmd, const char *s, fp4moe_device *d);
/* --gpus N (N >= 1) with --device device_arg, dev after auto: FP4MOE_EXIT_OK when dev is CUDA and N usable
 * devices are visible; else the message and an exit code - 2 for --device cpu with it, 1 when the machine lacks
 * them (the reason of fp4moe_cuda_check, or how many devices are visible). */
int cli_check_gpus(const char *cmd, int64_t gpus, const char *device_arg, fp4moe_device dev);
/* Default prefill chunk of CUDA sessions (tokens): large, so that a prompt reads the weights once, and so that a long
 * prompt's MoE steps reach the big tiles and the dequant_gemm route (>= 128 / 1,024 rows an expert, gather_qmm_cuda.cu). Measured (session 39,
 * H100, synthetic 30B-A3B shape, docs/PERFORMANCE.md): 32,768 against 8,192 - prefill 20,480 tokens 46,223 -> 52,646
 * tok/s, 32,768 tokens 42,716 -> 50,237, 12,288 tokens equal; the session's activations are sized for a chunk (bench's
 * GPU memory peak 23.2 -> 28.5 GB at a 512-token prompt), so generate and bench size it to the prompt:
 * cli_cuda_chunk. */
#define CLI_CUDA_CHUNK 32768
/* The step of bench's --batch and expert-parallel runs on CUDA (tokens): the CUDA default before session 39, kept for
 * steps of several sequences (not re-measured there) */
#define CLI_CUDA_BATCH_CHUNK 8192
/* The CUDA default chunk for a prompt of `tokens` tokens (<= 0: unknown): CLI_CUDA_CHUNK, or the prompt's length
 * rounded up to 256 tokens where that is smaller (the same steps, smaller activation buffers). */
static inline int64_t cli_cuda_chunk(int64_t tokens) {
    if (tokens <= 0 || tokens >= CLI_CUDA_CHUNK) return CLI_CUDA_CHUNK;
    return (tokens + 255) / 256 * 256;
}
/* Model-level summary (format, layer pattern, parameters, bytes per component) of model dir `dir`
 * for `inspect -m DIR`: as text on `out`, or (json non-NULL) as json's "model" object. Returns an exit code. */
struct cJSON;
int cli_model_summary(const char *cmd, const char *dir, FILE *out, struct cJSON *json);
/* "bf16"/"f32" -> dtype, else a usage error (exit code 2). */
int cli_parse_dtype(const char *cmd, const char *s, fp4moe_dtype *dt);
/* --cpu-act: "float" -> FLOAT, "q8" -> Q8; NULL -> Q8 on the CPU, FLOAT on CUDA (dev DEFAULT: CUDA
 * when a GPU is visible); else, and q8 on CUDA, a usage error (exit code 2). */
int cli_parse_cpu_act(const char *cmd, const char *s, fp4moe_device dev, fp4moe_cpu_act *ca);
/* The compute options of the model commands at once: --device (auto resolved here: cuda when a GPU
 * is visible), --dtype (NULL: bf16 on cuda, f32 on the cpu) and --cpu-act, in that order. Returns
 * an exit code (FP4MOE_EXIT_USAGE with a message naming the option). */
int cli_parse_compute(const char *cmd, const char *device, const char *dtype, const char *cpu_act,
                      fp4moe_device *dev, fp4moe_dtype *dt, fp4moe_cpu_act *ca);
/* --kv-cache-dtype: NULL or "auto" -> AUTO, "fp8" -> FP8 (the CPU only: on cuda a usage error);
 * else a usage error (exit code 2). dev: the resolved device. */
int cli_parse_kv_dtype(const char *cmd, const char *s, fp4moe_device dev, fp4moe_kv_dtype *kv);
#define CLI_KV_HELP "KV cache storage: auto (the backend's: fp32 on the cpu; cuda: K bf16, V fp16) or fp8 (E4M3 with a scale per token and kv head: ~4x smaller on the cpu; accuracy in docs/PERFORMANCE.md; cpu only so far)"
/* The --cpu-act option's help text (one place for every command). */
#define CLI_CPU_ACT_HELP "CPU NVFP4 matmuls: q8 (the CPU default: W4A8, the activations, after --dtype's rounding, as int8 per 16-element block; integer dot products; +0.03% held-out perplexity on the default model, docs/PERFORMANCE.md) or float (activations at --dtype: the f32 contract, equal to transformers); cuda: float only"
/* Installs a SIGINT handler; the returned flag becomes 1 on Ctrl-C. */
const volatile sig_atomic_t *cli_install_sigint(void);
/* cli_install_sigint, and SIGTERM and SIGHUP set the same flag (the converters: their staged output removed). */
const volatile sig_atomic_t *cli_install_stop_signals(void);
/* FP4MOE_EINTERRUPTED (message "interrupted (Ctrl-C)") once that flag is set, else FP4MOE_OK: for
 * loops that write files (quantize, dequantize). */
int cli_check_interrupt(void);
/* The end of a converter whose output failed: the staged directory of a directory output (cli_stage_dir; NULL for a
 * file output, whose file is written atomically) is removed with what it holds, the output left as it was; an
 * interruption prints that nothing was written and gives exit code 130, any other failure the usual message and 1. */
int cli_convert_failed(const char *cmd, int status, const char *output, char *stage);

/* ---- cli_model.c -------------------------------------------------------------------------------- */
#include <cjson/cJSON.h>
#include "fp4moe/tokenizer.h"
/* A model with random NVFP4 weights of config NAME (a config.json path, a model directory, or a
 * name under configs/), with a progress bar and a summary on stderr. Returns an exit code. */
int cli_load_synthetic(const char *cmd, const char *name, uint64_t seed, fp4moe_device dev, fp4moe_model **out);
/* The same without progress or messages (for worker threads): an fp4moe status. */
int cli_synthetic_quiet(const char *name, uint64_t seed, fp4moe_device dev, fp4moe_model **out);
/* The model of dir with only rank `rank` of `world`'s share of the routed experts (expert
 * parallelism), on dev, without progress or messages: an fp4moe status. */
int cli_load_share_quiet(const char *dir, int quantize, fp4moe_device dev, int world, int rank, fp4moe_model **out);
/* The chat template text (malloc'd): file `override` when given, else DIR/chat_template.jinja, else
 * the "chat_template" of DIR/tokenizer_config.json (a string, or the "default" of a list). NULL with
 * fp4moe_last_error() set when there is none. where (may be NULL): the source's name for messages
 * (malloc'd; the file, or "FILE (chat_template)"), NULL when there is none. */
char *cli_load_chat_template(const char *dir, const char *override, char **where);
/* bos_token / eos_token / pad_token of DIR/tokenizer_config.json (strings, "" when absent) into ctx (as the special
 * tokens HF's apply_chat_template passes). */
void cli_template_special_tokens(const char *dir, cJSON *ctx);
/* Checks that every id of ids[0..n) is below the model's vocab_size V: else FP4MOE_EFORMAT naming the first such
 * id, its token in the tokenizer (tok may be NULL), what it is (`what`, e.g. "the prompt") and the two sizes - the
 * tokenizer.json and config.json of `dir` disagree. */
int cli_ids_in_vocab(const char *dir, const fp4moe_tokenizer *tok, const int32_t *ids, int64_t n, int64_t V,
                     const char *what);
/* The sampling options of the commands that generate (generate, chat): one group, one check. */
typedef struct {
    double temp, top_p, min_p, repeat_penalty, presence_penalty, frequency_penalty;
    int64_t top_k, seed, repeat_last_n;
} cli_sampling;
#define CLI_SAMPLING_INIT {.top_p = 1.0, .repeat_penalty = 1.0, .repeat_last_n = 64, .seed = INT64_MIN}
/* Its cli_opt entries (cli/cli_util.h), for an options array. */
#define CLI_SAMPLING_OPTS(s)                                                                                   \
    {"--temp", NULL, CLI_DOUBLE, &(s).temp, "T", "sampling temperature; 0 = greedy (default 0)"},            \
    {"--top-p", NULL, CLI_DOUBLE, &(s).top_p, "P", "nucleus sampling mass in (0, 1] (default 1)"},           \
    {"--top-k", NULL, CLI_INT, &(s).top_k, "K", "sample among the K most likely tokens; 0 = all (default 0)"}, \
    {"--min-p", NULL, CLI_DOUBLE, &(s).min_p, "P", "drop tokens below P x the top probability, in [0, 1] "     \
     "(default 0)"},                                                                                           \
    {"--seed", NULL, CLI_INT, &(s).seed, "S", "sampling seed (default: random, printed on stderr to repeat "   \
     "the run)"},                                                                                              \
    {"--repeat-penalty", NULL, CLI_DOUBLE, &(s).repeat_penalty, "P", "divide positive / multiply negative "    \
     "logits of recent tokens by P; 1 = off (default 1)"},                                                     \
    {"--repeat-last-n", NULL, CLI_INT, &(s).repeat_last_n, "N", "tokens the repeat penalty looks back "        \
     "(default 64)"},                                                                                          \
    {"--presence-penalty", NULL, CLI_DOUBLE, &(s).presence_penalty, "P", "subtract P from the logit of every " \
     "token the answer holds, in [-2, 2] (OpenAI's; default 0)"},                                              \
    {"--frequency-penalty", NULL, CLI_DOUBLE, &(s).frequency_penalty, "P", "subtract P x its count in the "    \
     "answer from a token's logit, in [-2, 2] (OpenAI's; default 0)"}
/* Usage errors for out-of-range values; draws the random seed when none was given (printed on
 * stderr when sampling, so that the run can be repeated). Returns an exit code. */
int cli_sampling_check(const char *cmd, cli_sampling *s);
/* The sampler settings of s, with every stop id of dir (cli_generation_defaults) unless no_stop. */
void cli_sampling_params(const cli_sampling *s, const char *dir, const fp4moe_tokenizer *tok, int64_t vocab,
                         int no_stop, fp4moe_sampler_params *sp);

/* Stop ids (the tokenizer's EOS, the chat end tokens it has, every eos_token_id of
 * DIR/generation_config.json) added to sp, and its sampling defaults (do_sample false: greedy;
 * temperature, top_p, top_k, min_p) when the file exists. Returns 1 when the file was read. */
int cli_generation_defaults(const char *dir, const fp4moe_tokenizer *tok, int64_t vocab, fp4moe_sampler_params *sp);

#endif
