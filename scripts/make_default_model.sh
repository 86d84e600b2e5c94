#!/usr/bin/env bash
# Makes the shipped default model models/nemotron-h-tiny-moe (MLX nvfp4) from the trained bf16
# original models/nemotron-h-tiny-moe-bf16 (scripts/train_default_model.py) with fp4moe's own
# quantizer, default rules (`fp4moe quantize --help`):
#   NVFP4 (E2M1 codes + E4M3 block scale per 16 weights, no global scale): every Mamba in/out_proj,
#     attention q/k/v/o_proj, dense MLP up/down_proj, shared expert, and the routed experts, which
#     are stacked into mixer.switch_mlp.fc1/fc2 (E, N, K/8);
#   kept as stored (bf16; the correction bias fp32): embeddings, lm_head, norms, the router gate and
#     its e_score_correction_bias, conv1d (reshaped to MLX's (C, Kc, 1)), A_log, D, dt_bias.
# config.json gets "quantization": {"group_size": 16, "bits": 4, "mode": "nvfp4"}; tokenizer and
# generation config are copied. The training records (train_log.json, train.log) stay with the bf16
# original; MODEL.md (written by hand) is left as it is. The output is bit-for-bit reproducible.
# Usage: scripts/make_default_model.sh [BUILD_DIR]   (default: build; needs BUILD_DIR/fp4moe)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
BIN=$BUILD/fp4moe
SRC=${SRC:-models/nemotron-h-tiny-moe-bf16}   # the bf16 original (override: SRC=DIR)
OUT=models/nemotron-h-tiny-moe
if [[ ! -x "$BIN" ]]; then
  echo "make_default_model: $BIN not found; build first (make build)" >&2
  exit 1
fi
tmp=$(mktemp -d "${TMPDIR:-/tmp}/fp4moe-default-model.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

"$BIN" quantize --input "$SRC" --output "$tmp/q"
mkdir -p "$OUT"
for f in config.json generation_config.json model.safetensors tokenizer.json tokenizer_config.json; do
  cp "$tmp/q/$f" "$OUT/$f"
done
"$BIN" inspect -m "$OUT" --summary
sha256sum "$OUT/model.safetensors"
