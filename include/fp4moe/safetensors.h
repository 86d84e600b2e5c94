/* fp4moe/safetensors.h: read (mmap, validated) and write safetensors files; sharded model dirs.
 *
 * File format (https://github.com/huggingface/safetensors, "Format" section):
 *   bytes [0, 8)        N, the header length, unsigned 64-bit little-endian
 *   bytes [8, 8+N)      UTF-8 JSON object: {"NAME": {"dtype": "BF16", "shape": [d0, d1, ...],
 *                       "data_offsets": [begin, end]}, ..., "__metadata__": {"key": "value", ...}}
 *                       (may be padded at the end with spaces)
 *   bytes [8+N, EOF)    the data area; a tensor's bytes are [8+N+begin, 8+N+end), row-major,
 *                       little-endian.
 *
 * What the reader validates (every error names the file and, where there is one, the tensor):
 *   - 8 <= file size; N <= FP4MOE_ST_MAX_HEADER and 8 + N <= file size;
 *   - the header is one well-formed JSON object (only whitespace after it), every entry an object
 *     with a known "dtype", a "shape" array of integers >= 0 (at most FP4MOE_ST_MAX_DIMS of them),
 *     and "data_offsets" [begin, end] with 0 <= begin <= end <= data-area size;
 *   - prod(shape) * dtype size == end - begin, every product checked for int64 overflow;
 *   - spans do not overlap (gaps are allowed); names are unique and non-empty;
 *   - "__metadata__", when present, maps strings to strings.
 * Numbers in the header must be integers exactly representable as a double (<= 2^53).
 *
 * Views: every fp4moe_st_tensor points into a read-only mapping of the file and stays valid until
 * the file (or model) is closed. `data` is aligned to the element size only when the file aligned
 * it (files from fp4moe_st_writer and the safetensors library are: their header length is a multiple
 * of 8 and tensors are sorted by element size, largest first). The data are little-endian; fp4moe
 * supports little-endian hosts only.
 *
 * Thread safety: a file or model handle may be read from several threads at once; nothing else. */
#ifndef FP4MOE_SAFETENSORS_H
#define FP4MOE_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>
#include "fp4moe/types.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FP4MOE_ST_MAX_DIMS 8                       /* more dims: FP4MOE_EUNSUPPORTED */
#define FP4MOE_ST_MAX_HEADER (100LL * 1000 * 1000) /* header bytes, as the safetensors crate */

/* Element types of safetensors, with the names the format uses ("BOOL", "U8", ..., "F8_E4M3"). */
typedef enum {
    FP4MOE_ST_BOOL = 0,
    FP4MOE_ST_U8,
    FP4MOE_ST_I8,
    FP4MOE_ST_U16,
    FP4MOE_ST_I16,
    FP4MOE_ST_U32,
    FP4MOE_ST_I32,
    FP4MOE_ST_U64,
    FP4MOE_ST_I64,
    FP4MOE_ST_F16,
    FP4MOE_ST_BF16,
    FP4MOE_ST_F32,
    FP4MOE_ST_F64,
    FP4MOE_ST_F8_E4M3,   /* "F8_E4M3" (torch.float8_e4m3fn; ModelOpt weight_scale) */
    FP4MOE_ST_F8_E5M2,   /* "F8_E5M2" */
    FP4MOE_ST_DTYPE_COUNT
} fp4moe_st_dtype;

/* "U8", "BF16", ...; "?" for a value out of range. */
const char *fp4moe_st_dtype_name(fp4moe_st_dtype dtype);
/* Element size in bytes (BOOL 1, F8_* 1, ..., F64 8); 0 for a value out of range. */
size_t fp4moe_st_dtype_size(fp4moe_st_dtype dtype);
/* Parses a format dtype name (exact, case-sensitive). Returns FP4MOE_OK, or FP4MOE_EUNSUPPORTED
 * with a message naming the string. */
int fp4moe_st_dtype_parse(const char *s, fp4moe_st_dtype *out);
/* The safetensors dtype of an fp4moe activation dtype (F32, F16, BF16). */
fp4moe_st_dtype fp4moe_st_dtype_from(fp4moe_dtype dtype);
/* The fp4moe activation dtype of a float safetensors dtype: FP4MOE_OK for F32/F16/BF16, else
 * FP4MOE_EUNSUPPORTED (no message is set). */
int fp4moe_st_dtype_to(fp4moe_st_dtype st, fp4moe_dtype *out);

