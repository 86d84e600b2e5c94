/* JSON text -> cJSON with a located error (the files fp4moe reads: config.json, tokenizer.json, ...). */
#ifndef FP4MOE_COMMON_JSON_H
#define FP4MOE_COMMON_JSON_H

#include <stddef.h>

#include <cjson/cJSON.h>

/* Parses the len bytes of data (JSON text; need not be NUL-terminated) into *root (caller: cJSON_Delete).
 * Errors: FP4MOE_EFORMAT, "LABEL: malformed JSON near line L column C (byte N)" - the 1-based line and column
 * (in bytes) and the offset where cJSON stopped; "LABEL: text after the JSON value near ..." when anything but
 * white space (or NUL padding) follows the value (RFC 8259: one value a text); *root = NULL. */
int fp4moe_json_parse(const char *data, size_t len, const char *label, cJSON **root);

#endif
