/* Structured output (include/fp4moe/grammar.h): the byte matcher on hand-written documents (valid ones
 * accepted whole and complete, invalid ones refused), the schema compiler's errors, and the token mask
 * against a brute force (every token tried alone on a copy of the matcher) along random walks over the
 * default model's tokenizer, whose finished outputs must parse as JSON and satisfy their schema. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <cjson/cJSON.h>

#include "fp4moe/grammar.h"
#include "fp4moe/tokenizer.h"
#include "fp4moe/types.h"

#define TOKENIZER "models/nemotron-h-tiny-moe/tokenizer.json"

static fp4moe_grammar *compile(const char *schema) {
    fp4moe_grammar *g = NULL;
    if (!schema) {
        assert_int_equal(fp4moe_grammar_from_json_schema(NULL, NULL, &g), FP4MOE_OK);
        return g;
    }
    cJSON *s = cJSON_Parse(schema);
    assert_non_null(s);
    const int st = fp4moe_grammar_from_json_schema(s, NULL, &g);
    if (st) fprintf(stderr, "schema %s: %s\n", schema, fp4moe_last_error());
    assert_int_equal(st, FP4MOE_OK);
    cJSON_Delete(s);
    return g;
}

/* a vocab of one token per byte value (ids 0..255) and a stop id 256 */
typedef struct {
    fp4moe_tokenizer *tok;
    fp4moe_grammar_vocab *v;
    int32_t eos;
} tvocab;

static int tok_setup(void **state) {
    static tvocab tv;
    if (fp4moe_tokenizer_load(TOKENIZER, &tv.tok)) {
        fprintf(stderr, "%s: %s\n", TOKENIZER, fp4moe_last_error());
        return -1;
    }
    if (fp4moe_grammar_vocab_new(tv.tok, &tv.v)) return -1;
    tv.eos = fp4moe_tokenizer_eos_id(tv.tok);
    *state = &tv;
    return 0;
}
static int tok_teardown(void **state) {
    tvocab *tv = *state;
    fp4moe_grammar_vocab_free(tv->v);
    fp4moe_tokenizer_free(tv->tok);
    return 0;
}

/* 1 when the document is accepted whole and complete */
static int doc_ok(const fp4moe_grammar *g, const fp4moe_grammar_vocab *v, const char *doc) {
    fp4moe_grammar_matcher *m = NULL;
    assert_int_equal(fp4moe_grammar_matcher_new(g, v, NULL, 0, &m), FP4MOE_OK);
    const int ok = fp4moe_grammar_accept_bytes(m, doc, (int64_t)strlen(doc)) == FP4MOE_OK && fp4moe_grammar_is_complete(m);
    fp4moe_grammar_matcher_free(m);
    return ok;
}

typedef struct {
    const char *schema; /* NULL: any JSON object */
    const char *doc;
    int ok;
} doc_case;

