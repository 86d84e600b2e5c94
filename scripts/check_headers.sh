#!/usr/bin/env bash
# scripts/check_headers.sh CC [CXX]: every public header (include/fp4moe/*.h) compiles on its own as C11 with
# -Wall -Wextra -pedantic -Werror, and as C++17 where a C++ compiler is given; every header that declares
# functions wraps them in extern "C" for C++ callers (a C++ program linking a header without it gets undefined
# references). ctest api/headers runs it. Exit 0 when all hold.
set -u
cd "$(dirname "$0")/.."
CC=${1:-cc}
CXX=${2:-}
fail=0
for h in include/fp4moe/*.h; do
    n=${h#include/}
    if ! printf '#include "%s"\nint fp4moe_header_check_;\n' "$n" |
        "$CC" -std=c11 -Wall -Wextra -pedantic -Werror -fsyntax-only -Iinclude -x c - 2>/tmp/fp4moe_hdr.$$; then
        echo "FAIL $n: does not compile alone as C11:"; cat /tmp/fp4moe_hdr.$$; fail=1
    fi
    if [ -n "$CXX" ] && ! printf '#include "%s"\nint fp4moe_header_check_;\n' "$n" |
        "$CXX" -std=c++17 -Wall -Wextra -pedantic -Werror -fsyntax-only -Iinclude -x c++ - 2>/tmp/fp4moe_hdr.$$; then
        echo "FAIL $n: does not compile alone as C++17:"; cat /tmp/fp4moe_hdr.$$; fail=1
    fi
    # a function declaration: a line starting with a type and holding "fp4moe_...(" at top level
    if grep -qE '^[a-z_][a-z0-9_ *]*[ *]fp4moe_[a-z0-9_]+\(' "$h" && ! grep -q 'extern "C"' "$h"; then
        echo "FAIL $n: declares functions without extern \"C\" for C++"; fail=1
    fi
done
rm -f /tmp/fp4moe_hdr.$$
[ $fail = 0 ] && echo "public headers: $(ls include/fp4moe/*.h | wc -l) compile alone (C11${CXX:+, C++17}), extern \"C\" where needed"
exit $fail
