#!/usr/bin/env bash
# Wheels for the GPU checks on a CUDA machine that cannot reach a package index but already has
# CUDA PyTorch, numpy, safetensors, peft, onnxruntime, tokenizers, huggingface-hub, aiohttp,
# matplotlib and pytest (a data-centre image; the lent GPU machine's has these). They are what
# `bash benchmarks/run_gpu.sh` imports beyond that, pinned to the versions our CPU tests run with.
# transformers stays the machine's own (a 5.x; the test suite passes with 5.17 as with 5.23).
#
#   bash scripts/gpu_wheels.sh [DIR] [PYTHON_VERSION]      # here, with an index: DIR (.whl) for 3.12
#   # there, from the repository root:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site PYTHON=python3 bash benchmarks/run_gpu.sh --quick
#
# --no-deps on both sides: the list is the closure of what the GPU runs import (traced with the
# test files, benchmarks.gpu_suite, bench_asr and run_all), so nothing the machine already has
# is replaced. 19 MB; .whl/ is git-ignored (docs/GPU.md, "On a GPU machine without a package index").
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.whl}"
python_version="${2:-3.12}"
wheels=(
    pipecat-ai==1.14.0 loguru==0.7.3 docstring_parser==0.18.0 sentencex==1.0.32 soundfile==0.13.1
    cffi==2.1.1 pycparser==3.12
    pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
    loudness==0.2.0 websockets==17.4 soxr==1.0.0 webrtcvad-wheels==2.0.14.post1 kaldi-native-fbank==1.23.0
)
# pipecat-ai needs wait_for2 below Python 3.12 only
[[ "$python_version" == 3.11 ]] && wheels+=(wait_for2==0.4.1)
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 \
    -d "$dir" "${wheels[@]}" 2> >(grep -v "is ignored" >&2)
ls -l "$dir"
du -sh "$dir"