static void test_documents(void **state) {
    tvocab *tv = *state;
    static const doc_case cases[] = {
        /* any object */
        {NULL, "{}", 1}, {NULL, " {\"a\": [1, 2.5e-3, -0, true, null, {\"b\": \"x\\u00e9\\n\"}]}", 1},
        {NULL, "[]", 0}, {NULL, "{\"a\":1,}", 0}, {NULL, "{\"a\":01}", 0}, {NULL, "{\"a\":1} ", 0},
        {NULL, "{\"a\":\"\x01\"}", 0}, {NULL, "{\"a\":\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\"}", 1},
        {NULL, "{\"a\":\"\xc0\xaf\"}", 0}, {NULL, "{\"a\":\"\xed\xa0\x80\"}", 0}, {NULL, "{\"a\":\"\\x\"}", 0},
        {NULL, "{\"a\":1.}", 0}, {NULL, "{\"a\":-}", 0}, {NULL, "{\"a\":1e+}", 0}, {NULL, "{\"a\":tru}", 0},
        {NULL, "{", 0}, {NULL, "{\"a\" : 1 , \"b\" :\n[ ] }", 1},
        {NULL, "                         {}", 0}, /* 25 spaces: more than FP4MOE_GRAMMAR_MAX_WS */
        /* properties in order, required, optional left out, nothing else */
        {"{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\"},"
         "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"},\"maxItems\":2}},\"required\":[\"name\",\"age\"]}",
         "{\"name\": \"Ann\", \"age\": 31}", 1},
        {"{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\"},"
         "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"},\"maxItems\":2}},\"required\":[\"name\",\"age\"]}",
         "{\"name\": \"Ann\", \"age\": 31, \"tags\": [\"a\", \"b\"]}", 1},
        {"{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\"},"
         "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"},\"maxItems\":2}},\"required\":[\"name\",\"age\"]}",
         "{\"name\": \"Ann\", \"age\": 31, \"tags\": [\"a\", \"b\", \"c\"]}", 0},
        {"{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\"}},"
         "\"required\":[\"name\",\"age\"]}", "{\"name\": \"Ann\"}", 0},
        {"{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\"}},"
         "\"required\":[\"name\",\"age\"]}", "{\"age\": 3, \"name\": \"Ann\"}", 0},
        {"{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\"}},"
         "\"required\":[\"name\",\"age\"]}", "{\"name\": \"Ann\", \"age\": 3.5}", 0},
        {"{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\"}},"
         "\"required\":[\"name\",\"age\"]}", "{\"name\": \"Ann\", \"age\": 3, \"x\": 1}", 0},
        {"{\"properties\":{\"a\":{},\"ab\":{},\"b\":{}},\"required\":[\"b\"]}", "{\"ab\":[],\"b\":{}}", 1},
        {"{\"properties\":{\"a\":{},\"ab\":{},\"b\":{}},\"required\":[\"b\"]}", "{\"a\":1,\"ab\":2,\"b\":3}", 1},
        {"{\"properties\":{\"a\":{},\"ab\":{},\"b\":{}},\"required\":[\"b\"]}", "{}", 0},
        {"{\"properties\":{\"a\":{}}}", "{}", 1},
        /* strings */
        {"{\"type\":\"string\",\"minLength\":2,\"maxLength\":3}", "\"ab\"", 1},
        {"{\"type\":\"string\",\"minLength\":2,\"maxLength\":3}", "\"\\u00e9\xc3\xa9\\n\"", 1},
        {"{\"type\":\"string\",\"minLength\":2,\"maxLength\":3}", "\"a\"", 0},
        {"{\"type\":\"string\",\"minLength\":2,\"maxLength\":3}", "\"abcd\"", 0},
        /* numbers, enums, const, booleans, null */
        {"{\"type\":\"integer\"}", "-120", 1}, {"{\"type\":\"integer\"}", "1.0", 0}, {"{\"type\":\"number\"}", "1.0E+2", 1},
        {"{\"type\":\"number\"}", "123456789012345678901234567890123", 0}, /* 33 bytes */
        {"{\"enum\":[1,12,\"x\",null]}", "1", 1}, {"{\"enum\":[1,12,\"x\",null]}", "12", 1},
        {"{\"enum\":[1,12,\"x\",null]}", "123", 0}, {"{\"enum\":[1,12,\"x\",null]}", "\"x\"", 1},
        {"{\"enum\":[1,12,\"x\",null]}", "nul", 0}, {"{\"type\":\"array\",\"items\":{\"enum\":[1,12]}}", "[12,1, 1]", 1},
        {"{\"const\":{\"a\":[1,2]}}", "{\"a\":[1,2]}", 1}, {"{\"const\":{\"a\":[1,2]}}", "{\"a\": [1,2]}", 0},
        {"{\"type\":\"boolean\"}", "false", 1}, {"{\"type\":\"null\"}", "null", 1},
        /* anyOf / type lists / $ref (recursion) */
        {"{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"null\"}]}", "null", 1},
        {"{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"null\"}]}", "\"s\"", 1},
        {"{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"null\"}]}", "1", 0},
        {"{\"type\":[\"integer\",\"number\",\"boolean\"]}", "2.5", 1},
        {"{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},\"next\":{\"anyOf\":"
         "[{\"$ref\":\"#/$defs/node\"},{\"type\":\"null\"}]}},\"required\":[\"v\",\"next\"]}},\"$ref\":\"#/$defs/node\"}",
         "{\"v\":1,\"next\":{\"v\":2,\"next\":null}}", 1},
        {"{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},\"next\":{\"anyOf\":"
         "[{\"$ref\":\"#/$defs/node\"},{\"type\":\"null\"}]}},\"required\":[\"v\",\"next\"]}},\"$ref\":\"#/$defs/node\"}",
         "{\"v\":1,\"next\":{\"v\":2}}", 0},
        {"{\"type\":\"object\",\"additionalProperties\":{\"type\":\"integer\"}}", "{\"x\":1,\"y\":2}", 1},
        {"{\"type\":\"object\",\"additionalProperties\":{\"type\":\"integer\"}}", "{\"x\":\"1\"}", 0},
        {"{\"type\":\"object\",\"additionalProperties\":false}", "{}", 1},
        {"{\"type\":\"array\",\"minItems\":1}", "[]", 0}, {"{\"type\":\"array\",\"minItems\":1}", "[{}]", 1},
        {"true", "[\"any\"]", 1},
        {"{\"title\":\"T\",\"description\":\"d\",\"type\":\"string\",\"format\":\"date\",\"x-note\":1}", "\"s\"", 1},
        /* const of an array is that array; enum / const numbers as Python writes them (shortest round trip) */
        {"{\"const\":[1,2]}", "[1,2]", 1}, {"{\"const\":[1,2]}", "1", 0},
        {"{\"const\":9007199254740991}", "9007199254740991", 1}, {"{\"const\":0.30000000000000004}", "0.30000000000000004", 1},
        {"{\"const\":0.30000000000000004}", "0.3", 0}, {"{\"enum\":[1e300,-0.0,2.5e-7]}", "1e+300", 1},
        {"{\"enum\":[1e300,-0.0,2.5e-7]}", "0", 1}, {"{\"enum\":[1e300,-0.0,2.5e-7]}", "2.5e-07", 1},
        /* UTF-16 surrogates only in pairs; a pair is one character */
        {"{\"type\":\"string\",\"maxLength\":1}", "\"\\ud83d\\ude00\"", 1}, {"{\"type\":\"string\"}", "\"\\udddd\"", 0},
        {"{\"type\":\"string\"}", "\"\\ud83d\"", 0}, {"{\"type\":\"string\"}", "\"\\ud83dx\"", 0},
        {"{\"type\":\"string\"}", "\"\\ud83d\\u0041\"", 0}, {"{\"type\":\"string\"}", "\"\\uD7FF\\uE000\"", 1},
        {"{\"type\":\"string\",\"minLength\":2}", "\"\\ud83d\\ude00\"", 0},
        /* an integer beside a number: the number */
        {"{\"anyOf\":[{\"type\":\"integer\"},{\"type\":\"number\"}]}", "2.5", 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        fp4moe_grammar *g = compile(cases[i].schema);
        const int ok = doc_ok(g, tv->v, cases[i].doc);
        if (ok != cases[i].ok) fprintf(stderr, "case %zu: schema %s doc [%s]: %s, expected %s\n", i,
                                       cases[i].schema ? cases[i].schema : "(object)", cases[i].doc,
                                       ok ? "accepted" : "refused", cases[i].ok ? "accepted" : "refused");
        assert_int_equal(ok, cases[i].ok);
        fp4moe_grammar_free(g);
    }
}

