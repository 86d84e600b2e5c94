/* fp4moe inspect PATH: the tensors of a .safetensors file or model directory (name, dtype, shape,
 * bytes, shard), the detected format (MLX nvfp4 / ModelOpt NVFP4 / plain, io/nvfp4_ckpt.h), each
 * quantized module's logical shape, and a check of EVERY NVFP4 scale byte: NaN bytes (0x7F/0xFF,
 * spec NVFP4.md section 1) are reported with tensor and index, and make the exit code 1, as do NaN / Inf values
 * of float tensors (the engine refuses them when it runs).
 * `inspect -m DIR` first prints the model-level summary of the loader (cli_model_summary in
 * cmd_generate.c: format, layer pattern, parameters, bytes per component), then the same report
 * without the per-tensor listing. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "fp4moe/fp4moe.h"
#include "fp4moe/checkpoint.h"

#define CMD "inspect"
#define MAX_REPORTED 20 /* NaN positions listed per tensor (all are counted) */

static const char *k_help =
    "Lists the tensors of a .safetensors file or model directory (dtype, shape, bytes), detects the\n"
    "format (MLX nvfp4, ModelOpt NVFP4, plain) and validates every NVFP4 block-scale byte: NaN bytes\n"
    "(0x7F/0xFF) are reported with tensor and index; float tensors (F32/F16/BF16) are checked for\n"
    "NaN / Inf values. Exit code 1 when a scale byte is NaN, a float value is not finite or a\n"
    "quantized module is inconsistent.";

typedef struct {
    int json, summary;
    cJSON *root, *tensors, *problems;
    int64_t nan_total, scale_bytes, problems_n, quantized, nonfinite_total, float_values;
} report;

static void shape_str(const int64_t *shape, int ndim, char *buf, size_t cap) {
    size_t k = (size_t)snprintf(buf, cap, "(");
    for (int d = 0; d < ndim && k < cap; d++) k += (size_t)snprintf(buf + k, cap - k, d ? ", %lld" : "%lld", (long long)shape[d]);
    if (k < cap) snprintf(buf + k, cap - k, ndim == 1 ? ",)" : ")");
}

static cJSON *shape_json(const int64_t *shape, int ndim) {
    cJSON *a = cJSON_CreateArray();
    for (int d = 0; d < ndim; d++) cJSON_AddItemToArray(a, cJSON_CreateNumber((double)shape[d]));
    return a;
}

static void problem(report *r, const char *text) {
    r->problems_n++;
    if (r->json) cJSON_AddItemToArray(r->problems, cJSON_CreateString(text));
    else printf("PROBLEM: %s\n", text);
}

/* Scans every scale byte of q; reports NaN bytes (the first MAX_REPORTED of the tensor by index). */
static void check_scales(report *r, const fp4moe_qtensor *q) {
    for (int64_t e = 0; q->gs && e < q->E; e++) {      /* global scales: finite and >= 0, as load requires */
        float gs;
        if (fp4moe_qtensor_gs(q, e, &gs)) {
            problem(r, fp4moe_last_error());
            break;
        }
    }
    const uint8_t *s = q->scales->data;
    const int64_t n = q->scales->numel, per_row = q->K / 16;
    int64_t count = 0;
    r->scale_bytes += n;
    for (int64_t at = 0; at < n;) {
        const int64_t k = fp4moe_nvfp4_find_nan_scale(s + at, n - at);
        if (k < 0) break;
        at += k;
        if (count < MAX_REPORTED) {
            const int64_t row = at / per_row, e = row / q->N;
            char msg[1400];
            if (q->E > 1)
                snprintf(msg, sizeof msg, "NaN scale byte 0x%02X in '%s' at index %lld (expert %lld, row %lld, block %lld)",
                         s[at], q->scales->name, (long long)at, (long long)e, (long long)(row % q->N),
                         (long long)(at % per_row));
            else
                snprintf(msg, sizeof msg, "NaN scale byte 0x%02X in '%s' at index %lld (row %lld, block %lld)", s[at],
                         q->scales->name, (long long)at, (long long)row, (long long)(at % per_row));
            problem(r, msg);
        } else {
            r->problems_n++;
        }
        count++;
        at++;
    }
    if (count > MAX_REPORTED && !r->json)
        printf("PROBLEM: ... %lld NaN scale bytes in '%s' in all\n", (long long)count, q->scales->name);
    r->nan_total += count;
}