/* One tensor of a file: a view into the mapping. */
typedef struct {
    const char *name;                       /* NUL-terminated, unique within the file */
    fp4moe_st_dtype dtype;
    int ndim;                               /* 0 (scalar) .. FP4MOE_ST_MAX_DIMS */
    int64_t shape[FP4MOE_ST_MAX_DIMS];      /* entries >= ndim are 0 */
    int64_t numel;                          /* prod(shape) (1 for a scalar) */
    int64_t nbytes;                         /* numel * element size == end - begin */
    int64_t offset;                         /* begin, relative to the data area */
    const void *data;                       /* nbytes bytes; read-only */
    const char *file;                       /* path of the file holding it */
} fp4moe_st_tensor;

/* ---- one file ----------------------------------------------------------------------------------- */

typedef struct fp4moe_st_file fp4moe_st_file;

/* Opens and validates the safetensors file `path` (mmap, read-only; nothing is copied).
 * *out: the handle (NULL on failure). Errors: FP4MOE_EINVAL (NULL argument), FP4MOE_EIO (cannot
 * open/stat/map), FP4MOE_EFORMAT (any validation failure above), FP4MOE_EOVERFLOW (a size product
 * overflows), FP4MOE_EUNSUPPORTED (unknown dtype, too many dims), FP4MOE_ENOMEM. Every message
 * starts with the path and names the tensor when the problem is in one. */
int fp4moe_st_open(const char *path, fp4moe_st_file **out);

/* Same validation on a file image already in memory (size bytes, NOT copied: it must outlive the
 * handle). `label` names it in messages (e.g. a path; NULL -> "<memory>"). Used by the fuzzer. */
int fp4moe_st_open_memory(const void *image, size_t size, const char *label, fp4moe_st_file **out);

/* Unmaps and frees; NULL is a no-op. Every view into the file becomes invalid. */
void fp4moe_st_close(fp4moe_st_file *f);

/* The path (or label) the file was opened with. */
const char *fp4moe_st_path(const fp4moe_st_file *f);

/* Number of tensors. */
int64_t fp4moe_st_count(const fp4moe_st_file *f);

/* Tensor i (0 <= i < count) in file order: increasing data offset (ties: header order).
 * NULL when i is out of range. */
const fp4moe_st_tensor *fp4moe_st_at(const fp4moe_st_file *f, int64_t i);

/* The tensor named `name`, or NULL (no error is set). O(log count). */
const fp4moe_st_tensor *fp4moe_st_find(const fp4moe_st_file *f, const char *name);

/* Value of "__metadata__"[key], or NULL when absent. */
const char *fp4moe_st_metadata(const fp4moe_st_file *f, const char *key);
/* Number of metadata entries, and entry i (header order); returns FP4MOE_EINVAL when out of range. */
int64_t fp4moe_st_metadata_count(const fp4moe_st_file *f);
int fp4moe_st_metadata_at(const fp4moe_st_file *f, int64_t i, const char **key, const char **value);

/* Size of the data area in bytes (file size - 8 - N). */
int64_t fp4moe_st_data_size(const fp4moe_st_file *f);

/* ---- a model: a directory of shards, or one file -------------------------------------------------- */

typedef struct fp4moe_st_model fp4moe_st_model;

/* Opens every tensor of a model as one view. `path` is
 *   - a .safetensors file: that file alone;
 *   - a directory with model.safetensors.index.json ({"weight_map": {tensor: file}}): exactly the
 *     tensors of weight_map, each looked up in its file (tensors of a shard not named by the index
 *     are ignored, as transformers does);
 *   - otherwise a directory with model.safetensors, or else all *.safetensors files in it (sorted by
 *     name); a name present in two files is an error naming both.
 * Errors: as fp4moe_st_open, plus FP4MOE_EFORMAT for a bad index, a file named by the index that
 * cannot be opened (message names the index and the file), a tensor named by the index but missing
 * from its file (names both), a file name with '/' or "..", a directory without safetensors files. */
int fp4moe_st_model_open(const char *path, fp4moe_st_model **out);

/* Closes every file; NULL is a no-op. */
void fp4moe_st_model_close(fp4moe_st_model *m);

/* The directory of the model ("." style path as given; for a single file, its directory). */
const char *fp4moe_st_model_dir(const fp4moe_st_model *m);
/* 1 when the model was opened from a directory, 0 from a single file. */
int fp4moe_st_model_is_dir(const fp4moe_st_model *m);

/* Number of tensors, tensor i (files in name order, each in file order; NULL out of range), lookup. */
int64_t fp4moe_st_model_count(const fp4moe_st_model *m);
const fp4moe_st_tensor *fp4moe_st_model_at(const fp4moe_st_model *m, int64_t i);
const fp4moe_st_tensor *fp4moe_st_model_find(const fp4moe_st_model *m, const char *name);

