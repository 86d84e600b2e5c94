/* Tool calls in a chat answer -> OpenAI tool_calls (pure; see srv.h).
 *
 * Two formats, as the chat templates of the Nemotron family ask the model to write them:
 *  - XML (Nemotron-3-Nano / Cascade, Qwen3-Coder; vLLM's tool-call parser "qwen3_coder"):
 *      <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n...</function>\n</tool_call>
 *    a value loses one leading and one trailing newline and is converted by the type its tool's
 *    parameters schema gives it (vLLM's rules: "null" -> null; string / enum as written; integer
 *    types through int(); number through float() (integral values as integers); boolean: "true" /
 *    "false" (anything else false); object / array through JSON; no type or not in the schema: the
 *    string); a value that does not convert stays a string.
 *  - JSON (Nemotron-Nano-9B-v2): <TOOLCALL>[{"name": NAME, "arguments": {...}}, ...]</TOOLCALL>
 * The content before the first call marker stays content (null when empty); the calls' arguments are
 * JSON text (compact, as cJSON prints it; integers with their exact digits). Text that has a marker but no parsable call
 * goes back to the content, unchanged. */
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/srv.h"

static const char *const k_xml_markers[] = {"<tool_call>", "<function="};
static const char *const k_json_markers[] = {"<TOOLCALL>"};

srv_tool_format srv_tool_format_of_template(const char *src) {
    if (!src) return SRV_TOOLS_NONE;
    if (strstr(src, "<function=") && strstr(src, "<parameter=")) return SRV_TOOLS_XML;
    if (strstr(src, "<TOOLCALL>")) return SRV_TOOLS_JSON;
    return SRV_TOOLS_NONE;
}

static int markers(srv_tool_format f, const char *const **m) {
    if (f == SRV_TOOLS_XML) {
        *m = k_xml_markers;
        return 2;
    }
    *m = k_json_markers;
    return f == SRV_TOOLS_JSON ? 1 : 0;
}

void srv_tool_split_init(srv_tool_split *t, srv_tool_format fmt) {
    memset(t, 0, sizeof *t);
    t->fmt = fmt;
}

void srv_tool_split_free(srv_tool_split *t) {
    srv_buf_free(&t->held);
    srv_buf_free(&t->calls);
}

/* the first complete marker in p[0..n), or -1; *partial: the start of the longest suffix that may begin one */
static long first_marker(srv_tool_format f, const char *p, size_t n, size_t *partial) {
    const char *const *m;
    const int nm = markers(f, &m);
    long best = -1;
    *partial = n;
    for (int k = 0; k < nm; k++) {
        const size_t ml = strlen(m[k]);
        for (size_t i = 0; i + ml <= n; i++)
            if (!memcmp(p + i, m[k], ml)) {
                if (best < 0 || (long)i < best) best = (long)i;
                break;
            }
        for (size_t s = n > ml - 1 ? n - (ml - 1) : 0; s < n; s++)
            if (!memcmp(p + s, m[k], n - s) && s < *partial) {
                *partial = s;
                break;
            }
    }
    return best;
}

int srv_tool_split_feed(srv_tool_split *t, const char *s, size_t n, srv_buf *content) {
    if (t->in_calls) return srv_buf_add(&t->calls, s, n);
    if (srv_buf_add(&t->held, s, n)) return -1;
    size_t partial;
    const long at = first_marker(t->fmt, t->held.p ? t->held.p : "", t->held.n, &partial);
    if (at >= 0) {
        t->in_calls = 1;
        if (srv_buf_add(content, t->held.p, (size_t)at) ||
            srv_buf_add(&t->calls, t->held.p + at, t->held.n - (size_t)at))
            return -1;
        t->held.n = 0;
        return 0;
    }
    if (srv_buf_add(content, t->held.p, partial)) return -1;
    memmove(t->held.p, t->held.p + partial, t->held.n - partial);
    t->held.n -= partial;
    return 0;
}

int srv_tool_split_flush(srv_tool_split *t, srv_buf *content) {
    const int st = srv_buf_add(content, t->held.p, t->held.n);
    t->held.n = 0;
    return st;
}

/* ---- parsing ----------------------------------------------------------------------------------------- */

static const cJSON *tool_properties(const cJSON *tools, const char *name) {
    for (const cJSON *t = tools ? tools->child : NULL; t; t = t->next) {
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(t, "function");
        const cJSON *n = cJSON_GetObjectItemCaseSensitive(f, "name");
        if (cJSON_IsString(n) && !strcmp(n->valuestring, name)) {
            const cJSON *p = cJSON_GetObjectItemCaseSensitive(f, "parameters");
            const cJSON *props = cJSON_GetObjectItemCaseSensitive(p, "properties");
            return cJSON_IsObject(props) ? props : p;
        }
    }
    return NULL;
}