/* Scans a float tensor (F32, F16, BF16) for NaN / Inf (an exponent of all ones), which the engine refuses at run
 * time ("weights hold NaN/Inf values"): one problem line a tensor, with the first index and the count. */
static void check_floats(report *r, const fp4moe_st_tensor *t) {
    const fp4moe_dtype dt = t->dtype == FP4MOE_ST_F32    ? FP4MOE_F32
                            : t->dtype == FP4MOE_ST_BF16 ? FP4MOE_BF16
                            : t->dtype == FP4MOE_ST_F16  ? FP4MOE_F16
                                                         : (fp4moe_dtype)-1;
    if ((int)dt < 0) return;
    int64_t first = -1;
    const int64_t count = fp4moe_count_nonfinite(t->data, dt, t->numel, &first);
    r->float_values += t->numel;
    r->nonfinite_total += count;
    if (count) {
        char msg[1400];
        snprintf(msg, sizeof msg, "%lld NaN / Inf values in '%s' (%s), the first at index %lld", (long long)count,
                 t->name, fp4moe_st_dtype_name(t->dtype), (long long)first);
        problem(r, msg);
    }
}

static int ends_with(const char *s, const char *suffix) {
    const size_t a = strlen(s), b = strlen(suffix);
    return a >= b && !memcmp(s + a - b, suffix, b);
}

static void list_tensor(report *r, const fp4moe_st_model *m, const fp4moe_st_tensor *t) {
    fp4moe_qtensor q;
    const int qr = fp4moe_qtensor_of(m, t, &q);
    if (qr < 0) problem(r, fp4moe_last_error());
    if (qr == 0 && t->dtype == FP4MOE_ST_U32 && ends_with(t->name, ".weight")) {
        /* packed MLX codes without their block scales: no loader can read the module */
        char msg[600];
        snprintf(msg, sizeof msg, "'%s' holds packed MLX nvfp4 codes (U32) but its block scales '%.*s.scales' are "
                 "missing", t->name, (int)(strlen(t->name) - strlen(".weight")), t->name);
        problem(r, msg);
    }
    if (qr == 1) {
        r->quantized++;
        check_scales(r, &q);
    }
    check_floats(r, t);
    if (r->summary) return;
    char shape[160], b[32];
    shape_str(t->shape, t->ndim, shape, sizeof shape);
    const char *file = strrchr(t->file, '/');
    file = file ? file + 1 : t->file;
    if (r->json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "name", t->name);
        cJSON_AddStringToObject(o, "dtype", fp4moe_st_dtype_name(t->dtype));
        cJSON_AddItemToObject(o, "shape", shape_json(t->shape, t->ndim));
        cJSON_AddNumberToObject(o, "bytes", (double)t->nbytes);
        cJSON_AddStringToObject(o, "file", file);
        if (qr == 1) {
            cJSON *nv = cJSON_AddObjectToObject(o, "nvfp4");
            cJSON_AddStringToObject(nv, "format", fp4moe_qformat_name(q.format));
            cJSON_AddItemToObject(nv, "shape", shape_json(q.shape, q.ndim));
            cJSON_AddBoolToObject(nv, "global_scale", q.gs != NULL);
        }
        cJSON_AddItemToArray(r->tensors, o);
        return;
    }
    printf("  %-64s %-8s %-22s %12s", t->name, fp4moe_st_dtype_name(t->dtype), shape, cli_format_bytes(t->nbytes, b));
    if (fp4moe_st_model_nfiles(m) > 1) printf("  %s", file);
    if (qr == 1) {
        shape_str(q.shape, q.ndim, shape, sizeof shape);
        printf("  nvfp4 %s%s", shape, q.gs ? " +global scale" : "");
    }
    printf("\n");
}

