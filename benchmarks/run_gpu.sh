#!/usr/bin/env bash
# Everything that needs a GPU, in one command (CI has none; run it on the GPU machine):
#   1. the CUDA-graph parity tests (graphed == eager on the golden tiny checkpoint, really captured);
#   2. the real-time suite: eager vs graphed first audio per stage, ms/token, ms/chunk, RTF,
#      concurrent calls, bf16 parity at full size -> benchmarks/results/gpu_suite.md (+ .json);
#   3. the CPU benchmark suite on CUDA in bfloat16 -> benchmarks/results/gpu.md (skipped with --quick).
#   bash benchmarks/run_gpu.sh            # all of it
#   bash benchmarks/run_gpu.sh --quick    # 1 and 2, tiny size, short runs (a check that it all runs)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device visible to torch: nothing to measure" >&2
    exit 1
fi
"$PYTHON" -m pytest -q -rs tests/test_gpu_graphs.py tests/test_whisper_decode.py
if [ "${1:-}" = "--quick" ]; then
    exec "$PYTHON" -m benchmarks.gpu_suite --device cuda --dtype bfloat16 --size tiny --quick \
        --out benchmarks/results/gpu_suite_tiny.md
fi
"$PYTHON" -m benchmarks.gpu_suite --device cuda --dtype bfloat16 --size full
"$PYTHON" benchmarks/bench_asr.py --models large --device cuda --dtype bfloat16
exec "$PYTHON" benchmarks/run_all.py --device cuda --dtype bfloat16 \
    --out benchmarks/results/gpu.md --results benchmarks/results/gpu "$@"
