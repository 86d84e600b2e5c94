/* fp4moe dequantize: an MLX nvfp4 or ModelOpt NVFP4 checkpoint -> plain float tensors.
 * Every quantized module (io/nvfp4_ckpt.h) "<m>.weight" becomes a float "<m>.weight" of its logical
 * shape (..., N, K), computed by fp4moe_nvfp4_dequantize (w = e2m1 * e4m3 * gs, rounded once);
 * its scales, global scale and (ModelOpt) input scale are dropped; every other tensor is copied.
 * Stacked experts ("<p>.switch_mlp.fc1/fc2.weight", E x N x K) stay stacked, the layout mlx-lm
 * and the fp4moe loader read; --unstack writes HF's "<p>.experts.{e}.up_proj/down_proj.weight"
 * instead (what transformers loads). A NaN scale byte (0x7F/0xFF) is an error naming the tensor
 * and the index. A directory's config.json loses its "quantization"/"quantization_config" entries
 * and hf_quant_config.json is not copied. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "fp4moe/fp4moe.h"
#include "fp4moe/checkpoint.h"

#define CMD "dequantize"
#define CHUNK_ROWS_BYTES (8 << 20) /* output bytes per step */

typedef struct {
    fp4moe_qtensor q;
    int64_t e0, e1;         /* leading indices [e0, e1) of q written by this producer */
    fp4moe_dtype out;
    cli_progress *progress;
    int64_t *done;
} deq_ctx;

static const char *k_help =
    "Dequantizes an MLX nvfp4 or ModelOpt NVFP4 checkpoint (file or model directory) to plain\n"
    "float tensors of --dtype (w = e2m1(code) * e4m3(scale) * global scale, rounded once).\n"
    "Scales, global scales and input scales are dropped; other tensors are copied unchanged.\n"
    "Stacked experts (switch_mlp.fc1/fc2) stay stacked unless --unstack is given, which writes\n"
    "HF names (experts.{e}.up_proj/down_proj). A NaN scale byte (0x7F/0xFF) is an error.";

/* Dequantizes leading indices [e0, e1) chunk by chunk into the sink. */
static int fill_deq(void *vctx, fp4moe_st_sink *sink, int64_t nbytes) {
    deq_ctx *c = vctx;
    const fp4moe_qtensor *q = &c->q;
    const int64_t K = q->K, os = (int64_t)fp4moe_dtype_size(c->out);
    const int64_t rows_per = CHUNK_ROWS_BYTES / (K * os) > 0 ? CHUNK_ROWS_BYTES / (K * os) : 1;
    void *buf = malloc((size_t)(rows_per * K * os));
    if (!buf) return fp4moe_set_error(FP4MOE_ENOMEM, "out of memory");
    int st = FP4MOE_OK;
    for (int64_t e = c->e0; e < c->e1 && !st; e++) {
        float gs;
        if ((st = fp4moe_qtensor_gs(q, e, &gs))) break;
        for (int64_t r0 = 0; r0 < q->N && !st; r0 += rows_per) {
            if ((st = cli_check_interrupt())) break;
            const int64_t r = q->N - r0 < rows_per ? q->N - r0 : rows_per, row = e * q->N + r0;
            const uint8_t *codes = (const uint8_t *)q->weight->data + row * (K / 2);
            const uint8_t *scales = (const uint8_t *)q->scales->data + row * (K / 16);
            const int64_t bad = fp4moe_nvfp4_find_nan_scale(scales, r * K / 16);
            if (bad >= 0) {
                const int64_t at = row * (K / 16) + bad;
                st = fp4moe_set_error(FP4MOE_EFORMAT, "%s: tensor '%s': NaN scale byte 0x%02X at index %lld "
                                      "(row %lld, block %lld)", q->scales->file, q->scales->name, scales[bad],
                                      (long long)at, (long long)(at / (K / 16)), (long long)(at % (K / 16)));
                break;
            }
            if ((st = fp4moe_nvfp4_dequantize(codes, scales, r, K, gs, c->out, buf))) {
                fp4moe_error_context(st, "tensor '%s'", q->weight->name);
                break;
            }
            st = fp4moe_st_sink_write(sink, buf, r * K * os);
            *c->done += r * K / 2;
            cli_progress_update(c->progress, *c->done, q->weight->name);
        }
    }
    free(buf);
    (void)nbytes;
    return st;
}

static int ends_with_conv1d(const char *name) {
    const size_t n = strlen(name), k = strlen(".conv1d.weight");
    return n >= k && !strcmp(name + n - k, ".conv1d.weight");
}

/* For --unstack: "<p>.switch_mlp.fc1.weight" -> "<p>.experts.<e>.up_proj.weight" (fc2: down_proj). */
static int unstacked_name(const char *name, int64_t e, char *out, size_t cap) {
    const char *x = strstr(name, ".switch_mlp.");
    if (!x) return 0;
    const char *proj = !strcmp(x, ".switch_mlp.fc1.weight") ? "up_proj" : !strcmp(x, ".switch_mlp.fc2.weight") ? "down_proj" : NULL;
    if (!proj) return 0;
    return (size_t)snprintf(out, cap, "%.*s.experts.%lld.%s.weight", (int)(x - name), name, (long long)e, proj) < cap;
}


