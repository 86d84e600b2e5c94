/* The one table of FP4MOE_* environment variables (src/common/env.c): values checked, read once,
 * and the README's environment table in step with it (every variable of the table has its row,
 * with its allowed values and default, and the README names no variable the table lacks). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "common/env.h"
#include "fp4moe/fp4moe.h"
#include "testutil.h"

static char *read_all(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("cannot open %s", path);
    fseek(f, 0, SEEK_END);
    const long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    assert_int_equal(fread(s, 1, (size_t)n, f), (size_t)n);
    s[n] = 0;
    fclose(f);
    return s;
}

static void test_check_and_defaults(void **state) {
    for (int i = 0; i < fp4moe_env_count(); i++) tu_setenv(fp4moe_env_var_at(i)->name, NULL);
    assert_int_equal(fp4moe_env_check(), FP4MOE_OK);
    assert_null(fp4moe_env_var_at(-1));
    assert_null(fp4moe_env_var_at(fp4moe_env_count()));
    assert_string_equal(fp4moe_env_value("FP4MOE_GATHER_ROUTE"), "auto");
    assert_null(fp4moe_env_value("FP4MOE_NO_SUCH_THING"));
    tu_setenv("FP4MOE_GATHER_ROUTE", "qmv");
    assert_string_equal(fp4moe_env_value("FP4MOE_GATHER_ROUTE"), "qmv");
    tu_setenv("FP4MOE_GATHER_ROUTE", "qvm");                           /* a typo: the default, and an error */
    assert_string_equal(fp4moe_env_value("FP4MOE_GATHER_ROUTE"), "auto");
    assert_int_equal(fp4moe_env_check(), FP4MOE_EINVAL);
    assert_non_null(strstr(fp4moe_last_error(), "FP4MOE_GATHER_ROUTE='qvm'"));
    assert_non_null(strstr(fp4moe_last_error(), "auto|qmv|batched|dequant_gemm"));
    tu_setenv("FP4MOE_GATHER_ROUTE", NULL);
    tu_setenv("FP4MOE_QUANTIZE_STASH_MB", "-3");
    assert_int_equal(fp4moe_env_check(), FP4MOE_EINVAL);
    assert_int_equal(env_get_int(ENV_QUANTIZE_STASH_MB), 1024);
    tu_setenv("FP4MOE_QUANTIZE_STASH_MB", "0");
    assert_int_equal(env_get_int(ENV_QUANTIZE_STASH_MB), 0);
    tu_setenv("FP4MOE_QUANTIZE_STASH_MB", NULL);
}

static void test_read_once(void **state) {
    tu_setenv("FP4MOE_CUDA_GRAPH", "0");
    assert_string_equal(env_get(ENV_CUDA_GRAPH), "0");
    setenv("FP4MOE_CUDA_GRAPH", "1", 1);                               /* no reload: the value read stays */
    assert_string_equal(env_get(ENV_CUDA_GRAPH), "0");
    tu_setenv("FP4MOE_CUDA_GRAPH", NULL);
    assert_string_equal(env_get(ENV_CUDA_GRAPH), "1");
}

static void test_readme_matches_table(void **state) {
    char *readme = read_all("README.md");
    for (int i = 0; i < fp4moe_env_count(); i++) {
        const fp4moe_env_var *v = fp4moe_env_var_at(i);
        char allowed[128], row[256];
        size_t k = 0;                                  /* a pipe in a table cell is written \| */
        for (const char *c = v->allowed; *c && k + 2 < sizeof allowed; c++) {
            if (*c == '|') allowed[k++] = '\\';
            allowed[k++] = *c;
        }
        allowed[k] = 0;
        snprintf(row, sizeof row, "| `%s` | `%s` | `%s` |", v->name, allowed, v->def);
        if (!strstr(readme, row)) fail_msg("README.md has no environment row starting '%s'", row);
    }
    /* every FP4MOE_ name in the README that is an environment variable is in the table */
    for (const char *p = strstr(readme, "FP4MOE_"); p; p = strstr(p + 1, "FP4MOE_")) {
        char name[64];
        size_t n = 0;
        while (n < sizeof name - 1 && ((p[n] >= 'A' && p[n] <= 'Z') || p[n] == '_' || (p[n] >= '0' && p[n] <= '9')))
            name[n] = p[n], n++;
        name[n] = 0;
        if (!strncmp(name, "FP4MOE_EXIT_", 12) || !strncmp(name, "FP4MOE_CUDA=", 12)) continue;
        if (p[n] == '=' || p[n] == '`' || p[n] == ' ') {
            /* the CMake options (-DFP4MOE_CUDA, FP4MOE_BUILD_CLI / _TESTS) and the public API's names (model.h) */
            static const char *const not_env[] = {"FP4MOE_CUDA", "FP4MOE_BUILD_CLI", "FP4MOE_BUILD_TESTS",
                                                  "FP4MOE_CPU_ACT_FLOAT", "FP4MOE_CPU_ACT_Q8"};
            int skip = 0;
            for (size_t k = 0; k < sizeof not_env / sizeof *not_env; k++) skip |= !strcmp(name, not_env[k]);
            if (skip) continue;
            if (!fp4moe_env_value(name)) fail_msg("README.md names %s, which the environment table lacks", name);
        }
    }
    free(readme);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_check_and_defaults),
        cmocka_unit_test(test_read_once),
        cmocka_unit_test(test_readme_matches_table),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
