/* Structured output: JSON Schema / choices -> a byte-level matcher, and the token mask over a tokenizer's
 * byte trie (include/fp4moe/grammar.h).
 *
 * A grammar is a graph of nodes (an object with properties, an object with free keys, an array, a string,
 * a number, an integer, a set of literals, a choice among alternatives by their first byte). A matcher is a
 * stack of frames, one per open value; step() takes one byte. Values that end without a closing byte (a
 * number, a literal that may go on: "1" of enum [1, 12]) end when a byte that cannot extend them comes: the
 * frame is popped and the byte goes to the parent. The mask walks the trie of the vocab's token bytes with
 * a copy of the state per trie level, so a prefix shared by many tokens is matched once. */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "fp4moe/grammar.h"

enum { GK_ANY, GK_OBJ, GK_FREEOBJ, GK_ARR, GK_STR, GK_NUM, GK_INT, GK_LIT, GK_ALT };
#define G_MAX_ITEMS 65536

typedef struct {
    int kind;
    int a, b;         /* OBJ: props [a, a + b); FREEOBJ: value node a; ARR: item node a; LIT: lits [a, a + b)
                         (sorted); ALT: alternatives [a, a + b) of g->alts */
    int64_t lo, hi;   /* ARR: min / max items; STR: min / max length (hi < 0: none) */
    int raw;          /* LIT: raw text (choices): no whitespace before it */
    int amap;         /* ALT: its 256-byte map (first byte -> alternative, 255: none) in g->amaps */
    int mind;         /* the fewest open values (frames) a document of this node needs, itself included: a value
                         is begun only where it can end within FP4MOE_GRAMMAR_MAX_DEPTH (no dead ends) */
    int path;         /* ALT: its place in the schema (g->paths), for errors; -1: none */
    int tag;          /* OBJ: -1; else the node of property 1 depends on the literal property 0 took: it is
                         g->tagmap[tag + (that literal's index - the first literal of property 0's node)] */
    int state;        /* compile: 0 done, 1 alias pending, 2 in a first-set walk */
    uint8_t first[32];
} gnode;

typedef struct {
    char *key; /* the key as JSON text, quotes included */
    int len, node, required;
} gprop;

typedef struct {
    char *s;
    int len;
} glit;

struct fp4moe_grammar {
    gnode *nodes;
    int n_nodes, cap_nodes;
    gprop *props;
    int n_props, cap_props;
    glit *lits;
    int n_lits, cap_lits;
    int *alts;
    int n_alts, cap_alts;
    uint8_t *amaps;
    int n_amaps;
    int *tagmap;
    int n_tagmap;
    char **paths;
    int n_paths;
    int root, any, any_str;
};

/* ---- compile ----------------------------------------------------------------------------------------- */

typedef struct {
    fp4moe_grammar *g;
    const cJSON *root;
    const char *where;    /* the root's name in messages */
    const cJSON **memo_s; /* $ref targets compiled: schema -> node */
    int *memo_n;
    int n_memo, cap_memo;
} gcomp;

static int grow(void **p, int *cap, int need, size_t elem) {
    if (need <= *cap) return 0;
    if (need > G_MAX_ITEMS) return fp4moe_set_error(FP4MOE_EOVERFLOW, "grammar: more than %d nodes / literals",
                                                    G_MAX_ITEMS);
    int c = *cap ? *cap : 16;
    while (c < need) c *= 2;
    void *q = realloc(*p, (size_t)c * elem);
    if (!q) return fp4moe_set_error(FP4MOE_ENOMEM, "grammar: out of memory");
    *p = q;
    *cap = c;
    return 0;
}

static int new_node(fp4moe_grammar *g, int kind) {
    int st = grow((void **)&g->nodes, &g->cap_nodes, g->n_nodes + 1, sizeof(gnode));
    if (st) return st;
    gnode *n = &g->nodes[g->n_nodes];
    memset(n, 0, sizeof *n);
    n->kind = kind;
    n->hi = -1;
    n->amap = -1;
    n->tag = -1;
    n->path = -1;
    return g->n_nodes++;
}

static int add_lit(fp4moe_grammar *g, const char *s, size_t len) {
    int st = grow((void **)&g->lits, &g->cap_lits, g->n_lits + 1, sizeof(glit));
    if (st) return st;
    char *c = malloc(len + 1);
    if (!c) return fp4moe_set_error(FP4MOE_ENOMEM, "grammar: out of memory");
    memcpy(c, s, len);
    c[len] = 0;
    g->lits[g->n_lits].s = c;
    g->lits[g->n_lits].len = (int)len;
    g->n_lits++;
    return 0;
}

static int lit_cmp(const void *x, const void *y) {
    const glit *a = x, *b = y;
    const int m = a->len < b->len ? a->len : b->len;
    const int c = memcmp(a->s, b->s, (size_t)m);
    return c ? c : (a->len > b->len) - (a->len < b->len);
}

/* a tool's name literal and the tool's index (fp4moe_grammar_from_tools) */
typedef struct {
    glit l;
    int tool;
} tool_lit;
static int tool_lit_cmp(const void *x, const void *y) {
    const tool_lit *a = x, *b = y;
    return lit_cmp(&a->l, &b->l);
}

/* sorts lits [a, a + n), drops repeats; returns the count left */
static int lits_sort(fp4moe_grammar *g, int a, int n) {
    qsort(g->lits + a, (size_t)n, sizeof(glit), lit_cmp);
    int k = 0;
    for (int i = 0; i < n; i++) {
        if (k && !lit_cmp(&g->lits[a + k - 1], &g->lits[a + i])) {
            free(g->lits[a + i].s);
            continue;
        }
        g->lits[a + k++] = g->lits[a + i];
    }
    g->n_lits = a + k;
    return k;
}

static int lit_node(fp4moe_grammar *g, const char *const *s, const int64_t *lens, int n, int raw) {
    const int a = g->n_lits;
    for (int i = 0; i < n; i++) {
        const int st = add_lit(g, s[i], lens ? (size_t)lens[i] : strlen(s[i]));
        if (st) return st;
    }
    const int k = lits_sort(g, a, n);
    const int id = new_node(g, GK_LIT);
    if (id < 0) return id;
    g->nodes[id].a = a;
    g->nodes[id].b = k;
    g->nodes[id].raw = raw;
    return id;
}

static int alt_node(fp4moe_grammar *g, const int *alts, int n, const char *path) {
    const int a = g->n_alts;
    int st = grow((void **)&g->alts, &g->cap_alts, a + n, sizeof(int));
    if (st) return st;
    memcpy(g->alts + a, alts, (size_t)n * sizeof(int));
    g->n_alts += n;
    const int id = new_node(g, GK_ALT);
    if (id < 0) return id;
    g->nodes[id].a = a;
    g->nodes[id].b = n;
    char **pp = realloc(g->paths, (size_t)(g->n_paths + 1) * sizeof(char *));
    if (!pp) return fp4moe_set_error(FP4MOE_ENOMEM, "grammar: out of memory");
    g->paths = pp;
    if (!(pp[g->n_paths] = strdup(path))) return fp4moe_set_error(FP4MOE_ENOMEM, "grammar: out of memory");
    g->nodes[id].path = g->n_paths++;
    return id;
}

/* any JSON value: an ALT over an object of free keys, an array, a string, a number and the literals */
static int any_node(fp4moe_grammar *g) {
    if (g->any >= 0) return g->any;
    const int alt = new_node(g, GK_ALT); /* filled below: the parts refer to it */
    if (alt < 0) return alt;
    g->any = alt;
    int parts[5];
    if ((parts[0] = new_node(g, GK_FREEOBJ)) < 0) return parts[0];
    g->nodes[parts[0]].a = alt;
    if ((parts[1] = new_node(g, GK_ARR)) < 0) return parts[1];
    g->nodes[parts[1]].a = alt;
    if ((parts[2] = new_node(g, GK_STR)) < 0) return parts[2];
    g->any_str = parts[2];
    if ((parts[3] = new_node(g, GK_NUM)) < 0) return parts[3];
    static const char *const words[] = {"false", "null", "true"};
    if ((parts[4] = lit_node(g, words, NULL, 3, 0)) < 0) return parts[4];
    const int a = g->n_alts;
    int st = grow((void **)&g->alts, &g->cap_alts, a + 5, sizeof(int));
    if (st) return st;
    memcpy(g->alts + a, parts, sizeof parts);
    g->n_alts += 5;
    g->nodes[alt].a = a;
    g->nodes[alt].b = 5;
    return alt;
}

static int key_str(fp4moe_grammar *g) {
    if (g->any_str >= 0) return g->any_str;
    const int st = any_node(g);
    return st < 0 ? st : g->any_str;
}

static const char *const g_annotations[] = {"title",      "description", "default",   "examples",        "$schema",
                                            "$id",        "$comment",    "deprecated", "readOnly",       "writeOnly",
                                            "format",     "contentMediaType", "contentEncoding", "$defs", "definitions",
                                            "$anchor"};
static const char *const g_keywords[] = {"type",     "enum",     "const",    "properties", "required",
                                         "additionalProperties", "items", "minItems", "maxItems", "minLength",
                                         "maxLength", "anyOf",   "oneOf",    "allOf",      "$ref"};

