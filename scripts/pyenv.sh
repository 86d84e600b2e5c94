#!/usr/bin/env bash
# Creates (or reuses) the Python venv of the mlx-lm golden oracle: BUILD/mlx-venv with the pins of
# scripts/requirements-mlx.txt (mlx[cpu], mlx-lm, transformers), from PyPI. Used by the ctest
# python/mlx_oracle (its fixture runs this first) and by scripts/make_mlx_golden.py.
# Idempotent: a venv whose stamp matches the requirements file is kept (well under a second);
# otherwise it is rebuilt (measured: ~35 s with an empty pip cache, ~360 MB on disk).
# Needs python3 with the venv module (Debian: python3-venv, installed by scripts/deps.sh).
# Usage: scripts/pyenv.sh [BUILD_DIR]   (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
REQ=scripts/requirements-mlx.txt
VENV=$BUILD/mlx-venv
STAMP=$VENV/.requirements-mlx.sha256
PY=${FP4MOE_PYTHON:-/usr/bin/python3}
[[ -x "$PY" ]] || PY=python3

want=$(sha256sum "$REQ" | cut -d' ' -f1)
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi
# one creator at a time (ctest may start this from several processes)
mkdir -p "$BUILD"
exec 9> "$BUILD/.mlx-venv.lock"
flock 9
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi
echo "pyenv: creating $VENV from $REQ" >&2
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check -r "$REQ"
echo "$want" > "$STAMP"
echo "pyenv: $VENV ready ($(du -sh "$VENV" | cut -f1))" >&2
