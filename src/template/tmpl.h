/* src/template/tmpl.h: internals of the chat-template engine (a Jinja2 subset as transformers
 * renders chat templates: trim_blocks, lstrip_blocks, loopcontrols, tojson = json.dumps with
 * ensure_ascii=False, raise_exception).
 *
 *   value.c    values (refcounted strings/lists/dicts), Python str()/repr()/json.dumps, compare
 *   lexer.c    source -> tokens (whitespace control, trim/lstrip blocks, raw)
 *   parser.c   tokens -> AST (statements, expressions with Jinja's precedence)
 *   eval.c     AST -> output (scopes, loops, macros, operators, limits)
 *   builtins.c filters, tests, str/dict methods, global functions
 *   template.c the public API (include/fp4moe/template.h)
 *
 * Errors inside the engine: functions return 0 / -1 and leave a message in the context they were
 * given (tmpl_err); the public API turns that into fp4moe_set_error. */
#ifndef FP4MOE_TEMPLATE_TMPL_H
#define FP4MOE_TEMPLATE_TMPL_H

#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

/* ---- errors ---------------------------------------------------------------------------------- */
typedef struct {
    int status;        /* fp4moe_status of the first error (0 = none) */
    int line;          /* template line (1-based; 0 = unknown) */
    char msg[480];
} tmpl_err;

