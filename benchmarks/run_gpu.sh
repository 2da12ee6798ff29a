#!/usr/bin/env bash
# Everything that needs a GPU, in one command (CI has none; run it on the GPU machine). Parts:
#   tests      the CUDA-graph parity tests (graphed == eager on the golden tiny checkpoint, really captured);
#   suite      the real-time suite: eager vs graphed first audio per stage, ms/token, ms/chunk, RTF,
#              concurrent calls, bf16 parity at full size -> benchmarks/results/gpu_suite.md (+ .json);
#   asr        the Whisper-large-v3-sized ASR benchmark (generate vs the static loop, drafts);
#   cpu-suite  the CPU benchmark suite on CUDA in bfloat16 -> benchmarks/results/gpu.md;
#   quick      the real-time suite at tiny size, short runs (a check that it all runs).
#   bash benchmarks/run_gpu.sh                  # tests suite asr cpu-suite
#   bash benchmarks/run_gpu.sh --quick          # tests quick
#   bash benchmarks/run_gpu.sh suite asr        # the parts named, in that order
# Works from a checkout without installing it (PYTHON=python3 on a machine with CUDA torch; the
# packages torch does not bring: scripts/gpu_wheels.sh, docs/GPU.md "On a GPU machine").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
export PYTHONPATH="$PWD:$PWD/plugin:$PWD/agents${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device visible to torch: nothing to measure" >&2
    exit 1
fi
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests suite asr cpu-suite)
[ "${parts[0]}" = "--quick" ] && parts=(tests quick)
for part in "${parts[@]}"; do
    echo "== $part ($(date +%H:%M:%S))"
    case "$part" in
        tests) "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/test_gpu_graphs.py tests/test_whisper_decode.py tests/test_device_copies.py ;;
        suite) "$PYTHON" -m benchmarks.gpu_suite --device cuda --dtype bfloat16 --size full ;;
        asr) "$PYTHON" benchmarks/bench_asr.py --models large --device cuda --dtype bfloat16 ;;
        cpu-suite) "$PYTHON" benchmarks/run_all.py --device cuda --dtype bfloat16 \
            --out benchmarks/results/gpu.md --results benchmarks/results/gpu ;;
        quick) "$PYTHON" -m benchmarks.gpu_suite --device cuda --dtype bfloat16 --size tiny --quick \
            --out benchmarks/results/gpu_suite_tiny.md ;;
        *) echo "unknown part '$part': tests, suite, asr, cpu-suite, quick or --quick" >&2; exit 2 ;;
    esac
done
