#!/usr/bin/env bash
# Fuzzes fp4moe serve's request parsing with libFuzzer (clang -fsanitize=fuzzer,address,undefined).
# usage: fuzz/run_request.sh [SECONDS]   (default 300; one job, one core)
# Seeds: the request bodies of tests/server/regressions/ and a few written here. Crashing / leaking /
# timing-out inputs land in fuzz-out/request/artifacts/; copy each into tests/server/regressions/
# (the ctest server/test_srv replays them all), then fix the parser.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_TO_RUN=${1:-300}
OUT=fuzz-out/request
mkdir -p "$OUT/corpus" "$OUT/artifacts"
CC=${CC:-clang}
$CC -std=c11 -g -O1 -D_GNU_SOURCE -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -Iinclude -Isrc fuzz/fuzz_request.c src/server/srv_request.c src/server/srv_text.c src/server/srv_tokenize.c src/template/*.c src/tokenizer/*.c src/grammar/*.c \
    src/common/error.c src/common/json.c src/model/sampler.c $(pkg-config --cflags --libs libpcre2-8) -lcjson -lm -o "$OUT/fuzz_request"
cp tests/server/regressions/* "$OUT/corpus/" 2>/dev/null || true
echo "fuzzing for ${SECONDS_TO_RUN}s ..."
"$OUT/fuzz_request" "$OUT/corpus" -dict=fuzz/request.dict -max_total_time="$SECONDS_TO_RUN" \
    -max_len=4096 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$OUT/artifacts/" 2>&1 | tee "$OUT/fuzz.log" | grep -E "^#[0-9]+.*(DONE|pulse)|stat::|ERROR|SUMMARY" || true
echo "artifacts (copy crashes into tests/server/regressions/):"
ls -l "$OUT/artifacts/"
