/* JSON text -> cJSON with a located error (json.h). */
#include "common/json.h"

#include "common/error.h"
#include "fp4moe/types.h"

int fp4moe_json_parse(const char *data, size_t len, const char *label, cJSON **root) {
    const char *end = NULL;
    *root = cJSON_ParseWithLengthOpts(data, len, &end, 0);
    if (*root) return FP4MOE_OK;
    const char *at = end ? end : cJSON_GetErrorPtr();
    const size_t off = at && at >= data && at <= data + len ? (size_t)(at - data) : 0;
    int line = 1, col = 1;
    for (size_t i = 0; i < off; i++) {
        if (data[i] == '\n') line++, col = 1;
        else col++;
    }
    return fp4moe_set_error(FP4MOE_EFORMAT, "%s: malformed JSON near line %d column %d (byte %zu)", label, line, col,
                            off);
}
