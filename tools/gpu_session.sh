#!/usr/bin/env bash
# The one prepared run for a session that is lent a GPU machine (the device tool): it installs the
# packages the GPU image lacks from carried wheels, then runs the GPU tests and prints a summary.
#
# On the CPU machine first (the device image runs Python 3.12 with its own torch; nothing can be
# fetched there):
#   python3 -m pip download -d .gpu-wheels --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any \
#       'megatron-core==0.16.1' 'math-verify==0.9.0' latex2sympy2_extended 'antlr4-python3-runtime==4.13.2' \
#       fastapi starlette uvicorn pydantic pydantic-core typing-inspection annotated-types httptools
# (the image has torch, transformers, aiohttp, httpx and uvloop, not the stand-in server's fastapi stack)
# then run it through the device tool with carry=[".gpu-wheels"] and a timeout that leaves time
# to rerun once:  bash tools/gpu_session.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -m pip install -q --no-index --no-deps .gpu-wheels/*.whl 2>&1 | tail -3
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -rs -m gpu tests/gpu -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.txt" | tail -15