/* "quantization" (or "quantization_config") of config.json: a copy (caller: cJSON_Delete), NULL when absent.
 * bad (600 bytes, or NULL): set to a message when config.json exists but is not valid JSON, else left alone. */
static cJSON *config_quant(const fp4moe_st_model *m, char *bad) {
    if (!fp4moe_st_model_is_dir(m)) return NULL;
    cJSON *out = NULL;
    char *path = cli_join(fp4moe_st_model_dir(m), "config.json"), *text = NULL;
    if (path && cli_read_text(path, 64 << 20, &text) == FP4MOE_OK) {
        cJSON *root = cJSON_Parse(text);
        if (!root && bad) { /* the loader refuses it: a problem, located */
            const char *at = cJSON_GetErrorPtr();
            int line = 1, col = 1;
            for (const char *c = text; at && c < at && *c; c++) {
                if (*c == '\n') {
                    line++;
                    col = 1;
                } else {
                    col++;
                }
            }
            snprintf(bad, 600, "%s: malformed JSON near line %d column %d", path, line, col);
        }
        const cJSON *q = cJSON_GetObjectItemCaseSensitive(root, "quantization");
        if (!q) q = cJSON_GetObjectItemCaseSensitive(root, "quantization_config");
        if (cJSON_IsObject(q)) out = cJSON_Duplicate(q, 1);
        cJSON_Delete(root);
    }
    free(text);
    free(path);
    return out;
}

