/* Replays every input kept in tests/io/regressions/ (*.bin: inputs found by fuzz/run.sh and
 * hand-made edge cases) through the safetensors header parser. Each must either open, with every
 * view inside the image, or fail with a message that names the input; none may crash or hang.
 * (ctest runs this from the source directory.) */
#include "io_helpers.h"

#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#define REG_DIR "tests/io/regressions"

static uint8_t *read_all(const char *path, size_t *n) {
    FILE *fp = fopen(path, "rb");
    assert_non_null(fp);
    fseek(fp, 0, SEEK_END);
    long len = ftell(fp);
    rewind(fp);
    uint8_t *p = malloc((size_t)len + 1);
    assert_int_equal(fread(p, 1, (size_t)len, fp), (size_t)len);
    fclose(fp);
    *n = (size_t)len;
    return p;
}

static void replay_one(const char *path, int *n_ok, int *n_err) {
    size_t n;
    uint8_t *img = read_all(path, &n);
    fp4moe_st_file *f = NULL;
    const int st = fp4moe_st_open_memory(img, n, path, &f);
    if (st != FP4MOE_OK) {
        assert_null(f);
        if (!strstr(fp4moe_last_error(), path)) fail_msg("%s: message lacks the name: %s", path, fp4moe_last_error());
        (*n_err)++;
    } else {
        for (int64_t i = 0; i < fp4moe_st_count(f); i++) {
            const fp4moe_st_tensor *t = fp4moe_st_at(f, i);
            assert_ptr_equal(fp4moe_st_find(f, t->name), t);
            assert_true(t->nbytes >= 0 && t->offset >= 0);
            assert_true((const uint8_t *)t->data >= img && (const uint8_t *)t->data + t->nbytes <= img + n);
        }
        fp4moe_st_close(f);
        (*n_ok)++;
    }
    free(img);
}

static void test_replay_regressions(void **state) {
    DIR *d = opendir(REG_DIR);
    if (!d) fail_msg("cannot open %s (run from the source directory)", REG_DIR);
    int n_ok = 0, n_err = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        size_t len = strlen(de->d_name);
        if (len < 5 || strcmp(de->d_name + len - 4, ".bin")) continue;
        char path[600];
        snprintf(path, sizeof path, "%s/%s", REG_DIR, de->d_name);
        replay_one(path, &n_ok, &n_err);
    }
    closedir(d);
    printf("replayed %d inputs: %d opened, %d rejected with a message\n", n_ok + n_err, n_ok, n_err);
    assert_true(n_ok + n_err > 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_replay_regressions)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
