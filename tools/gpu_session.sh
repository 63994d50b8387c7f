#!/usr/bin/env bash
# The one prepared run for a session that is lent a GPU machine (the device tool): it installs the
# packages the GPU image lacks from carried wheels, then runs the GPU check (tools/gpu_checks.py at
# Qwen3-8B's layer shapes, 2 layers, bf16: one table of PASS/FAIL/SKIP with its figures, written to
# $OUT/gpu-checks.md and .json; budgeted at <= 10 minutes on one H100), then the GPU tests
# (pytest -m gpu tests/gpu), and exits non-zero if either failed.
#
# On the CPU machine first (the device image runs Python 3.12 with its own torch; nothing can be
# fetched there):
#   python3 -m pip download -d .gpu-wheels --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any \
#       'megatron-core==0.16.1' 'math-verify==0.9.0' latex2sympy2_extended 'antlr4-python3-runtime==4.13.2' \
#       fastapi starlette uvicorn pydantic pydantic-core typing-inspection annotated-types httptools
# (the image has torch, transformers, aiohttp, httpx and uvloop, not the stand-in server's fastapi stack,
# which the weight_sync check and the RL checks need)
# then run it through the device tool with carry=[".gpu-wheels"] and a timeout that leaves time
# to rerun once:  bash tools/gpu_session.sh
# GPU_CHECKS_ARGS adds arguments to the check (a rerun of some: GPU_CHECKS_ARGS='--only weight_sync,moe').
# Record the table ($OUT/gpu-checks.md) in docs/training.md, "The GPU check".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -m pip install -q --no-index --no-deps .gpu-wheels/*.whl 2>&1 | tail -3
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$OUT/gpu.txt"
# the table on stdout; progress, warnings and any failure's traceback in gpu-checks.log
# shellcheck disable=SC2086  # GPU_CHECKS_ARGS: several words
python3 tools/gpu_checks.py --device cuda --shape 8b-layers --out "$OUT" ${GPU_CHECKS_ARGS:-} \
    2> "$OUT/gpu-checks.log" | tee "$OUT/gpu-checks.txt"
checks=${PIPESTATUS[0]}
[ "$checks" -eq 0 ] || { echo "== gpu_checks.py failed (exit $checks); the end of $OUT/gpu-checks.log:"; tail -40 "$OUT/gpu-checks.log"; }
python3 -m pytest -q -rs -m gpu tests/gpu -p no:cacheprovider --deselect tests/gpu/test_gpu_ipc.py 2>&1 | tee "$OUT/gpu-tests.txt" | tail -15
tests=${PIPESTATUS[0]}
# the in-memory push (rollout.weight_sync=memory), one check a line (tests/gpu/test_gpu_ipc.py):
# expandable_segments with a separately launched opener; the per-GPU rule with two GPUs (skipped,
# with the reason, on one); memory_reserved before and after the push
for check in test_a_handle_made_under_expandable_segments_opens_in_a_separately_launched_process \
    test_a_handle_of_a_gpu_the_opener_cannot_see_fails_and_its_own_opens \
    test_the_push_buffers_go_back_to_the_device_after_the_push; do
    python3 -m pytest -q -rs -m gpu "tests/gpu/test_gpu_ipc.py::$check" -p no:cacheprovider 2>&1 | tee -a "$OUT/gpu-tests.txt" | tail -3
    [ "${PIPESTATUS[0]}" -eq 0 ] || tests=1
done
echo "== gpu_checks.py exit $checks, pytest -m gpu exit $tests"
[ "$checks" -eq 0 ] && [ "$tests" -eq 0 ]
