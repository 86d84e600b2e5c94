/* Internal: helpers shared by every fp4moe subcommand: declarative option parsing with generated
 * usage text, error reporting with the command's name, progress on stderr, wall-clock time, and the
 * small file-system operations of the converters (mkdir -p, copy a file, list a directory). */
#ifndef FP4MOE_CLI_UTIL_H
#define FP4MOE_CLI_UTIL_H

#include <stdint.h>
#include <stdio.h>

#include <cjson/cJSON.h>

#include "fp4moe/safetensors.h"

/* ---- options -------------------------------------------------------------------------------------- */

typedef enum {
    CLI_FLAG,    /* no value: *(int *)dst = 1 */
    CLI_STRING,  /* *(const char **)dst = value (points into argv) */
    CLI_INT,     /* *(int64_t *)dst = value (decimal) */
    CLI_DOUBLE,  /* *(double *)dst = value */
    CLI_STRINGS  /* repeatable: appended to *(cli_strings *)dst (at most CLI_MAX_STRINGS) */
} cli_kind;

#define CLI_MAX_STRINGS 16
typedef struct {
    const char *v[CLI_MAX_STRINGS];
    int n;
} cli_strings;

typedef struct {
    const char *name;     /* long form, "--input" */
    const char *alias;    /* short form, "-i", or NULL */
    cli_kind kind;
    void *dst;
    const char *metavar;  /* "PATH" (shown in the usage text; NULL for flags) */
    const char *help;     /* one line; the default, if any, belongs here */
} cli_opt;

typedef struct {
    const char *command;      /* "quantize" */
    const char *usage;        /* "fp4moe quantize --input IN --output OUT [options]" */
    const char *description;  /* a paragraph (may hold newlines); NULL for none */
    const cli_opt *opts;
    int nopts;
    const char **positional;  /* room for max_positional arguments, or NULL */
    int max_positional;
    int *npositional;         /* out: how many were given (may be NULL when max_positional is 0) */
} cli_spec;

#define CLI_OK 0
#define CLI_HELP 1   /* --help / -h was given: usage printed on stdout; the command exits 0 */
#define CLI_USAGE 2  /* bad arguments: message printed on stderr; the command exits 2 */

/* Parses argv[1..argc) (argv[0] is the command name) against spec. Accepts "--name value",
 * "--name=value", "-a value", and "--" ending the options. Returns CLI_OK, CLI_HELP or CLI_USAGE
 * (unknown option, missing or malformed value, too many positional arguments, or the environment check
 * below failing - after the options, so that --json gets its error object and --help its text). */
int cli_parse(const cli_spec *spec, int argc, char **argv);
/* The environment switches the library reads (fp4moe_env_check: one table) and OMP_NUM_THREADS (at most 4096): a
 * value the library would ignore is a usage error (CLI_USAGE, message on stderr), so that a typo cannot pass for a
 * measurement; help: only a warning on stderr (CLI_OK). */
int cli_check_environment(const char *cmd, int help);

/* Prints the usage text generated from spec. */
void cli_print_usage(const cli_spec *spec, FILE *out);

