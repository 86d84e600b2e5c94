/* safetensors reader, writer and model-directory view (include/fp4moe/safetensors.h).
 * Valid files come from the writer with random contents; bad files are written by hand, and each
 * one checks the status AND that the message names the file, the tensor and the problem. */
#include "io_helpers.h"

#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <sys/stat.h>
#include <cmocka.h>

#include "testutil.h"
#include "common/error.h"

/* ---- helpers ----------------------------------------------------------------------------------------- */

static uint8_t *random_bytes(tu_rng *r, int64_t n) {
    uint8_t *p = malloc((size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; i++) p[i] = (uint8_t)(1 + tu_rng_below(r, 255)); /* never 0 */
    return p;
}

/* Opens `path` expecting failure with `status` and every needle in the message. */
static void expect_open_error(const char *path, int status, const char *n1, const char *n2, const char *n3) {
    fp4moe_st_file *f = (fp4moe_st_file *)0x1;
    const int st = fp4moe_st_open(path, &f);
    const char *msg = fp4moe_last_error();
    if (st != status) fail_msg("%s: status %d, expected %d; message: %s", path, st, status, msg);
    assert_null(f);
    const char *needles[] = {path, n1, n2, n3};
    for (int i = 0; i < 4; i++)
        if (needles[i] && !strstr(msg, needles[i])) fail_msg("message \"%s\" lacks \"%s\"", msg, needles[i]);
}

/* A bad header written by hand, opened, checked. */
static void bad_header(const char *file, const char *header, size_t data_len, int status, const char *n1,
                       const char *n2, const char *n3) {
    const char *path = io_path(file);
    io_write_raw(path, header, -1, data_len);
    expect_open_error(path, status, n1, n2, n3);
}

static int count_files(const char *dir, const char *prefix) {
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *de;
    while (d && (de = readdir(d)))
        if (!strncmp(de->d_name, prefix, strlen(prefix))) n++;
    if (d) closedir(d);
    return n;
}

/* ---- valid files ------------------------------------------------------------------------------------- */

static void test_roundtrip_every_dtype(void **state) {
    tu_rng r;
    tu_rng_seed(&r, 11);
    fp4moe_st_writer *w;
    assert_int_equal(fp4moe_st_writer_new(&w), FP4MOE_OK);
    uint8_t *bufs[FP4MOE_ST_DTYPE_COUNT + 2];
    int64_t shapes[FP4MOE_ST_DTYPE_COUNT][3];
    char names[FP4MOE_ST_DTYPE_COUNT][64];
    for (int d = 0; d < FP4MOE_ST_DTYPE_COUNT; d++) {
        /* odd shapes so that misalignment would show; ndim cycles 1..3 */
        const int ndim = 1 + d % 3;
        int64_t n = 1;
        for (int k = 0; k < ndim; k++) n *= (shapes[d][k] = 1 + tu_rng_below(&r, 7) + (k == 0) * 2);
        snprintf(names[d], sizeof names[d], "layer.%d.\"quoted\\name\".%s", d, fp4moe_st_dtype_name(d));
        bufs[d] = random_bytes(&r, n * (int64_t)fp4moe_st_dtype_size(d));
        assert_int_equal(fp4moe_st_writer_add(w, names[d], (fp4moe_st_dtype)d, ndim, shapes[d], bufs[d]), FP4MOE_OK);
    }
    const int64_t zero_shape[2] = {3, 0};
    const float scalar = 3.25f;
    assert_int_equal(fp4moe_st_writer_add(w, "empty", FP4MOE_ST_F32, 2, zero_shape, NULL), FP4MOE_OK);
    assert_int_equal(fp4moe_st_writer_add(w, "scalar", FP4MOE_ST_F32, 0, NULL, &scalar), FP4MOE_OK);
    assert_int_equal(fp4moe_st_writer_set_metadata(w, "format", "pt"), FP4MOE_OK);
    assert_int_equal(fp4moe_st_writer_set_metadata(w, "note", "x"), FP4MOE_OK);
    assert_int_equal(fp4moe_st_writer_set_metadata(w, "note", "tab\there \"q\""), FP4MOE_OK); /* replaces */
    /* invalid additions are refused with a message */
    assert_int_equal(fp4moe_st_writer_add(w, "empty", FP4MOE_ST_F32, 2, zero_shape, NULL), FP4MOE_EINVAL);
    assert_non_null(strstr(fp4moe_last_error(), "empty"));
    assert_int_equal(fp4moe_st_writer_add(w, "__metadata__", FP4MOE_ST_U8, 0, NULL, &scalar), FP4MOE_EINVAL);
    const int64_t neg[1] = {-1};
    assert_int_equal(fp4moe_st_writer_add(w, "neg", FP4MOE_ST_U8, 1, neg, &scalar), FP4MOE_EINVAL);
    const char *path = io_path("all.safetensors");
    assert_int_equal(fp4moe_st_writer_write(w, path), FP4MOE_OK);
    fp4moe_st_writer_free(w);

    fp4moe_st_file *f;
    if (fp4moe_st_open(path, &f)) fail_msg("%s", fp4moe_last_error());
    assert_int_equal(fp4moe_st_count(f), FP4MOE_ST_DTYPE_COUNT + 2);
    for (int d = 0; d < FP4MOE_ST_DTYPE_COUNT; d++) {
        const fp4moe_st_tensor *t = fp4moe_st_find(f, names[d]);
        assert_non_null(t);
        assert_string_equal(t->name, names[d]);
        assert_int_equal(t->dtype, d);
        assert_int_equal(t->ndim, 1 + d % 3);
        for (int k = 0; k < t->ndim; k++) assert_int_equal(t->shape[k], shapes[d][k]);
        assert_int_equal(t->nbytes, t->numel * (int64_t)fp4moe_st_dtype_size(d));
        assert_memory_equal(t->data, bufs[d], (size_t)t->nbytes);
        assert_int_equal((uintptr_t)t->data % fp4moe_st_dtype_size(d), 0); /* aligned by the writer's order */
        assert_string_equal(t->file, path);
        free(bufs[d]);
    }
    const fp4moe_st_tensor *e = fp4moe_st_find(f, "empty"), *s = fp4moe_st_find(f, "scalar");
    assert_non_null(e);
    assert_int_equal(e->nbytes, 0);
    assert_int_equal(e->shape[1], 0);
    assert_non_null(s);
    assert_int_equal(s->ndim, 0);
    assert_int_equal(s->numel, 1);
    assert_memory_equal(s->data, &scalar, 4);
    assert_null(fp4moe_st_find(f, "missing"));
    assert_null(fp4moe_st_at(f, -1));
    assert_null(fp4moe_st_at(f, fp4moe_st_count(f)));
    for (int64_t i = 1; i < fp4moe_st_count(f); i++) /* file order */
        assert_true(fp4moe_st_at(f, i - 1)->offset <= fp4moe_st_at(f, i)->offset);
    assert_string_equal(fp4moe_st_metadata(f, "format"), "pt");
    assert_string_equal(fp4moe_st_metadata(f, "note"), "tab\there \"q\"");
    assert_int_equal(fp4moe_st_metadata_count(f), 2);
    assert_null(fp4moe_st_metadata(f, "nope"));
    fp4moe_st_close(f);

    /* the header length is a multiple of 8 (space padded), as the safetensors library writes it */
    FILE *fp = fopen(path, "rb");
    uint8_t len8[8];
    assert_int_equal(fread(len8, 1, 8, fp), 8);
    fclose(fp);
    assert_int_equal(len8[0] % 8, 0);
}

typedef struct { const uint8_t *src; int64_t n, piece; int fail_at; } fill_state;

static int fill_pieces(void *ctx, fp4moe_st_sink *sink, int64_t nbytes) {
    fill_state *s = ctx;
    assert_int_equal(nbytes, s->n);
    for (int64_t i = 0; i < s->n; i += s->piece) {
        if (s->fail_at >= 0 && i >= s->fail_at) return fp4moe_set_error(FP4MOE_EIO, "fill failed on purpose");
        const int64_t k = s->n - i < s->piece ? s->n - i : s->piece;
        int st = fp4moe_st_sink_write(sink, s->src + i, k);
        if (st) return st;
    }
    return FP4MOE_OK;
}

static void test_writer_callbacks_and_atomicity(void **state) {
    tu_rng r;
    tu_rng_seed(&r, 12);
    const int64_t shape[2] = {37, 24};
    uint8_t *a = random_bytes(&r, 37 * 24 * 2), *b = random_bytes(&r, 37 * 24 * 2);
    fill_state fs = {a, 37 * 24 * 2, 100, -1};
    fp4moe_st_writer *w;
    assert_int_equal(fp4moe_st_writer_new(&w), FP4MOE_OK);
    assert_int_equal(fp4moe_st_writer_add_fn(w, "cb", FP4MOE_ST_BF16, 2, shape, fill_pieces, &fs), FP4MOE_OK);
    assert_int_equal(fp4moe_st_writer_add(w, "direct", FP4MOE_ST_F16, 2, shape, b), FP4MOE_OK);
    const char *path = io_path("cb.safetensors");
    assert_int_equal(fp4moe_st_writer_write(w, path), FP4MOE_OK);
    fp4moe_st_file *f;
    assert_int_equal(fp4moe_st_open(path, &f), FP4MOE_OK);
    assert_memory_equal(fp4moe_st_find(f, "cb")->data, a, (size_t)fs.n);
    assert_memory_equal(fp4moe_st_find(f, "direct")->data, b, (size_t)fs.n);
    fp4moe_st_close(f);

    /* a failing producer: error returned, the old file intact, no temporary file left behind */
    struct stat before, after;
    assert_int_equal(stat(path, &before), 0);
    fs.fail_at = 500;
    assert_int_equal(fp4moe_st_writer_write(w, path), FP4MOE_EIO);
    assert_non_null(strstr(fp4moe_last_error(), "on purpose"));
    assert_int_equal(stat(path, &after), 0);
    assert_int_equal(before.st_ino, after.st_ino);
    assert_int_equal(count_files(io_tmpdir(), ".cb.safetensors"), 0);
    assert_int_equal(fp4moe_st_open(path, &f), FP4MOE_OK);
    assert_memory_equal(fp4moe_st_find(f, "cb")->data, a, (size_t)fs.n);
    fp4moe_st_close(f);

    fp4moe_st_writer_free(w);
    free(a);
    free(b);
}

static int fill_wrong_count(void *ctx, fp4moe_st_sink *sink, int64_t nbytes) {
    const uint8_t *src = ctx;
    return fp4moe_st_sink_write(sink, src, nbytes - 3); /* 3 bytes short */
}

static int fill_overrun(void *ctx, fp4moe_st_sink *sink, int64_t nbytes) {
    const uint8_t *src = ctx;
    return fp4moe_st_sink_write(sink, src, nbytes + 1);
}

static void test_writer_producer_size_checked(void **state) {
    uint8_t src[64];
    for (int i = 0; i < 64; i++) src[i] = (uint8_t)(i + 1);
    const int64_t shape[1] = {16};
    fp4moe_st_writer *w;
    assert_int_equal(fp4moe_st_writer_new(&w), FP4MOE_OK);
    assert_int_equal(fp4moe_st_writer_add_fn(w, "t_short", FP4MOE_ST_F32, 1, shape, fill_wrong_count, src), FP4MOE_OK);
    assert_int_equal(fp4moe_st_writer_write(w, io_path("p1.safetensors")), FP4MOE_EFORMAT);
    assert_non_null(strstr(fp4moe_last_error(), "t_short"));
    assert_int_equal(access(io_path("p1.safetensors"), F_OK), -1);
    fp4moe_st_writer_free(w);
    assert_int_equal(fp4moe_st_writer_new(&w), FP4MOE_OK);
    assert_int_equal(fp4moe_st_writer_add_fn(w, "t_long", FP4MOE_ST_F32, 1, shape, fill_overrun, src), FP4MOE_OK);
    assert_int_equal(fp4moe_st_writer_write(w, io_path("p2.safetensors")), FP4MOE_EFORMAT);
    assert_non_null(strstr(fp4moe_last_error(), "t_long"));
    assert_int_equal(access(io_path("p2.safetensors"), F_OK), -1);
    fp4moe_st_writer_free(w);
    /* an unwritable destination names the path */
    assert_int_equal(fp4moe_st_writer_new(&w), FP4MOE_OK);
    assert_int_equal(fp4moe_st_writer_write(w, "/nonexistent-dir/x.safetensors"), FP4MOE_EIO);
    assert_non_null(strstr(fp4moe_last_error(), "/nonexistent-dir/x.safetensors"));
    fp4moe_st_writer_free(w);
}

static void test_hand_written_valid_file(void **state) {
    /* as another writer may produce it: keys in any order, unpadded, gaps, extra keys, F8_E4M3 */
    const char *hdr = "{\"b\":{\"data_offsets\":[8,16],\"shape\":[2,2],\"dtype\":\"U16\",\"extra\":1},"
                      "\"a\":{\"dtype\":\"F8_E4M3\",\"shape\":[4],\"data_offsets\":[0,4]},"
                      "\"__metadata__\":{\"k\":\"v\"}}  \n";
    const char *path = io_path("hand.safetensors");
    io_write_raw(path, hdr, -1, 16);
    fp4moe_st_file *f;
    if (fp4moe_st_open(path, &f)) fail_msg("%s", fp4moe_last_error());
    assert_int_equal(fp4moe_st_count(f), 2);
    assert_string_equal(fp4moe_st_at(f, 0)->name, "a"); /* file order = offset order */
    assert_string_equal(fp4moe_st_at(f, 1)->name, "b");
    assert_int_equal(fp4moe_st_find(f, "a")->dtype, FP4MOE_ST_F8_E4M3);
    assert_int_equal(((const uint8_t *)fp4moe_st_find(f, "b")->data)[0], (uint8_t)(8 * 7 + 1));
    assert_string_equal(fp4moe_st_metadata(f, "k"), "v");
    assert_int_equal(fp4moe_st_data_size(f), 16);
    fp4moe_st_close(f);
}

/* A file written by the reference library (safetensors 0.8.0 + numpy + ml_dtypes; see
 * tests/io/data/make_reference_files.py): names, dtypes, shapes, values, metadata. */
static void test_reference_library_file(void **state) {
    const char *path = "tests/io/data/ref_safetensors.safetensors";
    fp4moe_st_file *f;
    if (fp4moe_st_open(path, &f)) fail_msg("%s", fp4moe_last_error());
    assert_int_equal(fp4moe_st_count(f), 9);
    const fp4moe_st_tensor *t = fp4moe_st_find(f, "a.u8");
    assert_non_null(t);
    assert_int_equal(t->dtype, FP4MOE_ST_U8);
    assert_int_equal(t->shape[0], 3);
    assert_int_equal(t->shape[1], 4);
    for (int i = 0; i < 12; i++) assert_int_equal(((const uint8_t *)t->data)[i], i + 1);
    t = fp4moe_st_find(f, "b.f32");
    float fv[6];
    memcpy(fv, t->data, sizeof fv);
    for (int i = 0; i < 6; i++) assert_true(fv[i] == 0.5f * (float)(i + 1));
    t = fp4moe_st_find(f, "c.i64");
    int64_t iv[3];
    memcpy(iv, t->data, sizeof iv);
    assert_true(iv[0] == -1 && iv[1] == ((int64_t)1 << 40) && iv[2] == 3);
    t = fp4moe_st_find(f, "d.f16");
    assert_int_equal(t->dtype, FP4MOE_ST_F16);
    assert_true(fp4moe_f16_to_f32(((const uint16_t *)t->data)[3]) == 4.0f);
    t = fp4moe_st_find(f, "e.u32");
    assert_int_equal(((const uint32_t *)t->data)[1], 0x89ABCDEFu);
    t = fp4moe_st_find(f, "f.bf16");
    assert_int_equal(t->dtype, FP4MOE_ST_BF16);
    assert_true(fp4moe_bf16_to_f32(((const uint16_t *)t->data)[2]) == 3.25f);
    t = fp4moe_st_find(f, "g.f8"); /* the reference writes "F8_E4M3" for float8_e4m3fn */
    assert_int_equal(t->dtype, FP4MOE_ST_F8_E4M3);
    const float want[4] = {0.5f, 448.0f, -1.0f, 0.001953125f};
    for (int i = 0; i < 4; i++) assert_true(fp4moe_e4m3_to_f32(((const uint8_t *)t->data)[i]) == want[i]);
    t = fp4moe_st_find(f, "h.scalar");
    assert_int_equal(t->ndim, 0);
    assert_true(*(const float *)t->data == 7.25f);
    t = fp4moe_st_find(f, "i.empty");
    assert_int_equal(t->nbytes, 0);
    assert_string_equal(fp4moe_st_metadata(f, "format"), "np");
    assert_string_equal(fp4moe_st_metadata(f, "note"), "reference");
    for (int64_t i = 0; i < fp4moe_st_count(f); i++) /* the reference aligns like fp4moe's writer */
        assert_int_equal((uintptr_t)fp4moe_st_at(f, i)->data % fp4moe_st_dtype_size(fp4moe_st_at(f, i)->dtype), 0);
    fp4moe_st_close(f);
}

/* ---- bad files ------------------------------------------------------------------------------------- */

static void test_bad_files(void **state) {
    /* truncated: fewer than 8 bytes */
    io_write_bytes(io_path("trunc.safetensors"), "\x10\x00\x00", 3);
    expect_open_error(io_path("trunc.safetensors"), FP4MOE_EFORMAT, "truncated", NULL, NULL);
    io_write_bytes(io_path("zero.safetensors"), "", 0);
    expect_open_error(io_path("zero.safetensors"), FP4MOE_EFORMAT, "truncated", NULL, NULL);
    /* header length past EOF; and over the 100 MB bound */
    io_write_raw(io_path("hlen.safetensors"), "{}", 4096, 0);
    expect_open_error(io_path("hlen.safetensors"), FP4MOE_EFORMAT, "header length 4096", "past the end", NULL);
    io_write_raw(io_path("hbig.safetensors"), "{}", (int64_t)1 << 40, 0);
    expect_open_error(io_path("hbig.safetensors"), FP4MOE_EFORMAT, "not a safetensors file?", "give 1099511627776, over the", NULL);
    /* truncated data area */
    bad_header("shortdata.safetensors", "{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 10,
               FP4MOE_EFORMAT, "'w'", "past the end of the data area", NULL);
    /* header not JSON, not an object, trailing garbage */
    bad_header("notjson.safetensors", "{\"w\": {\"dtype\": \"F32\", \"shape\": [1,", 0, FP4MOE_EFORMAT,
               "not valid JSON", NULL, NULL);
    bad_header("array.safetensors", "[1, 2]", 0, FP4MOE_EFORMAT, "not a JSON object", NULL, NULL);
    bad_header("trailing.safetensors", "{} x", 0, FP4MOE_EFORMAT, "after its JSON", NULL, NULL);
    /* one name twice: said so whether or not the two entries share bytes (a helper's trial, session 44: the shared
     * case was reported as an overlap of the tensor with itself) */
    bad_header("dup_same.safetensors", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
               "\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, FP4MOE_EFORMAT,
               "tensor 'w' appears twice in the header", NULL, NULL);
    bad_header("dup_apart.safetensors", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
               "\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, FP4MOE_EFORMAT,
               "tensor 'w' appears twice in the header", NULL, NULL);
    bad_header("empty_hdr.safetensors", "", 0, FP4MOE_EFORMAT, "not a JSON object", NULL, NULL);
    /* unknown dtype (F8_E4M3FN is torch's name, not the format's) */
    bad_header("dtype.safetensors", "{\"w.scale\":{\"dtype\":\"F8_E4M3FN\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1,
               FP4MOE_EUNSUPPORTED, "'w.scale'", "unknown dtype", "F8_E4M3FN");
    /* shape x size != span */
    bad_header("span.safetensors", "{\"w\":{\"dtype\":\"BF16\",\"shape\":[3,4],\"data_offsets\":[0,20]}}", 24,
               FP4MOE_EFORMAT, "'w'", "needs 24 bytes", "span 20");
    /* span past EOF */
    bad_header("eof.safetensors", "{\"w\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[4,12]}}", 8,
               FP4MOE_EFORMAT, "'w'", "past the end of the data area", NULL);
    /* overlapping spans: both tensors named */
    bad_header("overlap.safetensors",
               "{\"first\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[0,8]},"
               "\"second\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[6,10]}}",
               16, FP4MOE_EFORMAT, "'second'", "overlaps", "'first'");
    /* negative, fractional and overflowing shapes */
    bad_header("neg.safetensors", "{\"w\":{\"dtype\":\"U8\",\"shape\":[2,-3],\"data_offsets\":[0,0]}}", 0,
               FP4MOE_EFORMAT, "'w'", "shape[1]", "negative");
    bad_header("frac.safetensors", "{\"w\":{\"dtype\":\"U8\",\"shape\":[1.5],\"data_offsets\":[0,1]}}", 1,
               FP4MOE_EFORMAT, "'w'", "not an integer", NULL);
    bad_header("ovf.safetensors",
               "{\"w\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,0]}}", 0,
               FP4MOE_EOVERFLOW, "'w'", "overflow", NULL);
    bad_header("ovf2.safetensors",
               "{\"w\":{\"dtype\":\"F64\",\"shape\":[4611686018427387904],\"data_offsets\":[0,0]}}", 0,
               FP4MOE_EOVERFLOW, "'w'", "too large", NULL);
    bad_header("ovf3.safetensors",
               "{\"w\":{\"dtype\":\"F64\",\"shape\":[2147483648,2147483648],\"data_offsets\":[0,0]}}", 0,
               FP4MOE_EOVERFLOW, "'w'", "overflows", NULL);
    bad_header("huge.safetensors", "{\"w\":{\"dtype\":\"U8\",\"shape\":[1e300],\"data_offsets\":[0,0]}}", 0,
               FP4MOE_EOVERFLOW, "'w'", "too large", NULL);
    /* missing fields */
    bad_header("nooff.safetensors", "{\"w\":{\"dtype\":\"U8\",\"shape\":[1]}}", 1, FP4MOE_EFORMAT, "'w'",
               "data_offsets", NULL);
    bad_header("off3.safetensors", "{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1,2]}}", 1,
               FP4MOE_EFORMAT, "'w'", "data_offsets", NULL);
    bad_header("nodtype.safetensors", "{\"w\":{\"shape\":[1],\"data_offsets\":[0,1]}}", 1, FP4MOE_EFORMAT, "'w'",
               "dtype", NULL);
    bad_header("noshape.safetensors", "{\"w\":{\"dtype\":\"U8\",\"data_offsets\":[0,1]}}", 1, FP4MOE_EFORMAT,
               "'w'", "shape", NULL);
    bad_header("endlt.safetensors", "{\"w\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[4,2]}}", 8,
               FP4MOE_EFORMAT, "'w'", "end < begin", NULL);
    bad_header("notobj.safetensors", "{\"w\":[1,2]}", 0, FP4MOE_EFORMAT, "'w'", "not an object", NULL);
    bad_header("dims.safetensors",
               "{\"w\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}", 1,
               FP4MOE_EUNSUPPORTED, "'w'", "9 dims", NULL);
    /* duplicate and empty names; bad metadata */
    bad_header("dup.safetensors",
               "{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
               "\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}",
               2, FP4MOE_EFORMAT, "'w'", "twice", NULL);
    bad_header("noname.safetensors", "{\"\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1,
               FP4MOE_EFORMAT, "empty name", NULL, NULL);
    bad_header("meta.safetensors", "{\"__metadata__\":{\"format\":1}}", 0, FP4MOE_EFORMAT, "__metadata__",
               "format", "not a string");
    /* a NUL character in a name (it was read as the name cut there, "a"); an escaped backslash before u0000 is text */
    bad_header("nulname.safetensors", "{\"a\\u0000b\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1,
               FP4MOE_EFORMAT, "\\u0000 (NUL) character", "at byte 3", NULL);
    bad_header("bsname.safetensors", "{\"a\\\\u0000b\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
               "\"c\\\\\\u0000\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}", 2,
               FP4MOE_EFORMAT, "\\u0000 (NUL) character", "at byte 65", NULL);
    /* not a file at all */
    expect_open_error(io_tmpdir(), FP4MOE_EIO, "not a regular file", NULL, NULL);
    expect_open_error(io_path("does-not-exist.safetensors"), FP4MOE_EIO, "cannot open", NULL, NULL);
    /* NULL arguments: errors, no crash */
    fp4moe_st_file *f;
    assert_int_equal(fp4moe_st_open(NULL, &f), FP4MOE_EINVAL);
    assert_int_equal(fp4moe_st_open("x", NULL), FP4MOE_EINVAL);
    assert_null(fp4moe_st_find(NULL, "x"));
    assert_int_equal(fp4moe_st_count(NULL), 0);
    fp4moe_st_close(NULL);
}

static void test_open_memory(void **state) {
    const char img[] = "\x08\x00\x00\x00\x00\x00\x00\x00{}      ";
    fp4moe_st_file *f;
    assert_int_equal(fp4moe_st_open_memory(img, 16, "mem-label", &f), FP4MOE_OK);
    assert_int_equal(fp4moe_st_count(f), 0);
    assert_string_equal(fp4moe_st_path(f), "mem-label");
    fp4moe_st_close(f);
    assert_int_equal(fp4moe_st_open_memory(img, 12, "mem-label", &f), FP4MOE_EFORMAT);
    assert_non_null(strstr(fp4moe_last_error(), "mem-label"));
    assert_int_equal(fp4moe_st_open_memory(NULL, 0, NULL, &f), FP4MOE_EFORMAT);
}

/* ---- model directories ------------------------------------------------------------------------------ */

#define NT 9
static void make_writer(tu_rng *r, fp4moe_st_writer **w, uint8_t **bufs, char names[NT][32]) {
    assert_int_equal(fp4moe_st_writer_new(w), FP4MOE_OK);
    for (int i = 0; i < NT; i++) {
        const int64_t shape[2] = {10 + i, 16};
        const fp4moe_st_dtype dt = i % 3 == 0 ? FP4MOE_ST_F32 : i % 3 == 1 ? FP4MOE_ST_BF16 : FP4MOE_ST_U8;
        snprintf(names[i], 32, "layers.%d.weight", i);
        bufs[i] = random_bytes(r, shape[0] * shape[1] * (int64_t)fp4moe_st_dtype_size(dt));
        assert_int_equal(fp4moe_st_writer_add(*w, names[i], dt, 2, shape, bufs[i]), FP4MOE_OK);
    }
}

static void test_sharded_model_roundtrip(void **state) {
    tu_rng r;
    tu_rng_seed(&r, 13);
    fp4moe_st_writer *w;
    uint8_t *bufs[NT];
    char names[NT][32];
    make_writer(&r, &w, bufs, names);
    char dir[512];
    snprintf(dir, sizeof dir, "%s", io_path("sharded"));
    assert_int_equal(mkdir(dir, 0777), 0);
    assert_int_equal(fp4moe_st_writer_write_model(w, dir, 1500), FP4MOE_OK); /* several shards */
    fp4moe_st_writer_free(w);
    assert_true(count_files(dir, "model-0000") >= 3);
    assert_int_equal(count_files(dir, "model.safetensors.index.json"), 1);
    fp4moe_st_model *m;
    if (fp4moe_st_model_open(dir, &m)) fail_msg("%s", fp4moe_last_error());
    assert_int_equal(fp4moe_st_model_count(m), NT);
    assert_true(fp4moe_st_model_nfiles(m) >= 3);
    assert_true(fp4moe_st_model_is_dir(m));
    for (int i = 0; i < NT; i++) {
        const fp4moe_st_tensor *t = fp4moe_st_model_find(m, names[i]);
        assert_non_null(t);
        assert_memory_equal(t->data, bufs[i], (size_t)t->nbytes);
        assert_non_null(strstr(t->file, "model-0000"));
    }
    assert_null(fp4moe_st_model_find(m, "nope"));
    fp4moe_st_model_close(m);

    for (int i = 0; i < NT; i++) free(bufs[i]);
    /* the same, as one file; a stale index is removed so the new file is what the dir holds */
    make_writer(&r, &w, bufs + 0, names);
    assert_int_equal(fp4moe_st_writer_write_model(w, dir, 0), FP4MOE_OK);
    fp4moe_st_writer_free(w);
    assert_int_equal(count_files(dir, "model.safetensors.index.json"), 0);
    /* the shards of the earlier split are gone too (mlx-lm / transformers glob model*.safetensors and would read
       them beside the new file: a helper's trial, session 32) */
    assert_int_equal(count_files(dir, "model-0000"), 0);
    assert_int_equal(fp4moe_st_model_open(dir, &m), FP4MOE_OK);
    assert_int_equal(fp4moe_st_model_nfiles(m), 1);
    for (int i = 0; i < NT; i++) {
        assert_memory_equal(fp4moe_st_model_find(m, names[i])->data, bufs[i], (size_t)fp4moe_st_model_find(m, names[i])->nbytes);
        free(bufs[i]);
    }
    fp4moe_st_model_close(m);

    /* a single file path */
    assert_int_equal(fp4moe_st_model_open(io_path("sharded/model.safetensors"), &m), FP4MOE_OK);
    assert_false(fp4moe_st_model_is_dir(m));
    assert_string_equal(fp4moe_st_model_dir(m), io_path("sharded"));
    fp4moe_st_model_close(m);

    /* back to shards: model.safetensors removed; then fewer shards: the extra ones of the earlier split removed;
       other files of the directory stay */
    char keep[600];
    snprintf(keep, sizeof keep, "%s/notes.txt", dir);
    FILE *kf = fopen(keep, "w");
    assert_non_null(kf);
    fputs("mine", kf);
    fclose(kf);
    make_writer(&r, &w, bufs, names);
    assert_int_equal(fp4moe_st_writer_write_model(w, dir, 1000), FP4MOE_OK);
    fp4moe_st_writer_free(w);
    for (int i = 0; i < NT; i++) free(bufs[i]);
    const int many = count_files(dir, "model-0000");
    assert_true(many >= 4);
    assert_int_equal(count_files(dir, "model.safetensors"), 1); /* the index only */
    make_writer(&r, &w, bufs, names);
    assert_int_equal(fp4moe_st_writer_write_model(w, dir, 2500), FP4MOE_OK);
    fp4moe_st_writer_free(w);
    const int fewer = count_files(dir, "model-0000");
    assert_true(fewer >= 2 && fewer < many);
    assert_int_equal(fp4moe_st_model_open(dir, &m), FP4MOE_OK);
    assert_int_equal(fp4moe_st_model_nfiles(m), fewer);
    for (int i = 0; i < NT; i++) {
        assert_memory_equal(fp4moe_st_model_find(m, names[i])->data, bufs[i], (size_t)fp4moe_st_model_find(m, names[i])->nbytes);
        free(bufs[i]);
    }
    fp4moe_st_model_close(m);
    assert_int_equal(access(keep, F_OK), 0);
}

static void write_small(const char *path, const char *name, int n) {
    fp4moe_st_writer *w;
    uint8_t data[64];
    for (int i = 0; i < 64; i++) data[i] = (uint8_t)(i + 3);
    assert_int_equal(fp4moe_st_writer_new(&w), FP4MOE_OK);
    for (int i = 0; i < n; i++) {
        char nm[64];
        const int64_t shape[1] = {8};
        snprintf(nm, sizeof nm, "%s%d", name, i);
        assert_int_equal(fp4moe_st_writer_add(w, nm, FP4MOE_ST_U8, 1, shape, data + i), FP4MOE_OK);
    }
    assert_int_equal(fp4moe_st_writer_write(w, path), FP4MOE_OK);
    fp4moe_st_writer_free(w);
}

static void expect_model_error(const char *dir, const char *n1, const char *n2, const char *n3) {
    fp4moe_st_model *m = (fp4moe_st_model *)0x1;
    const int st = fp4moe_st_model_open(dir, &m);
    assert_int_not_equal(st, FP4MOE_OK);
    assert_null(m);
    const char *msg = fp4moe_last_error();
    const char *needles[] = {n1, n2, n3};
    for (int i = 0; i < 3; i++)
        if (needles[i] && !strstr(msg, needles[i])) fail_msg("message \"%s\" lacks \"%s\"", msg, needles[i]);
}

static void test_bad_model_dirs(void **state) {
    /* index naming a missing file */
    char d1[512];
    snprintf(d1, sizeof d1, "%s", io_path("idx_missing_file"));
    mkdir(d1, 0777);
    write_small(io_path("idx_missing_file/a.safetensors"), "t", 2);
    FILE *fp = fopen(io_path("idx_missing_file/model.safetensors.index.json"), "w");
    fputs("{\"weight_map\": {\"t0\": \"a.safetensors\", \"t1\": \"b.safetensors\"}}", fp);
    fclose(fp);
    expect_model_error(d1, "model.safetensors.index.json", "b.safetensors", "cannot open");
    /* index naming a tensor missing from its file: names both */
    char d2[512];
    snprintf(d2, sizeof d2, "%s", io_path("idx_missing_tensor"));
    mkdir(d2, 0777);
    write_small(io_path("idx_missing_tensor/a.safetensors"), "t", 2);
    fp = fopen(io_path("idx_missing_tensor/model.safetensors.index.json"), "w");
    fputs("{\"weight_map\": {\"t0\": \"a.safetensors\", \"ghost\": \"a.safetensors\"}}", fp);
    fclose(fp);
    expect_model_error(d2, "'ghost'", "a.safetensors", "no such tensor");
    /* the index may not leave the directory */
    fp = fopen(io_path("idx_missing_tensor/model.safetensors.index.json"), "w");
    fputs("{\"weight_map\": {\"t0\": \"../a.safetensors\"}}", fp);
    fclose(fp);
    expect_model_error(d2, "'t0'", "../a.safetensors", "not a file name");
    /* not JSON; no weight_map */
    fp = fopen(io_path("idx_missing_tensor/model.safetensors.index.json"), "w");
    fputs("{\"weight_map\": ", fp);
    fclose(fp);
    expect_model_error(d2, "index.json", "malformed JSON near line 1 column 15", NULL);
    fp = fopen(io_path("idx_missing_tensor/model.safetensors.index.json"), "w");
    fputs("{\"weight_map\": {\"t0\": \"a.safetensors\"}} x", fp); /* one JSON value a file (a helper's trial, session 44) */
    fclose(fp);
    expect_model_error(d2, "index.json", "text after the JSON value near line 1 column 41", NULL);
    fp = fopen(io_path("idx_missing_tensor/model.safetensors.index.json"), "w");
    fputs("{\"metadata\": {}}", fp);
    fclose(fp);
    expect_model_error(d2, "index.json", "weight_map", NULL);
    /* a bad shard: its own path named */
    io_write_raw(io_path("idx_missing_tensor/c.safetensors"), "{", -1, 0);
    fp = fopen(io_path("idx_missing_tensor/model.safetensors.index.json"), "w");
    fputs("{\"weight_map\": {\"t0\": \"a.safetensors\", \"x\": \"c.safetensors\"}}", fp);
    fclose(fp);
    expect_model_error(d2, "c.safetensors", "not valid JSON", NULL);
    /* index subset: tensors of a shard not in the weight_map are ignored */
    fp = fopen(io_path("idx_missing_tensor/model.safetensors.index.json"), "w");
    fputs("{\"weight_map\": {\"t1\": \"a.safetensors\"}}", fp);
    fclose(fp);
    fp4moe_st_model *m;
    if (fp4moe_st_model_open(d2, &m)) fail_msg("%s", fp4moe_last_error());
    assert_int_equal(fp4moe_st_model_count(m), 1);
    assert_non_null(fp4moe_st_model_find(m, "t1"));
    assert_null(fp4moe_st_model_find(m, "t0"));
    fp4moe_st_model_close(m);
    /* no index: all *.safetensors; the same name in two files names both files */
    char d3[512];
    snprintf(d3, sizeof d3, "%s", io_path("dup_across"));
    mkdir(d3, 0777);
    write_small(io_path("dup_across/x-1.safetensors"), "t", 2);
    write_small(io_path("dup_across/x-2.safetensors"), "u", 3);
    assert_int_equal(fp4moe_st_model_open(d3, &m), FP4MOE_OK);
    assert_int_equal(fp4moe_st_model_count(m), 5);
    assert_string_equal(fp4moe_st_model_at(m, 0)->name, "t0"); /* files in name order */
    fp4moe_st_model_close(m);
    write_small(io_path("dup_across/x-3.safetensors"), "u", 1);
    expect_model_error(d3, "'u0'", "x-2.safetensors", "x-3.safetensors");
    /* a directory without weights */
    char d4[512];
    snprintf(d4, sizeof d4, "%s", io_path("empty_dir"));
    mkdir(d4, 0777);
    expect_model_error(d4, "empty_dir", "no .safetensors", NULL);
    expect_model_error(io_path("nonexistent"), "nonexistent", "cannot stat", NULL);
}

static int teardown(void **state) {
    io_rmtree_tmp();
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip_every_dtype),
        cmocka_unit_test(test_writer_callbacks_and_atomicity),
        cmocka_unit_test(test_writer_producer_size_checked),
        cmocka_unit_test(test_hand_written_valid_file),
        cmocka_unit_test(test_reference_library_file),
        cmocka_unit_test(test_bad_files),
        cmocka_unit_test(test_open_memory),
        cmocka_unit_test(test_sharded_model_roundtrip),
        cmocka_unit_test(test_bad_model_dirs),
    };
    return cmocka_run_group_tests(tests, NULL, teardown);
}