static int is_annotation(const char *k) {
    if (!strncmp(k, "x-", 2)) return 1;
    for (size_t i = 0; i < sizeof g_annotations / sizeof *g_annotations; i++)
        if (!strcmp(k, g_annotations[i])) return 1;
    return 0;
}

static int comp(gcomp *cx, const cJSON *s, const char *path, int depth);

/* a non-negative integer keyword, or -1 when absent; -2 after an error */
static int64_t get_count(const cJSON *s, const char *name, const char *path) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(s, name);
    if (!v) return -1;
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble != floor(v->valuedouble) ||
        v->valuedouble > 1e15) {
        fp4moe_set_error(FP4MOE_EINVAL, "%s: '%s' must be a non-negative integer", path, name);
        return -2;
    }
    return (int64_t)v->valuedouble;
}

static int type_matches(const cJSON *v, const char *type) {
    if (!strcmp(type, "string")) return cJSON_IsString(v);
    if (!strcmp(type, "number")) return cJSON_IsNumber(v);
    if (!strcmp(type, "integer")) return cJSON_IsNumber(v) && v->valuedouble == floor(v->valuedouble);
    if (!strcmp(type, "boolean")) return cJSON_IsBool(v);
    if (!strcmp(type, "null")) return cJSON_IsNull(v);
    if (!strcmp(type, "object")) return cJSON_IsObject(v);
    if (!strcmp(type, "array")) return cJSON_IsArray(v);
    return 0;
}

/* enum / const values (those of `type` when given) -> a LIT node of their JSON texts */
typedef struct {
    char *p;
    size_t n, cap;
} gbuf;

static int gb_add(gbuf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t c = b->cap ? b->cap * 2 : 64;
        while (c < b->n + n + 1) c *= 2;
        char *q = realloc(b->p, c);
        if (!q) return fp4moe_set_error(FP4MOE_ENOMEM, "grammar: out of memory");
        b->p = q;
        b->cap = c;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return 0;
}

/* JSON text of an enum / const value (compact, as cJSON prints it), numbers in the shortest form that reads back as
 * the same double (Python's repr; integral values of magnitude below 2^53 as integers). An integral value from 2^53
 * to 1e21 is refused: cJSON keeps numbers as doubles, so the digits the client wrote (an int?) are not known. */
static int print_value(const cJSON *v, gbuf *b, const char *path, int depth) {
    if (depth > 64) return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: an enum / const value nested deeper than 64", path);
    if (cJSON_IsNumber(v)) {
        const double x = v->valuedouble;
        char t[40];
        if (!isfinite(x)) return fp4moe_set_error(FP4MOE_EINVAL, "%s: a non-finite number in enum / const", path);
        if (x == floor(x) && fabs(x) >= 9007199254740992.0 && fabs(x) < 1e21) /* (from 1e21 only a float: 1e+300) */
            return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: the enum / const number %.17g is beyond 2^53 (not held "
                                    "exactly)", path, x);
        if (x == floor(x) && fabs(x) < 1e16) { /* (Python writes floats from 1e16 with an exponent) */
            snprintf(t, sizeof t, "%.0f", x);
            if (!strcmp(t, "-0")) snprintf(t, sizeof t, "0");
        } else {
            for (int prec = 1; prec <= 17; prec++) {
                snprintf(t, sizeof t, "%.*g", prec, x);
                if (strtod(t, NULL) == x) break;
            }
        }
        return gb_add(b, t, strlen(t));
    }
    if (cJSON_IsArray(v) || cJSON_IsObject(v)) {
        const int arr = cJSON_IsArray(v);
        int st = gb_add(b, arr ? "[" : "{", 1);
        for (const cJSON *c = v->child; !st && c; c = c->next) {
            if (c != v->child) st = gb_add(b, ",", 1);
            if (!st && !arr) {
                cJSON *k = cJSON_CreateString(c->string);
                char *kt = k ? cJSON_PrintUnformatted(k) : NULL;
                cJSON_Delete(k);
                st = kt ? gb_add(b, kt, strlen(kt)) : fp4moe_set_error(FP4MOE_ENOMEM, "grammar: out of memory");
                free(kt);
                if (!st) st = gb_add(b, ":", 1);
            }
            if (!st) st = print_value(c, b, path, depth + 1);
        }
        return st ? st : gb_add(b, arr ? "]" : "}", 1);
    }
    char *txt = cJSON_PrintUnformatted(v); /* strings, true, false, null */
    if (!txt) return fp4moe_set_error(FP4MOE_ENOMEM, "grammar: out of memory");
    const int st = gb_add(b, txt, strlen(txt));
    free(txt);
    return st;
}

/* enum (a list) / const (one value; list 0) -> a LIT node of their JSON texts (those of `type` when given) */
static int comp_enum(gcomp *cx, const cJSON *vals, int list, const cJSON *type, const char *path, const char *kw) {
    fp4moe_grammar *g = cx->g;
    const int a = g->n_lits;
    int k = 0;
    for (const cJSON *v = list ? vals->child : vals; v; v = list ? v->next : NULL) {
        if (type) {
            int ok = 0;
            if (cJSON_IsString(type)) ok = type_matches(v, type->valuestring);
            else
                for (const cJSON *t = type->child; t; t = t->next) ok |= cJSON_IsString(t) && type_matches(v, t->valuestring);
            if (!ok) continue;
        }
        gbuf b = {0};
        int st = print_value(v, &b, path, 0);
        if (!st) st = add_lit(g, b.p, b.n);
        free(b.p);
        if (st) return st;
        k++;
    }
    if (!k) return fp4moe_set_error(FP4MOE_EINVAL, "%s: '%s' allows no value%s", path, kw, type ? " of its type" : "");
    k = lits_sort(g, a, k);
    const int id = new_node(g, GK_LIT);
    if (id < 0) return id;
    g->nodes[id].a = a;
    g->nodes[id].b = k;
    return id;
}

static int comp_object(gcomp *cx, const cJSON *s, const char *path, int depth) {
    fp4moe_grammar *g = cx->g;
    const cJSON *props = cJSON_GetObjectItemCaseSensitive(s, "properties");
    const cJSON *req = cJSON_GetObjectItemCaseSensitive(s, "required");
    const cJSON *add = cJSON_GetObjectItemCaseSensitive(s, "additionalProperties");
    char sub[512];
    if (props && !cJSON_IsObject(props)) return fp4moe_set_error(FP4MOE_EINVAL, "%s: 'properties' must be an object", path);
    if (req && !cJSON_IsArray(req)) return fp4moe_set_error(FP4MOE_EINVAL, "%s: 'required' must be an array", path);
    if (add && !cJSON_IsBool(add) && !cJSON_IsObject(add))
        return fp4moe_set_error(FP4MOE_EINVAL, "%s: 'additionalProperties' must be a boolean or a schema", path);
    if (!props || !props->child) {
        if (req && cJSON_GetArraySize(req) > 0)
            return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: 'required' without 'properties' is not supported", path);
        if (cJSON_IsFalse(add)) { /* only {} */
            const int id = new_node(g, GK_OBJ);
            if (id >= 0) g->nodes[id].a = g->n_props, g->nodes[id].b = 0;
            return id;
        }
        int val;
        if (cJSON_IsObject(add)) {
            snprintf(sub, sizeof sub, "%s.additionalProperties", path);
            val = comp(cx, add, sub, depth + 1);
        } else {
            val = any_node(g);
        }
        if (val < 0) return val;
        const int id = new_node(g, GK_FREEOBJ);
        if (id >= 0) g->nodes[id].a = val;
        if (id >= 0) { int ks = key_str(g); if (ks < 0) return ks; }
        return id;
    }
    if (add && !cJSON_IsFalse(add))
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: 'additionalProperties' other than false beside 'properties' "
                                "is not supported", path);
    for (const cJSON *r = req ? req->child : NULL; r; r = r->next) {
        if (!cJSON_IsString(r)) return fp4moe_set_error(FP4MOE_EINVAL, "%s: 'required' must list strings", path);
        if (!cJSON_GetObjectItemCaseSensitive(props, r->valuestring))
            return fp4moe_set_error(FP4MOE_EINVAL, "%s: 'required' names '%s', which is not in 'properties'", path,
                                    r->valuestring);
    }
    const int np = cJSON_GetArraySize(props);
    /* the property nodes first (they may add props of their own), then this object's props in a row */
    int *nodes = malloc((size_t)np * sizeof(int));
    if (!nodes) return fp4moe_set_error(FP4MOE_ENOMEM, "grammar: out of memory");
    int i = 0;
    for (const cJSON *p = props->child; p; p = p->next, i++) {
        snprintf(sub, sizeof sub, "%s.properties.%s", path, p->string);
        for (const cJSON *q = props->child; q != p; q = q->next)
            if (!strcmp(q->string, p->string)) {
                free(nodes);
                return fp4moe_set_error(FP4MOE_EINVAL, "%s: property '%s' given twice", path, p->string);
            }
        if ((nodes[i] = comp(cx, p, sub, depth + 1)) < 0) {
            const int st = nodes[i];
            free(nodes);
            return st;
        }
    }
    const int a = g->n_props;
    int st = grow((void **)&g->props, &g->cap_props, a + np, sizeof(gprop));
    if (st) {
        free(nodes);
        return st;
    }
    i = 0;
    for (const cJSON *p = props->child; p; p = p->next, i++) {
        cJSON *ks = cJSON_CreateString(p->string);
        char *txt = ks ? cJSON_PrintUnformatted(ks) : NULL;
        cJSON_Delete(ks);
        if (!txt) {
            free(nodes);
            return fp4moe_set_error(FP4MOE_ENOMEM, "grammar: out of memory");
        }
        gprop *pr = &g->props[a + i];
        pr->key = txt;
        pr->len = (int)strlen(txt);
        pr->node = nodes[i];
        pr->required = 0;
        for (const cJSON *r = req ? req->child : NULL; r; r = r->next)
            if (!strcmp(r->valuestring, p->string)) pr->required = 1;
        g->n_props++;
    }
    free(nodes);
    const int id = new_node(g, GK_OBJ);
    if (id < 0) return id;
    g->nodes[id].a = a;
    g->nodes[id].b = np;
    return id;
}