/* Prints "fp4moe CMD: MESSAGE" and "Try 'fp4moe CMD --help'." on stderr; returns 2 (usage exit). */
int cli_usage_error(const char *command, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* -m DIR of the model commands: a missing path or a file (not a directory) is an error said so
 * before anything is loaded. Returns an exit code (0 or 1). */
int cli_require_model_dir(const char *command, const char *dir);

/* --threads N of the model commands: 0 keeps the default; else fp4moe_set_threads (a usage error
 * for N < 0). Returns an exit code. */
int cli_set_threads(const char *command, int64_t n);

/* Prints "fp4moe CMD: error: <fp4moe_last_error()>" on stderr; returns 1 (failure exit). */
int cli_fail(const char *command, int status);

/* Prints "fp4moe CMD: error: MESSAGE" on stderr (and keeps it for --json, below); returns exit_code. */
int cli_error(const char *command, int exit_code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* ---- --json: failures as JSON too ---------------------------------------------------------------------
 * A command run with --json prints one JSON object on stdout. When it fails before printing it (exit 1 or
 * 2), main() prints {"error": {"command": C, "message": M, "exit_code": N}} on stdout instead, so that a
 * script reading stdout gets one JSON object either way. M is the last message of cli_usage_error,
 * cli_fail or cli_error (those still go to stderr too), or "failed (the reason is on stderr)".
 * cli_parse turns the mode on when the command's options have a --json flag and argv sets it (before any
 * other option is checked, so a usage error is JSON too); a command with its own parser calls
 * cli_json_mode_on. */
void cli_json_mode_on(void);
/* Prints text and a newline on stdout: the command's JSON object is out (no error object after it). */
void cli_json_print(const char *text);
/* Makes every key and string value of o (its siblings after it and their children) valid UTF-8 - RFC 8259 requires
 * it, and names and messages may quote a file's raw bytes - by fp4moe_utf8_lossy (invalid subparts -> U+FFFD). */
void cli_json_make_utf8(cJSON *o);
/* cli_json_make_utf8(o), then o printed (cJSON_Print) by cli_json_print; o stays the caller's. */
void cli_json_print_obj(cJSON *o);
/* The error object's fields {"command", "message", "exit_code"} as a JSON text (malloc'd; NULL when out of
 * memory), for a command that adds it to an object it prints anyway. */
char *cli_json_error_text(const char *command, int exit_code);
/* Keeps MESSAGE for the error object (as cli_error does) without printing it: for a caller that prints its own
 * text on stderr (main()'s unknown command and its usage). */
void cli_json_note_error(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;
/* main(): prints the error object when the mode is on, exit_code != 0 and no JSON object was printed.
 * Returns exit_code. */
int cli_json_finish(const char *command, int exit_code);

/* ---- time and progress --------------------------------------------------------------------------- */

/* Monotonic wall-clock seconds. */
double cli_now(void);

/* "12.3 MiB" style (binary units) into buf. Returns buf. */
const char *cli_format_bytes(int64_t bytes, char buf[32]);
/* The warning of generate, chat and perplexity on stderr when --ctx (ctx > 0) exceeds the model's
 * max_position_embeddings (max_position > 0): it was not trained that long. */
void cli_warn_ctx(const char *cmd, int64_t ctx, int64_t max_position);
/* 1 when the V logits hold a NaN or an infinity (broken weights: generate, perplexity and bench report
 * CLI_BAD_LOGITS instead of garbage or a believable number), else 0. */
int cli_bad_logits(const float *lg, int64_t V);
#define CLI_BAD_LOGITS "the forward produced NaN or infinite logits: the model's weights hold NaN/Inf values " \
                       "(check the checkpoint, e.g. with fp4moe inspect)"

/* A progress line on stderr for long runs: on a terminal it is redrawn in place at most 10 times a
 * second; otherwise one line every 10 s. Nothing is printed during the first second. */
typedef struct {
    const char *label;
    int64_t total;        /* units of work (bytes, tensors); 0 = unknown */
    double t0, last;
    int tty, shown;
    int quiet;            /* set after cli_progress_start: nothing printed (a command's --quiet) */
} cli_progress;

void cli_progress_start(cli_progress *p, const char *label, int64_t total);
/* done: units finished so far; item: what is being worked on (may be NULL). */
void cli_progress_update(cli_progress *p, int64_t done, const char *item);
/* Ends the line (if one was shown) and prints "<label>: done in X s" when the run took >= 1 s. */
void cli_progress_finish(cli_progress *p);

/* ---- files ------------------------------------------------------------------------------------------ */

/* 1 if path is a directory, 0 otherwise. */
int cli_is_dir(const char *path);
/* mkdir -p (mode 0777 & ~umask). Returns FP4MOE_OK or FP4MOE_EIO with a message. */
int cli_mkdirs(const char *path);
/* Copies the regular file src to dst (overwriting). Returns FP4MOE_OK or FP4MOE_EIO. */
int cli_copy_file(const char *src, const char *dst);
/* "dir/name" in a new buffer (caller frees), NULL when out of memory. */
char *cli_join(const char *dir, const char *name);

/* Writes w to the file `output`, or, when `output` is an existing directory, to the file named like
 * `input`'s last path component inside it. Returns a status (message set by the writer). */
/* Copies in_dir/config.json to out_dir/config.json with the quantization entry set to MLX nvfp4
 * ({"group_size": 16, "bits": 4, "mode": "nvfp4"}, mirrored as "quantization_config") when nvfp4,
 * or removed when not. A missing input config gives a config holding only that entry (nvfp4, with a warning
 * on stderr) or no file (not nvfp4). Errors: the input is not a regular file, not valid JSON or not a JSON
 * object (message names the file), I/O. */
int cli_copy_config(const char *in_dir, const char *out_dir, int nvfp4);

/* Writes w as one .safetensors file: at output, or at output/<input's file name> when output is a directory;
 * missing parent directories are created; replacing an existing file is said on stderr ("CMD: replacing ...").
 * Errors: those of cli_mkdirs and fp4moe_st_writer_write. */
int cli_write_file(const char *cmd, fp4moe_st_writer *w, const char *input, const char *output);
/* 1 when a and b name the same existing file or directory (same device and inode). */
int cli_same_file(const char *a, const char *b);

/* Reads a whole text file (<= max_bytes) into a NUL-terminated buffer (caller frees). Errors: cannot open /
 * read, too large, FP4MOE_EFORMAT for a NUL byte in the file (named with its offset: text would end there). */
int cli_read_text(const char *path, int64_t max_bytes, char **out);
/* cli_read_text, then FP4MOE_EFORMAT naming path and the byte when the text is not UTF-8 (*out NULL); what / path
 * name it in the message ("chat template X"). A chat template or a system document must be UTF-8: transformers and
 * vLLM cannot decode anything else, and the bytes would reach prompts. */
int cli_read_utf8_text(const char *what, const char *path, int64_t max_bytes, char **out);
/* Drops one trailing newline (LF or CRLF) of text in place, as llama.cpp's -f does (an editor's end of file is not
 * prompt text). */
void cli_drop_final_newline(char *text);
/* FP4MOE_EINVAL (message naming both) when writing to `output` (a file, or a directory that gets
 * the model's files) would overwrite one of the files of input model m. */
int cli_output_overwrites_input(const fp4moe_st_model *m, const char *input, const char *output);
/* A growable NUL-terminated text buffer (zero-initialise; free(s) when done). */
typedef struct {
    char *s;
    size_t n, cap;
} cli_text;
/* Appends n bytes of t. Errors: FP4MOE_ENOMEM (the buffer keeps what it had). */
int cli_text_add(cli_text *b, const char *t, size_t n);

/* All of stream f as a NUL-terminated malloc'd string (at most 1 GiB). Errors: FP4MOE_EIO, ENOMEM, FP4MOE_EFORMAT
 * (a NUL byte in the stream: text would end there; messages say "standard input"). */
int cli_read_stream(FILE *f, char **out);
/* Writes text to path (temp file + rename). */
int cli_write_text(const char *path, const char *text);

/* Calls fn(name, ctx) for each regular file of dir (no recursion, names sorted). Stops at and
 * returns the first nonzero return of fn. Errors: FP4MOE_EIO. */
int cli_for_each_file(const char *dir, int (*fn)(const char *name, void *ctx), void *ctx);

/* Copies the regular files of a model directory to out_dir, except the weights (*.safetensors,
 * model.safetensors.index.json), hidden files, and the names listed in skip (NULL-terminated;
 * e.g. config.json when the caller rewrites it). */
int cli_copy_model_files(const char *in_dir, const char *out_dir, const char *const *skip);

/* A directory output is written whole into a staging directory beside it (".NAME.fp4moe-XXXXXX" in its parent,
 * missing parents created) and moved into place only when complete, so that an error or Ctrl-C leaves the output
 * as it was (the new files never mixed with an earlier model's). cli_stage_dir: *stage (malloc'd) the new empty
 * directory; errors: output exists and is not a directory, I/O (the message names the path). cli_stage_commit: a
 * new output becomes the staged directory (one rename); an existing one loses its weights (model.safetensors,
 * model-*-of-*.safetensors, model.safetensors.index.json) and takes every staged file (same names replaced), the
 * staged directory removed; errors: I/O. cli_stage_remove: the staged directory and its files removed; NULL:
 * nothing. */
int cli_stage_dir(const char *output, char **stage);
int cli_stage_commit(const char *stage, const char *output);
void cli_stage_remove(const char *stage);


/* The machine's memory read bandwidth: best of 3 parallel sums over `bytes` (GB/s, 1e9 bytes/s;
 * 512 MB is beyond any cache); 0 when out of memory. */
double cli_measure_read_gbs(size_t bytes);

#endif
