/* fp4moe/grammar.h: structured output - constrained decoding to JSON (OpenAI response_format
 * json_object / json_schema, vLLM guided_json / guided_choice / structured_outputs).
 *
 * A grammar is compiled once (from a JSON Schema, "any JSON object", or a list of choices) and is
 * immutable (any number of matchers and threads may share it). A grammar vocab is built once per
 * tokenizer: every token's bytes (fp4moe_tokenizer_token_to_piece) in a byte trie. A matcher is one
 * sequence's position in the grammar: fp4moe_grammar_mask_logits sets the logits of the tokens that
 * cannot come next to -inf (the sampler then draws among the rest: vLLM's order - the mask first,
 * then penalties, temperature and the top-k / min-p / top-p cuts, as its structured-output bitmask),
 * fp4moe_grammar_accept_token advances it by the token that was drawn.
 *
 * The language (what a matcher accepts; bytes, UTF-8):
 * - JSON text per RFC 8259, one value, nothing after it but an end token (a stop id: allowed exactly
 *   when the value is complete). Whitespace (space, \t, \n, \r) where RFC 8259 allows it, at most
 *   FP4MOE_GRAMMAR_MAX_WS bytes in a row (a greedy model would otherwise loop on newlines: the
 *   bound xgrammar's max_whitespace_cnt gives). Strings: valid UTF-8 (RFC 3629), no control bytes,
 *   the escapes \" \\ \/ \b \f \n \r \t \uXXXX. Numbers: RFC 8259's grammar, at most
 *   FP4MOE_GRAMMAR_MAX_NUMBER bytes. Nesting: at most FP4MOE_GRAMMAR_MAX_DEPTH open values.
 * - JSON Schema (draft 2020-12 keywords; the subset xgrammar / OpenAI structured outputs use):
 *   type (a name or a list), enum, const, properties + required (properties in the schema's order,
 *   as xgrammar and OpenAI strict mode emit them; optional ones may be left out; no other keys
 *   unless the object has no "properties"), additionalProperties (false, or with no "properties":
 *   true or the schema of every value), items, minItems, maxItems, minLength, maxLength (code
 *   points, an escape - or a \\uD83D\\uDE00 surrogate pair - counting as one), anyOf / oneOf (oneOf as anyOf)
 *   whose alternatives begin
 *   with different bytes (a string, an object, a number, ... - e.g. Optional[...] = anyOf [X,
 *   null]; two object alternatives are refused), allOf of one schema, $ref to "#", "#/$defs/N" or
 *   "#/definitions/N" (recursion allowed; a schema no finite document satisfies, or whose smallest document
 *   nests deeper than FP4MOE_GRAMMAR_MAX_DEPTH, is refused, and a value is begun only where it can still end
 *   within that depth). enum / const stand alone (beside them only "type", which filters them); their numbers
 *   are written as Python does (shortest round trip; integral values from 2^53 to 1e21 are refused: cJSON keeps
 *   doubles, the digits written are not known). An integer alternative beside a number one is the number.
 *   Strings: UTF-16 surrogate escapes only as high + low pairs. Annotations are ignored: title, description, default,
 *   examples, $schema, $id, $comment, deprecated, readOnly, writeOnly, format (an annotation in
 *   2020-12 unless a validator opts in), contentMediaType, contentEncoding, and "x-..." keys.
 *   Every other keyword (minimum, pattern, uniqueItems, prefixItems, ...) is refused with an error
 *   that names it and its place: a constraint is never dropped silently.
 * Sources: RFC 8259 (JSON), RFC 3629 (UTF-8, Table 3-7 of Unicode for the well-formed byte
 * sequences), JSON Schema 2020-12 core / validation, OpenAI's structured-outputs guide, vLLM's
 * structured-output request fields.
 *
 * Errors follow include/fp4moe/types.h: a status code plus fp4moe_last_error(). */
#ifndef FP4MOE_GRAMMAR_H
#define FP4MOE_GRAMMAR_H

#include <stdint.h>

#include <cjson/cJSON.h>

#include "fp4moe/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FP4MOE_GRAMMAR_MAX_WS 24     /* whitespace bytes in a row */
#define FP4MOE_GRAMMAR_MAX_NUMBER 32 /* bytes of a number */
#define FP4MOE_GRAMMAR_MAX_DEPTH 32  /* open values (objects, arrays, the value inside them) */

typedef struct fp4moe_grammar fp4moe_grammar;
typedef struct fp4moe_grammar_vocab fp4moe_grammar_vocab;
typedef struct fp4moe_grammar_matcher fp4moe_grammar_matcher;

/* Compiles a JSON Schema (a cJSON object or the boolean true; borrowed, not kept). schema NULL: any
 * JSON object (response_format {"type": "json_object"}). where: a name for the schema's root in
 * error messages (e.g. "response_format.json_schema.schema"; NULL: "schema").
 * Errors: FP4MOE_EUNSUPPORTED (a keyword outside the subset above, anyOf alternatives that begin
 * alike, an unresolvable $ref: the message gives the path, e.g.
 * "schema.properties.age: 'minimum' is not supported"), FP4MOE_EINVAL (not a schema: a keyword
 * with the wrong type, minLength > maxLength, required naming no property, an empty enum, false),
 * FP4MOE_EOVERFLOW (more than 65,536 schema nodes or literals), FP4MOE_ENOMEM. */
