#!/usr/bin/env python3
"""Goldens for the chat-template engine (src/template/, test tests/template/test_template.c).

Renders with Python jinja2 configured exactly as transformers does it
(transformers/utils/chat_template_utils.py, _cached_compile_jinja_template, transformers 5.24):
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
extensions=[<generation tag>, jinja2.ext.loopcontrols]), filters["tojson"] = json.dumps(x,
ensure_ascii=False, indent, separators, sort_keys), globals raise_exception / strftime_now / dict /
namespace (no underscore names). The context is what render_jinja_template passes to
Template.render: messages (after _alias_reasoning_fields, with None-valued keys dropped as
_normalize_chat_messages does), tools (None when absent), documents (None), add_generation_prompt
and the extra kwargs (enable_thinking, ...).

Writes tests/golden/templates/:
  <template>.golden.json   the real templates of ../shared/chat_templates over many message lists
  language.golden.json     small templates, one language feature each (and error cases)

usage: python3 -m venv build/tmpl-venv && build/tmpl-venv/bin/pip install jinja2==3.1.6
       build/tmpl-venv/bin/python scripts/make_template_golden.py [TEMPLATE_DIR]
"""
import json
import os
import random
import sys
from datetime import datetime

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "golden", "templates")


# ---- the environment, as transformers builds it ------------------------------------------------
class GenerationTag(Extension):
    """transformers' AssistantTracker without the index tracking: {% generation %} renders its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

    def _generation_support(self, caller):
        return caller()


def make_env():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError("underscore-prefixed namespace attribute")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def template_context(messages, tools=None, add_generation_prompt=False, **kwargs):
    """What render_jinja_template hands to Template.render."""
    chat = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}             # _normalize_chat_messages
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:                                     # _alias_reasoning_fields
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        chat.append(m)
    ctx = {"messages": chat, "tools": tools, "documents": None, "add_generation_prompt": add_generation_prompt}
    ctx.update(kwargs)
    return ctx


def render(env, source, ctx):
    try:
        t = env.from_string(source)
    except Exception as e:  # TemplateSyntaxError, TemplateAssertionError, SyntaxError ('break' outside loop)
        return {"error": "compile", "error_message": f"{type(e).__name__}: {e}"}
    try:
        return {"expected": t.render(**ctx)}
    except Exception as e:  # TemplateError, TypeError, ... : the C engine must fail too
        return {"error": "render", "error_message": f"{type(e).__name__}: {e}"}


# ---- message lists -----------------------------------------------------------------------------
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "  Get the current weather\nfor a city.  ",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. \"Paris\" or 東京"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
            "days": {"type": ["integer", "null"], "description": "Forecast days", "minimum": 1},
            "tags": {"type": "array", "items": {"type": "string"}, "description": "tags"},
            "opts": {"type": "object", "properties": {"a": {"type": "boolean"}}, "nullable": True}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search",
        "description": "Search the web \\ with quotes \" and tabs\t.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"],
                       "additionalProperties": False},
        "strict": True}},
    {"name": "bare_tool", "description": "A tool given without the 'function' wrapper 😀",
     "parameters": {"type": "object", "properties": {}}},
]

USER_TEXTS = [
    "Hello!", "What's the weather in Paris?", "Line one\nLine two\n\tTabbed \\ backslash \"quoted\"",
    "日本語のテキスト、中文字符，한국어 and emoji 😀🎉 and é à ü", "  padded with spaces  ",
    "Use /think please", "Answer quickly /no_think", "control \u0001 chars \u001f here", "",
    "{{ not a template }} {% neither %}", "<think>user wrote think</think>",
]
ASSISTANT_TEXTS = [
    "Hi! How can I help?", "  It is sunny.  ", "<think>\nreasoning inline\n</think>\nThe answer is 42.",
    "Partial <think> never closed", "Done.</think> stray close", "多行\n回答 😀", "",
]
REASONING = ["I should check the weather.", "  \n  ", "Step 1: think\nStep 2: \"answer\" \\ done"]
TOOL_CALLS = [
    [{"type": "function", "function": {"name": "get_weather",
                                       "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}}],
    [{"type": "function", "function": {"name": "search", "arguments": {"q": "日本 \"quoted\" \\ back\nnl"}}},
     {"type": "function", "function": {"name": "get_weather",
                                       "arguments": {"city": "東京", "tags": ["a", "b"], "opts": {"a": True, "n": None},
                                                     "ratio": 0.25}}}],
    [{"name": "bare_tool", "arguments": {}}],
]
TOOL_RESULTS = ['{"temp": 21, "sky": "clear"}', "result with \"quotes\" and 😀", "plain text\nsecond line"]


def conversations(rng):
    convs = []
    convs.append(("user_only", [{"role": "user", "content": "Hello!"}]))
    convs.append(("system_user", [{"role": "system", "content": "You are a helpful assistant."},
                                  {"role": "user", "content": "Hi"}]))
    convs.append(("multi_turn", [{"role": "system", "content": "Be brief. /no_think"},
                                 {"role": "user", "content": "One?"}, {"role": "assistant", "content": "1"},
                                 {"role": "user", "content": "Two?"}, {"role": "assistant", "content": "2"},
                                 {"role": "user", "content": "Three?"}]))
    convs.append(("reasoning_history", [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "thinking about Q1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2", "reasoning_content": "thinking about Q2"}]))
    convs.append(("tool_round_trip", [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": TOOL_CALLS[1]},
        {"role": "tool", "content": TOOL_RESULTS[0]}, {"role": "tool", "content": TOOL_RESULTS[1]},
        {"role": "assistant", "content": "Paris is clear, Tokyo too."},
        {"role": "user", "content": "Thanks"}]))
    convs.append(("tool_call_last", [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": TOOL_CALLS[0]}]))
    convs.append(("tool_response_last", [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": TOOL_CALLS[0]},
        {"role": "tool", "content": TOOL_RESULTS[2]}]))
    convs.append(("assistant_last", [
        {"role": "system", "content": "sys /think"}, {"role": "user", "content": "Continue"},
        {"role": "assistant", "content": "  Partial answer  "}]))
    convs.append(("unicode_escapes", [
        {"role": "system", "content": "Système: \"quotes\", \\backslashes\\, tabs\t, newlines\n, emoji 😀, 中文"},
        {"role": "user", "content": USER_TEXTS[3]}, {"role": "assistant", "content": ASSISTANT_TEXTS[5]},
        {"role": "user", "content": USER_TEXTS[7]}]))
    convs.append(("other_roles_and_list_content", [
        {"role": "developer", "content": "dev note"},
        {"role": "user", "content": [{"type": "text", "text": "look at this"}, {"type": "image", "url": "x.png"}]}]))
    # jinja2 raises on these (the engine must fail too)
    convs.append(("empty_messages", []))
    convs.append(("string_tool_arguments", [
        {"role": "user", "content": "call it"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "search", "arguments": "{\"q\": \"x\"}"}}]},
        {"role": "user", "content": "again"}]))
    # random conversations
    for i in range(40):
        msgs = []
        if rng.random() < 0.6:
            msgs.append({"role": "system", "content": rng.choice(["You are helpful.", "Système 😀 /think",
                                                                  "Be terse. /no_think", "", "multi\nline\nsystem"])})
        for turn in range(rng.randint(1, 4)):
            msgs.append({"role": "user", "content": rng.choice(USER_TEXTS)})
            if turn == 3 or rng.random() < 0.15:
                break
            a = {"role": "assistant", "content": rng.choice(ASSISTANT_TEXTS)}
            if rng.random() < 0.4:
                a["reasoning_content"] = rng.choice(REASONING)
            if rng.random() < 0.35:
                a["tool_calls"] = rng.choice(TOOL_CALLS)
                if rng.random() < 0.3:
                    a["content"] = None
                msgs.append(a)
                for _ in range(rng.randint(1, 2)):
                    msgs.append({"role": "tool", "content": rng.choice(TOOL_RESULTS)})
                if rng.random() < 0.7:
                    msgs.append({"role": "assistant", "content": rng.choice(ASSISTANT_TEXTS)})
            else:
                msgs.append(a)
        convs.append((f"random_{i:02d}", msgs))
    return convs


def real_template_cases(rng):
    cases = []
    for name, msgs in conversations(rng):
        for variant in range(3):
            kw = {}
            tools = None
            if variant == 1:
                tools = TOOLS[: rng.randint(1, 3)]
            agp = (variant != 2) if name.startswith("random") else bool(variant % 2 == 0)
            think = rng.choice(["absent", True, False])
            if think != "absent":
                kw["enable_thinking"] = think
            if variant == 2 and rng.random() < 0.5:
                kw["truncate_history_thinking"] = False
            if variant == 2 and name == "assistant_last":
                kw["continue_final_message"] = False
            cases.append({"name": f"{name}/v{variant}",
                          "context": template_context(msgs, tools=tools, add_generation_prompt=agp,
                                                      bos_token="<s>", eos_token="</s>", **kw)})
    return cases


# ---- language features -------------------------------------------------------------------------
LANG = [
    # (name, template, context)
    ("text", "plain text", {}),
    ("print_types", "{{ 1 }} {{ 1.5 }} {{ 'a' }} {{ true }} {{ none }} {{ [1, 'a', none, true] }} {{ {'k': 'v', 'n': 1} }}", {}),
    ("print_floats", "{{ 0.1 }} {{ 1e16 }} {{ 1e-5 }} {{ 123456789.125 }} {{ 2.0 }} {{ 1/3 }} {{ -0.0 }} {{ 1e300*10 }}", {}),
    ("undefined_prints_empty", "[{{ nope }}][{{ x.missing }}]", {"x": {}}),
    ("comment", "a{# comment #}b{#- trimmed -#}  c", {}),
    ("ws_control", "a  {{- 'b' -}}  c\n  {%- if true -%}  d  {%- endif -%}  e", {}),
    ("trim_lstrip_blocks", "line1\n    {% if true %}\n    inside\n    {% endif %}\nline2\n", {}),
    ("lstrip_plus", "x\n    {%+ if true %}y{% endif %}\n", {}),
    ("trim_plus", "{% if true +%}\nkept newline{% endif %}", {}),
    ("comment_lstrip", "a\n   {# c #}\nb", {}),
    ("var_no_lstrip", "a\n   {{ 'v' }}\nb", {}),
    ("trailing_newline_dropped", "abc\n", {}),
    ("crlf", "a\r\n{% if true %}\r\nb\r\n{% endif %}\r\nc", {}),
    ("raw", "{% raw %}{{ not evaluated }}{% endraw %}!", {}),
    ("string_literals", "{{ '{{' }}x{{ '}}' }} {{ \"dq 'sq'\" }} {{ 'a\\nb\\t\\u00e9\\x41\\\\' }} {{ 'con' 'cat' }}", {}),
    ("arith_int_float", "{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 2 ** -1 }} {{ 2 ** 3 ** 2 }} {{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 7.5 // 2 }} {{ 7.5 % 2 }}", {}),
    ("string_ops", "{{ 'a' + 'b' }} {{ 'ab' * 3 }} {{ 1 ~ 'x' ~ none ~ true ~ nope }} {{ [1] + [2, 3] }}", {}),
    ("compare", "{{ 1 < 2 < 3 }} {{ 1 < 3 < 2 }} {{ 'a' < 'b' }} {{ 1 == 1.0 }} {{ true == 1 }} {{ [1,2] == [1,2] }} {{ 'a' != 'b' }} {{ none == none }}", {}),
    ("in_notin", "{{ 'b' in 'abc' }} {{ 2 in [1,2] }} {{ 'k' in {'k':1} }} {{ 'z' not in 'abc' }} {{ not 'a' in 'a' }}", {}),
    ("logic", "{{ 0 or 'x' }} {{ 1 and 'y' }} {{ '' and 'z' }} {{ none or [] }} {{ not none }} {{ not 1 or 0 }}", {}),
    ("condexpr", "{{ 'y' if true else 'n' }} {{ 'y' if false else 'n' }} [{{ 'y' if false }}] {{ 1 if 0 else 2 if 0 else 3 }}", {}),
    ("unary", "{{ -3 }} {{ - 3 | abs }} {{ -(3) }} {{ +4 }} {{ -1.5 }} {{ 2 - -1 }}", {}),
    ("filter_precedence", "{{ 'a' ~ ' b ' | trim }} {{ '<t>' ~ '  x  ' | trim ~ '|' }} {{ [1,2,3] | length > 2 }}", {}),
    ("if_elif_else", "{% for x in [1,2,3,4] %}{% if x == 1 %}one{% elif x == 2 %}two{% elif x == 3 %}three{% else %}other{% endif %} {% endfor %}", {}),
    ("for_loop_vars", "{% for x in ['a','b','c'] %}{{ loop.index0 }}{{ loop.index }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}[{{ loop.previtem }}|{{ loop.nextitem }}]{{ loop.cycle('o','e') }} {% endfor %}", {}),
    ("for_if_filter", "{% for x in range(10) if x is odd %}{{ loop.index }}:{{ x }}{{ ',' if not loop.last }}{% endfor %}", {}),
    ("for_else", "{% for x in [] %}x{% else %}empty{% endfor %}{% for x in [1] %}{{ x }}{% else %}no{% endfor %}", {}),
    ("for_dict_items", "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k in d %}{{ k }}{% endfor %}{% for k, v in d | items %}{{ v }}{% endfor %}", {"d": {"b": 1, "a": 2}}),
    ("for_string", "{% for c in 'héllo' %}{{ c }}.{% endfor %}", {}),
    ("for_unpack_list", "{% for a, b in [[1, 2], [3, 4]] %}{{ a + b }} {% endfor %}", {}),
    ("nested_loops", "{% for i in range(3) %}{% for j in range(i) %}{{ loop.index }}{{ i }}{% endfor %};{% endfor %}", {}),
    ("break_continue", "{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 5 %}{% break %}{% endif %}{{ x }}{% endfor %}", {}),
    ("loop_scope", "{% set x = 'outer' %}{% for i in [1] %}{% set x = 'inner' %}{{ x }}{% endfor %} {{ x }}", {}),
    ("if_scope_leaks", "{% if true %}{% set y = 'set in if' %}{% endif %}{{ y }}", {}),
    ("namespace", "{% set ns = namespace(n=0, s='') %}{% for i in range(4) %}{% set ns.n = ns.n + i %}{% set ns.s = ns.s ~ i %}{% endfor %}{{ ns.n }} {{ ns.s }}", {}),
    ("set_tuple", "{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set t = (1, 2) %}{{ t }}", {}),
    ("set_block", "{% set blk %}  inner {{ 1 + 1 }}  {% endset %}[{{ blk }}]{% set up | upper | trim %} shout {% endset %}[{{ up }}]", {}),
    ("macro", "{% macro greet(name, greeting='Hello', punct='!') %}{{ greeting }}, {{ name }}{{ punct }}{% endmacro %}{{ greet('Ann') }} {{ greet('Bob', 'Hi') }} {{ greet(name='Cy', punct='?') }}", {}),
    ("macro_missing_arg", "{% macro m(a, b) %}[{{ a }}|{{ b }}]{% endmacro %}{{ m(1) }}", {}),
    ("macro_recursion", "{% macro fact(n) %}{% if n <= 1 %}1{% else %}{{ n * (fact(n - 1) | int) }}{% endif %}{% endmacro %}{{ fact(6) }}", {}),
    ("macro_sees_globals", "{% macro m() %}{{ g }}{% endmacro %}{% set g2 = 1 %}{{ m() }}", {"g": "global"}),
    ("slicing", "{{ [1,2,3,4,5][1:] }} {{ [1,2,3,4,5][:-1] }} {{ [1,2,3,4,5][::2] }} {{ [1,2,3,4,5][::-1] }} {{ 'hello'[1:3] }} {{ 'héllo'[::-1] }} {{ [1,2][5:] }} {{ 'abc'[-1] }} {{ [1,2,3][-1] }}", {}),
    ("subscript_attr", "{{ d.a }} {{ d['a'] }} {{ l[0] }} {{ l.1 }} {{ d.nested.x }} {{ d['nested']['x'] }} [{{ l[9] }}]", {"d": {"a": 1, "nested": {"x": "y"}}, "l": [10, 20]}),
    ("str_methods", "{{ ' x '.strip() }}|{{ 'xxaxx'.strip('x') }}|{{ ' a '.lstrip() }}|{{ ' a '.rstrip() }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'a-b-c'.split('-', 1) }}|{{ 'aaa'.replace('a', 'b', 2) }}|{{ 'abc'.startswith('ab') }}|{{ 'abc'.endswith(('x', 'c')) }}|{{ 'MiXed'.upper() }}{{ 'MiXed'.lower() }}|{{ 'hello world'.title() }}|{{ 'hELLO'.capitalize() }}|{{ 'héllo'.find('l') }}|{{ 'abc'.find('z') }}|{{ ', '.join(['a', 'b']) }}|{{ 'a</think>b</think>c'.split('</think>')[-1] }}", {}),
    ("dict_methods", "{{ d.keys() | list }} {{ d.values() | list }} {{ d.items() | list }} {{ d.get('a') }} {{ d.get('z') }} {{ d.get('z', 'dflt') }}", {"d": {"a": 1, "b": [2]}}),
    ("tests", "{{ x is defined }}{{ y is defined }}{{ y is undefined }}{{ n is none }}{{ d is mapping }}{{ l is sequence }}{{ s is sequence }}{{ d is sequence }}{{ s is string }}{{ 1 is number }}{{ 1.5 is number }}{{ s is iterable }}{{ 1 is iterable }}{{ t is boolean }}{{ t is true }}{{ f is false }}{{ 1 is true }}{{ 2 is in [1,2] }}{{ 3 is equalto 3 }}{{ 9 is divisibleby 3 }}{{ 3 is odd }}{{ 3 is even }}{{ s is not string }}{{ n is not none }}", {"x": 1, "n": None, "d": {}, "l": [], "s": "s", "t": True, "f": False}),
    ("undefined_tests", "{{ y is sequence }} {{ y is iterable }} {{ y is mapping }} {{ y | length }} {{ y | default('dflt') }} {{ y | string }}|", {}),
    ("filters_basic", "{{ '  pad  ' | trim }}|{{ 'abc' | length }}|{{ [1,2] | length }}|{{ {'a':1} | length }}|{{ 5 | string }}|{{ none | string }}|{{ none | default('d') }}|{{ none | default('d', true) }}|{{ '' | default('e', true) }}|{{ 'Ab' | upper }}{{ 'Ab' | lower }}|{{ 'a-b' | replace('-', '+') }}|{{ [1,2,3] | first }}{{ [1,2,3] | last }}|{{ 'ab' | list }}|{{ '42' | int + 1 }}|{{ '3.7' | int }}|{{ 'x' | int }}|{{ '2.5' | float }}|{{ -3 | abs }}|{{ 2.567 | round(2) }}|{{ 2.5 | round }}|{{ 3.5 | round }}|{{ 2.1 | round(method='ceil') }}|{{ ['a','b'] | join(', ') }}|{{ [1,2] | join }}", {}),
    ("filters_seq", "{{ users | map(attribute='name') | list }}|{{ ['a','b'] | map('upper') | list }}|{{ [1,2,3,4] | select('odd') | list }}|{{ [1,2,3,4] | reject('odd') | list }}|{{ users | selectattr('admin') | map(attribute='name') | join(',') }}|{{ users | rejectattr('admin') | map(attribute='name') | join(',') }}|{{ users | selectattr('name', 'equalto', 'b') | list | length }}|{{ ['b','A','a','c'] | unique | list }}|{{ [3,1,2] | sort }}|{{ ['b','A','c'] | sort }}|{{ [3,1,2] | sort(reverse=true) }}|{{ users | sort(attribute='name', reverse=true) | map(attribute='name') | join }}|{{ {'b':1,'a':2} | dictsort }}|{{ [1,5,3] | max }}{{ [4,2] | min }}{{ [1,2,3] | sum }}|{{ [1,2] | reverse | list }}", {"users": [{"name": "a", "admin": True}, {"name": "c", "admin": False}, {"name": "b"}]}),
    ("filters_text", "{{ 'a\\nb\\n\\nc' | indent(2) }}|{{ 'a\\nb' | indent(2, true) }}|{{ 'a\\n\\nb' | indent(2, blank=true) }}|{{ 'one two, three' | wordcount }}|{{ 'hello world' | title }}|{{ 'hELLo' | capitalize }}|{{ '<a href=\"x\">&' | e }}|{{ 'x' | center(5) }}|", {}),
    ("tojson", "{{ d | tojson }}|{{ d | tojson(indent=2) }}|{{ d | tojson(sort_keys=true) }}|{{ 'é\"\\\\\\n😀\\u0001' | tojson }}|{{ [] | tojson }}{{ {} | tojson }}|{{ [1.5, none, true] | tojson }}|{{ s | tojson }}", {"d": {"z": [1, {"y": None}], "a": "中文 \"q\"", "e": {}}, "s": "tab\t nl\n bs\\ q\" emoji 😀 ctrl \u0007"}),
    ("tojson_indent_nested", "{{ d | tojson(indent=4) }}", {"d": {"a": [1, [2, []], {}], "b": {"c": "d"}}}),
    ("list_dict_literals", "{{ [1, [2, 3], {'a': [4]}] }} {{ {'k': 1, 2: 'two'} }} {{ (1,) }} {{ () }} {{ [1,2,][1] }}", {}),
    ("repr_quotes", "{{ ['it\\'s', 'say \"hi\"', 'both \\' \"', 'nl\\n', 'bs\\\\'] }}", {}),
    ("generation_tag", "a{% generation %}b{{ 1 }}{% endgeneration %}c", {}),
    ("filter_block", "{% filter upper %}shout {{ 'this' }}{% endfilter %}", {}),
    ("dict_global", "{{ dict(a=1, b='x') }} {{ dict(a=1).a }}", {}),
    ("range", "{{ range(3) | list }} {{ range(1, 7, 2) | list }} {{ range(5, 0, -2) | list }}", {}),
    ("bool_arith", "{{ true + 1 }} {{ true * 3 }} {{ 10 - true }}", {}),
    ("string_compare_unicode", "{{ 'é' > 'z' }} {{ 'abc' < 'abd' }} {{ 'ab' < 'abc' }}", {}),
    ("content_is_list", "{% for part in m.content %}{{ part.type }}:{{ part.text | default('-') }};{% endfor %}{{ m.content is string }}", {"m": {"content": [{"type": "text", "text": "hi"}, {"type": "image"}]}}),
    ("title_filter_vs_method", "{{ 'x,y z-w (a) it\'s' | title }}|{{ 'x,y z-w (a) it\'s'.title() }}", {}),
    ("select_on_falsy", "{{ n | select('odd') | list }}{{ z | map(attribute='a') | list }}{{ fa | selectattr('x') | list }}", {"n": None, "z": 0, "fa": False}),
    ("odd_even_float", "{{ 2.5 is odd }}{{ 3.0 is odd }}{{ 4.0 is even }}{{ 7.5 is divisibleby 2.5 }}", {}),
    ("err_slice_int", "{% set x = n[1:] %}", {"n": 3}),
    ("err_unhashable_in", "{{ [1] in {'a': 1} }}", {}),
    ("err_indent_int", "{{ n | indent(2) }}", {"n": 3}),
    # Jinja's compile-time scoping (idtracking): a name first stored directly in a scope starts undefined
    ("scope_root_load_first", "{{ n }}{% set n = 5 %}{{ n }}", {"n": 2}),
    ("scope_loop_before_root_set", "{% for x in [1] %}[{{ n }}]{% endfor %}{% set n = 5 %}", {"n": 2}),
    ("scope_blockset_before_root_set", "{% set b %}{{ n }}{% endset %}[{{ b }}]{% set n = 5 %}", {"n": 2}),
    ("scope_branch_store_resolves", "{% for x in [1] %}[{{ n }}]{% endfor %}{% if false %}{% set n = 1 %}{% endif %}", {"n": 2}),
    ("scope_for_else", "{% for x in [] %}{% else %}[{{ n }}]{% endfor %}{% set n = 5 %}", {"n": 2}),
    ("scope_macro_before_root_set", "{% macro m() %}[{{ n }}]{% endmacro %}{{ m() }}{% set n = 5 %}{{ m() }}", {"n": 2}),
    ("scope_macro_sees_root_not_caller", "{% macro m() %}{{ n }}{% endmacro %}{% for x in [1] %}{% set n = 7 %}{{ m() }}{% endfor %}", {"n": 2}),
    ("scope_loop_body_fresh", "{% for x in [1,2] %}[{{ y }}|{{ n }}]{% set y = x %}{% set n = x %}{% endfor %}", {"n": 2}),
    ("scope_nested_loop_sees_later_store", "{% for x in [1,2] %}{% for z in [0] %}[{{ s }}]{% endfor %}{% set s = x %}{% endfor %}", {"s": "ctx"}),
    ("scope_blockset_no_leak", "{% set b %}{% set z = 1 %}{% endset %}[{{ z }}]{% filter upper %}{% set w = 1 %}{% endfilter %}[{{ w }}]", {}),
    ("scope_set_self", "{% for x in [1] %}[{{ n }}]{% endfor %}{% set n = n %}", {"n": 2}),
    ("unicode_case", "{{ s.upper() }}|{{ s.lower() }}|{{ s.title() }}|{{ s | title }}|{{ s | capitalize }}|{{ s | wordcount }}", {"s": "straße ÉCOLE élan ŉ ΟΔΟΣ Σ'α привет МИР 東京 abc😀def it's"}),
    ("safe_makes_string", "{{ not [] | safe }} {{ 5 | safe ~ 1 }}", {}),
    ("err_test_extra_arg", "{{ 1 is false not in [] }}", {}),
    # errors (jinja2 fails; so must the engine)
    ("err_syntax_unclosed", "line1\n{% if x %}\nnever closed", {}),
    ("err_syntax_bad_expr", "ok\nok\n{{ 1 + }}", {}),
    ("err_unknown_filter", "{{ x | nosuchfilter }}", {}),
    ("err_unknown_test", "{{ x is nosuchtest }}", {}),
    ("err_unknown_tag", "{% frobnicate %}", {}),
    ("err_raise", "a\n{{ raise_exception('custom failure: ' ~ 42) }}", {}),
    ("err_undefined_attr", "{{ missing.attr }}", {}),
    ("err_undefined_add", "{{ missing + 1 }}", {}),
    ("err_type_add", "{{ 'a' + 1 }}", {}),
    ("err_div_zero", "{{ 1 // 0 }}", {}),
    ("err_items_string", "{% for k, v in 'abc' | items %}{% endfor %}", {}),
    ("err_not_iterable", "{% for x in 5 %}{% endfor %}", {}),
    ("err_unclosed_comment", "{# no end", {}),
    ("err_unmatched_endfor", "{% endfor %}", {}),
    ("err_tojson_undefined", "{{ nope | tojson }}", {}),
    ("err_break_outside", "{% break %}", {}),
    ("err_ns_set_non_namespace", "{% set d = {} %}{% set d.x = 1 %}", {}),
    ("err_none_iter", "{% for x in none %}{% endfor %}", {}),
    ("err_compare_types", "{{ 1 < 'a' }}", {}),
    ("err_list_append", "{% set l = [] %}{{ l.append(1) }}", {}),
]


def main():
    tdir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "..", "shared", "chat_templates")
    env = make_env()
    os.makedirs(OUT, exist_ok=True)
    rng = random.Random(10)
    total = 0
    for fn in sorted(os.listdir(tdir)):
        if not fn.endswith(".jinja"):
            continue
        with open(os.path.join(tdir, fn), encoding="utf-8") as f:
            source = f.read()
        # the template is copied next to its goldens so that the C test needs nothing outside the repo
        with open(os.path.join(OUT, fn), "w", encoding="utf-8", newline="") as f:
            f.write(source)
        cases = []
        for c in real_template_cases(rng):
            c.update(render(env, source, c["context"]))
            cases.append(c)
        stem = fn[: -len(".jinja")]
        with open(os.path.join(OUT, stem + ".golden.json"), "w", encoding="utf-8") as f:
            json.dump({"template": fn, "jinja2": jinja2.__version__, "cases": cases}, f, ensure_ascii=False, indent=1)
            f.write("\n")
        errs = sum(1 for c in cases if "error" in c)
        print(f"{fn}: {len(cases)} cases ({errs} where jinja2 raises)")
        total += len(cases)
    lang = []
    for name, src, ctx in LANG:
        c = {"name": name, "template": src, "context": ctx}
        c.update(render(env, src, ctx))
        lang.append(c)
    with open(os.path.join(OUT, "language.golden.json"), "w", encoding="utf-8") as f:
        json.dump({"jinja2": jinja2.__version__, "cases": lang}, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"language: {len(lang)} cases ({sum(1 for c in lang if 'error' in c)} errors)")


if __name__ == "__main__":
    main()