int cmd_inspect(int argc, char **argv) {
    report r = {0};
    const char *model_dir = NULL;
    const char *pos[1] = {NULL};
    int npos = 0;
    const cli_opt opts[] = {
        {"--json", NULL, CLI_FLAG, &r.json, NULL, "print one JSON object instead of text"},
        {"--summary", NULL, CLI_FLAG, &r.summary, NULL, "omit the per-tensor listing"},
        {"--model", "-m", CLI_STRING, &model_dir, "DIR", "model directory: model summary (layers, parameters), then the checks"},
    };
    const cli_spec spec = {CMD, "fp4moe inspect PATH [--json] [--summary]  |  fp4moe inspect -m DIR [--json]", k_help, opts,
                           (int)(sizeof opts / sizeof opts[0]), pos, 1, &npos};
    int rc = cli_parse(&spec, argc, argv);
    if (rc == CLI_HELP) return FP4MOE_EXIT_OK;
    if (rc) return FP4MOE_EXIT_USAGE;
    if (npos && model_dir) return cli_usage_error(CMD, "give PATH or -m DIR, not both");
    const char *path = npos ? pos[0] : model_dir;
    if (!path) return cli_usage_error(CMD, "missing PATH (a .safetensors file or a model directory)");
    cJSON *model_json = NULL; /* -m DIR --json: the summary as the "model" object */
    char model_err[1200] = "";
    static const char k_no_load[] = "the model does not load: ";
    if (model_dir) {
        /* a missing DIR (or a file) said once, as generate says it (a user's trial: "config.json: cannot open", then
           "DIR: cannot stat") */
        if (cli_require_model_dir(CMD, model_dir)) return FP4MOE_EXIT_FAIL;
        if (r.json && !(model_json = cJSON_CreateObject())) return cli_fail(CMD, FP4MOE_ENOMEM);
        /* a model that does not load: said (stderr, and as a problem below), then the files' checks all the same -
           they name what is wrong with the tensors (it stopped here, with no report) */
        if (cli_model_summary(CMD, model_dir, stdout, model_json))
            snprintf(model_err, sizeof model_err, "%s%s", k_no_load, fp4moe_last_error());
        r.summary = 1;
    }

    fp4moe_st_model *m = NULL;
    int st = fp4moe_st_model_open(path, &m);
    if (st) {
        cJSON_Delete(model_json);
        /* the files fail as the model did (a truncated shard): the message is on stderr already, not twice */
        if (model_err[0] && !strcmp(model_err + sizeof k_no_load - 1, fp4moe_last_error())) return 1;
        return cli_fail(CMD, st);
    }
    const fp4moe_qformat fmt = fp4moe_qformat_detect(m);
    int64_t total = 0;
    for (int64_t i = 0; i < fp4moe_st_model_count(m); i++) total += fp4moe_st_model_at(m, i)->nbytes;
    char b[32];
    char bad_config[600] = "";
    cJSON *cq = config_quant(m, bad_config);
    if (r.json) {
        r.root = cJSON_CreateObject();
        cJSON_AddStringToObject(r.root, "path", path);
        if (model_json) cJSON_AddItemToObject(r.root, "model", cJSON_DetachItemFromObject(model_json, "model"));
        cJSON_Delete(model_json);
        model_json = NULL;
        cJSON_AddStringToObject(r.root, "format", fp4moe_qformat_name(fmt));
        if (cq) cJSON_AddItemToObject(r.root, "config_quantization", cq); /* the object itself */
        cq = NULL;
        cJSON_AddNumberToObject(r.root, "files", (double)fp4moe_st_model_nfiles(m));
        cJSON_AddNumberToObject(r.root, "tensor_count", (double)fp4moe_st_model_count(m));
        cJSON_AddNumberToObject(r.root, "bytes", (double)total);
        r.tensors = cJSON_AddArrayToObject(r.root, "tensors");
        r.problems = cJSON_AddArrayToObject(r.root, "problems");
    } else {
        printf("path:    %s\n", path);
        printf("files:   %lld   tensors: %lld   bytes: %s\n", (long long)fp4moe_st_model_nfiles(m),
               (long long)fp4moe_st_model_count(m), cli_format_bytes(total, b));
        char *cqs = cq ? cJSON_PrintUnformatted(cq) : NULL; /* whole: a ModelOpt entry runs to ~300 characters */
        printf("format:  %s%s%s\n", fp4moe_qformat_name(fmt), cqs ? "   config quantization: " : "", cqs ? cqs : "");
        free(cqs);
        cJSON_Delete(cq);
        cq = NULL;
        if (!r.summary) printf("tensors:\n");
    }
    if (model_err[0]) problem(&r, model_err);
    if (bad_config[0]) problem(&r, bad_config);
    for (int64_t i = 0; i < fp4moe_st_model_count(m); i++) list_tensor(&r, m, fp4moe_st_model_at(m, i));
    if (r.json) {
        cJSON_AddNumberToObject(r.root, "quantized_modules", (double)r.quantized);
        cJSON_AddNumberToObject(r.root, "scale_bytes_checked", (double)r.scale_bytes);
        cJSON_AddNumberToObject(r.root, "nan_scale_bytes", (double)r.nan_total);
        cJSON_AddNumberToObject(r.root, "float_values_checked", (double)r.float_values);
        cJSON_AddNumberToObject(r.root, "nonfinite_float_values", (double)r.nonfinite_total);
        cJSON_AddBoolToObject(r.root, "ok", r.problems_n == 0);
        cli_json_print_obj(r.root);
        cJSON_Delete(r.root);
    } else {
        printf("nvfp4:   %lld quantized modules, %lld scale bytes checked, %lld NaN\n", (long long)r.quantized,
               (long long)r.scale_bytes, (long long)r.nan_total);
        printf("floats:  %lld values checked, %lld NaN / Inf\n", (long long)r.float_values, (long long)r.nonfinite_total);
        printf("status:  %s\n", r.problems_n ? "PROBLEMS FOUND" : "ok");
    }
    fp4moe_st_model_close(m);
    return r.problems_n ? FP4MOE_EXIT_FAIL : FP4MOE_EXIT_OK;
}