int fp4moe_grammar_from_json_schema(const cJSON *schema, const char *where, fp4moe_grammar **out);

/* A grammar whose outputs are exactly one of n choices (vLLM guided_choice): raw text, not JSON;
 * choices[i] holds lens[i] bytes of UTF-8 (lens NULL: NUL-terminated). Errors: FP4MOE_EINVAL (n < 1,
 * a NULL or empty choice, invalid UTF-8), FP4MOE_EOVERFLOW (n > 65,536), FP4MOE_ENOMEM. */
int fp4moe_grammar_from_choices(const char *const *choices, const int64_t *lens, int64_t n,
                                fp4moe_grammar **out);

/* Forced tool calls (OpenAI tool_choice "required", as vLLM writes them): a JSON array of one or more objects
 * {"name": NAME, "parameters": VALUE} (those two keys, in that order) where NAME is one of the n names (JSON
 * strings) and VALUE satisfies the parameters schema of that tool (params[i]: a JSON Schema as above, borrowed;
 * NULL: any object). Errors: FP4MOE_EINVAL (n < 1, an empty or repeated name), a schema's errors (named
 * "tools[i].function.parameters..."), FP4MOE_EOVERFLOW (n > 4096), FP4MOE_ENOMEM. */
int fp4moe_grammar_from_tools(const char *const *names, const cJSON *const *params, int64_t n, fp4moe_grammar **out);

/* fp4moe_grammar_from_tools with at most max_calls objects in the array (>= 1; 0: no limit): max_calls 1 is
 * OpenAI's parallel_tool_calls false (vLLM: "maxItems": 1). Errors: as fp4moe_grammar_from_tools, FP4MOE_EINVAL
 * (max_calls < 0). */
int fp4moe_grammar_from_tools_limit(const char *const *names, const cJSON *const *params, int64_t n, int64_t max_calls,
                                    fp4moe_grammar **out);

/* Frees a grammar (after its matchers); NULL is a no-op. */
void fp4moe_grammar_free(fp4moe_grammar *g);

/* The byte trie of a tokenizer's tokens for matching: every id in [0, vocab) with a piece of >= 1
 * byte that is not a special token (special tokens never match a grammar; stop ids end it). Build
 * once, share read-only. Errors: FP4MOE_EINVAL (NULL), FP4MOE_ENOMEM. */
int fp4moe_grammar_vocab_new(const fp4moe_tokenizer *tok, fp4moe_grammar_vocab **out);
void fp4moe_grammar_vocab_free(fp4moe_grammar_vocab *v);
/* Number of ids the vocab covers (the tokenizer's vocab size). */
int64_t fp4moe_grammar_vocab_size(const fp4moe_grammar_vocab *v);

/* A matcher at the grammar's start. stop_ids (n_stop of them, copied): the tokens that end the
 * output, allowed exactly when the value is complete. g and v must outlive it.
 * Errors: FP4MOE_EINVAL (NULL g / v, n_stop < 0, a stop id outside the vocab), FP4MOE_ENOMEM. */
int fp4moe_grammar_matcher_new(const fp4moe_grammar *g, const fp4moe_grammar_vocab *v,
                               const int32_t *stop_ids, int n_stop, fp4moe_grammar_matcher **out);
void fp4moe_grammar_matcher_free(fp4moe_grammar_matcher *m);
/* Sets dst to src's position (the same grammar, vocab and stop ids; e.g. n choices after a shared prompt, or
 * trying a token without losing the state). Errors: FP4MOE_EINVAL (NULL, or another grammar / vocab). */
int fp4moe_grammar_matcher_copy(fp4moe_grammar_matcher *dst, const fp4moe_grammar_matcher *src);

/* Sets logits[id] = -inf for every id in [0, n) that cannot come next (n: the model's vocab, may
 * exceed the tokenizer's: ids past it are masked); returns how many were left (>= 1 while the
 * matcher has not ended and the grammar can go on; 0 after a stop id was accepted, or when no token
 * of the vocab continues the grammar - e.g. a choice no token sequence can spell - so the caller
 * ends the output with an error). Cost: one walk of the trie's branches the grammar allows (inside
 * a string without maxLength the tokens that are plain string text are taken as one set). */
int64_t fp4moe_grammar_mask_logits(fp4moe_grammar_matcher *m, float *logits, int64_t n);

/* Advances by token id (a stop id ends the matcher). Errors: FP4MOE_EINVAL when the grammar does
 * not allow it (the matcher is unchanged), or after the end. */
int fp4moe_grammar_accept_token(fp4moe_grammar_matcher *m, int32_t id);

/* Advances by n bytes of text (all or nothing: FP4MOE_EINVAL and unchanged when a byte is not
 * allowed). For tests and for text forced into the output. */
int fp4moe_grammar_accept_bytes(fp4moe_grammar_matcher *m, const char *bytes, int64_t n);

/* 1 when the bytes so far form a complete value (a stop id may come), else 0. */
int fp4moe_grammar_is_complete(const fp4moe_grammar_matcher *m);
/* 1 after a stop id was accepted. */
int fp4moe_grammar_is_ended(const fp4moe_grammar_matcher *m);

#ifdef __cplusplus
}
#endif
#endif
