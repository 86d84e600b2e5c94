#!/usr/bin/env bash
# Fuzzes the safetensors header parser with libFuzzer (clang -fsanitize=fuzzer,address,undefined).
# usage: fuzz/run.sh [SECONDS]   (default 300; one job, one core)
# Crashing / leaking / timing-out inputs land in fuzz-out/artifacts/; copy each into
# tests/io/regressions/ (the ctest io/test_st_regressions replays them all), then fix the parser.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_TO_RUN=${1:-300}
OUT=fuzz-out
mkdir -p "$OUT/corpus" "$OUT/artifacts"
CC=${CC:-clang}
$CC -std=c11 -g -O1 -D_GNU_SOURCE -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -Iinclude -Isrc fuzz/fuzz_safetensors.c src/io/safetensors_read.c src/common/error.c \
    -lcjson -o "$OUT/fuzz_safetensors"
# seeds: the regression inputs plus a few valid files written here (8-byte length + header + data)
seed() { # name header data_len
  python3 -c 'import struct,sys; h=sys.argv[2].encode(); open(sys.argv[1],"wb").write(struct.pack("<Q",len(h))+h+bytes(range(1,1+int(sys.argv[3]))))' "$OUT/corpus/$1" "$2" "$3"
}
seed s1 '{"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]}}' 12
seed s2 '{"__metadata__":{"format":"pt"},"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[],"data_offsets":[4,8]}}' 8
seed s3 '{"x.weight":{"dtype":"U32","shape":[2,2],"data_offsets":[0,16]},"x.scales":{"dtype":"U8","shape":[2,1],"data_offsets":[16,18]},"z":{"dtype":"F8_E4M3","shape":[0],"data_offsets":[18,18]}}' 18
# header-only seeds (the harness also wraps every input as a header with a correct length)
printf '%s' '{"a":{"dtype":"I64","shape":[2,2,2],"data_offsets":[0,64]},"b":{"dtype":"F16","shape":[8],"data_offsets":[64,80]},"c":{"dtype":"U8","shape":[1],"data_offsets":[70,71]}}' > "$OUT/corpus/h0"
printf '%s' '{"__metadata__":{"format":"pt"},"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]}}' > "$OUT/corpus/h1"
cp tests/io/regressions/*.bin "$OUT/corpus/" 2>/dev/null || true
echo "fuzzing for ${SECONDS_TO_RUN}s ..."
"$OUT/fuzz_safetensors" "$OUT/corpus" -dict=fuzz/safetensors.dict -max_total_time="$SECONDS_TO_RUN" \
    -max_len=4096 -timeout=5 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$OUT/artifacts/" 2>&1 | tee "$OUT/fuzz.log" | grep -E "^#[0-9]+.*(DONE|pulse)|stat::|ERROR|SUMMARY" || true
echo "artifacts (copy crashes into tests/io/regressions/):"
ls -l "$OUT/artifacts/"