static int has_suffix(const char *name, const char *suffix) {
    const size_t n = strlen(name), k = strlen(suffix);
    return n >= k && !strcmp(name + n - k, suffix);
}

/* Half of a quantized module (t, not one by fp4moe_qtensor_of): packed codes without their block scales, or block
 * scales without their codes. Either would be copied into the "plain float" output as raw bytes - a checkpoint that
 * no loader reads - so it is an error naming the tensor (the loader's and inspect's message). */
static int half_a_module(const fp4moe_st_model *m, fp4moe_qformat fmt, const fp4moe_st_tensor *t) {
    const int stem = (int)strlen(t->name);
    if (t->dtype == FP4MOE_ST_U32 && has_suffix(t->name, ".weight"))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: tensor '%s' holds packed MLX nvfp4 codes (U32) but its block "
                                "scales '%.*s.scales' are missing", t->file, t->name, stem - 7, t->name);
    if (fmt == FP4MOE_QFMT_MODELOPT_NVFP4 && t->dtype == FP4MOE_ST_U8 && has_suffix(t->name, ".weight"))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: tensor '%s' holds packed NVFP4 codes (U8) but its block scales "
                                "'%.*s.weight_scale' are missing", t->file, t->name, stem - 7, t->name);
    const char *sfx = has_suffix(t->name, ".scales") ? ".scales" : has_suffix(t->name, ".weight_scale") ? ".weight_scale" : NULL;
    if (sfx && (t->dtype == FP4MOE_ST_U8 || t->dtype == FP4MOE_ST_F8_E4M3) && !fp4moe_qtensor_is_aux(m, t->name))
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: block scales '%s' have no packed codes '%.*s.weight' beside them "
                                "(missing, or not NVFP4-packed)", t->file, t->name, stem - (int)strlen(sfx), t->name);
    return FP4MOE_OK;
}