static int comp_typed(gcomp *cx, const cJSON *s, const char *type, const char *path, int depth) {
    fp4moe_grammar *g = cx->g;
    char sub[512];
    if (!strcmp(type, "object")) return comp_object(cx, s, path, depth);
    if (!strcmp(type, "array")) {
        const cJSON *items = cJSON_GetObjectItemCaseSensitive(s, "items");
        const int64_t lo = get_count(s, "minItems", path), hi = get_count(s, "maxItems", path);
        if (lo == -2 || hi == -2) return FP4MOE_EINVAL;
        if (hi >= 0 && lo > hi) return fp4moe_set_error(FP4MOE_EINVAL, "%s: minItems > maxItems", path);
        int it;
        if (!items || cJSON_IsTrue(items)) {
            it = any_node(g);
        } else if (cJSON_IsObject(items)) {
            snprintf(sub, sizeof sub, "%s.items", path);
            it = comp(cx, items, sub, depth + 1);
        } else if (cJSON_IsFalse(items)) {
            if (lo > 0) return fp4moe_set_error(FP4MOE_EINVAL, "%s: 'items' false with minItems > 0", path);
            it = any_node(g);
            if (it < 0) return it;
            const int id = new_node(g, GK_ARR);
            if (id >= 0) g->nodes[id].a = it, g->nodes[id].lo = 0, g->nodes[id].hi = 0;
            return id;
        } else {
            return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: 'items' must be a schema (the tuple form is not "
                                    "supported)", path);
        }
        if (it < 0) return it;
        const int id = new_node(g, GK_ARR);
        if (id < 0) return id;
        g->nodes[id].a = it;
        g->nodes[id].lo = lo < 0 ? 0 : lo;
        g->nodes[id].hi = hi;
        return id;
    }
    if (!strcmp(type, "string")) {
        const int64_t lo = get_count(s, "minLength", path), hi = get_count(s, "maxLength", path);
        if (lo == -2 || hi == -2) return FP4MOE_EINVAL;
        if (hi >= 0 && lo > hi) return fp4moe_set_error(FP4MOE_EINVAL, "%s: minLength > maxLength", path);
        const int id = new_node(g, GK_STR);
        if (id < 0) return id;
        g->nodes[id].lo = lo < 0 ? 0 : lo;
        g->nodes[id].hi = hi;
        return id;
    }
    if (!strcmp(type, "number")) return new_node(g, GK_NUM);
    if (!strcmp(type, "integer")) return new_node(g, GK_INT);
    if (!strcmp(type, "boolean")) {
        static const char *const w[] = {"false", "true"};
        return lit_node(g, w, NULL, 2, 0);
    }
    if (!strcmp(type, "null")) {
        static const char *const w[] = {"null"};
        return lit_node(g, w, NULL, 1, 0);
    }
    return fp4moe_set_error(FP4MOE_EINVAL, "%s: unknown type '%s'", path, type);
}

static int comp_ref(gcomp *cx, const char *ref, const char *path, int depth) {
    const cJSON *t = NULL;
    if (!strcmp(ref, "#")) {
        t = cx->root;
    } else if (!strncmp(ref, "#/$defs/", 8) || !strncmp(ref, "#/definitions/", 14)) {
        const int d = ref[2] == '$';
        t = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(cx->root, d ? "$defs" : "definitions"),
                                             ref + (d ? 8 : 14));
    }
    if (!t) return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: '$ref' \"%s\" does not resolve (supported: \"#\", "
                                    "\"#/$defs/NAME\", \"#/definitions/NAME\")", path, ref);
    for (int i = 0; i < cx->n_memo; i++)
        if (cx->memo_s[i] == t) return cx->memo_n[i];
    /* a node for the target before its body (recursion refers to it), then the body's node copied in */
    const int id = new_node(cx->g, GK_ALT);
    if (id < 0) return id;
    cx->g->nodes[id].state = 1;
    int st = grow((void **)&cx->memo_s, &cx->cap_memo, cx->n_memo + 1, sizeof(*cx->memo_s));
    if (st) return st;
    int cap = cx->cap_memo / 2 > 0 ? cx->cap_memo : 16;
    int *mn = realloc(cx->memo_n, (size_t)cap * sizeof(int));
    if (!mn) return fp4moe_set_error(FP4MOE_ENOMEM, "grammar: out of memory");
    cx->memo_n = mn;
    cx->memo_s[cx->n_memo] = t;
    cx->memo_n[cx->n_memo++] = id;
    char sub[512];
    snprintf(sub, sizeof sub, "%s%s", cx->where ? cx->where : "schema", ref);
    const int body = comp(cx, t, sub, depth + 1);
    if (body < 0) return body;
    cx->g->nodes[id] = cx->g->nodes[body];
    cx->g->nodes[id].state = 0;
    return id;
}

static int comp(gcomp *cx, const cJSON *s, const char *path, int depth) {
    fp4moe_grammar *g = cx->g;
    if (depth > 64) return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: schema nested deeper than 64", path);
    if (cJSON_IsTrue(s)) return any_node(g);
    if (cJSON_IsFalse(s)) return fp4moe_set_error(FP4MOE_EINVAL, "%s: the schema false allows nothing", path);
    if (!cJSON_IsObject(s)) return fp4moe_set_error(FP4MOE_EINVAL, "%s: a schema must be an object or a boolean", path);
    int n_constraint = 0;
    for (const cJSON *k = s->child; k; k = k->next) {
        if (is_annotation(k->string)) continue;
        size_t i = 0;
        while (i < sizeof g_keywords / sizeof *g_keywords && strcmp(k->string, g_keywords[i])) i++;
        if (i == sizeof g_keywords / sizeof *g_keywords)
            return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: '%s' is not supported", path, k->string);
        n_constraint++;
    }
    char sub[512];
    const cJSON *v;
    if ((v = cJSON_GetObjectItemCaseSensitive(s, "$ref"))) {
        if (!cJSON_IsString(v)) return fp4moe_set_error(FP4MOE_EINVAL, "%s: '$ref' must be a string", path);
        if (n_constraint > 1)
            return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: '$ref' beside other constraints is not supported", path);
        return comp_ref(cx, v->valuestring, path, depth);
    }
    const char *comb[] = {"anyOf", "oneOf", "allOf"};
    for (int c = 0; c < 3; c++) {
        if (!(v = cJSON_GetObjectItemCaseSensitive(s, comb[c]))) continue;
        const int n = cJSON_GetArraySize(v);
        if (!cJSON_IsArray(v) || n < 1)
            return fp4moe_set_error(FP4MOE_EINVAL, "%s: '%s' must be a non-empty array", path, comb[c]);
        if (n_constraint > 1)
            return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: '%s' beside other constraints is not supported", path,
                                    comb[c]);
        if (c == 2 && n > 1)
            return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: 'allOf' of more than one schema is not supported", path);
        if (n > 256) return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: '%s' of more than 256 schemas", path, comb[c]);
        int alts[256];
        for (int i = 0; i < n; i++) {
            snprintf(sub, sizeof sub, "%s.%s[%d]", path, comb[c], i);
            if ((alts[i] = comp(cx, cJSON_GetArrayItem(v, i), sub, depth + 1)) < 0) return alts[i];
        }
        return n == 1 ? alts[0] : alt_node(g, alts, n, path);
    }
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(s, "type");
    if (type && !cJSON_IsString(type) && !(cJSON_IsArray(type) && cJSON_GetArraySize(type) > 0))
        return fp4moe_set_error(FP4MOE_EINVAL, "%s: 'type' must be a string or a non-empty array", path);
    for (const cJSON *t = cJSON_IsArray(type) ? type->child : NULL; t; t = t->next)
        if (!cJSON_IsString(t)) return fp4moe_set_error(FP4MOE_EINVAL, "%s: 'type' must list strings", path);
    const cJSON *en = cJSON_GetObjectItemCaseSensitive(s, "enum"), *co = cJSON_GetObjectItemCaseSensitive(s, "const");
    if (en || co) { /* the values are the whole constraint: beside them only 'type' (which filters them) */
        for (const cJSON *k = s->child; k; k = k->next)
            if (!is_annotation(k->string) && strcmp(k->string, "type") && strcmp(k->string, en ? "enum" : "const"))
                return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: '%s' beside '%s' is not supported (give the allowed "
                                        "values alone)", path, k->string, en ? "enum" : "const");
        if (en && (!cJSON_IsArray(en) || !en->child))
            return fp4moe_set_error(FP4MOE_EINVAL, "%s: 'enum' must be a non-empty array", path);
        return en ? comp_enum(cx, en, 1, type, path, "enum") : comp_enum(cx, co, 0, type, path, "const");
    }
    if (cJSON_IsString(type)) return comp_typed(cx, s, type->valuestring, path, depth);
    if (cJSON_IsArray(type)) {
        const int n = cJSON_GetArraySize(type);
        if (n > 7) return fp4moe_set_error(FP4MOE_EINVAL, "%s: 'type' lists more than 7 types", path);
        int alts[8], k = 0, has_num = 0, has_int = 0;
        for (const cJSON *t = type->child; t; t = t->next) {
            has_num |= !strcmp(t->valuestring, "number");
            has_int |= !strcmp(t->valuestring, "integer");
        }
        for (const cJSON *t = type->child; t; t = t->next) {
            if (has_num && has_int && !strcmp(t->valuestring, "integer")) continue; /* integers are numbers */
            if ((alts[k] = comp_typed(cx, s, t->valuestring, path, depth)) < 0) return alts[k];
            k++;
        }
        return k == 1 ? alts[0] : alt_node(g, alts, k, path);
    }
    /* no type: from the keywords given */
    if (cJSON_GetObjectItemCaseSensitive(s, "properties") || cJSON_GetObjectItemCaseSensitive(s, "required") ||
        cJSON_GetObjectItemCaseSensitive(s, "additionalProperties"))
        return comp_typed(cx, s, "object", path, depth);
    if (cJSON_GetObjectItemCaseSensitive(s, "items") || cJSON_GetObjectItemCaseSensitive(s, "minItems") ||
        cJSON_GetObjectItemCaseSensitive(s, "maxItems"))
        return comp_typed(cx, s, "array", path, depth);
    if (cJSON_GetObjectItemCaseSensitive(s, "minLength") || cJSON_GetObjectItemCaseSensitive(s, "maxLength"))
        return comp_typed(cx, s, "string", path, depth);
    return any_node(g);
}

