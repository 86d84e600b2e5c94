#!/usr/bin/env bash
# Fuzzes the tokenizer.json loader (+ encode/decode/stream) and the config.json parser with
# libFuzzer (clang -fsanitize=fuzzer,address,undefined), SECONDS each (default 300; one core).
# Seeds: the golden tokenizers / configs and the regression inputs. Crashing / leaking /
# timing-out inputs land in fuzz-out/{tokenizer,config}/artifacts/; copy them into
# tests/tokenizer/regressions/ or tests/model/regressions/ (replayed by the ctests
# tokenizer/test_tokenizer and model/test_config_regressions), then fix the parser.
# usage: fuzz/run_parsers.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_TO_RUN=${1:-300}
CC=${CC:-clang}
CF="-std=c11 -g -O1 -D_GNU_SOURCE -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -Iinclude -Isrc"
PCRE=$(pkg-config --cflags --libs libpcre2-8)
mkdir -p fuzz-out/tokenizer/{corpus,artifacts} fuzz-out/config/{corpus,artifacts}
$CC $CF fuzz/fuzz_tokenizer.c src/tokenizer/*.c src/common/error.c src/common/json.c $PCRE -lcjson -lm -o fuzz-out/tokenizer/fuzz_tokenizer
$CC $CF fuzz/fuzz_config.c src/model/config.c src/common/*.c -lcjson -lm -fopenmp -o fuzz-out/config/fuzz_config
for f in tests/golden/tokenizer/*_style.json tests/golden/tokenizer/v_*.json; do
  [ -f "$f" ] && head -c 60000 "$f" > "fuzz-out/tokenizer/corpus/$(basename "$f")"
done
cp tests/tokenizer/regressions/* fuzz-out/tokenizer/corpus/ 2>/dev/null || true
for d in models/nemotron-h-tiny-moe tests/golden/models/*/; do
  [ -f "$d/config.json" ] && cp "$d/config.json" "fuzz-out/config/corpus/$(basename "$d").json"
done
cp ../shared/configs/*.json configs/*.json fuzz-out/config/corpus/ 2>/dev/null || true
cp tests/model/regressions/* fuzz-out/config/corpus/ 2>/dev/null || true
for t in tokenizer config; do
  echo "== $t: fuzzing for ${SECONDS_TO_RUN}s ..."
  "fuzz-out/$t/fuzz_$t" "fuzz-out/$t/corpus" -max_total_time="$SECONDS_TO_RUN" -max_len=65536 -timeout=10 \
      -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="fuzz-out/$t/artifacts/" 2>&1 |
      tee "fuzz-out/$t/fuzz.log" | grep -E "DONE|stat::number_of_executed|ERROR|SUMMARY" || true
  echo "artifacts:"; ls -l "fuzz-out/$t/artifacts/"
done
