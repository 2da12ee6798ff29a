#!/usr/bin/env bash
# The benchmark suite on CUDA in bfloat16 (the concurrency section, which measures process
# memory, is CPU-only). Writes benchmarks/results/gpu.md, plots and JSON under benchmarks/results/gpu/.
#   bash benchmarks/run_gpu.sh            # tiny + full size
#   bash benchmarks/run_gpu.sh --quick    # tiny only
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device visible to torch: nothing to measure" >&2
    exit 1
fi
exec "$PYTHON" benchmarks/run_all.py --device cuda --dtype bfloat16 \
    --out benchmarks/results/gpu.md --results benchmarks/results/gpu "$@"
