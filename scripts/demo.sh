#!/usr/bin/env bash
# `make demo`: the default model (models/nemotron-h-tiny-moe, a 22.5 M-parameter nemotron_h MoE in
# MLX nvfp4, see its MODEL.md) continues a fixed English prompt greedily on the CPU, then prints
# prefill / decode speeds, then (unless DEMO_KERNEL_BENCH=0) a short gather_qmm kernel table on the
# Nemotron-3-Nano MoE shape. Builds nothing: `make demo` builds first. About half a minute on 2 cores.
# Usage: scripts/demo.sh [BUILD_DIR]   (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
BIN=$BUILD/fp4moe
MODEL=models/nemotron-h-tiny-moe
PROMPT="The little girl opened the door and saw"
if [[ ! -x "$BIN" ]]; then
  echo "demo: $BIN not found; build first (make build, or: cmake -S . -B $BUILD && cmake --build $BUILD)" >&2
  exit 1
fi

log=$(mktemp "${TMPDIR:-/tmp}/fp4moe-demo.XXXXXX")
trap 'rm -f "$log"' EXIT

echo "== fp4moe generate -m $MODEL -p \"$PROMPT\" -n 64   (greedy, CPU, W4A8: int8 activations, --cpu-act q8)"
echo
printf '%s' "$PROMPT"
if ! "$BIN" generate -m "$MODEL" -p "$PROMPT" -n 64 --ignore-eos 2> "$log"; then
  cat "$log" >&2
  exit 1
fi
echo
sed -n 's/^generate: //p' "$log"
echo
echo "== fp4moe bench -m $MODEL --prompt-tokens 512 --gen-tokens 64 --repeats 1   (prefill / decode speed)"
"$BIN" bench -m "$MODEL" --prompt-tokens 512 --gen-tokens 64 --repeats 1 2>/dev/null

if [[ "${DEMO_KERNEL_BENCH:-1}" != 0 ]]; then
  echo
  echo "== fp4moe bench-kernel --both --E 128 --tokens 512 --topk 6 --repeats 3   (MoE gather_qmm, Nemotron-3-Nano shape)"
  "$BIN" bench-kernel --both --E 128 --tokens 512 --topk 6 --dtype bf16 --repeats 3
fi