/* The files of the model (0 <= i < nfiles). */
int64_t fp4moe_st_model_nfiles(const fp4moe_st_model *m);
const fp4moe_st_file *fp4moe_st_model_file(const fp4moe_st_model *m, int64_t i);

/* ---- writer -------------------------------------------------------------------------------------- */

typedef struct fp4moe_st_writer fp4moe_st_writer;
typedef struct fp4moe_st_sink fp4moe_st_sink;

/* Produces a tensor's bytes at write time by calling fp4moe_st_sink_write (any number of times,
 * in order, exactly `nbytes` in total). Returns FP4MOE_OK or an error status (with a message);
 * an error aborts the write and nothing is left on disk. */
typedef int (*fp4moe_st_fill_fn)(void *ctx, fp4moe_st_sink *sink, int64_t nbytes);

/* Appends n bytes of the current tensor. Errors: FP4MOE_EIO (write failed), FP4MOE_EFORMAT (more
 * bytes than the tensor holds). */
int fp4moe_st_sink_write(fp4moe_st_sink *sink, const void *buf, int64_t n);

/* A new empty writer. Errors: FP4MOE_EINVAL, FP4MOE_ENOMEM. */
int fp4moe_st_writer_new(fp4moe_st_writer **out);
/* Frees the writer (not the data it points to); NULL is a no-op. */
void fp4moe_st_writer_free(fp4moe_st_writer *w);

/* Adds tensor `name` (copied) of dtype and shape[ndim] (0 <= ndim <= FP4MOE_ST_MAX_DIMS, dims >= 0)
 * whose bytes are `data` (prod(shape) * dtype size bytes, NOT copied: valid until the write).
 * Errors: FP4MOE_EINVAL (NULL/empty name, "__metadata__", duplicate name, bad dtype/ndim/dim, NULL
 * data with nbytes > 0), FP4MOE_EOVERFLOW, FP4MOE_ENOMEM. */
int fp4moe_st_writer_add(fp4moe_st_writer *w, const char *name, fp4moe_st_dtype dtype, int ndim,
                         const int64_t *shape, const void *data);

/* Same, the bytes produced at write time by fill(ctx, sink, nbytes). ctx must stay valid. */
int fp4moe_st_writer_add_fn(fp4moe_st_writer *w, const char *name, fp4moe_st_dtype dtype, int ndim,
                            const int64_t *shape, fp4moe_st_fill_fn fill, void *ctx);

/* Sets "__metadata__"[key] = value (both copied; a second set of a key replaces the value). */
int fp4moe_st_writer_set_metadata(fp4moe_st_writer *w, const char *key, const char *value);

/* Number of tensors added, and the total data bytes. */
int64_t fp4moe_st_writer_count(const fp4moe_st_writer *w);
int64_t fp4moe_st_writer_data_size(const fp4moe_st_writer *w);

/* Writes one file: header (JSON, padded with spaces to a multiple of 8 bytes, as the safetensors
 * library does) then the data, tensors ordered by element size (largest first) then by order of
 * addition, contiguous, so that every tensor is aligned to its element size. Written to a temporary
 * file in the same directory, flushed, then renamed over `path`: a failure leaves `path` as it was.
 * Errors: FP4MOE_EIO (naming the path), FP4MOE_ENOMEM, or the status of a failing fill function. */
int fp4moe_st_writer_write(const fp4moe_st_writer *w, const char *path);

/* Writes the tensors as a model into the existing directory `dir`: one "model.safetensors" when
 * the data fit in max_shard_bytes (<= 0: no limit), else shards "model-00001-of-0000S.safetensors"
 * (each up to max_shard_bytes, a larger tensor alone in its shard) plus
 * "model.safetensors.index.json" ({"metadata": {"total_size": T}, "weight_map": {...}}), like
 * transformers' save_pretrained. Every file goes through temp + rename; the index is written last.
 * Then the weight files of an earlier split in dir are removed (model.safetensors beside new shards,
 * model-*-of-*.safetensors of another count or beside a new single file, a stale index), so that
 * loaders globbing "model*.safetensors" see only the new set.
 * The writer's metadata go into every shard. Errors: as fp4moe_st_writer_write. */
int fp4moe_st_writer_write_model(const fp4moe_st_writer *w, const char *dir, int64_t max_shard_bytes);

#ifdef __cplusplus
}
#endif
#endif
