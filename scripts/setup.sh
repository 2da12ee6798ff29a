#!/usr/bin/env bash
# One-shot set-up on a fresh machine: a virtual environment in .venv with the CPU build of torch
# (pinned: an unpinned torch pulls a multi-GB CUDA build) and this project installed editable.
# --test also installs what the test suite needs from Debian (espeak-ng and sox for real speech,
# chromium for the browser test) when apt-get is available and we are root.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="pipecat"
if [[ "${1:-}" == "--test" ]]; then
  extras="test"
  if command -v apt-get >/dev/null && [[ "$(id -u)" == 0 ]]; then
    missing=()
    for pkg in espeak-ng sox chromium; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
    if (( ${#missing[@]} )); then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
  fi
fi
[[ -x .venv/bin/python ]] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q "torch==2.13.0" -e ".[${extras}]"
