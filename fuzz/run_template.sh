#!/usr/bin/env bash
# Fuzzes the chat-template engine with libFuzzer (clang -fsanitize=fuzzer,address,undefined).
# usage: fuzz/run_template.sh [SECONDS]   (default 300; one job, one core)
# Seeds: the real templates and the language goldens' templates (tests/golden/templates/) and the
# regression inputs. Crashing / leaking / timing-out inputs land in fuzz-out/template/artifacts/;
# copy each into tests/template/regressions/ (the ctest template/test_template replays them all),
# then fix the engine.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_TO_RUN=${1:-300}
OUT=fuzz-out/template
mkdir -p "$OUT/corpus" "$OUT/artifacts"
CC=${CC:-clang}
$CC -std=c11 -g -O1 -D_GNU_SOURCE -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -Iinclude -Isrc fuzz/fuzz_template.c src/template/*.c src/common/error.c \
    -lcjson -lm -o "$OUT/fuzz_template"
cp tests/golden/templates/*.jinja "$OUT/corpus/"
python3 - "$OUT/corpus" <<'PY'
import json, sys, hashlib
d = json.load(open("tests/golden/templates/language.golden.json"))
for c in d["cases"]:
    src = c["template"].encode()
    open(f"{sys.argv[1]}/lang_{hashlib.sha1(src).hexdigest()[:12]}", "wb").write(src)
PY
cp tests/template/regressions/* "$OUT/corpus/" 2>/dev/null || true
echo "fuzzing for ${SECONDS_TO_RUN}s ..."
"$OUT/fuzz_template" "$OUT/corpus" -dict=fuzz/template.dict -max_total_time="$SECONDS_TO_RUN" \
    -max_len=8192 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$OUT/artifacts/" 2>&1 | tee "$OUT/fuzz.log" | grep -E "^#[0-9]+.*(DONE|pulse)|stat::|ERROR|SUMMARY" || true
echo "artifacts (copy crashes into tests/template/regressions/):"
ls -l "$OUT/artifacts/"
