#!/usr/bin/env bash
# The GPU checks in one command sized for a lent GPU machine, which gives a session minutes, not
# hours: the CUDA-graph parity tests, then the real-time suite at real size in bfloat16 under a
# time budget. Every result is written into OUT_DIR as soon as it exists, so a run cut short still
# brings back the tests' output and every table the suite finished.
#
#   bash benchmarks/device_check.sh OUT_DIR [SECONDS]    # SECONDS: the whole run (default 540)
#
# REHEARSE=1 runs the same steps on a CPU (tiny size, short runs): a check of this script itself.
# CALLS=1,2,4,8,16 sets the rows of concurrent calls (default 1,2,4,8); PARTS=graphed_calls,... the
# suite's parts (default all, in the suite's order); TESTS_S the tests' share of the budget (default
# half: on the H100 22 of tests/test_gpu_graphs.py's 24 tests took 197 s and the other two files
# 28 s - the CUDA stream tests build engines at tiny size, tens of seconds each); TESTS=0 leaves the
# tests out (a session that measures what an earlier one left, on code whose GPU tests passed).
# FIRST_TURN=1 adds the first-turn benchmark (with and without the start-up rehearsal) before the suite.
# ASR_BATCH=1 adds the built-in ASR's benchmark at whisper-large-v3 size (bench_asr.py): eight turn
# ends decoded one by one against one batch (ASR_BATCH_S seconds at most, default 150).
# EAGER_OPS=1 adds the operators a turn's first audio runs outside captured steps, per stage, at full
# size (bench_eager_ops.py; EAGER_OPS_S seconds at most, default 240): eager path vs fast path.
# OUT_DIR gets machine.txt (GPU, driver, torch), tests.log, first_turn.txt, asr_batch.txt, eager_ops.txt, suite.log,
# gpu_suite.md and gpu_suite.json.
# On a machine without a package index whose image already has CUDA PyTorch and transformers, carry
# the wheels of `bash scripts/gpu_wheels.sh` in .whl/: they are installed first (docs/GPU.md).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bash benchmarks/device_check.sh OUT_DIR [SECONDS]}"
budget="${2:-540}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "installing the wheels in .whl failed" >&2; exit 2; }
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
export PYTHONPATH="$PWD:$PWD/plugin:$PWD/agents${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
{
    nvidia-smi || true
    "$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"
# Concurrent calls up to 8 (issue 9's target) unless CALLS says otherwise: a row of 16 costs as much
# as the others together, and three paths are compared (one stream, a synthesis stream, call streams).
suite=(--device cuda --dtype bfloat16 --size full --calls "${CALLS:-1,2,4,8}")
if [ "${REHEARSE:-0}" = 1 ]; then
    suite=(--device cpu --dtype float32 --size tiny --quick --calls 1,2)
elif ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device visible to torch: nothing to measure" >&2
    exit 1
fi
if [ -n "${PARTS:-}" ]; then
    suite+=(--parts "$PARTS")
fi

# The parity tests first (an acceptance point of their own, and a broken capture shows here in
# seconds), at most TESTS_S seconds.
tests_rc=0
if [ "${TESTS:-1}" != 0 ]; then
    echo "== tests ($(date +%H:%M:%S))"
    # (SIGINT, not TERM: pytest then still prints its failures and the tests it did not reach)
    timeout -s INT -k 10 "${TESTS_S:-$((budget / 2))}" "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider \
        tests/test_gpu_graphs.py tests/test_whisper_decode.py tests/test_device_copies.py 2>&1 | tee "$out/tests.log"
    tests_rc=${PIPESTATUS[0]}
fi

# FIRST_TURN=1: the first caller after a start, with and without the rehearsal turn (one fresh
# process each; bench_first_turn.py), at most FIRST_TURN_S seconds (default 240: each process
# builds the full model and warms an engine up, some 100 s on the H200; each prints its line as it
# ends, so a run cut short still shows the first).
if [ "${FIRST_TURN:-0}" = 1 ]; then
    echo "== first turn ($(date +%H:%M:%S))"
    first=(--device cuda --dtype bfloat16 --size full)
    [ "${REHEARSE:-0}" = 1 ] && first=(--device cpu --size tiny)
    timeout -k 10 "${FIRST_TURN_S:-240}" "$PYTHON" benchmarks/bench_first_turn.py "${first[@]}" --processes 1 \
        2>&1 | tee "$out/first_turn.txt"
fi

# ASR_BATCH=1: the ASR's parts and eight turn ends, one by one vs one batch (bench_asr.py).
if [ "${ASR_BATCH:-0}" = 1 ]; then
    echo "== ASR batches ($(date +%H:%M:%S))"
    asr=(--models large --device cuda --dtype bfloat16 --together 8)
    [ "${REHEARSE:-0}" = 1 ] && asr=(--models tiny --together 4 --repeats 2)
    timeout -k 10 "${ASR_BATCH_S:-150}" "$PYTHON" benchmarks/bench_asr.py "${asr[@]}" 2>&1 | tee "$out/asr_batch.txt"
fi

# EAGER_OPS=1: the operators left outside the graphs per first-audio stage (bench_eager_ops.py).
if [ "${EAGER_OPS:-0}" = 1 ]; then
    echo "== eager operators ($(date +%H:%M:%S))"
    ops=(--size full --device cuda --dtype bfloat16)
    [ "${REHEARSE:-0}" = 1 ] && ops=(--size tiny --device cpu)
    timeout -k 10 "${EAGER_OPS_S:-240}" "$PYTHON" benchmarks/bench_eager_ops.py "${ops[@]}" 2>&1 | tee "$out/eager_ops.txt"
fi

# The suite gets what is left. It starts no part later than a minute before the end (its longest
# part, a row of concurrent calls, should fit in that minute), and `timeout` stops it at the end.
left=$((budget - SECONDS - 5))
if [ "$left" -lt 120 ]; then  # (the suite's budget is what is left less a minute: too little to build the model)
    echo "== suite skipped ($(date +%H:%M:%S)): ${left} s left" >&2
    [ "$tests_rc" -eq 0 ]
    exit
fi
echo "== suite ($(date +%H:%M:%S), ${left} s left)"
timeout -k 10 "$left" "$PYTHON" -m benchmarks.gpu_suite "${suite[@]}" \
    --budget-s $((left - 60)) --out "$out/gpu_suite.md" 2>&1 | tee "$out/suite.log"
suite_rc=${PIPESTATUS[0]}
echo "== done ($(date +%H:%M:%S)): tests exit $tests_rc, suite exit $suite_rc (124: stopped at the budget)"
[ "$tests_rc" -eq 0 ] && [ "$suite_rc" -eq 0 ]
