/* Lexer: template source -> tokens, following jinja2/lexer.py with the environment transformers
 * builds (trim_blocks=True, lstrip_blocks=True, default delimiters, keep_trailing_newline=False):
 *   - newlines (\r\n, \r) become \n and one trailing newline of the source is dropped;
 *   - "{%-" / "{{-" / "{#-" strip all whitespace before the tag, "-%}" / "-}}" / "-#}" after it;
 *   - lstrip_blocks: spaces/tabs between the line start and "{%" or "{#" are removed ("{%+" keeps);
 *   - trim_blocks: one newline right after "%}" or "#}" is removed ("+%}" keeps it);
 *   - {% raw %}...{% endraw %} is data;
 *   - inside tags, an end delimiter only counts when brackets are balanced. */
#include "template/tmpl.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#include "fp4moe/types.h"

typedef struct {
    tmpl_err *e;
    const char *s;
    size_t n, pos;
    int line;
    token_vec *out;
} lexer;

static int push(lexer *L, tk_type type, int line, const char *text, size_t len) {
    token_vec *v = L->out;
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 64;
        token *t = realloc(v->t, cap * sizeof *t);
        if (!t) return tmpl_fail(L->e, FP4MOE_ENOMEM, line, "out of memory (tokens)");
        v->t = t;
        v->cap = cap;
    }
    token *t = &v->t[v->n];
    memset(t, 0, sizeof *t);
    t->type = type;
    t->line = line;
    if (text) {
        t->text = malloc(len + 1);
        if (!t->text) return tmpl_fail(L->e, FP4MOE_ENOMEM, line, "out of memory (tokens)");
        memcpy(t->text, text, len);
        t->text[len] = '\0';
        t->len = len;
    }
    v->n++;
    return 0;
}

void tmpl_tokens_free(token_vec *v) {
    for (size_t i = 0; i < v->n; i++) free(v->t[i].text);
    free(v->t);
    v->t = NULL;
    v->n = v->cap = 0;
}

static int count_nl(const char *s, size_t n) {
    int c = 0;
    for (size_t i = 0; i < n; i++) c += s[i] == '\n';
    return c;
}

/* Python's \s in a str pattern: Unicode whitespace. Returns byte length of the char at i if it is
 * whitespace, else 0. */
static size_t ws_at(const char *s, size_t n, size_t i) {
    uint32_t cp;
    size_t j = u8_next(s, n, i, &cp);
    return py_isspace(cp) ? j - i : 0;
}

static size_t rstrip_len(const char *s, size_t n) {   /* length of s.rstrip() */
    size_t end = n;
    for (;;) {
        size_t i = end, start = end;
        if (i == 0) break;
        /* step back one UTF-8 character */
        do { i--; } while (i > 0 && ((unsigned char)s[i] & 0xC0) == 0x80 && end - i < 4);
        if (ws_at(s, n, i) == end - i) { end = i; continue; }
        (void)start;
        break;
    }
    return end;
}

static size_t skip_ws(const char *s, size_t n, size_t i) {
    size_t k;
    while (i < n && (k = ws_at(s, n, i)) > 0) i += k;
    return i;
}

/* The earliest "{{", "{%" or "{#" at or after pos; n if none. */
static size_t find_tag(const char *s, size_t n, size_t pos) {
    for (size_t i = pos; i + 1 < n; i++)
        if (s[i] == '{' && (s[i + 1] == '{' || s[i + 1] == '%' || s[i + 1] == '#')) return i;
    return n;
}

/* Emits data text s[a..b) with the strip rules for a following tag (sign '-', '+', 0) of kind
 * ('{', '%', '#'); line_starting as Jinja tracks it. */
static int emit_data(lexer *L, size_t a, size_t b, char sign, char kind, int line_starting) {
    const char *t = L->s + a;
    size_t len = b - a;
    int line = L->line;
    L->line += count_nl(t, len);
    if (sign == '-') {
        len = rstrip_len(t, len);
    } else if (sign != '+' && kind != '{') {
        size_t l_pos = 0;
        for (size_t i = len; i > 0; i--)
            if (t[i - 1] == '\n') { l_pos = i; break; }
        if (l_pos > 0 || line_starting) {
            size_t j = skip_ws(t, len, l_pos);
            if (j == len && len > l_pos) len = l_pos;
        }
    }
    return len ? push(L, TK_DATA, line, t, len) : 0;
}