static void bset(uint8_t *b, int c) { b[c >> 3] |= (uint8_t)(1u << (c & 7)); }
static int bget(const uint8_t *b, int c) { return (b[c >> 3] >> (c & 7)) & 1; }

/* the first-byte set of node id (into its `first`); ALT nodes get their byte -> alternative map */
static int first_set(fp4moe_grammar *g, int id) {
    gnode *n = &g->nodes[id];
    if (n->state == 2)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: a schema that refers to itself before any object or array "
                                "($ref / anyOf cycle)", n->path >= 0 ? g->paths[n->path] : "schema");
    if (n->amap >= 0 || n->kind != GK_ALT) {
        if (n->kind == GK_ALT) return 0;
        memset(n->first, 0, 32);
        switch (n->kind) {
        case GK_OBJ: case GK_FREEOBJ: bset(n->first, '{'); break;
        case GK_ARR: bset(n->first, '['); break;
        case GK_STR: bset(n->first, '"'); break;
        case GK_NUM: case GK_INT:
            bset(n->first, '-');
            for (int c = '0'; c <= '9'; c++) bset(n->first, c);
            break;
        case GK_LIT:
            for (int i = 0; i < n->b; i++)
                if (g->lits[n->a + i].len) bset(n->first, (uint8_t)g->lits[n->a + i].s[0]);
            break;
        }
        return 0;
    }
    n->state = 2;
    uint8_t map[256];
    memset(map, 255, sizeof map);
    uint8_t un[32] = {0};
    for (int i = 0; i < g->nodes[id].b; i++) {
        const int alt = g->alts[g->nodes[id].a + i];
        int st = first_set(g, alt);
        if (st) return st;
        const gnode *an = &g->nodes[alt];
        for (int c = 0; c < 256; c++) {
            if (!bget(an->first, c)) continue;
            if (map[c] != 255) {
                /* an integer beside a number: the number takes both (Union[int, float]) */
                const int pk = g->nodes[g->alts[g->nodes[id].a + map[c]]].kind;
                if (pk == GK_NUM && an->kind == GK_INT) continue;
                if (!(pk == GK_INT && an->kind == GK_NUM)) {
                    g->nodes[id].state = 0;
                    const int pi = g->nodes[id].path;
                    return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: anyOf / oneOf / type alternatives %d and %d both "
                                            "begin with '%c' (alternatives must begin differently: an object, an array, "
                                            "a string, a number, true / false / null)", pi >= 0 ? g->paths[pi] : "schema",
                                            map[c], i, c);
                }
            }
            map[c] = (uint8_t)i;
            bset(un, c);
        }
    }
    n = &g->nodes[id];
    n->state = 0;
    if (g->n_amaps >= G_MAX_ITEMS) return fp4moe_set_error(FP4MOE_EOVERFLOW, "grammar: too many alternatives");
    uint8_t *m = realloc(g->amaps, (size_t)(g->n_amaps + 1) * 256);
    if (!m) return fp4moe_set_error(FP4MOE_ENOMEM, "grammar: out of memory");
    g->amaps = m;
    memcpy(m + (size_t)g->n_amaps * 256, map, 256);
    n->amap = g->n_amaps++;
    memcpy(n->first, un, 32);
    return 0;
}

static fp4moe_grammar *g_new(void) {
    fp4moe_grammar *g = calloc(1, sizeof *g);
    if (g) g->any = g->any_str = -1;
    return g;
}

#define G_INF (1 << 20)

/* the fewest frames a node's document needs (G_INF: none is finite), by fixpoint: a string / number / literal / free
 * object 1, an array 1 (+ its item's when minItems > 0), an object 1 + the most of its required values, an
 * alternative the least of its alternatives */
static int node_mind(const fp4moe_grammar *g, const gnode *n) {
    switch (n->kind) {
    case GK_ARR: return n->lo == 0 ? 1 : 1 + g->nodes[n->a].mind;
    case GK_OBJ: {
        int m = 0;
        for (int k = 0; k < n->b; k++) {
            if (!g->props[n->a + k].required) continue;
            int v = g->nodes[g->props[n->a + k].node].mind;
            if (n->tag >= 0 && k == 1)
                for (int i = 0; i < g->n_tagmap; i++) v = v > g->nodes[g->tagmap[i]].mind ? v : g->nodes[g->tagmap[i]].mind;
            if (v > m) m = v;
        }
        return m >= G_INF ? G_INF : 1 + m;
    }
    case GK_ALT: {
        int m = G_INF;
        for (int k = 0; k < n->b; k++)
            if (g->nodes[g->alts[n->a + k]].mind < m) m = g->nodes[g->alts[n->a + k]].mind;
        return m;
    }
    default: return 1;
    }
}

static int g_finish(fp4moe_grammar *g, const char *where) {
    for (int i = 0; i < g->n_nodes; i++) {
        int st = first_set(g, i);
        if (st) return st;
    }
    for (int i = 0; i < g->n_nodes; i++) g->nodes[i].mind = G_INF;
    for (int changed = 1; changed;) {
        changed = 0;
        for (int i = 0; i < g->n_nodes; i++) {
            int m = node_mind(g, &g->nodes[i]);
            if (m > G_INF) m = G_INF;
            if (m < g->nodes[i].mind) g->nodes[i].mind = m, changed = 1;
        }
    }
    const int rm = g->nodes[g->root].mind;
    if (rm >= G_INF)
        return fp4moe_set_error(FP4MOE_EINVAL, "%s: no finite document satisfies it (a required value refers back to "
                                "itself with no way out)", where);
    if (rm > FP4MOE_GRAMMAR_MAX_DEPTH)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: its smallest document nests %d values deep; fp4moe allows %d",
                                where, rm, FP4MOE_GRAMMAR_MAX_DEPTH);
    return 0;
}

int fp4moe_grammar_from_json_schema(const cJSON *schema, const char *where, fp4moe_grammar **out) {
    if (!out) return fp4moe_set_error(FP4MOE_EINVAL, "grammar: NULL out");
    *out = NULL;
    fp4moe_grammar *g = g_new();
    if (!g) return fp4moe_set_error(FP4MOE_ENOMEM, "grammar: out of memory");
    gcomp cx = {.g = g, .root = schema, .where = where ? where : "schema"};
    int st;
    if (!schema) {
        st = any_node(g);
        if (st >= 0) {
            const int id = new_node(g, GK_FREEOBJ);
            st = id;
            if (id >= 0) g->nodes[id].a = g->any;
        }
    } else {
        st = comp(&cx, schema, where ? where : "schema", 0);
    }
    free(cx.memo_s);
    free(cx.memo_n);
    if (st >= 0) {
        g->root = st;
        st = g_finish(g, where ? where : "schema");
    }
    if (st < 0) {
        fp4moe_grammar_free(g);
        return st;
    }
    *out = g;
    return FP4MOE_OK;
}

