/* Renders a JSON array of {"template": ..., "context": {...}} with the C engine and prints a JSON
 * array of {"out": ...} or {"error": "compile"|"render", "msg": ...}; the helper of
 * scripts/template_differential.py (built there with cc; not part of the library or the tests). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "fp4moe/template.h"
#include "fp4moe/types.h"

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, n = 0;
    char *b = malloc(cap);
    size_t k;
    while (b && (k = fread(b + n, 1, cap - n - 1, f)) > 0) {
        n += k;
        if (n + 1 == cap) {
            char *p = realloc(b, cap *= 2);
            if (!p) { free(b); b = NULL; }
            else b = p;
        }
    }
    fclose(f);
    if (b) b[n] = '\0';
    return b;
}

int main(int argc, char **argv) {
    if (argc != 2) { fprintf(stderr, "usage: %s CASES.json\n", argv[0]); return 2; }
    char *text = slurp(argv[1]);
    cJSON *cases = text ? cJSON_Parse(text) : NULL;
    free(text);
    if (!cases) { fprintf(stderr, "cannot read %s\n", argv[1]); return 1; }
    cJSON *res = cJSON_CreateArray();
    const cJSON *c;
    cJSON_ArrayForEach(c, cases) {
        const char *src = cJSON_GetStringValue(cJSON_GetObjectItem(c, "template"));
        cJSON *o = cJSON_CreateObject();
        fp4moe_template *t = NULL;
        if (!src || fp4moe_template_compile(src, strlen(src), &t) != FP4MOE_OK) {
            cJSON_AddStringToObject(o, "error", "compile");
            cJSON_AddStringToObject(o, "msg", fp4moe_last_error());
        } else {
            fp4moe_template_limits lim = {1 << 20, 50, 1000000};
            char *out = NULL;
            if (fp4moe_template_render(t, cJSON_GetObjectItem(c, "context"), &lim, &out, NULL) != FP4MOE_OK) {
                cJSON_AddStringToObject(o, "error", "render");
                cJSON_AddStringToObject(o, "msg", fp4moe_last_error());
            } else {
                cJSON_AddStringToObject(o, "out", out);
            }
            free(out);
            fp4moe_template_free(t);
        }
        cJSON_AddItemToArray(res, o);
    }
    char *p = cJSON_PrintUnformatted(res);
    if (p) puts(p);
    free(p);
    cJSON_Delete(res);
    cJSON_Delete(cases);
    return 0;
}