int cmd_dequantize(int argc, char **argv) {
    const char *input = NULL, *output = NULL, *dtype_s = "bf16";
    int unstack = 0, quiet = 0;
    double shard_gb = 5.0;
    const cli_opt opts[] = {
        {"--input", "-i", CLI_STRING, &input, "IN", "a .safetensors file or a model directory (required)"},
        {"--output", "-o", CLI_STRING, &output, "OUT", "output file (for a file) or directory (required)"},
        {"--dtype", NULL, CLI_STRING, &dtype_s, "T", "bf16 | f16 | f32 (default bf16)"},
        {"--unstack", NULL, CLI_FLAG, &unstack, NULL, "write stacked experts as HF experts.{e}.up_proj/down_proj"},
        {"--shard-gb", NULL, CLI_DOUBLE, &shard_gb, "GB", "max shard size of a directory output (default 5)"},
        {"--quiet", "-q", CLI_FLAG, &quiet, NULL, "no progress or summary on stderr (notes, warnings and errors stay)"},
    };
    const cli_spec spec = {CMD,
                           "fp4moe dequantize --input IN --output OUT [--dtype bf16|f16|f32] [--shard-gb GB] [--unstack]",
                           k_help,
                           opts, (int)(sizeof opts / sizeof opts[0]), NULL, 0, NULL};
    int rc = cli_parse(&spec, argc, argv);
    if (rc == CLI_HELP) return FP4MOE_EXIT_OK;
    if (rc) return FP4MOE_EXIT_USAGE;
    if (!input || !output) return cli_usage_error(CMD, "--input and --output are required");
    fp4moe_dtype out_dt;
    if (fp4moe_dtype_parse(dtype_s, &out_dt)) return cli_usage_error(CMD, "--dtype must be bf16, f16 or f32, not '%s'", dtype_s);
    if (!(shard_gb > 0)) return cli_usage_error(CMD, "--shard-gb must be > 0");

    const double t0 = cli_now();
    fp4moe_st_model *m = NULL;
    fp4moe_st_writer *w = NULL;
    char *stage = NULL; /* a directory output's staging directory (cli_stage_dir) */
    deq_ctx *ctx = NULL;
    int64_t nctx = 0, done = 0, total = 0, ndeq = 0;
    cli_progress progress;
    int st = fp4moe_st_model_open(input, &m);
    rc = FP4MOE_EXIT_FAIL;
    if (st) goto fail;
    const int is_dir = fp4moe_st_model_is_dir(m);
    if ((is_dir && cli_same_file(input, output)) || cli_output_overwrites_input(m, input, output)) {
        rc = cli_usage_error(CMD, "%s", is_dir && cli_same_file(input, output) ? "--output must differ from --input"
                                                                          : fp4moe_last_error());
        goto done;
    }
    const fp4moe_qformat fmt = fp4moe_qformat_detect(m);
    const int64_t n = fp4moe_st_model_count(m);
    int64_t max_ctx = 0; /* one producer per quantized tensor, E with --unstack */
    for (int64_t i = 0; i < n; i++) {
        fp4moe_qtensor q;
        const fp4moe_st_tensor *t = fp4moe_st_model_at(m, i);
        int r = fp4moe_qtensor_of(m, t, &q);
        if (r < 0) { st = r; goto fail; }
        if (r == 1) max_ctx += unstack && q.ndim == 3 ? q.E : 1;
        if (r == 0 && (st = half_a_module(m, fmt, t))) goto fail;
    }
    if (fmt == FP4MOE_QFMT_PLAIN)
        fprintf(stderr, "dequantize: %s has no quantized tensor; copying it unchanged (its dtypes kept, not --dtype)\n",
                input);
    if (!(ctx = calloc((size_t)max_ctx + 1, sizeof *ctx)) || (st = fp4moe_st_writer_new(&w))) {
        if (!st) st = fp4moe_set_error(FP4MOE_ENOMEM, "out of memory");
        goto fail;
    }
    cli_progress_start(&progress, "dequantize", 0);
    progress.quiet = quiet;
    for (int64_t i = 0; i < n; i++) {
        const fp4moe_st_tensor *t = fp4moe_st_model_at(m, i);
        fp4moe_qtensor q;
        if (fp4moe_qtensor_is_aux(m, t->name)) continue;
        if (fp4moe_qtensor_of(m, t, &q) != 1) {
            int64_t shape[FP4MOE_ST_MAX_DIMS];
            const int nd = t->ndim;
            for (int d = 0; d < nd; d++) shape[d] = t->shape[d];
            /* --unstack writes HF's layout: MLX's depthwise conv1d (C, K, 1) is HF's (C, 1, K) - the same bytes */
            if (unstack && nd == 3 && shape[2] == 1 && shape[1] > 1 && ends_with_conv1d(t->name)) {
                shape[2] = shape[1];
                shape[1] = 1;
            }
            if ((st = fp4moe_st_writer_add(w, t->name, t->dtype, t->ndim, shape, t->data))) goto fail;
            continue;
        }
        ndeq++;
        total += q.weight->nbytes;
        char name[1100];
        if (unstack && q.ndim == 3 && unstacked_name(t->name, 0, name, sizeof name)) {
            for (int64_t e = 0; e < q.E; e++) {
                unstacked_name(t->name, e, name, sizeof name);
                ctx[nctx] = (deq_ctx){q, e, e + 1, out_dt, &progress, &done};
                if ((st = fp4moe_st_writer_add_fn(w, name, fp4moe_st_dtype_from(out_dt), 2, q.shape + 1, fill_deq,
                                                  &ctx[nctx++])))
                    goto fail;
            }
            continue;
        }
        ctx[nctx] = (deq_ctx){q, 0, q.E, out_dt, &progress, &done};
        if ((st = fp4moe_st_writer_add_fn(w, t->name, fp4moe_st_dtype_from(out_dt), q.ndim, q.shape, fill_deq,
                                          &ctx[nctx++])))
            goto fail;
    }
    progress.total = total;
    if ((st = fp4moe_st_writer_set_metadata(w, "format", "pt"))) goto fail;
    cli_install_stop_signals();
    if (is_dir && cli_is_dir(output))
        fprintf(stderr, "dequantize: writing into the existing directory %s (its model files are replaced once the "
                "new ones are complete)\n", output);
    if (is_dir) {
        const char *skip[] = {"config.json", "hf_quant_config.json", NULL};
        if ((st = cli_stage_dir(output, &stage)) ||
            (st = fp4moe_st_writer_write_model(w, stage, (int64_t)(shard_gb * 1e9))) ||
            (st = cli_copy_config(fp4moe_st_model_dir(m), stage, 0)) ||
            (st = cli_copy_model_files(fp4moe_st_model_dir(m), stage, skip)) || (st = cli_check_interrupt()) ||
            (st = cli_stage_commit(stage, output)))
            goto fail;
    } else {
        if ((st = cli_write_file(CMD, w, input, output))) goto fail;
    }
    cli_progress_finish(&progress);
    char b[32];
    if (quiet) {
    } else if (ndeq)
        fprintf(stderr, "dequantize: %lld %s tensors -> %s, %lld tensors written (%s) in %.1f s\n", (long long)ndeq,
                fp4moe_qformat_name(fmt), fp4moe_dtype_name(out_dt), (long long)fp4moe_st_writer_count(w),
                cli_format_bytes(fp4moe_st_writer_data_size(w), b), cli_now() - t0);
    else
        fprintf(stderr, "dequantize: nothing to dequantize; %lld tensors copied unchanged (%s) in %.1f s\n",
                (long long)fp4moe_st_writer_count(w), cli_format_bytes(fp4moe_st_writer_data_size(w), b), cli_now() - t0);
    rc = FP4MOE_EXIT_OK;
    goto done;
fail:
    rc = cli_convert_failed(CMD, st, output, stage);
    stage = NULL;
done:
    free(stage);
    fp4moe_st_writer_free(w);
    free(ctx);
    fp4moe_st_model_close(m);
    return rc;
}
