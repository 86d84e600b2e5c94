/* libFuzzer harness: config.json parsing (fp4moe_config_parse): any input either parses to a
 * config whose sizes are positive and whose layer pattern has n_layers entries, or fails with a
 * message. Built and run by fuzz/run_config.sh. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fp4moe/model.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *s = malloc(size + 1);
    if (!s) return 0;
    memcpy(s, data, size);
    s[size] = 0;
    fp4moe_config c;
    if (fp4moe_config_parse(s, "fuzz.json", &c) == FP4MOE_OK) {
        if (c.n_layers < 1 || c.hidden < 1 || c.vocab < 1 || (int64_t)strlen(c.layer_types) != c.n_layers) __builtin_trap();
        fp4moe_config_free(&c);
    } else if (!strstr(fp4moe_last_error(), "fuzz.json")) {
        __builtin_trap();   /* errors name the file */
    }
    free(s);
    return 0;
}
