/* JSON text -> cJSON with a located error (json.h). */
#include "common/json.h"

#include "common/error.h"
#include "fp4moe/types.h"

static int json_error_at(const char *data, size_t len, const char *at, const char *label, const char *what) {
    const size_t off = at && at >= data && at <= data + len ? (size_t)(at - data) : 0;
    int line = 1, col = 1;
    for (size_t i = 0; i < off; i++) {
        if (data[i] == '\n') line++, col = 1;
        else col++;
    }
    return fp4moe_set_error(FP4MOE_EFORMAT, "%s: %s near line %d column %d (byte %zu)", label, what, line, col, off);
}

int fp4moe_json_parse(const char *data, size_t len, const char *label, cJSON **root) {
    const char *end = NULL;
    *root = cJSON_ParseWithLengthOpts(data, len, &end, 0);
    if (!*root) return json_error_at(data, len, end ? end : cJSON_GetErrorPtr(), label, "malformed JSON");
    /* one value and nothing after it but white space (RFC 8259 section 2; json.loads refuses "{} xyz" too) */
    size_t i = end && end >= data && end <= data + len ? (size_t)(end - data) : len;
    while (i < len && (data[i] == ' ' || data[i] == '\t' || data[i] == '\n' || data[i] == '\r' || data[i] == '\0')) i++;
    if (i < len) {
        cJSON_Delete(*root);
        *root = NULL;
        return json_error_at(data, len, data + i, label, "text after the JSON value");
    }
    return FP4MOE_OK;
}