/* Python string-literal unescaping as jinja2 does it ("unicode-escape" on the literal body). */
static int unescape(lexer *L, const char *s, size_t n, int line) {
    char *o = malloc(n + 1);
    if (!o) return tmpl_fail(L->e, FP4MOE_ENOMEM, line, "out of memory");
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '\\' || i + 1 >= n) { o[k++] = s[i]; continue; }
        char c = s[++i];
        uint32_t cp = 0;
        int ndig = 0;
        switch (c) {
        case '\n': break;
        case '\\': o[k++] = '\\'; break;
        case '\'': o[k++] = '\''; break;
        case '"': o[k++] = '"'; break;
        case 'a': o[k++] = '\a'; break;
        case 'b': o[k++] = '\b'; break;
        case 'f': o[k++] = '\f'; break;
        case 'n': o[k++] = '\n'; break;
        case 'r': o[k++] = '\r'; break;
        case 't': o[k++] = '\t'; break;
        case 'v': o[k++] = '\v'; break;
        case 'x': ndig = 2; break;
        case 'u': ndig = 4; break;
        case 'U': ndig = 8; break;
        default:
            if (c >= '0' && c <= '7') {
                cp = (uint32_t)(c - '0');
                for (int d = 0; d < 2 && i + 1 < n && s[i + 1] >= '0' && s[i + 1] <= '7'; d++)
                    cp = cp * 8 + (uint32_t)(s[++i] - '0');
                ndig = -1;
            } else {
                o[k++] = '\\';
                o[k++] = c;
            }
        }
        if (ndig > 0) {
            if (i + (size_t)ndig >= n + 0 && i + (size_t)ndig > n - 1) {
                free(o);
                return tmpl_fail(L->e, FP4MOE_EFORMAT, line, "truncated \\%c escape in a string literal", c);
            }
            for (int d = 0; d < ndig; d++) {
                char h = s[++i];
                if (!isxdigit((unsigned char)h)) {
                    free(o);
                    return tmpl_fail(L->e, FP4MOE_EFORMAT, line, "bad \\%c escape in a string literal", c);
                }
                cp = cp * 16 + (uint32_t)(isdigit((unsigned char)h) ? h - '0' : (tolower((unsigned char)h) - 'a' + 10));
            }
        }
        if (ndig != 0) {
            if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
                free(o);
                return tmpl_fail(L->e, FP4MOE_EFORMAT, line, "escape \\%c in a string literal is not a character", c);
            }
            if (cp < 0x80) o[k++] = (char)cp;    /* each escape is shorter than its UTF-8 */
            else if (cp < 0x800) { o[k++] = (char)(0xC0 | (cp >> 6)); o[k++] = (char)(0x80 | (cp & 0x3F)); }
            else if (cp < 0x10000) {
                o[k++] = (char)(0xE0 | (cp >> 12)); o[k++] = (char)(0x80 | ((cp >> 6) & 0x3F));
                o[k++] = (char)(0x80 | (cp & 0x3F));
            } else {
                o[k++] = (char)(0xF0 | (cp >> 18)); o[k++] = (char)(0x80 | ((cp >> 12) & 0x3F));
                o[k++] = (char)(0x80 | ((cp >> 6) & 0x3F)); o[k++] = (char)(0x80 | (cp & 0x3F));
            }
        }
    }
    int rc = push(L, TK_STRING, line, o, k);
    free(o);
    return rc;
}

static const char *const OPS[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/", "*", "%", "~",
                                  "[", "]", "(", ")", "{", "}", ">", "<", "=", ".", ":", "|", ",", ";"};

