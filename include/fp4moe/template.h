/* fp4moe/template.h: chat templates (the Jinja2 templates shipped in tokenizer_config.json /
 * chat_template.jinja), rendered with the semantics transformers uses in apply_chat_template
 * (transformers/utils/chat_template_utils.py, _compile_jinja_template + render_jinja_template):
 * an ImmutableSandboxedEnvironment with trim_blocks=True, lstrip_blocks=True, the loopcontrols
 * extension (break / continue) and the {% generation %} tag; `tojson` is
 * json.dumps(x, ensure_ascii=False, indent=..., sort_keys=...); globals raise_exception(msg),
 * strftime_now(fmt), namespace(...), dict(...), range(...).
 *
 * Supported: text / {{ }} / {% %} / {# #}, whitespace control (-, +), {% raw %}; if/elif/else,
 * for (with `if` filter, else, tuple unpacking, loop.index/index0/revindex/revindex0/first/last/
 * length/previtem/nextitem/cycle), set (name, ns.attr, tuples, block set with filters), macro
 * (positional / keyword arguments, defaults, varargs / kwargs when the body reads them), filter blocks,
 * break/continue; literals (strings with
 * Python escapes, ints, floats, lists, tuples, dicts, true/false/none in both cases); operators with
 * Jinja's precedence: if-else, or, and, not, == != < <= > >= in not-in (chained), + -, ~, * / // %,
 * ** (left-assoc as in Jinja), unary - +, filters | and tests `is [not]` binding tightest; slicing
 * [a:b:c]; the filters and tests listed in src/template/builtins.c; str methods (strip, lstrip,
 * rstrip, split, replace, startswith, endswith, upper, lower, title, capitalize, find, rfind, index,
 * count, join, is*), dict methods (items, keys, values, get).
 *
 * Not supported (an error names them): include/import/extends/block/call/with, recursive loops,
 * printf-style '%' on strings, str.format, filters batch/slice/format/truncate/wordwrap/groupby/... (named
 * when a render reaches them, so that a template holding one in a branch never taken still renders),
 * loop.changed, the cycler / joiner globals.
 * Known differences from CPython: integers are 64-bit (overflow is an error, not a bigint); JSON
 * numbers with an integral value become ints (cJSON does not keep "1.0" apart from "1"), so
 * tojson prints 1 where Python would print 1.0; upper/lower/title/capitalize know the cases of
 * ASCII, Latin-1, Latin Extended-A, Greek, Cyrillic and fullwidth Latin only (other scripts are left
 * as they are); wordcount's \w and str.isalpha/isdigit are approximations outside ASCII;
 * printf-style '%' and str.format are not implemented.
 *
 * Errors follow include/fp4moe/types.h: a status code plus fp4moe_last_error(), whose message
 * starts with "template line N: " when a line is known. */
#ifndef FP4MOE_TEMPLATE_H
#define FP4MOE_TEMPLATE_H

#include <stddef.h>

#include <cjson/cJSON.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fp4moe_template fp4moe_template;

/* Limits of one render (0 in a field = its default). */
typedef struct {
    size_t max_output_bytes;      /* output and any single string built: default 64 MiB */
    int max_macro_depth;          /* nested macro calls: default 64 */
    unsigned long long max_steps; /* loop iterations + macro / filter calls: default 50,000,000 */
    size_t max_value_bytes;       /* strings, lists and dicts alive at once (the context's included): default
                                     256 MiB */
} fp4moe_template_limits;

/* Compiles template source `src` of `len` bytes (not necessarily NUL-terminated; NULL with len 0: the empty
 * template). On success *out owns a compiled template (free with fp4moe_template_free) and FP4MOE_OK is
 * returned. Errors: FP4MOE_EINVAL (NULL out, or NULL src with len > 0), FP4MOE_EFORMAT (syntax error: the message names
 * the line and what is wrong, e.g. "template line 3: No filter named 'foo'"), FP4MOE_ENOMEM.
 * Semantics: jinja2.Environment.from_string in the environment described above. */
int fp4moe_template_compile(const char *src, size_t len, fp4moe_template **out);

/* Renders `tmpl` with the variables of the JSON object `context` (cJSON, borrowed; e.g. messages,
 * tools, add_generation_prompt, enable_thinking, bos_token, eos_token; NULL = no variables).
 * The caller passes what transformers passes to Template.render: render_jinja_template gives
 * messages, tools (None when absent), documents (None), add_generation_prompt and every extra kwarg.
 * limits may be NULL (defaults). On success *out is a malloc'd NUL-terminated UTF-8 string (the
 * caller frees it with free()) and *out_len (when not NULL) its length; FP4MOE_OK is returned.
 * Errors (*out = NULL): FP4MOE_EINVAL from raise_exception (its message verbatim after the line
 * prefix) or for a NULL / non-object argument; FP4MOE_EFORMAT for a runtime error (undefined
 * value used, type error, unsupported operation; the message names the line);
 * FP4MOE_EUNSUPPORTED for a construct this engine does not implement; FP4MOE_EOVERFLOW when a
 * limit is exceeded or an integer overflows; FP4MOE_ENOMEM. A compiled template may be rendered by several
 * threads at once (its literals are shared read-only, never reference-counted); a context nested deeper than the
 * engine's value depth limit (256) is FP4MOE_EOVERFLOW. */
int fp4moe_template_render(const fp4moe_template *tmpl, const cJSON *context,
                           const fp4moe_template_limits *limits, char **out, size_t *out_len);

/* Frees a compiled template; NULL is a no-op. */
void fp4moe_template_free(fp4moe_template *tmpl);

#ifdef __cplusplus
}
#endif
#endif