/* Records the first error (later ones are ignored); returns -1. */
int tmpl_fail(tmpl_err *e, int status, int line, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;

/* ---- string buffer --------------------------------------------------------------------------- */
typedef struct {
    char *p;
    size_t n, cap;
    size_t limit;      /* 0 = none; growing past it fails */
} sbuf;

int sb_put(sbuf *b, const char *s, size_t n);       /* 0 / -1 (ENOMEM or over limit) */
int sb_puts(sbuf *b, const char *s);
int sb_putc(sbuf *b, char c);
void sb_free(sbuf *b);

/* ---- values ---------------------------------------------------------------------------------- */
typedef enum {
    TV_UNDEF = 0, TV_NONE, TV_BOOL, TV_INT, TV_FLOAT, TV_STR, TV_LIST, TV_DICT, TV_NS, TV_MACRO,
    TV_FUNC
} tv_kind;

typedef struct tv_str tv_str;
typedef struct tv_list tv_list;
typedef struct tv_dict tv_dict;
struct tnode;

typedef struct {
    tv_kind kind;
    union {
        int b;
        int64_t i;
        double f;
        tv_str *s;
        tv_list *l;
        tv_dict *d;                 /* TV_DICT and TV_NS (a namespace is a mutable dict) */
        const struct tnode *m;      /* TV_MACRO: the macro's definition (owned by the template) */
        int fn;                     /* TV_FUNC: builtin global function id */
    } u;
} tv;

struct tv_str { int refs; size_t len; char data[]; };
/* depth: 1 + the deepest list/dict inside (bounded by TV_MAX_DEPTH, so that printing, comparing
 * and freeing values cannot recurse without limit) */
#define TV_MAX_DEPTH 256
struct tv_list { int refs; int is_tuple; int depth; size_t n, cap; tv *items; };   /* a tuple prints as (a, b) */
struct tv_dict { int refs; int is_loop; int depth; size_t n, cap; tv *keys, *vals; };

static inline tv tv_undef(void) { tv v; v.kind = TV_UNDEF; v.u.i = 0; return v; }
static inline tv tv_none(void) { tv v; v.kind = TV_NONE; v.u.i = 0; return v; }
static inline tv tv_bool(int b) { tv v; v.kind = TV_BOOL; v.u.b = b ? 1 : 0; return v; }
static inline tv tv_int(int64_t i) { tv v; v.kind = TV_INT; v.u.i = i; return v; }
static inline tv tv_float(double f) { tv v; v.kind = TV_FLOAT; v.u.f = f; return v; }

tv tv_ref(tv v);                 /* +1 reference (no-op for scalars); returns v */
void tv_unref(tv v);             /* -1 reference, frees at 0 */
/* A compiled template's string literal: shared by all renders (any thread), never counted (tv_ref / tv_unref
 * leave it), freed by tv_free_static when the template is freed (tv_free_static of a counted value: tv_unref). */
void tv_make_static(tv *v);
/* The live-bytes budget of a render (value.c): strings and the item arrays of lists / dicts made while it is set
 * on this thread count against limit; going over it is FP4MOE_EOVERFLOW. NULL: no accounting. */
typedef struct {
    size_t live, limit;
} tv_budget;
void tv_budget_set(tv_budget *b);
void tv_free_static(tv v);
/* Drops a result on a failure path: unref, then undefined (a caller that unrefs it again frees nothing twice). */
static inline void tv_drop(tv *v) { tv_unref(*v); *v = tv_undef(); }

/* Constructors return 0 / -1 (ENOMEM in e). */
int tv_str_new(tmpl_err *e, const char *s, size_t n, tv *out);
int tv_list_new(tmpl_err *e, tv *out);
int tv_dict_new(tmpl_err *e, tv *out);
int tv_list_push(tmpl_err *e, tv_list *l, tv v);             /* takes v's reference */
int tv_dict_set(tmpl_err *e, tv_dict *d, tv key, tv val);   /* takes both references */
tv tv_dict_get(const tv_dict *d, tv key, int *found);       /* borrowed */
tv tv_dict_gets(const tv_dict *d, const char *key, int *found);
int tv_from_json(tmpl_err *e, const cJSON *j, tv *out);     /* integral numbers become ints */
int tv_depth(tv v);                                          /* 0 for scalars */
/* Does v (transitively) hold the container d? (a namespace must not come to contain itself) */
int tv_holds(tv v, const tv_dict *d);

int tv_truthy(tv v);
int tv_eq(tv a, tv b);
/* Python ordering: *res < 0, 0, > 0; -1 with a TypeError for unorderable types. */
int tv_cmp(tmpl_err *e, int line, tv a, tv b, int *res);
const char *tv_type_name(tv v);          /* Python's type names: 'str', 'int', 'dict', ... */
int tv_is_num(tv v);                     /* bool, int, float */
double tv_num(tv v);

/* Python str() (what {{ x }} prints; undefined -> ""), repr(), json.dumps(ensure_ascii=False). */
int tv_str_append(tmpl_err *e, int line, sbuf *b, tv v);
int tv_repr_append(tmpl_err *e, int line, sbuf *b, tv v);
/* indent < 0: no indent (separators ", " ": "); else newline + indent spaces (or indent_str). */
int tv_json_append(tmpl_err *e, int line, sbuf *b, tv v, int indent, const char *indent_str,
                   int sort_keys, int depth);
int tv_to_str(tmpl_err *e, int line, tv v, tv *out);  /* str(v) as a TV_STR */
void fmt_float(sbuf *b, double f);      /* Python repr(float) */

/* UTF-8 helpers (input is treated as UTF-8; invalid bytes count as one character each). */
size_t u8_len(const char *s, size_t n);                   /* code points */
size_t u8_offset(const char *s, size_t n, size_t cp);     /* byte offset of code point cp */
size_t u8_next(const char *s, size_t n, size_t i, uint32_t *cp); /* decodes at i, returns next i */
int py_isspace(uint32_t cp);

/* ---- tokens and lexer ------------------------------------------------------------------------ */
typedef enum {
    TK_EOF = 0, TK_DATA, TK_VAR_BEGIN, TK_VAR_END, TK_BLOCK_BEGIN, TK_BLOCK_END,
    TK_NAME, TK_STRING, TK_INT, TK_FLOAT, TK_OP
} tk_type;

typedef struct {
    tk_type type;
    int line;
    char *text;        /* TK_DATA / TK_NAME / TK_STRING (unescaped) / TK_OP; malloc'd */
    size_t len;
    int64_t ival;
    double fval;
} token;

typedef struct {
    token *t;
    size_t n, cap;
} token_vec;

int tmpl_lex(tmpl_err *e, const char *src, size_t len, token_vec *out);
void tmpl_tokens_free(token_vec *v);

/* ---- AST ------------------------------------------------------------------------------------- */
typedef enum {
    /* statements */
    N_BODY, N_TEXT, N_OUTPUT, N_IF, N_FOR, N_SET, N_SETBLOCK, N_MACRO, N_BREAK, N_CONTINUE,
    N_FILTERBLOCK, N_CALLBLOCK,
    /* expressions */
    N_CONST, N_NAME, N_LIST, N_TUPLE, N_DICT, N_GETATTR, N_GETITEM, N_SLICE, N_CALL, N_KW,
    N_FILTER, N_TEST, N_NOT, N_NEG, N_POS, N_BIN, N_AND, N_OR, N_CMP, N_CMPOP, N_COND, N_PARAM
} node_kind;

typedef enum {
    OP_ADD, OP_SUB, OP_MUL, OP_DIV, OP_FLOORDIV, OP_MOD, OP_POW, OP_CONCAT,
    OP_EQ, OP_NE, OP_LT, OP_LE, OP_GT, OP_GE, OP_IN, OP_NOTIN
} op_kind;

typedef struct tnode tnode;
typedef struct { tnode **v; size_t n, cap; } node_vec;

struct tnode {
    node_kind kind;
    int line;
    int op;                 /* N_BIN / N_CMPOP: op_kind; N_OUTPUT etc.: unused */
    char *name;             /* N_NAME, N_GETATTR, N_FILTER, N_TEST, N_KW, N_MACRO, N_PARAM */
    tv lit;                 /* N_CONST, N_TEXT */
    tv scope;               /* N_BODY of a scope (template, loop, macro, block set): a dict of the
                               names that start undefined there (see tmpl_analyze_scopes) */
    tnode *a, *b, *c, *d;   /* operands / target / iterable / condition */
    node_vec list;          /* body / args / items / dict keys / chained comparison ops */
    node_vec list2;         /* else body / dict values / macro body */
};

void tmpl_node_free(tnode *n);
/* Parses tokens into a N_BODY; 0 / -1 with e (FP4MOE_EFORMAT, line). max_depth bounds nesting. */
int tmpl_parse(tmpl_err *e, const token_vec *toks, tnode **out);

/* ---- evaluation ------------------------------------------------------------------------------ */
typedef struct frame frame;
struct frame {
    tv vars;               /* TV_DICT */
    frame *parent;
    const tv_dict *undef_first;   /* the scope's names that start undefined (NULL: none) */
};

typedef struct {
    tmpl_err err;
    size_t max_output;      /* bytes of output and of any one string built */
    int max_depth;          /* nested macro calls */
    uint64_t max_steps;     /* loop iterations + macro calls + filter calls over the render */
    int depth;
    uint64_t steps;
    frame *root;            /* template-level variables (parent: globals) */
} rctx;

/* Jinja's compile-time scoping (jinja2/idtracking.py), computed once after parsing: in every
 * scope (template, loop body, macro body, block set), a name whose first reference there is a
 * direct store (set / block set / macro, not inside an if) and which no enclosing scope references
 * starts undefined: a nested scope reading it before the store sees undefined, not the value of an
 * outer scope or of the context. Fills tnode.scope of each scope body. */
int tmpl_analyze_scopes(tmpl_err *e, tnode *body);

int tmpl_eval_body(rctx *r, const tnode *body, frame *f, sbuf *out);

/* builtins.c */
enum {
    FN_NAMESPACE = 1, FN_RAISE, FN_RANGE, FN_DICT, FN_STRFTIME, FN_LOOP_CYCLE
};
int tmpl_global_fn(const char *name);    /* FN_* or 0 */
/* args: positional values; kwnames[i] (NULL for positional) names args[i]. Borrowed args;
 * *out owns a reference. */
typedef struct {
    tv *v;
    const char **names;
    size_t n;
} argv_t;
int tmpl_call_fn(rctx *r, int line, int fn, const argv_t *a, tv *out);
int tmpl_filter(rctx *r, int line, const char *name, tv val, const argv_t *a, tv *out);
int tmpl_test(rctx *r, int line, const char *name, tv val, const argv_t *a, int *out);
/* Method call obj.name(args); *handled = 0 when obj has no such method (caller falls back). */
int tmpl_method(rctx *r, int line, tv obj, const char *name, const argv_t *a, tv *out, int *handled);
int tmpl_has_filter(const char *name);
int tmpl_has_test(const char *name);

/* eval.c helpers used by builtins */
int tmpl_getattr(rctx *r, int line, tv obj, const char *name, tv *out);
int tmpl_getitem(rctx *r, int line, tv obj, tv key, tv *out);
int tmpl_iter_list(rctx *r, int line, tv v, tv *out_list);   /* list(v) for iteration */
int tmpl_step(rctx *r, int line);

#endif