/* Lexes the inside of a {{ }} / {% %} tag starting at L->pos; kind '{' or '%'. */
static int lex_tag(lexer *L, char kind, int *line_starting) {
    const char *s = L->s;
    size_t n = L->n;
    char stack[256];
    size_t depth = 0;
    int start_line = L->line;
    for (;;) {
        size_t p = L->pos;
        /* whitespace */
        size_t q = skip_ws(s, n, p);
        L->line += count_nl(s + p, q - p);
        p = L->pos = q;
        if (p >= n)
            return tmpl_fail(L->e, FP4MOE_EFORMAT, start_line, "unexpected end of template: tag opened on line %d is never closed ('%s' expected)",
                             start_line, kind == '%' ? "%}" : "}}");
        if (depth == 0) {
            const char *endt = kind == '%' ? "%}" : "}}";
            int end = 0;
            size_t after = 0;
            if (kind == '%' && p + 2 < n + 0 && s[p] == '+' && p + 3 <= n && memcmp(s + p + 1, endt, 2) == 0) {
                end = 1; after = p + 3;
            } else if (s[p] == '-' && p + 3 <= n && memcmp(s + p + 1, endt, 2) == 0) {
                end = 1;
                after = skip_ws(s, n, p + 3);
            } else if (p + 2 <= n && memcmp(s + p, endt, 2) == 0) {
                end = 1;
                after = p + 2;
                if (kind == '%' && after < n && s[after] == '\n') after++;   /* trim_blocks */
            }
            if (end) {
                if (push(L, kind == '%' ? TK_BLOCK_END : TK_VAR_END, L->line, NULL, 0)) return -1;
                L->line += count_nl(s + p, after - p);
                *line_starting = after > p && s[after - 1] == '\n';
                L->pos = after;
                return 0;
            }
        }
        unsigned char c = (unsigned char)s[p];
        if (c == '\'' || c == '"') {
            size_t i = p + 1;
            while (i < n && s[i] != (char)c) i += (s[i] == '\\' && i + 1 < n) ? 2 : 1;
            if (i >= n) return tmpl_fail(L->e, FP4MOE_EFORMAT, L->line, "unterminated string literal");
            if (unescape(L, s + p + 1, i - p - 1, L->line)) return -1;
            L->line += count_nl(s + p, i - p);
            L->pos = i + 1;
            continue;
        }
        if (isdigit(c)) {
            size_t i = p;
            char num[128];
            size_t k = 0;
            int is_float = 0;
            while (i < n && (isdigit((unsigned char)s[i]) || (s[i] == '_' && i + 1 < n && isdigit((unsigned char)s[i + 1])))) {
                if (s[i] != '_' && k < sizeof num - 1) num[k++] = s[i];
                i++;
            }
            if (i + 1 < n && s[i] == '.' && isdigit((unsigned char)s[i + 1])) {
                is_float = 1;
                num[k < sizeof num - 1 ? k++ : k] = '.';
                i++;
                while (i < n && (isdigit((unsigned char)s[i]) || (s[i] == '_' && i + 1 < n && isdigit((unsigned char)s[i + 1])))) {
                    if (s[i] != '_' && k < sizeof num - 1) num[k++] = s[i];
                    i++;
                }
            }
            if (i < n && (s[i] == 'e' || s[i] == 'E')) {
                size_t j = i + 1;
                if (j < n && (s[j] == '+' || s[j] == '-')) j++;
                if (j < n && isdigit((unsigned char)s[j])) {
                    is_float = 1;
                    if (k < sizeof num - 1) num[k++] = 'e';
                    for (size_t t = i + 1; t < j; t++) if (k < sizeof num - 1) num[k++] = s[t];
                    i = j;
                    while (i < n && (isdigit((unsigned char)s[i]) || s[i] == '_')) {
                        if (s[i] != '_' && k < sizeof num - 1) num[k++] = s[i];
                        i++;
                    }
                }
            }
            num[k] = '\0';
            if (push(L, is_float ? TK_FLOAT : TK_INT, L->line, num, k)) return -1;
            token *t = &L->out->t[L->out->n - 1];
            if (is_float) t->fval = strtod(num, NULL);
            else {
                char *endp;
                unsigned long long v = strtoull(num, &endp, 10);
                if (v > (unsigned long long)INT64_MAX || k >= 20)
                    return tmpl_fail(L->e, FP4MOE_EFORMAT, L->line, "integer literal %s is too large", num);
                t->ival = (int64_t)v;
            }
            L->pos = i;
            continue;
        }
        if (isalpha(c) || c == '_') {
            size_t i = p;
            while (i < n && (isalnum((unsigned char)s[i]) || s[i] == '_')) i++;
            if (push(L, TK_NAME, L->line, s + p, i - p)) return -1;
            L->pos = i;
            continue;
        }
        size_t oplen = 0;
        for (size_t k = 0; k < sizeof OPS / sizeof OPS[0]; k++) {
            size_t l = strlen(OPS[k]);
            if (p + l <= n && memcmp(s + p, OPS[k], l) == 0) { oplen = l; break; }
        }
        if (!oplen) return tmpl_fail(L->e, FP4MOE_EFORMAT, L->line, "unexpected character '%c' inside a tag", c);
        char o = s[p];
        if (oplen == 1 && (o == '(' || o == '[' || o == '{')) {
            if (depth >= sizeof stack) return tmpl_fail(L->e, FP4MOE_EFORMAT, L->line, "brackets nested too deeply");
            stack[depth++] = o == '(' ? ')' : o == '[' ? ']' : '}';
        } else if (oplen == 1 && (o == ')' || o == ']' || o == '}')) {
            if (depth == 0) return tmpl_fail(L->e, FP4MOE_EFORMAT, L->line, "unexpected '%c'", o);
            if (stack[depth - 1] != o)
                return tmpl_fail(L->e, FP4MOE_EFORMAT, L->line, "unexpected '%c', expected '%c'", o, stack[depth - 1]);
            depth--;
        }
        if (push(L, TK_OP, L->line, s + p, oplen)) return -1;
        L->pos = p + oplen;
    }
}

