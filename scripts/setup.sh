#!/usr/bin/env bash
# One-shot set-up on a fresh machine: a virtual environment in .venv with torch pinned to 2.13.0 and
# this project installed editable. Where pip finds a CPU wheel of that version (as on our machines
# and CI) that is the build it takes; elsewhere the default Linux wheel carries CUDA (multi-GB):
# set TORCH_INDEX_URL to PyTorch's CPU-only wheel index to take the CPU build from there.
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
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
  .venv/bin/python -m pip install -q "torch==2.13.0" --index-url "$TORCH_INDEX_URL"
fi
.venv/bin/python -m pip install -q "torch==2.13.0" -e ".[${extras}]"
