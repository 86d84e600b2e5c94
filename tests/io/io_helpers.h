/* Helpers of the io tests (header-only: every tests/io/test_*.c is its own program): a private
 * temporary directory, raw safetensors images with a hand-written header, and error-message checks. */
#ifndef FP4MOE_TESTS_IO_HELPERS_H
#define FP4MOE_TESTS_IO_HELPERS_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fp4moe/fp4moe.h"

static char g_tmpdir[64];

/* Creates the test's own directory under /tmp (removed by io_rmtree_tmp). */
static inline const char *io_tmpdir(void) {
    if (!g_tmpdir[0]) {
        strcpy(g_tmpdir, "/tmp/fp4moe-io-test-XXXXXX");
        if (!mkdtemp(g_tmpdir)) {
            perror("mkdtemp");
            abort();
        }
    }
    return g_tmpdir;
}

/* io_path("a/b") -> "<tmpdir>/a/b" in a static rotating buffer (8 live results). */
static inline const char *io_path(const char *rel) {
    static char buf[8][512];
    static int k;
    char *p = buf[k++ & 7];
    snprintf(p, 512, "%s/%s", io_tmpdir(), rel);
    return p;
}

static inline int io_rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb; (void)flag; (void)ftw;
    return remove(p);
}

static inline void io_rmtree_tmp(void) {
    if (g_tmpdir[0] && strncmp(g_tmpdir, "/tmp/fp4moe-io-test-", 20) == 0)
        nftw(g_tmpdir, io_rm_cb, 16, FTW_DEPTH | FTW_PHYS);
    g_tmpdir[0] = '\0';
}

/* Writes bytes to path. */
static inline void io_write_bytes(const char *path, const void *p, size_t n) {
    FILE *fp = fopen(path, "wb");
    if (!fp || fwrite(p, 1, n, fp) != n) {
        perror(path);
        abort();
    }
    fclose(fp);
}

/* Writes a safetensors image: 8-byte length (hlen_override when >= 0, else strlen(header)),
 * the header text, then data_len bytes of non-zero data. */
static inline void io_write_raw(const char *path, const char *header, int64_t hlen_override, size_t data_len) {
    const size_t h = strlen(header);
    uint8_t *img = malloc(8 + h + data_len + 1);
    const uint64_t len = hlen_override >= 0 ? (uint64_t)hlen_override : h;
    for (int i = 0; i < 8; i++) img[i] = (uint8_t)(len >> (8 * i));
    memcpy(img + 8, header, h);
    for (size_t i = 0; i < data_len; i++) img[8 + h + i] = (uint8_t)(i * 7 + 1);
    io_write_bytes(path, img, 8 + h + data_len);
    free(img);
}

#endif