/* {% raw %} at s[p] ("{%" already seen, sign at p+2)? Returns the end of the opening tag or 0. */
static size_t raw_open(const char *s, size_t n, size_t p) {
    size_t i = p + 2;
    if (i < n && (s[i] == '-' || s[i] == '+')) i++;
    i = skip_ws(s, n, i);
    if (i + 3 > n || memcmp(s + i, "raw", 3) != 0) return 0;
    i = skip_ws(s, n, i + 3);
    if (i + 3 <= n && s[i] == '-' && s[i + 1] == '%' && s[i + 2] == '}') return skip_ws(s, n, i + 3);
    if (i + 2 <= n && s[i] == '%' && s[i + 1] == '}') return i + 2;
    return 0;
}

int tmpl_lex(tmpl_err *e, const char *src, size_t len, token_vec *out) {
    /* newline normalisation and the dropped trailing newline */
    char *s = malloc(len + 1);
    if (!s) return tmpl_fail(e, FP4MOE_ENOMEM, 0, "out of memory");
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            s[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n') i++;
        } else s[n++] = src[i];
    }
    if (n > 0 && s[n - 1] == '\n') n--;
    s[n] = '\0';
    lexer L = {e, s, n, 0, 1, out};
    int line_starting = 1, rc = 0;
    while (L.pos < n && !rc) {
        size_t t = find_tag(s, n, L.pos);
        if (t >= n) { rc = emit_data(&L, L.pos, n, '+', '{', 0); L.pos = n; break; }
        char kind = s[t + 1];
        char sign = (t + 2 < n && (s[t + 2] == '-' || s[t + 2] == '+')) ? s[t + 2] : 0;
        size_t raw_end = kind == '%' ? raw_open(s, n, t) : 0;
        if (raw_end) {
            if ((rc = emit_data(&L, L.pos, t, sign, '%', line_starting))) break;
            L.line += count_nl(s + t, raw_end - t);
            /* find {%(-|+|)\s*endraw\s*(+%}|-%}\s*|%}\n?) */
            size_t i = raw_end, found = 0, tag_end = 0;
            char esign = 0;
            for (; i + 1 < n; i++) {
                if (s[i] != '{' || s[i + 1] != '%') continue;
                size_t j = i + 2;
                char sg = (j < n && (s[j] == '-' || s[j] == '+')) ? s[j++] : 0;
                j = skip_ws(s, n, j);
                if (j + 6 > n || memcmp(s + j, "endraw", 6) != 0) continue;
                j = skip_ws(s, n, j + 6);
                if (j + 3 <= n && s[j] == '+' && s[j + 1] == '%' && s[j + 2] == '}') tag_end = j + 3;
                else if (j + 3 <= n && s[j] == '-' && s[j + 1] == '%' && s[j + 2] == '}') tag_end = skip_ws(s, n, j + 3);
                else if (j + 2 <= n && s[j] == '%' && s[j + 1] == '}') {
                    tag_end = j + 2;
                    if (tag_end < n && s[tag_end] == '\n') tag_end++;
                } else continue;
                found = 1;
                esign = sg;
                break;
            }
            if (!found) { rc = tmpl_fail(e, FP4MOE_EFORMAT, L.line, "Missing end of raw directive"); break; }
            L.pos = raw_end;
            if ((rc = emit_data(&L, raw_end, i, esign, '%', 0))) break;
            L.line += count_nl(s + i, tag_end - i);
            line_starting = s[tag_end - 1] == '\n';
            L.pos = tag_end;
            continue;
        }
        if ((rc = emit_data(&L, L.pos, t, sign, kind, line_starting))) break;
        L.pos = t + 2 + (sign ? 1 : 0);
        if (kind == '#') {
            size_t i = L.pos, end = 0;
            for (; i + 1 < n; i++) {
                if ((s[i] == '+' || s[i] == '-') && i + 2 < n && s[i + 1] == '#' && s[i + 2] == '}') {
                    end = s[i] == '-' ? skip_ws(s, n, i + 3) : i + 3;
                    break;
                }
                if (s[i] == '#' && s[i + 1] == '}') {
                    end = i + 2;
                    if (end < n && s[end] == '\n') end++;
                    break;
                }
            }
            if (!end) { rc = tmpl_fail(e, FP4MOE_EFORMAT, L.line, "Missing end of comment tag"); break; }
            L.line += count_nl(s + L.pos, end - L.pos);
            line_starting = s[end - 1] == '\n';
            L.pos = end;
            continue;
        }
        if ((rc = push(&L, kind == '%' ? TK_BLOCK_BEGIN : TK_VAR_BEGIN, L.line, NULL, 0))) break;
        rc = lex_tag(&L, kind, &line_starting);
    }
    if (!rc) rc = push(&L, TK_EOF, L.line, NULL, 0);
    free(s);
    if (rc) tmpl_tokens_free(out);
    return rc;
}