static int prefix_of(const char *type, const char *const *list, int n, int by_prefix) {
    for (int i = 0; i < n; i++)
        if (by_prefix ? !strncmp(type, list[i], strlen(list[i])) : !strcmp(type, list[i])) return 1;
    return 0;
}

/* Python's int(v) (optional sign, decimal digits, '_' between digits not taken; leading zeros dropped) as the exact
 * digits (a raw JSON number: no rounding through a double); number != 0: else Python's float(v) in decimal form (no
 * hex, inf or nan), integral values as integers (vLLM). NULL when it is not such a number: the text stays a string. */
static cJSON *int_value(const char *v, int number) {
    const char *p = v;
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++;
    const char *q = p;
    if (*q == '-' || *q == '+') q++;
    const char *d = q;
    while (*q >= '0' && *q <= '9') q++;
    const char *r = q;
    while (*r == ' ' || *r == '\t' || *r == '\n' || *r == '\r') r++;
    if (q > d && !*r) { /* an integer */
        while (*d == '0' && d + 1 < q) d++;
        char buf[512];
        const int neg = *p == '-' && !(q - d == 1 && *d == '0');
        if ((size_t)(q - d) + 2 > sizeof buf) return cJSON_CreateString(v);
        snprintf(buf, sizeof buf, "%s%.*s", neg ? "-" : "", (int)(q - d), d);
        return cJSON_CreateRaw(buf);
    }
    if (!number) return cJSON_CreateString(v);
    for (const char *c = p; *c; c++) /* (decimal only: float("0x10") is an error in Python) */
        if (!strchr("0123456789+-.eE \t\n\r", *c)) return cJSON_CreateString(v);
    char *end;
    const double x = strtod(p, &end);
    while (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r') end++;
    if (end == p || *end || !isfinite(x)) return cJSON_CreateString(v);
    return cJSON_CreateNumber(x);
}

/* a parameter's text -> its JSON value by the schema's type (vLLM qwen3_coder's _convert_param_value) */
static cJSON *convert_value(const char *v, const cJSON *props, const char *pname) {
    char low[8];
    size_t k = 0;
    for (; v[k] && k < sizeof low - 1; k++) low[k] = (char)(v[k] >= 'A' && v[k] <= 'Z' ? v[k] + 32 : v[k]);
    low[k] = 0;
    if (!v[k] && !strcmp(low, "null")) return cJSON_CreateNull();
    const cJSON *pc = props ? cJSON_GetObjectItemCaseSensitive(props, pname) : NULL;
    const cJSON *ty = cJSON_GetObjectItemCaseSensitive(pc, "type");
    if (!pc || !cJSON_IsString(ty)) return cJSON_CreateString(v);
    char type[32];
    size_t i = 0;
    const char *s = ty->valuestring;
    while (*s == ' ' || *s == '\t' || *s == '\n') s++;
    for (; s[i] && i < sizeof type - 1; i++) type[i] = (char)(s[i] >= 'A' && s[i] <= 'Z' ? s[i] + 32 : s[i]);
    while (i > 0 && (type[i - 1] == ' ' || type[i - 1] == '\n')) i--;
    type[i] = 0;
    static const char *const strs[] = {"string", "str", "text", "varchar", "char", "enum"};
    static const char *const ints[] = {"int", "uint", "long", "short", "unsigned"};
    static const char *const nums[] = {"num", "float"};
    static const char *const bools[] = {"boolean", "bool", "binary"};
    if (prefix_of(type, strs, 6, 0)) return cJSON_CreateString(v);
    if (prefix_of(type, ints, 5, 1)) return int_value(v, 0);
    if (prefix_of(type, nums, 2, 1)) return int_value(v, 1);
    if (prefix_of(type, bools, 3, 0)) return cJSON_CreateBool(!strcmp(low, "true") && !v[4]);
    cJSON *j = cJSON_Parse(v);
    return j ? j : cJSON_CreateString(v);
}

/* "call_" + 24 hex digits */
void srv_tool_call_id(char out[32], uint64_t *rng) {
    uint64_t a = (*rng += 0x9e3779b97f4a7c15ull), b = (*rng += 0x9e3779b97f4a7c15ull);
    a = (a ^ (a >> 31)) * 0xbf58476d1ce4e5b9ull;
    b = (b ^ (b >> 29)) * 0x94d049bb133111ebull;
    snprintf(out, 32, "call_%016llx%08llx", (unsigned long long)(a ^ (a >> 32)), (unsigned long long)(b >> 32));
}

static int add_call(cJSON *arr, const char *name, size_t nlen, cJSON *args, uint64_t *rng) {
    char *a = args ? cJSON_PrintUnformatted(args) : NULL;
    cJSON_Delete(args);
    if (!a) return -1;
    char id[32];
    srv_tool_call_id(id, rng);
    cJSON *c = cJSON_CreateObject(), *f;
    cJSON_AddStringToObject(c, "id", id);
    cJSON_AddStringToObject(c, "type", "function");
    f = cJSON_AddObjectToObject(c, "function");
    cJSON_AddItemToObject(f, "name", srv_json_string(name, nlen));
    cJSON_AddItemToObject(f, "arguments", srv_json_string(a, strlen(a)));
    free(a);
    cJSON_AddItemToArray(arr, c);
    return 0;
}

static const char *find(const char *p, const char *end, const char *s) {
    const size_t n = strlen(s);
    for (; p + n <= end; p++)
        if (!memcmp(p, s, n)) return p;
    return NULL;
}

/* one <function=NAME>...(</function>) body (p..end) */
static int parse_function(const char *p, const char *end, const cJSON *tools, cJSON *arr, uint64_t *rng) {
    const char *gt = memchr(p, '>', (size_t)(end - p));
    if (!gt || gt == p) return -1;
    char name[256];
    const size_t nl = (size_t)(gt - p);
    if (nl >= sizeof name || memchr(p, '\n', nl)) return -1;
    memcpy(name, p, nl);
    name[nl] = 0;
    const cJSON *props = tool_properties(tools, name);
    cJSON *args = cJSON_CreateObject();
    const char *q = gt + 1;
    for (const char *ps; (ps = find(q, end, "<parameter=")); ) {
        ps += 11;
        const char *pg = memchr(ps, '>', (size_t)(end - ps));
        if (!pg) break;
        /* the value runs to </parameter>, or the next <parameter= / </function> / the end */
        const char *ve = find(pg + 1, end, "</parameter>"), *nx = find(pg + 1, end, "<parameter="),
                   *fe = find(pg + 1, end, "</function>");
        const char *stop = end;
        if (ve && ve < stop) stop = ve;
        if (nx && nx < stop) stop = nx;
        if (fe && fe < stop) stop = fe;
        const char *vs = pg + 1, *vend = stop;
        if (vs < vend && *vs == '\n') vs++;
        if (vend > vs && vend[-1] == '\n') vend--;
        char *pname = strndup(ps, (size_t)(pg - ps)), *val = strndup(vs, (size_t)(vend - vs));
        if (!pname || !val) {
            free(pname);
            free(val);
            cJSON_Delete(args);
            return -1;
        }
        cJSON *jv = convert_value(val, props, pname);
        cJSON_DeleteItemFromObjectCaseSensitive(args, pname); /* (a parameter given twice: the last wins) */
        cJSON_AddItemToObject(args, pname, jv);
        free(pname);
        free(val);
        q = stop == ve ? ve + 12 : stop;
    }
    return add_call(arr, name, nl, args, rng);
}

/* vLLM qwen3_coder's order: the <tool_call>...</tool_call> blocks (the last may be open; none: the whole text), in
 * each the <function=NAME> ... </function> bodies (to the first </function>, or the block's end) */
static cJSON *parse_xml(const char *text, size_t n, const cJSON *tools, uint64_t *rng) {
    const char *end = text + n;
    cJSON *arr = cJSON_CreateArray();
    const int blocks = find(text, end, "<tool_call>") != NULL;
    for (const char *b = text; b && b < end;) {
        const char *bs = b, *be = end;
        if (blocks) {
            if (!(bs = find(b, end, "<tool_call>"))) break;
            bs += 11;
            const char *c = find(bs, end, "</tool_call>");
            be = c ? c : end;
            b = c ? c + 12 : end;
        } else {
            b = end;
        }
        for (const char *p = bs; (p = find(p, be, "<function=")); ) {
            p += 10;
            const char *fe = find(p, be, "</function>");
            const char *stop = fe ? fe : be;
            if (parse_function(p, stop, tools, arr, rng)) {
                cJSON_Delete(arr);
                return NULL;
            }
            p = fe ? fe + 11 : be;
        }
    }
    if (!cJSON_GetArraySize(arr)) {
        cJSON_Delete(arr);
        return NULL;
    }
    return arr;
}

static cJSON *parse_json(const char *text, size_t n, uint64_t *rng) {
    const char *end = text + n;
    cJSON *arr = cJSON_CreateArray();
    for (const char *p = text; (p = find(p, end, "<TOOLCALL>"));) { /* every block */
        p += 10;
        const char *e = find(p, end, "</TOOLCALL>");
        cJSON *list = cJSON_ParseWithLength(p, (size_t)((e ? e : end) - p));
        p = e ? e + 11 : end;
        if (!cJSON_IsArray(list) || !cJSON_GetArraySize(list)) {
            cJSON_Delete(list);
            cJSON_Delete(arr);
            return NULL;
        }
        for (const cJSON *c = list->child; c; c = c->next) {
            const cJSON *nm = cJSON_GetObjectItemCaseSensitive(c, "name");
            const cJSON *a = cJSON_GetObjectItemCaseSensitive(c, "arguments");
            cJSON *args = !a ? cJSON_CreateObject() : cJSON_IsString(a) ? cJSON_Parse(a->valuestring) : cJSON_Duplicate(a, 1);
            if (!cJSON_IsString(nm) || !nm->valuestring[0] || !cJSON_IsObject(args)) { /* (arguments: an object) */
                cJSON_Delete(args);
                cJSON_Delete(list);
                cJSON_Delete(arr);
                return NULL;
            }
            add_call(arr, nm->valuestring, strlen(nm->valuestring), args, rng);
        }
        cJSON_Delete(list);
    }
    if (!cJSON_GetArraySize(arr)) {
        cJSON_Delete(arr);
        return NULL;
    }
    return arr;
}

cJSON *srv_tool_calls_parse(srv_tool_format fmt, const char *text, size_t n, const cJSON *tools, int cut,
                            uint64_t *rng) {
    if (!text || !n) return NULL;
    if (cut && fmt == SRV_TOOLS_XML) { /* only what the last </function> closed (the text after it was cut) */
        const char *last = NULL;
        for (const char *p = text; (p = find(p, text + n, "</function>")); p += 11) last = p;
        if (!last) return NULL;
        n = (size_t)(last + 11 - text);
    }
    if (fmt == SRV_TOOLS_XML) return parse_xml(text, n, tools, rng);
    if (fmt == SRV_TOOLS_JSON) return parse_json(text, n, rng);
    return NULL;
}

/* The complete leading objects of a JSON array cut short ("[{...}, {...}, {.."): the array of them (NULL: none). */
static cJSON *array_prefix(const char *text, size_t n) {
    size_t i = 0;
    while (i < n && isspace((unsigned char)text[i])) i++;
    if (i >= n || text[i] != '[') return NULL;
    i++;
    cJSON *arr = cJSON_CreateArray();
    for (;;) {
        while (i < n && isspace((unsigned char)text[i])) i++;
        if (i >= n || text[i] != '{') break;
        const size_t len = srv_json_span(text + i, n - i, NULL), j = i + len; /* to the matching brace */
        cJSON *item = len ? cJSON_ParseWithLength(text + i, len) : NULL;
        if (!cJSON_IsObject(item)) {
            cJSON_Delete(item);
            break;
        }
        cJSON_AddItemToArray(arr, item);
        i = j;
        while (i < n && isspace((unsigned char)text[i])) i++;
        if (i >= n || text[i] != ',') break;
        i++;
    }
    if (!cJSON_GetArraySize(arr)) {
        cJSON_Delete(arr);
        return NULL;
    }
    return arr;
}

cJSON *srv_tool_calls_required(const char *text, size_t n, uint64_t *rng) {
    cJSON *list = text && n ? cJSON_ParseWithLength(text, n) : NULL;
    if (!list && text && n) list = array_prefix(text, n); /* cut short: the calls it completed */
    if (!cJSON_IsArray(list) || !cJSON_GetArraySize(list)) {
        cJSON_Delete(list);
        return NULL;
    }
    cJSON *arr = cJSON_CreateArray();
    for (const cJSON *c = list->child; c; c = c->next) {
        const cJSON *nm = cJSON_GetObjectItemCaseSensitive(c, "name");
        const cJSON *pa = cJSON_GetObjectItemCaseSensitive(c, "parameters");
        if (!cJSON_IsString(nm) || !pa || add_call(arr, nm->valuestring, strlen(nm->valuestring), cJSON_Duplicate(pa, 1), rng)) {
            cJSON_Delete(arr);
            cJSON_Delete(list);
            return NULL;
        }
    }
    cJSON_Delete(list);
    return arr;
}