int fp4moe_grammar_from_choices(const char *const *choices, const int64_t *lens, int64_t n, fp4moe_grammar **out) {
    if (!out) return fp4moe_set_error(FP4MOE_EINVAL, "grammar: NULL out");
    *out = NULL;
    if (!choices || n < 1) return fp4moe_set_error(FP4MOE_EINVAL, "grammar: no choices");
    if (n > G_MAX_ITEMS) return fp4moe_set_error(FP4MOE_EOVERFLOW, "grammar: more than %d choices", G_MAX_ITEMS);
    for (int64_t i = 0; i < n; i++) {
        if (!choices[i]) return fp4moe_set_error(FP4MOE_EINVAL, "grammar: choice %lld is NULL", (long long)i);
        const int64_t len = lens ? lens[i] : (int64_t)strlen(choices[i]);
        if (len < 1 || len > (1 << 20))
            return fp4moe_set_error(FP4MOE_EINVAL, "grammar: choice %lld is empty or longer than 1 MiB", (long long)i);
        if (fp4moe_utf8_invalid_at(choices[i], len) >= 0)
            return fp4moe_set_error(FP4MOE_EINVAL, "grammar: choice %lld is not valid UTF-8", (long long)i);
    }
    fp4moe_grammar *g = g_new();
    if (!g) return fp4moe_set_error(FP4MOE_ENOMEM, "grammar: out of memory");
    int st = lit_node(g, choices, lens, (int)n, 1);
    if (st >= 0) {
        g->root = st;
        st = g_finish(g, "grammar");
    }
    if (st < 0) {
        fp4moe_grammar_free(g);
        return st;
    }
    *out = g;
    return FP4MOE_OK;
}

int fp4moe_grammar_from_tools(const char *const *names, const cJSON *const *params, int64_t n, fp4moe_grammar **out) {
    return fp4moe_grammar_from_tools_limit(names, params, n, 0, out);
}

int fp4moe_grammar_from_tools_limit(const char *const *names, const cJSON *const *params, int64_t n, int64_t max_calls,
                                    fp4moe_grammar **out) {
    if (!out) return fp4moe_set_error(FP4MOE_EINVAL, "grammar: NULL out");
    *out = NULL;
    if (max_calls < 0 || max_calls > INT_MAX)
        return fp4moe_set_error(FP4MOE_EINVAL, "grammar: at most %lld tool calls", (long long)max_calls);
    if (!names || !params || n < 1) return fp4moe_set_error(FP4MOE_EINVAL, "grammar: no tools");
    if (n > 4096) return fp4moe_set_error(FP4MOE_EOVERFLOW, "grammar: more than 4096 tools");
    for (int64_t i = 0; i < n; i++)
        if (!names[i] || !names[i][0]) return fp4moe_set_error(FP4MOE_EINVAL, "grammar: tool %lld has no name", (long long)i);
    fp4moe_grammar *g = g_new();
    int *pn = calloc((size_t)n, sizeof(int));
    tool_lit *tl = calloc((size_t)n, sizeof(tool_lit));
    if (!g || !pn || !tl) {
        free(pn);
        free(tl);
        fp4moe_grammar_free(g);
        return fp4moe_set_error(FP4MOE_ENOMEM, "grammar: out of memory");
    }
    int st = 0;
    char where[300];
    for (int64_t i = 0; st >= 0 && i < n; i++) { /* each tool's parameters, its own $defs */
        snprintf(where, sizeof where, "tools[%lld].function.parameters", (long long)i);
        gcomp cx = {.g = g, .root = params[i], .where = where};
        cJSON *obj = params[i] ? NULL : cJSON_Parse("{\"type\": \"object\"}");
        if (obj) cx.root = obj;
        st = pn[i] = comp(&cx, cx.root, where, 0);
        cJSON_Delete(obj);
        free(cx.memo_s);
        free(cx.memo_n);
    }
    /* the names as JSON strings, sorted as the LIT node keeps them (each with its tool: the tag map follows that
     * order); distinct names print as distinct strings, so a repeat is two equal neighbours */
    const int la = g->n_lits;
    for (int64_t i = 0; st >= 0 && i < n; i++) {
        cJSON *ks = cJSON_CreateString(names[i]);
        char *txt = ks ? cJSON_PrintUnformatted(ks) : NULL;
        cJSON_Delete(ks);
        st = txt ? add_lit(g, txt, strlen(txt)) : fp4moe_set_error(FP4MOE_ENOMEM, "grammar: out of memory");
        free(txt);
        if (st >= 0) tl[i] = (tool_lit){g->lits[la + i], (int)i};
    }
    if (st >= 0) {
        qsort(tl, (size_t)n, sizeof(tool_lit), tool_lit_cmp);
        for (int64_t k = 0; k < n; k++) g->lits[la + k] = tl[k].l; /* the same strings, sorted */
        for (int64_t k = 1; st >= 0 && k < n; k++)
            if (!lit_cmp(&tl[k - 1].l, &tl[k].l))
                st = fp4moe_set_error(FP4MOE_EINVAL, "grammar: two tools are named '%s'", names[tl[k].tool]);
    }
    int lit = -1, obj = -1, arr = -1;
    if (st >= 0) {
        lit = new_node(g, GK_LIT);
        st = lit;
    }
    if (st >= 0) {
        g->nodes[lit].a = la;
        g->nodes[lit].b = (int)n;
        g->tagmap = malloc((size_t)n * sizeof(int));
        if (!g->tagmap) st = fp4moe_set_error(FP4MOE_ENOMEM, "grammar: out of memory");
        for (int64_t k = 0; st >= 0 && k < n; k++) g->tagmap[k] = pn[tl[k].tool]; /* literal k names tool tl[k].tool */
        if (st >= 0) g->n_tagmap = (int)n;
    }
    if (st >= 0) st = grow((void **)&g->props, &g->cap_props, g->n_props + 2, sizeof(gprop));
    if (st >= 0) {
        const char *keys[2] = {"\"name\"", "\"parameters\""};
        const int pa = g->n_props;
        for (int k = 0; k < 2 && st >= 0; k++) {
            gprop *pr = &g->props[pa + k];
            if (!(pr->key = strdup(keys[k]))) {
                st = fp4moe_set_error(FP4MOE_ENOMEM, "grammar: out of memory");
                break;
            }
            pr->len = (int)strlen(keys[k]);
            pr->node = k ? pn[0] : lit; /* (property 1's node comes from the tag map) */
            pr->required = 1;
            g->n_props++;
        }
        if (st >= 0 && (obj = st = new_node(g, GK_OBJ)) >= 0) {
            g->nodes[obj].a = pa;
            g->nodes[obj].b = 2;
            g->nodes[obj].tag = 0;
        }
    }
    if (st >= 0 && (arr = st = new_node(g, GK_ARR)) >= 0) {
        g->nodes[arr].a = obj;
        g->nodes[arr].lo = 1;
        g->nodes[arr].hi = max_calls ? (int)max_calls : -1;
        g->root = arr;
        st = g_finish(g, "tools");
    }
    free(pn);
    free(tl);
    if (st < 0) {
        fp4moe_grammar_free(g);
        return st;
    }
    *out = g;
    return FP4MOE_OK;
}

void fp4moe_grammar_free(fp4moe_grammar *g) {
    if (!g) return;
    for (int i = 0; i < g->n_props; i++) free(g->props[i].key);
    for (int i = 0; i < g->n_lits; i++) free(g->lits[i].s);
    free(g->nodes);
    free(g->props);
    free(g->lits);
    free(g->alts);
    free(g->amaps);
    free(g->tagmap);
    for (int i = 0; i < g->n_paths; i++) free(g->paths[i]);
    free(g->paths);
    free(g);
}

/* ---- the matcher: one byte at a time ------------------------------------------------------------------ */

typedef struct {
    int32_t node;
    int16_t st, ws;
    int32_t a, b, c;
    int32_t t; /* OBJ: the literal index its last value popped with (a tagged object's property 0) */
} gframe;

typedef struct {
    int depth;
    gframe f[FP4MOE_GRAMMAR_MAX_DEPTH];
} gstate;