/* nesting deeper than FP4MOE_GRAMMAR_MAX_DEPTH is refused, at the limit accepted; a value is begun only where it can
 * end within the limit (no dead end: after as many '[' as allowed, null still comes); a schema whose smallest
 * document is deeper is refused */
static void test_depth(void **state) {
    tvocab *tv = *state;
    {
        fp4moe_grammar *g = compile("{\"anyOf\":[{\"type\":\"array\",\"items\":{\"$ref\":\"#\"},\"minItems\":1,"
                                    "\"maxItems\":1},{\"type\":\"null\"}]}");
        fp4moe_grammar_matcher *m = NULL;
        assert_int_equal(fp4moe_grammar_matcher_new(g, tv->v, &tv->eos, 1, &m), FP4MOE_OK);
        int k = 0;
        while (k < 100 && fp4moe_grammar_accept_bytes(m, "[", 1) == FP4MOE_OK) k++;
        assert_true(k >= FP4MOE_GRAMMAR_MAX_DEPTH - 2 && k < FP4MOE_GRAMMAR_MAX_DEPTH);
        float lg[8192];
        for (int i = 0; i < 8192; i++) lg[i] = 0.0f;
        assert_true(fp4moe_grammar_mask_logits(m, lg, 8192) > 0);
        assert_int_equal(fp4moe_grammar_accept_bytes(m, "null", 4), FP4MOE_OK);
        for (int i = 0; i < k; i++) assert_int_equal(fp4moe_grammar_accept_bytes(m, "]", 1), FP4MOE_OK);
        assert_int_equal(fp4moe_grammar_is_complete(m), 1);
        fp4moe_grammar_matcher_free(m);
        fp4moe_grammar_free(g);
        /* 33 required levels: refused when compiled */
        char sch[4096] = "";
        for (int i = 0; i < 33; i++) strcat(sch, "{\"type\":\"array\",\"minItems\":1,\"items\":");
        strcat(sch, "{\"type\":\"null\"}");
        for (int i = 0; i < 33; i++) strcat(sch, "}");
        cJSON *sj = cJSON_Parse(sch);
        assert_int_equal(fp4moe_grammar_from_json_schema(sj, NULL, &g), FP4MOE_EUNSUPPORTED);
        assert_non_null(strstr(fp4moe_last_error(), "nests 34 values deep"));
        cJSON_Delete(sj);
    }
    fp4moe_grammar *g = compile("{\"type\":\"array\"}");
    char doc[256];
    for (int d = FP4MOE_GRAMMAR_MAX_DEPTH - 1; d <= FP4MOE_GRAMMAR_MAX_DEPTH + 1; d++) {
        int k = 0;
        for (int i = 0; i < d; i++) doc[k++] = '[';
        for (int i = 0; i < d; i++) doc[k++] = ']';
        doc[k] = 0;
        assert_int_equal(doc_ok(g, tv->v, doc), d <= FP4MOE_GRAMMAR_MAX_DEPTH);
    }
    fp4moe_grammar_free(g);
}

