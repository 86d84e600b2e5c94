#!/usr/bin/env bash
# scripts/check_install.sh BUILD CC [CXX]: the library as an application uses it. `cmake --install BUILD` into a
# scratch prefix; a C program built with `pkg-config --cflags --libs fp4moe` (from that prefix) that defines its own
# env_get (an internal name of the library: before session 31 the library called the application's) and greedy-
# decodes 8 tokens of the default model, its ids equal to `fp4moe generate --json`'s; the same as C++ where a C++
# compiler is given, and built from the build tree (BUILD/fp4moe-uninstalled.pc, no install); and no global symbol of
# the installed library but fp4moe_* ones. ctest api/install runs it.
set -u
cd "$(dirname "$0")/.."
BUILD=$1
CC=$2
CXX=${3:-}
T=$(mktemp -d "${TMPDIR:-/tmp}/fp4moe-install-XXXXXX")
trap 'rm -rf "$T"' EXIT
cmake --install "$BUILD" --prefix "$T/prefix" >"$T/install.log" 2>&1 || { cat "$T/install.log"; exit 1; }
export PKG_CONFIG_PATH="$T/prefix/lib/pkgconfig:$T/prefix/lib64/pkgconfig:$T/prefix/lib/x86_64-linux-gnu/pkgconfig:${PKG_CONFIG_PATH:-}"
FLAGS=$(pkg-config --cflags --libs fp4moe) || { echo "FAIL: pkg-config fp4moe"; exit 1; }
# a sanitizer build's library (scripts/sanitize-check.sh) needs its runtime in the program too
FLAGS="$FLAGS $(sed -n 's/^CMAKE_C_FLAGS:[A-Z]*=//p' "$BUILD/CMakeCache.txt" | grep -oE -- '-fsanitize=[^ ]+' | tr '\n' ' ')"
LIB=$(ls "$T"/prefix/lib*/libfp4moe.a "$T"/prefix/lib/*/libfp4moe.a 2>/dev/null | head -1)
[ -n "$LIB" ] || { echo "FAIL: no libfp4moe.a installed"; exit 1; }
other=$(nm -g --defined-only "$LIB" | awk 'NF == 3 {print $3}' | grep -v '^fp4moe_' | head -5)
[ -z "$other" ] || { echo "FAIL: global symbols other than fp4moe_* in $LIB: $other"; exit 1; }
cat >"$T/app.c" <<'C'
#include <stdio.h>
#include <stdlib.h>
#include "fp4moe/fp4moe.h"
/* the application's own helper, with a name the library uses internally */
const char *env_get(const char *name) { return getenv(name); }
int main(int argc, char **argv) {
    (void)argc;
    fp4moe_model *m = NULL;
    fp4moe_session *s = NULL;
    fp4moe_tokenizer *tok = NULL;
    int32_t *ids = NULL, next = 0;
    int64_t n = 0;
    if (fp4moe_model_load(argv[1], NULL, &m) || fp4moe_session_new(m, NULL, &s) ||
        fp4moe_tokenizer_load(argv[1], &tok) ||
        fp4moe_tokenizer_encode(tok, "The little girl opened the door", 31, 0, &ids, &n)) {
        fprintf(stderr, "app: %s\n", fp4moe_last_error());
        return 1;
    }
    printf("%s", fp4moe_version());
    for (int i = 0; i < 8; i++) {
        if (fp4moe_session_forward_argmax(s, i ? &next : ids, i ? 1 : n, &next)) {
            fprintf(stderr, "app: %s\n", fp4moe_last_error());
            return 1;
        }
        printf(" %d", (int)next);
    }
    printf("\n");
    free(ids);
    fp4moe_tokenizer_free(tok);
    fp4moe_session_free(s);
    fp4moe_model_free(m);
    return env_get("FP4MOE_NO_SUCH_VARIABLE") != NULL;
}
C
# shellcheck disable=SC2086
"$CC" -std=c11 -Wall -Wextra -Werror "$T/app.c" -o "$T/app" $FLAGS 2>"$T/cc.log" || { echo "FAIL: C build"; cat "$T/cc.log"; exit 1; }
"$T/app" models/nemotron-h-tiny-moe >"$T/c.out" 2>&1 || { echo "FAIL: the C program"; cat "$T/c.out"; exit 1; }
want=$("$BUILD/fp4moe" generate -m models/nemotron-h-tiny-moe -p "The little girl opened the door" -n 8 --cpu-act float \
       --json 2>/dev/null | python3 -c 'import json, sys; print(" ".join(map(str, json.load(sys.stdin)["ids"])))')
got=$(cut -d' ' -f2- "$T/c.out")
[ "$got" = "$want" ] || { echo "FAIL: the C program's ids [$got], fp4moe generate's [$want]"; exit 1; }
if [ -n "$CXX" ]; then
    cp "$T/app.c" "$T/app.cpp"
    # shellcheck disable=SC2086
    "$CXX" -std=c++17 -Wall -Wextra -Werror "$T/app.cpp" -o "$T/appxx" $FLAGS 2>"$T/cxx.log" ||
        { echo "FAIL: C++ build"; cat "$T/cxx.log"; exit 1; }
    "$T/appxx" models/nemotron-h-tiny-moe >"$T/cxx.out" 2>&1 || { echo "FAIL: the C++ program"; cat "$T/cxx.out"; exit 1; }
    cmp -s "$T/c.out" "$T/cxx.out" || { echo "FAIL: C++ output differs"; exit 1; }
fi
# the build tree's fp4moe-uninstalled.pc (no install): the same program, the same ids
UFLAGS=$(PKG_CONFIG_PATH="$BUILD" pkg-config --cflags --libs fp4moe) || { echo "FAIL: pkg-config fp4moe (build tree)"; exit 1; }
case "$UFLAGS" in *"$BUILD"/embed/libfp4moe.a*|*"$(cd "$BUILD" && pwd)"/embed/libfp4moe.a*) ;;
*) echo "FAIL: the build tree's pkg-config flags do not name embed/libfp4moe.a: $UFLAGS"; exit 1 ;; esac
UFLAGS="$UFLAGS $(sed -n 's/^CMAKE_C_FLAGS:[A-Z]*=//p' "$BUILD/CMakeCache.txt" | grep -oE -- '-fsanitize=[^ ]+' | tr '\n' ' ')"
# shellcheck disable=SC2086
"$CC" -std=c11 -Wall -Wextra -Werror "$T/app.c" -o "$T/appu" $UFLAGS 2>"$T/ccu.log" || { echo "FAIL: C build (build tree)"; cat "$T/ccu.log"; exit 1; }
"$T/appu" models/nemotron-h-tiny-moe >"$T/u.out" 2>&1 || { echo "FAIL: the C program (build tree)"; cat "$T/u.out"; exit 1; }
cmp -s "$T/c.out" "$T/u.out" || { echo "FAIL: the build-tree program's output differs"; exit 1; }
echo "installed library: $(head -c 5 "$T/c.out"), only fp4moe_* global, C${CXX:+ and C++} programs built with pkg-config (installed and build tree): ids $got"