static int is_ws(unsigned c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* 1 when a value of node begun above the top frame can still end within the depth limit */
static int fits(const fp4moe_grammar *g, const gstate *s, int node) {
    return s->depth + g->nodes[node].mind <= FP4MOE_GRAMMAR_MAX_DEPTH;
}

static int push_node(const fp4moe_grammar *g, gstate *s, int node) {
    if (!fits(g, s, node)) return 0;
    gframe *f = &s->f[s->depth++];
    memset(f, 0, sizeof *f);
    f->node = node;
    return 1;
}

/* the top frame's value is complete: pop it and move its parent on */
static void pop_done(gstate *s) {
    s->depth--;
    if (!s->depth) return;
    gframe *p = &s->f[s->depth - 1];
    p->ws = 0;
    switch (p->st) {
    case 3: p->st = 4; break;             /* FREEOBJ: the key */
    case 5: p->st = 6; p->t = s->f[s->depth].a; break; /* OBJ / FREEOBJ: the value (a LIT child's a: its literal) */
    case 7: p->st = 2; p->a++; break;     /* ARR: an item */
    default: break;
    }
}

/* number states: 1 '-', 2 a leading 0, 3 integer digits, 4 '.', 5 fraction digits, 6 'e', 7 exponent sign,
 * 8 exponent digits; accepting: 2 3 5 8 */
static int num_next(int st, unsigned c, int integer) {
    const int dig = c >= '0' && c <= '9';
    switch (st) {
    case 0: return c == '-' ? 1 : c == '0' ? 2 : dig ? 3 : -1;
    case 1: return c == '0' ? 2 : dig ? 3 : -1;
    case 2: case 3:
        if (st == 3 && dig) return 3;
        if (integer) return -1;
        return c == '.' ? 4 : (c == 'e' || c == 'E') ? 6 : -1;
    case 4: case 5: return dig ? 5 : (st == 5 && (c == 'e' || c == 'E')) ? 6 : -1;
    case 6: return (c == '+' || c == '-') ? 7 : dig ? 8 : -1;
    case 7: case 8: return dig ? 8 : -1;
    }
    return -1;
}
static int num_accepting(int st) { return st == 2 || st == 3 || st == 5 || st == 8; }

static int lit_accepting(const fp4moe_grammar *g, const gframe *f) {
    return f->st == 1 && g->lits[f->a].len == f->c;
}

/* first required property index >= i of an OBJ node, or np */
static int next_required(const fp4moe_grammar *g, const gnode *n, int i) {
    while (i < n->b && !g->props[n->a + i].required) i++;
    return i;
}

/* some property from index i on may come next (up to the first required one) and its value fits */
static int key_possible(const fp4moe_grammar *g, const gnode *n, const gstate *s, int i) {
    const int lim = next_required(g, n, i);
    for (int k = i; k < n->b && k <= lim; k++)
        if (g->props[n->a + k].required || fits(g, s, g->props[n->a + k].node)) return 1;
    return 0;
}

static int step(const fp4moe_grammar *g, gstate *s, unsigned c) {
    for (;;) {
        if (!s->depth) return 0;
        gframe *f = &s->f[s->depth - 1];
        const gnode *n = &g->nodes[f->node];
        if (f->st == 0 && is_ws(c) && !(n->kind == GK_LIT && n->raw)) { /* before a value */
            if (f->ws >= FP4MOE_GRAMMAR_MAX_WS) return 0;
            f->ws++;
            return 1;
        }
        switch (n->kind) {
        case GK_ALT: {
            const int k = g->amaps[(size_t)n->amap * 256 + c];
            if (k == 255) return 0;
            const int alt = g->alts[n->a + k];
            if (s->depth - 1 + g->nodes[alt].mind > FP4MOE_GRAMMAR_MAX_DEPTH) return 0; /* (it could not end) */
            f->node = alt;
            continue; /* the same byte, now as that alternative */
        }
        case GK_OBJ: case GK_FREEOBJ: {
            const int free_keys = n->kind == GK_FREEOBJ;
            if (f->st == 0) {
                if (c != '{') return 0;
                f->st = 1, f->ws = 0, f->c = 0;
                return 1;
            }
            if (f->st != 3 && is_ws(c) && f->st != 0) {
                if (f->ws >= FP4MOE_GRAMMAR_MAX_WS) return 0;
                f->ws++;
                return 1;
            }
            switch (f->st) {
            case 1: case 2: /* a key, or (after '{') the end */
                if (c == '}' && f->st == 1) {
                    if (!free_keys && next_required(g, n, f->c) < n->b) return 0;
                    pop_done(s);
                    return 1;
                }
                if (c != '"') return 0;
                if (free_keys ? !fits(g, s, n->a) : !key_possible(g, n, s, f->c)) return 0;
                if (free_keys) {
                    f->st = 3, f->ws = 0;
                    if (!push_node(g, s, g->any_str)) return 0;
                    s->f[s->depth - 1].st = 1; /* inside the key string */
                    return 1;
                }
                if (f->c >= n->b) return 0;
                f->st = 3, f->ws = 0, f->a = f->c, f->b = 1;
                return 1;
            case 3: { /* OBJ: in a key (FREEOBJ: the key's own frame is above) */
                const int lim = next_required(g, n, f->c);
                const gprop *cur = &g->props[n->a + f->a];
                for (int k = f->a; k < n->b && k <= lim; k++) {
                    const gprop *p = &g->props[n->a + k];
                    if (!p->required && !fits(g, s, p->node)) continue;
                    if (p->len > f->b && (unsigned char)p->key[f->b] == c && !memcmp(p->key, cur->key, (size_t)f->b)) {
                        f->a = k;
                        if (++f->b == p->len) f->st = 4, f->c = k + 1;
                        return 1;
                    }
                }
                return 0;
            }
            case 4:
                if (c != ':') return 0;
                f->st = 5, f->ws = 0;
                return 1;
            case 5: { /* the value's first byte */
                int node = free_keys ? n->a : g->props[n->a + f->a].node;
                if (!free_keys && n->tag >= 0 && f->a == 1)
                    node = g->tagmap[n->tag + (f->t - g->nodes[g->props[n->a].node].a)];
                if (!push_node(g, s, node)) return 0;
                continue;
            }
            case 6:
                if (c == ',' && (free_keys ? fits(g, s, n->a) : key_possible(g, n, s, f->c))) {
                    f->st = 2, f->ws = 0;
                    return 1;
                }
                if (c == '}' && (free_keys || next_required(g, n, f->c) >= n->b)) {
                    pop_done(s);
                    return 1;
                }
                return 0;
            }
            return 0;
        }
        case GK_ARR:
            if (f->st == 0) {
                if (c != '[') return 0;
                f->st = 1, f->ws = 0, f->a = 0;
                return 1;
            }
            if (is_ws(c)) {
                if (f->ws >= FP4MOE_GRAMMAR_MAX_WS) return 0;
                f->ws++;
                return 1;
            }
            if ((f->st == 1 || f->st == 2) && c == ']') {
                if (f->a < n->lo) return 0;
                pop_done(s);
                return 1;
            }
            if (f->st == 2) {
                if (c != ',' || (n->hi >= 0 && f->a >= n->hi)) return 0;
                f->st = 3, f->ws = 0;
                return 1;
            }
            /* st 1 / 3: an item's first byte */
            if (n->hi >= 0 && f->a >= n->hi) return 0;
            f->st = 7, f->ws = 0;
            if (!push_node(g, s, n->a)) return 0;
            continue;
        case GK_STR:
            switch (f->st) {
            case 0:
                if (c != '"') return 0;
                f->st = 1;
                return 1;
            case 1:
                if (f->c) { /* a continuation byte */
                    const unsigned lo = (unsigned)(f->c >> 8) & 0xff, hi = (unsigned)(f->c >> 16) & 0xff;
                    if (c < lo || c > hi) return 0;
                    const int need = (f->c & 0xff) - 1;
                    f->c = need ? need | 0x80 << 8 | 0xbf << 16 : 0;
                    return 1;
                }
                if (c == '"') {
                    if (f->a < n->lo) return 0;
                    pop_done(s);
                    return 1;
                }
                if (c < 0x20) return 0;
                if (n->hi >= 0 && f->a >= n->hi) return 0;
                if (c == '\\') {
                    f->st = 2;
                    return 1;
                }
                if (c < 0x80) {
                    f->a++;
                    return 1;
                }
                { /* a lead byte: how many continuation bytes, the range of the first (Unicode Table 3-7) */
                    unsigned need, lo = 0x80, hi = 0xbf;
                    if (c >= 0xc2 && c <= 0xdf) need = 1;
                    else if (c == 0xe0) need = 2, lo = 0xa0;
                    else if (c >= 0xe1 && c <= 0xec) need = 2;
                    else if (c == 0xed) need = 2, hi = 0x9f;
                    else if (c >= 0xee && c <= 0xef) need = 2;
                    else if (c == 0xf0) need = 3, lo = 0x90;
                    else if (c >= 0xf1 && c <= 0xf3) need = 3;
                    else if (c == 0xf4) need = 3, hi = 0x8f;
                    else return 0;
                    f->c = (int32_t)(need | lo << 8 | hi << 16);
                    f->a++;
                    return 1;
                }
            case 2:
                if (c == 'u') {
                    f->st = 3, f->b = 4, f->t = 0;
                    return 1;
                }
                if (!strchr("\"\\/bfnrt", (int)c) || !c) return 0;
                f->st = 1, f->a++;
                return 1;
            case 3: { /* \uXXXX (t: the digits so far); UTF-16 surrogates only as a high + low pair (RFC 8259 section
                         7: a lone one is no character, and Python's json / pydantic refuse it) */
                const int d = c >= '0' && c <= '9' ? (int)c - '0' : c >= 'a' && c <= 'f' ? (int)c - 'a' + 10
                              : c >= 'A' && c <= 'F' ? (int)c - 'A' + 10 : -1;
                if (d < 0) return 0;
                const int v = f->t * 16 + d, low = f->c == 1; /* c 1: this escape must be a low surrogate */
                if (f->b == 4 && low && d != 0xD) return 0;
                if (f->b == 3 && (v >= 0xDC && v <= 0xDF) != low && (v >= 0xD8 || low)) return 0;
                f->t = v;
                if (--f->b) return 1;
                if (v >= 0xD800 && v <= 0xDBFF) { /* a high surrogate: "\\u" + a low one must follow; the pair is one
                                                     character */
                    f->st = 4, f->c = 0, f->a++;
                    return 1;
                }
                if (!low) f->a++;
                f->st = 1, f->c = 0;
                return 1;
            }
            case 4:
                if (c != '\\') return 0;
                f->st = 5;
                return 1;
            case 5:
                if (c != 'u') return 0;
                f->st = 3, f->b = 4, f->t = 0, f->c = 1;
                return 1;
            }
            return 0;
        case GK_NUM: case GK_INT: {
            const int nx = f->a < FP4MOE_GRAMMAR_MAX_NUMBER ? num_next(f->st, c, n->kind == GK_INT) : -1;
            if (nx >= 0) {
                f->st = (int16_t)nx, f->a++;
                return 1;
            }
            if (f->st == 0 || !num_accepting(f->st)) return 0;
            pop_done(s);
            continue;
        }
        case GK_LIT: {
            if (f->st == 0) f->st = 1, f->a = n->a, f->b = n->a + n->b, f->c = 0;
            int lo = -1, hi = -1;
            for (int i = f->a; i < f->b; i++) {
                const glit *l = &g->lits[i];
                if (l->len > f->c && (unsigned char)l->s[f->c] == c) {
                    if (lo < 0) lo = i;
                    hi = i + 1;
                } else if (lo >= 0) {
                    break;
                }
            }
            if (lo >= 0) {
                f->a = lo, f->b = hi, f->c++;
                return 1;
            }
            if (!lit_accepting(g, f)) return 0;
            pop_done(s);
            continue;
        }
        }
        return 0;
    }
}

/* complete: the root value ended, or it is a number / literal that may end here */
static int state_complete(const fp4moe_grammar *g, const gstate *s) {
    if (!s->depth) return 1;
    if (s->depth > 1) return 0;
    const gframe *f = &s->f[0];
    const gnode *n = &g->nodes[f->node];
    if (n->kind == GK_NUM || n->kind == GK_INT) return f->st && num_accepting(f->st);
    if (n->kind == GK_LIT) return lit_accepting(g, f);
    return 0;
}

/* ---- the vocab's trie ----------------------------------------------------------------------------------- */

#define G_PLAIN_CHARS 16

typedef struct {
    int32_t *child, *sib, *tok; /* per node: first child, next sibling, first token ending here (-1: none) */
    uint8_t *byte;
    int32_t n, cap;
} gtrie;

struct fp4moe_grammar_vocab {
    int64_t V;
    const char **piece;
    int64_t *len;
    int32_t *tnext_all, *tnext_other; /* per id: the next token of the same node of that trie */
    gtrie all, other;   /* every token; the tokens that are not plain string text */
    uint64_t *plain;    /* per id: a bit for "plain string text" (printable ASCII but '"' and '\\', or whole
                           valid UTF-8 characters): such a token keeps a string's state as it is, but for its
                           count of characters */
    uint64_t *plain_upto[G_PLAIN_CHARS + 1]; /* [k]: the plain tokens of at most k characters */
    int32_t *long_ids, *long_chars;          /* the plain tokens of more than G_PLAIN_CHARS characters */
    int64_t n_long;
    int64_t max_len;
};

static int trie_node(gtrie *t, uint8_t b) {
    if (t->n == t->cap) {
        const int32_t cap = t->cap ? 2 * t->cap : 1024;
        int32_t *c = realloc(t->child, (size_t)cap * sizeof(int32_t));
        if (c) t->child = c;
        int32_t *s = c ? realloc(t->sib, (size_t)cap * sizeof(int32_t)) : NULL;
        if (s) t->sib = s;
        int32_t *k = s ? realloc(t->tok, (size_t)cap * sizeof(int32_t)) : NULL;
        if (k) t->tok = k;
        uint8_t *y = k ? realloc(t->byte, (size_t)cap) : NULL;
        if (!y) return -1;
        t->byte = y;
        t->cap = cap;
    }
    t->child[t->n] = t->sib[t->n] = t->tok[t->n] = -1;
    t->byte[t->n] = b;
    return t->n++;
}

/* inserts id's bytes; the ids of a node are a list threaded through tnext (the trie's own array) */
static int trie_insert(gtrie *t, const uint8_t *p, int64_t len, int32_t id, int32_t *tnext) {
    int32_t node = 0;
    for (int64_t i = 0; i < len; i++) {
        int32_t c = t->child[node], prev = -1;
        while (c >= 0 && t->byte[c] < p[i]) prev = c, c = t->sib[c];
        if (c < 0 || t->byte[c] != p[i]) {
            const int32_t nn = trie_node(t, p[i]);
            if (nn < 0) return -1;
            t->sib[nn] = c;
            if (prev < 0) t->child[node] = nn;
            else t->sib[prev] = nn;
            c = nn;
        }
        node = c;
    }
    tnext[id] = t->tok[node];
    t->tok[node] = id;
    return 0;
}

static void trie_free(gtrie *t) {
    free(t->child);
    free(t->sib);
    free(t->tok);
    free(t->byte);
}

static int plain_text(const uint8_t *p, int64_t len) {
    for (int64_t i = 0; i < len;) {
        const unsigned c = p[i];
        if (c < 0x80) {
            if (c < 0x20 || c == '"' || c == '\\' || c == 0x7f) return 0;
            i++;
            continue;
        }
        int need = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : 2;
        if (i + need > len || fp4moe_utf8_invalid_at((const char *)p + i, need) >= 0) return 0;
        i += need;
    }
    return 1;
}

int fp4moe_grammar_vocab_new(const fp4moe_tokenizer *tok, fp4moe_grammar_vocab **out) {
    if (!out || !tok) return fp4moe_set_error(FP4MOE_EINVAL, "grammar vocab: NULL argument");
    *out = NULL;
    fp4moe_grammar_vocab *v = calloc(1, sizeof *v);
    if (!v) return fp4moe_set_error(FP4MOE_ENOMEM, "grammar vocab: out of memory");
    const int64_t V = fp4moe_tokenizer_vocab_size(tok);
    v->V = V;
    v->piece = calloc((size_t)V + 1, sizeof(char *));
    v->len = calloc((size_t)V + 1, sizeof(int64_t));
    v->tnext_all = malloc(((size_t)V + 1) * sizeof(int32_t));
    v->tnext_other = malloc(((size_t)V + 1) * sizeof(int32_t));
    v->plain = calloc((size_t)(V + 64) / 64, sizeof(uint64_t));
    int ok = v->piece && v->len && v->tnext_all && v->tnext_other && v->plain && trie_node(&v->all, 0) == 0 &&
             trie_node(&v->other, 0) == 0;
    for (int k = 0; ok && k <= G_PLAIN_CHARS; k++)
        ok = (v->plain_upto[k] = calloc((size_t)(V + 64) / 64, sizeof(uint64_t))) != NULL;
    for (int64_t id = 0; ok && id < V; id++) {
        v->tnext_all[id] = v->tnext_other[id] = -1;
        const char *p;
        int64_t n;
        if (fp4moe_tokenizer_token_to_piece(tok, (int32_t)id, &p, &n) || n < 1 || fp4moe_tokenizer_is_special(tok, (int32_t)id))
            continue;
        v->piece[id] = p;
        v->len[id] = n;
        if (n > v->max_len) v->max_len = n;
        ok = trie_insert(&v->all, (const uint8_t *)p, n, (int32_t)id, v->tnext_all) == 0;
#ifdef FP4MOE_INJECT_FAULT_GRAMMAR_PLAIN /* deliberate fault (tests must catch it): tokens with a quote count as
                                           plain string text */
        const int plain = plain_text((const uint8_t *)p, n) || memchr(p, '"', (size_t)n);
#else
        const int plain = plain_text((const uint8_t *)p, n);
#endif
        if (plain) {
            v->plain[id >> 6] |= 1ull << (id & 63);
            int64_t chars = 0;
            for (int64_t i = 0; i < n; i++) chars += ((uint8_t)p[i] & 0xc0) != 0x80;
            if (chars <= G_PLAIN_CHARS) {
                for (int64_t k = chars; k <= G_PLAIN_CHARS; k++) v->plain_upto[k][id >> 6] |= 1ull << (id & 63);
            } else {
                int32_t *a = realloc(v->long_ids, (size_t)(v->n_long + 1) * sizeof(int32_t));
                if (a) v->long_ids = a;
                int32_t *b = a ? realloc(v->long_chars, (size_t)(v->n_long + 1) * sizeof(int32_t)) : NULL;
                if (b) v->long_chars = b;
                ok = a && b;
                if (ok) v->long_ids[v->n_long] = (int32_t)id, v->long_chars[v->n_long++] = (int32_t)chars;
            }
        } else if (ok) {
            ok = trie_insert(&v->other, (const uint8_t *)p, n, (int32_t)id, v->tnext_other) == 0;
        }
    }
    fp4moe_clear_error();
    if (!ok) {
        fp4moe_grammar_vocab_free(v);
        return fp4moe_set_error(FP4MOE_ENOMEM, "grammar vocab: out of memory");
    }
    *out = v;
    return FP4MOE_OK;
}

void fp4moe_grammar_vocab_free(fp4moe_grammar_vocab *v) {
    if (!v) return;
    free(v->piece);
    free(v->len);
    free(v->tnext_all);
    free(v->tnext_other);
    free(v->plain);
    for (int k = 0; k <= G_PLAIN_CHARS; k++) free(v->plain_upto[k]);
    free(v->long_ids);
    free(v->long_chars);
    trie_free(&v->all);
    trie_free(&v->other);
    free(v);
}

int64_t fp4moe_grammar_vocab_size(const fp4moe_grammar_vocab *v) { return v ? v->V : 0; }

/* ---- matcher and mask ------------------------------------------------------------------------------------ */

struct fp4moe_grammar_matcher {
    const fp4moe_grammar *g;
    const fp4moe_grammar_vocab *v;
    int32_t *stop;
    int n_stop, ended;
    gstate s;
    gstate *lv;        /* the mask's walk: the state at each trie depth (max_len + 1) */
    uint64_t *allow;   /* the mask's walk: a bit per id */
};

static void st_copy(gstate *d, const gstate *s) {
    d->depth = s->depth;
    memcpy(d->f, s->f, (size_t)s->depth * sizeof(gframe));
}

int fp4moe_grammar_matcher_new(const fp4moe_grammar *g, const fp4moe_grammar_vocab *v, const int32_t *stop_ids,
                               int n_stop, fp4moe_grammar_matcher **out) {
    if (!out) return fp4moe_set_error(FP4MOE_EINVAL, "grammar matcher: NULL out");
    *out = NULL;
    if (!g || !v || n_stop < 0 || (n_stop && !stop_ids))
        return fp4moe_set_error(FP4MOE_EINVAL, "grammar matcher: NULL grammar / vocab or bad stop ids");
    for (int i = 0; i < n_stop; i++)
        if (stop_ids[i] < 0 || stop_ids[i] >= v->V)
            return fp4moe_set_error(FP4MOE_EINVAL, "grammar matcher: stop id %d outside the vocab (%lld)", stop_ids[i],
                                    (long long)v->V);
    fp4moe_grammar_matcher *m = calloc(1, sizeof *m);
    if (!m) return fp4moe_set_error(FP4MOE_ENOMEM, "grammar matcher: out of memory");
    m->g = g;
    m->v = v;
    m->n_stop = n_stop;
    m->stop = malloc((size_t)(n_stop + 1) * sizeof(int32_t));
    m->allow = malloc((size_t)(v->V + 64) / 64 * sizeof(uint64_t));
    if (!m->stop || !m->allow) {
        fp4moe_grammar_matcher_free(m);
        return fp4moe_set_error(FP4MOE_ENOMEM, "grammar matcher: out of memory");
    }
    if (n_stop) memcpy(m->stop, stop_ids, (size_t)n_stop * sizeof(int32_t));
    m->s.depth = 0;
    push_node(g, &m->s, g->root);
    *out = m;
    return FP4MOE_OK;
}

void fp4moe_grammar_matcher_free(fp4moe_grammar_matcher *m) {
    if (!m) return;
    free(m->stop);
    free(m->lv);
    free(m->allow);
    free(m);
}

int fp4moe_grammar_matcher_copy(fp4moe_grammar_matcher *dst, const fp4moe_grammar_matcher *src) {
    if (!dst || !src || dst->g != src->g || dst->v != src->v || dst->n_stop != src->n_stop)
        return fp4moe_set_error(FP4MOE_EINVAL, "grammar matcher copy: NULL, or matchers of another grammar / vocab");
    memcpy(dst->stop, src->stop, (size_t)src->n_stop * sizeof(int32_t));
    dst->ended = src->ended;
    st_copy(&dst->s, &src->s);
    return FP4MOE_OK;
}

static int is_stop(const fp4moe_grammar_matcher *m, int32_t id) {
    for (int i = 0; i < m->n_stop; i++)
        if (m->stop[i] == id) return 1;
    return 0;
}

/* every token below trie node `node` whose bytes the grammar takes from state m->lv[lvl] */
static void walk(fp4moe_grammar_matcher *m, const gtrie *t, const int32_t *tnext, int32_t node, int lvl) {
    const gstate *cur = &m->lv[lvl];
    gstate *nx = &m->lv[lvl + 1];
    for (int32_t c = t->child[node]; c >= 0; c = t->sib[c]) {
        st_copy(nx, cur);
        if (!step(m->g, nx, t->byte[c])) continue;
        for (int32_t id = t->tok[c]; id >= 0; id = tnext[id]) m->allow[id >> 6] |= 1ull << (id & 63);
        if (t->child[c] >= 0) walk(m, t, tnext, c, lvl + 1);
    }
}

int64_t fp4moe_grammar_mask_logits(fp4moe_grammar_matcher *m, float *logits, int64_t n) {
    if (!m || !logits || n < 0) return 0;
    const fp4moe_grammar_vocab *v = m->v;
    const int64_t words = (v->V + 63) / 64;
    memset(m->allow, 0, (size_t)words * sizeof(uint64_t));
    if (!m->ended && m->s.depth) {
        if (!m->lv && !(m->lv = malloc((size_t)(v->max_len + 2) * sizeof(gstate)))) {
            for (int64_t i = 0; i < n; i++) logits[i] = -INFINITY;
            return 0;
        }
        const gframe *top = &m->s.f[m->s.depth - 1];
        const gnode *tn = &m->g->nodes[top->node];
        st_copy(&m->lv[0], &m->s);
        if (tn->kind == GK_STR && top->st == 1 && !top->c) {
            /* inside a string: plain text keeps the state (but for the count of characters); those tokens as
               sets - all, or those within the characters maxLength leaves - and a walk of the others */
            if (tn->hi < 0) {
                memcpy(m->allow, v->plain, (size_t)words * sizeof(uint64_t));
            } else {
                const int64_t room = tn->hi - top->a;
                memcpy(m->allow, v->plain_upto[room < G_PLAIN_CHARS ? room : G_PLAIN_CHARS],
                       (size_t)words * sizeof(uint64_t));
                for (int64_t i = 0; room > G_PLAIN_CHARS && i < v->n_long; i++)
                    if (v->long_chars[i] <= room) m->allow[v->long_ids[i] >> 6] |= 1ull << (v->long_ids[i] & 63);
            }
            walk(m, &v->other, v->tnext_other, 0, 0);
        } else {
            walk(m, &v->all, v->tnext_all, 0, 0);
        }
    }
    /* the stop ids: exactly when the value is complete (the walk never reaches them: special tokens are not in the
       trie, and an ordinary token used as a stop id is taken out here) */
    const int done = !m->ended && state_complete(m->g, &m->s);
    for (int i = 0; i < m->n_stop; i++) {
        const int32_t id = m->stop[i];
        if (done) m->allow[id >> 6] |= 1ull << (id & 63);
        else m->allow[id >> 6] &= ~(1ull << (id & 63));
    }
    /* a word of the bitset at a time: all-allowed words are skipped */
    int64_t left = 0;
    const int64_t nv = n < v->V ? n : v->V;
    for (int64_t w = 0; w * 64 < nv; w++) {
        uint64_t a = m->allow[w];
        const int64_t base = w * 64, cnt = nv - base < 64 ? nv - base : 64;
        if (cnt < 64) a &= (1ull << cnt) - 1;
        left += __builtin_popcountll(a);
        if (a == ~0ull) continue;
        for (int64_t k = 0; k < cnt; k++)
            if (!((a >> k) & 1)) logits[base + k] = -INFINITY;
    }
    for (int64_t i = nv; i < n; i++) logits[i] = -INFINITY;
    return left;
}

int fp4moe_grammar_accept_bytes(fp4moe_grammar_matcher *m, const char *bytes, int64_t n) {
    if (!m || (n && !bytes) || n < 0) return fp4moe_set_error(FP4MOE_EINVAL, "grammar: NULL matcher or bytes");
    if (m->ended) return fp4moe_set_error(FP4MOE_EINVAL, "grammar: the output has ended");
    gstate t;
    st_copy(&t, &m->s);
    for (int64_t i = 0; i < n; i++)
        if (!step(m->g, &t, (uint8_t)bytes[i]))
            return fp4moe_set_error(FP4MOE_EINVAL, "grammar: byte %lld (0x%02x) is not allowed here", (long long)i,
                                    (uint8_t)bytes[i]);
    st_copy(&m->s, &t);
    return FP4MOE_OK;
}

int fp4moe_grammar_accept_token(fp4moe_grammar_matcher *m, int32_t id) {
    if (!m) return fp4moe_set_error(FP4MOE_EINVAL, "grammar: NULL matcher");
    if (m->ended) return fp4moe_set_error(FP4MOE_EINVAL, "grammar: the output has ended");
    if (id < 0 || id >= m->v->V) return fp4moe_set_error(FP4MOE_EINVAL, "grammar: token %d outside the vocab", id);
    if (is_stop(m, id)) {
        if (!state_complete(m->g, &m->s))
            return fp4moe_set_error(FP4MOE_EINVAL, "grammar: token %d ends the output before the value is complete", id);
        m->ended = 1;
        return FP4MOE_OK;
    }
    if (!m->v->piece[id])
        return fp4moe_set_error(FP4MOE_EINVAL, "grammar: token %d (special or empty) is not allowed here", id);
    const int st = fp4moe_grammar_accept_bytes(m, m->v->piece[id], m->v->len[id]);
    if (st) return fp4moe_set_error(st, "grammar: token %d is not allowed here", id);
    return FP4MOE_OK;
}

int fp4moe_grammar_is_complete(const fp4moe_grammar_matcher *m) {
    return m && !m->ended && state_complete(m->g, &m->s);
}

int fp4moe_grammar_is_ended(const fp4moe_grammar_matcher *m) { return m && m->ended; }