static void test_schema_errors(void **state) {
    (void)state;
    static const struct {
        const char *schema;
        int code;
        const char *msg;
    } cases[] = {
        {"{\"type\":\"integer\",\"minimum\":0}", FP4MOE_EUNSUPPORTED, "schema: 'minimum' is not supported"},
        {"{\"properties\":{\"a\":{\"type\":\"string\",\"pattern\":\"x\"}}}", FP4MOE_EUNSUPPORTED,
         "schema.properties.a: 'pattern' is not supported"},
        {"{\"anyOf\":[{\"type\":\"object\"},{\"properties\":{}}]}", FP4MOE_EUNSUPPORTED, "both begin with '{'"},
        {"{\"$ref\":\"#/components/x\"}", FP4MOE_EUNSUPPORTED, "does not resolve"},
        {"{\"$defs\":{\"a\":{\"anyOf\":[{\"$ref\":\"#/$defs/a\"},{\"type\":\"null\"}]}},\"$ref\":\"#/$defs/a\"}",
         FP4MOE_EUNSUPPORTED, "refers to itself"},
        {"{\"type\":\"strin\"}", FP4MOE_EINVAL, "unknown type 'strin'"},
        {"{\"type\":\"string\",\"minLength\":3,\"maxLength\":2}", FP4MOE_EINVAL, "minLength > maxLength"},
        {"{\"properties\":{\"a\":{}},\"required\":[\"b\"]}", FP4MOE_EINVAL, "'required' names 'b'"},
        {"{\"enum\":[]}", FP4MOE_EINVAL, "'enum' must be a non-empty array"},
        {"{\"type\":\"string\",\"enum\":[1]}", FP4MOE_EINVAL, "allows no value of its type"},
        {"false", FP4MOE_EINVAL, "allows nothing"},
        {"{\"type\":\"array\",\"maxItems\":-1}", FP4MOE_EINVAL, "'maxItems' must be a non-negative integer"},
        {"{\"properties\":{\"a\":{}},\"additionalProperties\":true}", FP4MOE_EUNSUPPORTED, "additionalProperties"},
        {"{\"type\":\"array\",\"items\":[{}]}", FP4MOE_EUNSUPPORTED, "tuple form"},
        {"{\"allOf\":[{},{}]}", FP4MOE_EUNSUPPORTED, "allOf"},
        {"[1]", FP4MOE_EINVAL, "must be an object or a boolean"},
        {"{\"const\":9007199254740992}", FP4MOE_EUNSUPPORTED, "beyond 2^53"},
        {"{\"type\":\"string\",\"enum\":[\"abc\",\"x\"],\"maxLength\":1}", FP4MOE_EUNSUPPORTED, "'maxLength' beside 'enum'"},
        {"{\"const\":\"a\",\"enum\":[\"b\"]}", FP4MOE_EUNSUPPORTED, "beside 'enum'"},
        {"{\"$ref\":\"#\"}", FP4MOE_EINVAL, "no finite document"},
        {"{\"type\":\"object\",\"properties\":{\"x\":{\"$ref\":\"#\"}},\"required\":[\"x\"]}", FP4MOE_EINVAL,
         "no finite document"},
        {"{\"properties\":{\"deep\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"string\",\"maxLength\":2}]}}}",
         FP4MOE_EUNSUPPORTED, "schema.properties.deep: anyOf"},
        {"{\"$defs\":{\"u\":{\"properties\":{\"q\":{\"minimum\":1}}}},\"$ref\":\"#/$defs/u\"}", FP4MOE_EUNSUPPORTED,
         "schema#/$defs/u.properties.q: 'minimum'"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        cJSON *s = cJSON_Parse(cases[i].schema);
        assert_non_null(s);
        fp4moe_grammar *g = (fp4moe_grammar *)1;
        const int st = fp4moe_grammar_from_json_schema(s, NULL, &g);
        if (st != cases[i].code || !strstr(fp4moe_last_error(), cases[i].msg))
            fprintf(stderr, "case %zu (%s): %d %s\n", i, cases[i].schema, st, fp4moe_last_error());
        assert_int_equal(st, cases[i].code);
        assert_non_null(strstr(fp4moe_last_error(), cases[i].msg));
        assert_null(g);
        cJSON_Delete(s);
    }
}

static void test_choices(void **state) {
    tvocab *tv = *state;
    const char *ch[] = {"yes", "no", "yes sir", "no"};
    fp4moe_grammar *g = NULL;
    assert_int_equal(fp4moe_grammar_from_choices(ch, NULL, 4, &g), FP4MOE_OK);
    assert_int_equal(doc_ok(g, tv->v, "yes"), 1);
    assert_int_equal(doc_ok(g, tv->v, "yes sir"), 1);
    assert_int_equal(doc_ok(g, tv->v, "no"), 1);
    assert_int_equal(doc_ok(g, tv->v, "ye"), 0);
    assert_int_equal(doc_ok(g, tv->v, " yes"), 0);
    assert_int_equal(doc_ok(g, tv->v, "\"yes\""), 0);
    fp4moe_grammar_free(g);
    const char *bad[] = {"ok", ""};
    assert_int_equal(fp4moe_grammar_from_choices(bad, NULL, 2, &g), FP4MOE_EINVAL);
    const char *bad8[] = {"\xff"};
    assert_int_equal(fp4moe_grammar_from_choices(bad8, NULL, 1, &g), FP4MOE_EINVAL);
    assert_int_equal(fp4moe_grammar_from_choices(ch, NULL, 0, &g), FP4MOE_EINVAL);
}

static uint64_t rng_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* random walks: at every step the mask equals the brute force, a random allowed token is taken (biased to
 * close values sooner as the walk goes on: the stop id when allowed after step 40); the text of an ended walk
 * parses as JSON. Returns the number of walks that ended. */
static int walks(tvocab *tv, const fp4moe_grammar *g, int n_walks, int max_steps, uint64_t seed,
                 void (*check)(const cJSON *doc), const char *const *choices, int n_choices) {
    const int64_t V = fp4moe_grammar_vocab_size(tv->v);
    float *lg = malloc((size_t)(V + 3) * sizeof(float));
    int32_t *allowed = malloc((size_t)(V + 3) * sizeof(int32_t));
    char *text = malloc(1 << 16);
    assert_non_null(lg);
    assert_non_null(allowed);
    assert_non_null(text);
    fp4moe_grammar_matcher *m = NULL, *t = NULL;
    assert_int_equal(fp4moe_grammar_matcher_new(g, tv->v, &tv->eos, 1, &m), FP4MOE_OK);
    assert_int_equal(fp4moe_grammar_matcher_new(g, tv->v, &tv->eos, 1, &t), FP4MOE_OK);
    int ended = 0;
    uint64_t rs = seed;
    for (int w = 0; w < n_walks; w++) {
        fp4moe_grammar_matcher_free(m);
        assert_int_equal(fp4moe_grammar_matcher_new(g, tv->v, &tv->eos, 1, &m), FP4MOE_OK);
        size_t tl = 0;
        for (int s = 0; s < max_steps && !fp4moe_grammar_is_ended(m); s++) {
            for (int64_t i = 0; i < V + 3; i++) lg[i] = 0.0f;
            const int64_t left = fp4moe_grammar_mask_logits(m, lg, V + 3);
            int64_t n_allowed = 0;
            for (int64_t i = 0; i < V + 3; i++) {
                const int by_mask = lg[i] == 0.0f;
                int by_brute = 0;
                if (i < V) {
                    assert_int_equal(fp4moe_grammar_matcher_copy(t, m), FP4MOE_OK);
                    by_brute = fp4moe_grammar_accept_token(t, (int32_t)i) == FP4MOE_OK;
                }
                if (by_mask != by_brute)
                    fprintf(stderr, "walk %d step %d: token %lld [%s]: mask %d, brute force %d (text so far [%.*s])\n",
                            w, s, (long long)i, fp4moe_tokenizer_id_to_token(tv->tok, (int32_t)i), by_mask, by_brute,
                            (int)tl, text);
                assert_int_equal(by_mask, by_brute);
                assert_true(by_mask || isinf(lg[i]));
                if (by_mask) allowed[n_allowed++] = (int32_t)i;
            }
            assert_int_equal(left, n_allowed);
            assert_true(n_allowed > 0);
            int32_t id = allowed[rng_next(&rs) % (uint64_t)n_allowed];
            if (s > 40 && fp4moe_grammar_is_complete(m)) id = tv->eos;
            /* late in a walk prefer tokens that close something */
            if (s > 60 && id != tv->eos)
                for (int64_t k = 0; k < n_allowed; k++) {
                    const char *p;
                    int64_t pl;
                    if (fp4moe_tokenizer_token_to_piece(tv->tok, allowed[k], &p, &pl) == 0 && pl == 1 &&
                        (p[0] == '}' || p[0] == ']' || p[0] == '"')) {
                        id = allowed[k];
                        break;
                    }
                }
            assert_int_equal(fp4moe_grammar_accept_token(m, id), FP4MOE_OK);
            if (id != tv->eos) {
                const char *p;
                int64_t pl;
                assert_int_equal(fp4moe_tokenizer_token_to_piece(tv->tok, id, &p, &pl), 0);
                assert_true(tl + (size_t)pl < (1 << 16));
                memcpy(text + tl, p, (size_t)pl);
                tl += (size_t)pl;
            }
        }
        if (fp4moe_grammar_is_ended(m) && choices) {
            ended++;
            int hit = 0;
            for (int k = 0; k < n_choices; k++) hit |= strlen(choices[k]) == tl && !memcmp(choices[k], text, tl);
            if (!hit) fprintf(stderr, "walk %d: not a choice: [%.*s]\n", w, (int)tl, text);
            assert_true(hit);
        } else if (fp4moe_grammar_is_ended(m)) {
            ended++;
            cJSON *doc = cJSON_ParseWithLength(text, tl);
            if (!doc) fprintf(stderr, "walk %d: not JSON: [%.*s]\n", w, (int)tl, text);
            assert_non_null(doc);
            if (check) check(doc);
            cJSON_Delete(doc);
        }
    }
    fp4moe_grammar_matcher_free(m);
    fp4moe_grammar_matcher_free(t);
    free(lg);
    free(allowed);
    free(text);
    return ended;
}

static void check_person(const cJSON *doc) {
    assert_true(cJSON_IsObject(doc));
    assert_true(cJSON_IsString(cJSON_GetObjectItemCaseSensitive(doc, "name")));
    const cJSON *age = cJSON_GetObjectItemCaseSensitive(doc, "age");
    assert_true(cJSON_IsNumber(age) && age->valuedouble == floor(age->valuedouble));
    const cJSON *tags = cJSON_GetObjectItemCaseSensitive(doc, "tags");
    if (tags) {
        assert_true(cJSON_IsArray(tags) && cJSON_GetArraySize(tags) <= 3);
        for (const cJSON *x = tags->child; x; x = x->next)
            assert_true(cJSON_IsString(x) && strlen(x->valuestring) <= 5);
    }
    int n = 0;
    for (const cJSON *c = doc->child; c; c = c->next) n++;
    assert_int_equal(n, 2 + (tags != NULL) + (cJSON_GetObjectItemCaseSensitive(doc, "ok") != NULL));
}

static void check_object(const cJSON *doc) { assert_true(cJSON_IsObject(doc)); }

static void test_mask_walks(void **state) {
    tvocab *tv = *state;
    fp4moe_grammar *g = compile(
        "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\"},"
        "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\",\"maxLength\":5},\"maxItems\":3},"
        "\"ok\":{\"type\":\"boolean\"}},\"required\":[\"name\",\"age\"]}");
    const int e1 = walks(tv, g, 6, 120, 0x9e3779b97f4a7c15ull, check_person, NULL, 0);
    fp4moe_grammar_free(g);
    g = compile(NULL);
    const int e2 = walks(tv, g, 6, 120, 0x1234567ull, check_object, NULL, 0);
    fp4moe_grammar_free(g);
    const char *ch[] = {"positive", "negative", "neutral", "pos"};
    assert_int_equal(fp4moe_grammar_from_choices(ch, NULL, 4, &g), FP4MOE_OK);
    const int e3 = walks(tv, g, 6, 40, 0x5555ull, NULL, ch, 4);
    fp4moe_grammar_free(g);
    fprintf(stderr, "walks ended: %d / 6, %d / 6, %d / 6\n", e1, e2, e3);
    assert_true(e1 >= 1 && e2 >= 1 && e3 == 6);
}

/* tool_choice "required": [{"name": N, "parameters": P(N)}, ...], P chosen by the name */
static void test_tools(void **state) {
    tvocab *tv = *state;
    const char *names[] = {"get_weather", "now", "get"};
    cJSON *p0 = cJSON_Parse("{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\",\"maxLength\":6},"
                            "\"days\":{\"type\":\"integer\"}},\"required\":[\"city\",\"days\"]}");
    cJSON *p2 = cJSON_Parse("{\"$defs\":{\"k\":{\"enum\":[\"a\",\"b\"]}},\"type\":\"object\",\"properties\":"
                            "{\"key\":{\"$ref\":\"#/$defs/k\"}},\"required\":[\"key\"]}");
    const cJSON *params[] = {p0, NULL, p2};
    fp4moe_grammar *g = NULL;
    assert_int_equal(fp4moe_grammar_from_tools(names, params, 3, &g), FP4MOE_OK);
    static const struct {
        const char *doc;
        int ok;
    } cases[] = {
        {"[{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"days\": 3}}]", 1},
        {"[{\"name\": \"now\", \"parameters\": {\"any\": [1]}}, {\"name\": \"get\", \"parameters\": {\"key\": \"b\"}}]", 1},
        {"[{\"name\": \"get\", \"parameters\": {\"city\": \"Paris\", \"days\": 3}}]", 0},
        {"[{\"name\": \"get_weather\", \"parameters\": {\"key\": \"a\"}}]", 0},
        {"[{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris!!\", \"days\": 3}}]", 0},
        {"[{\"name\": \"other\", \"parameters\": {}}]", 0},
        {"[{\"parameters\": {}, \"name\": \"now\"}]", 0},
        {"[]", 0},
        {"[{\"name\": \"get\", \"parameters\": {\"key\": \"c\"}}]", 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        if (doc_ok(g, tv->v, cases[i].doc) != cases[i].ok) fail_msg("tools case %zu: %s", i, cases[i].doc);
    const int e = walks(tv, g, 4, 200, 0x777ull, NULL, NULL, 0);
    (void)e;
    fp4moe_grammar_free(g);
    /* at most one call (parallel_tool_calls false): the one-call document still, the two-call one not */
    assert_int_equal(fp4moe_grammar_from_tools_limit(names, params, 3, 1, &g), FP4MOE_OK);
    assert_int_equal(doc_ok(g, tv->v, cases[0].doc), 1);
    assert_int_equal(doc_ok(g, tv->v, cases[1].doc), 0);
    assert_int_equal(doc_ok(g, tv->v, "[{\"name\": \"now\", \"parameters\": {}}]"), 1);
    fp4moe_grammar_free(g);
    assert_int_equal(fp4moe_grammar_from_tools_limit(names, params, 3, 2, &g), FP4MOE_OK);
    assert_int_equal(doc_ok(g, tv->v, cases[1].doc), 1);
    fp4moe_grammar_free(g);
    assert_int_equal(fp4moe_grammar_from_tools_limit(names, params, 3, -1, &g), FP4MOE_EINVAL);
    const char *dup[] = {"b", "a", "b"};
    const cJSON *none[] = {NULL, NULL, NULL};
    assert_int_equal(fp4moe_grammar_from_tools(dup, none, 3, &g), FP4MOE_EINVAL);
    assert_non_null(strstr(fp4moe_last_error(), "two tools are named 'b'"));
    /* 4,096 tools (the limit), named in an order other than the literals' sorted one: each call's parameters are
     * its own tool's (tool 4000 has p2's enum, the others any object) */
    enum { NT = 4096 };
    char(*tn)[16] = malloc(NT * sizeof *tn);
    const char **tnames = malloc(NT * sizeof *tnames);
    const cJSON **tparams = calloc(NT, sizeof *tparams);
    assert_non_null(tn);
    assert_non_null(tnames);
    assert_non_null(tparams);
    for (int i = 0; i < NT; i++) {
        snprintf(tn[i], sizeof tn[i], "t%d", NT - 1 - i);
        tnames[i] = tn[i];
    }
    tparams[NT - 1 - 4000] = p2;
    assert_int_equal(fp4moe_grammar_from_tools(tnames, tparams, NT, &g), FP4MOE_OK);
    assert_int_equal(doc_ok(g, tv->v, "[{\"name\": \"t4000\", \"parameters\": {\"key\": \"a\"}}]"), 1);
    assert_int_equal(doc_ok(g, tv->v, "[{\"name\": \"t4000\", \"parameters\": {\"key\": \"c\"}}]"), 0);
    assert_int_equal(doc_ok(g, tv->v, "[{\"name\": \"t400\", \"parameters\": {\"key\": \"c\"}}]"), 1);
    assert_int_equal(doc_ok(g, tv->v, "[{\"name\": \"t4096\", \"parameters\": {}}]"), 0);
    fp4moe_grammar_free(g);
    free(tn);
    free(tnames);
    free(tparams);
    cJSON *bad = cJSON_Parse("{\"type\":\"integer\",\"minimum\":1}");
    const cJSON *pb[] = {NULL, bad};
    const char *two[] = {"a", "b"};
    assert_int_equal(fp4moe_grammar_from_tools(two, pb, 2, &g), FP4MOE_EUNSUPPORTED);
    assert_non_null(strstr(fp4moe_last_error(), "tools[1].function.parameters: 'minimum'"));
    cJSON_Delete(bad);
    cJSON_Delete(p0);
    cJSON_Delete(p2);
}

/* the end: the stop id only when complete; nothing after it */
static void test_stop(void **state) {
    tvocab *tv = *state;
    fp4moe_grammar *g = compile("{\"type\":\"integer\"}");
    fp4moe_grammar_matcher *m = NULL;
    assert_int_equal(fp4moe_grammar_matcher_new(g, tv->v, &tv->eos, 1, &m), FP4MOE_OK);
    assert_int_equal(fp4moe_grammar_accept_token(m, tv->eos), FP4MOE_EINVAL);
    assert_int_equal(fp4moe_grammar_accept_bytes(m, "-", 1), FP4MOE_OK);
    assert_int_equal(fp4moe_grammar_is_complete(m), 0);
    assert_int_equal(fp4moe_grammar_accept_bytes(m, "x", 1), FP4MOE_EINVAL);
    assert_int_equal(fp4moe_grammar_accept_bytes(m, "12", 2), FP4MOE_OK);
    assert_int_equal(fp4moe_grammar_is_complete(m), 1);
    assert_int_equal(fp4moe_grammar_accept_token(m, tv->eos), FP4MOE_OK);
    assert_int_equal(fp4moe_grammar_is_ended(m), 1);
    float lg[4] = {0, 0, 0, 0};
    assert_int_equal(fp4moe_grammar_mask_logits(m, lg, 4), 0);
    assert_true(isinf(lg[0]) && isinf(lg[3]));
    assert_int_equal(fp4moe_grammar_accept_bytes(m, "1", 1), FP4MOE_EINVAL);
    fp4moe_grammar_matcher_free(m);
    int32_t bad = (int32_t)fp4moe_grammar_vocab_size(tv->v);
    assert_int_equal(fp4moe_grammar_matcher_new(g, tv->v, &bad, 1, &m), FP4MOE_EINVAL);
    fp4moe_grammar_free(g);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_documents), cmocka_unit_test(test_depth),     cmocka_unit_test(test_schema_errors),
        cmocka_unit_test(test_choices),   cmocka_unit_test(test_stop),      cmocka_unit_test(test_mask_walks),
        cmocka_unit_test(test_tools),
    };
    return cmocka_run_group_tests(tests, tok_setup, tok_teardown);
}
