/* Internal: the fp4moe subcommands. Each takes the arguments after the command name
 * (argv[0] is the command name) and returns the process exit code:
 *   0 success, 1 runtime failure (bad file, failed kernel, ...), 2 usage error (bad flags).
 * Every command prints its usage for --help / -h and exits 0. */
#ifndef FP4MOE_CLI_COMMANDS_H
#define FP4MOE_CLI_COMMANDS_H

#define FP4MOE_EXIT_OK 0
#define FP4MOE_EXIT_FAIL 1
#define FP4MOE_EXIT_USAGE 2

int cmd_quantize(int argc, char **argv);
int cmd_dequantize(int argc, char **argv);
int cmd_inspect(int argc, char **argv);
int cmd_bench_kernel(int argc, char **argv);

#endif
