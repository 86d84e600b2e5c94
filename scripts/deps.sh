#!/usr/bin/env bash
# Installs (or names) the Debian packages fp4moe needs to build and test.
# As root: apt-get installs what is missing. Otherwise: prints the exact apt line and exits 1.
set -euo pipefail
pkgs=(build-essential cmake pkg-config libcmocka-dev libcjson-dev libpcre2-dev libopenblas-dev
      libmicrohttpd-dev libedit-dev curl
      python3 python3-venv)   # python3-venv: scripts/pyenv.sh (mlx-lm oracle, openai client tests)
# libmicrohttpd-dev: fp4moe serve's HTTP; libedit-dev: fp4moe chat's line editor (BSD editline; optional for the
# build); curl: the server test talks to it with curl too
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ]; then
  echo "deps: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null || { echo "deps: apt-get update failed" >&2; exit 1; }
  apt-get install -y -qq "${missing[@]}" >/dev/null || { echo "deps: apt-get install failed: ${missing[*]}" >&2; exit 1; }
else
  echo "deps: missing packages; run as root:" >&2
  echo "  sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
