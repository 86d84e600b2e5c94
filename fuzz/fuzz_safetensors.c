/* libFuzzer entry for the safetensors header parser. Each input is parsed twice with
 * fp4moe_st_open_memory: (1) as a whole file image, (2) as the header text of an image built around
 * it (a correct 8-byte length, then 512 data bytes), so that mutations of the JSON are not wasted on
 * a broken length field (cJSON itself is not instrumented). When an image validates, every view is
 * walked (lookup by name, metadata, a read of each tensor's first and last byte) so that a view
 * outside the image shows up under AddressSanitizer. Built and run by fuzz/run.sh only. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fp4moe/safetensors.h"

static int check_image(const uint8_t *data, size_t size) {
    fp4moe_st_file *f = NULL;
    if (fp4moe_st_open_memory(data, size, "fuzz", &f) != FP4MOE_OK) {
        if (f || !strstr(fp4moe_last_error(), "fuzz")) __builtin_trap(); /* errors name the file */
        return 0;
    }
    volatile uint8_t sink = 0;
    for (int64_t i = 0; i < fp4moe_st_count(f); i++) {
        const fp4moe_st_tensor *t = fp4moe_st_at(f, i);
        if (fp4moe_st_find(f, t->name) != t) __builtin_trap();
        if (t->nbytes < 0 || t->offset + t->nbytes > fp4moe_st_data_size(f)) __builtin_trap();
        if (t->nbytes > 0) sink ^= ((const uint8_t *)t->data)[0] ^ ((const uint8_t *)t->data)[t->nbytes - 1];
    }
    for (int64_t i = 0; i < fp4moe_st_metadata_count(f); i++) {
        const char *k, *v;
        fp4moe_st_metadata_at(f, i, &k, &v);
        if (fp4moe_st_metadata(f, k) == NULL) __builtin_trap();
        sink ^= (uint8_t)v[0];
    }
    (void)sink;
    fp4moe_st_close(f);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    check_image(data, size);
    uint8_t *img = malloc(8 + size + 512);
    if (!img) return 0;
    for (int i = 0; i < 8; i++) img[i] = (uint8_t)((uint64_t)size >> (8 * i));
    memcpy(img + 8, data, size);
    for (int i = 0; i < 512; i++) img[8 + size + i] = (uint8_t)(i * 31 + 7);
    check_image(img, 8 + size + 512);
    free(img);
    return 0;
}
