/* libFuzzer entry for the chat-template engine (fp4moe_template_compile / _render). Each input is
 * a template source; when it compiles it is rendered with a fixed chat context (messages with a
 * system prompt, a tool call and a tool response, tools, add_generation_prompt, enable_thinking)
 * under tight limits (256 KiB output, macro depth 32, 100,000 steps), so that runaway templates
 * end in a limit error instead of a timeout. Invariants: a failed call leaves *out NULL and names
 * the problem; a successful render's length matches strlen (no NUL inside, as inputs hold none).
 * Built and run by fuzz/run_template.sh only. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "fp4moe/template.h"
#include "fp4moe/types.h"

static const char CONTEXT[] =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"sys /think\"},"
    " {\"role\": \"user\", \"content\": \"Hi \\\"q\\\" \\\\ \\u65e5\\u672c \\ud83d\\ude00\"},"
    " {\"role\": \"assistant\", \"content\": \"<think>r</think>ok\", \"reasoning_content\": \"r\","
    "  \"tool_calls\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"arguments\": {\"a\": 1, \"b\": [true, null]}}}]},"
    " {\"role\": \"tool\", \"content\": \"{\\\"t\\\": 21}\"}, {\"role\": \"user\", \"content\": \"\"}],"
    " \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"description\": \"d\","
    "  \"parameters\": {\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"integer\", \"enum\": [1, 2]}}, \"required\": [\"a\"]}}}],"
    " \"documents\": null, \"add_generation_prompt\": true, \"enable_thinking\": false,"
    " \"bos_token\": \"<s>\", \"eos_token\": \"</s>\", \"n\": 3, \"f\": 2.5, \"s\": \"abc\"}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static cJSON *ctx;
    if (!ctx) ctx = cJSON_Parse(CONTEXT);
    if (!ctx) __builtin_trap();
    if (memchr(data, 0, size)) return 0;
    fp4moe_template *t = NULL;
    if (fp4moe_template_compile((const char *)data, size, &t) != FP4MOE_OK) {
        if (t || fp4moe_last_error()[0] == '\0') __builtin_trap();
        return 0;
    }
    fp4moe_template_limits lim = {256 << 10, 32, 100000};
    char *out = NULL;
    size_t len = 0;
    int rc = fp4moe_template_render(t, ctx, &lim, &out, &len);
    if (rc != FP4MOE_OK) {
        if (out || fp4moe_last_error()[0] == '\0') __builtin_trap();
    } else if (!out || len > lim.max_output_bytes) {
        __builtin_trap();
    }
    free(out);
    fp4moe_template_free(t);
    return 0;
}
