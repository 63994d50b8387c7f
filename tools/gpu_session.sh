#!/usr/bin/env bash
# The one prepared run for a session that is lent a GPU machine (the device tool). It installs what
# the GPU image lacks from carried wheels, then runs tools/gpu_session.py: a preflight, the GPU check
# (tools/gpu_checks.py at Qwen3-8B's layer shapes), the in-memory push under expandable segments and
# pytest -m gpu, each step under its own timeout and the whole under GPU_SESSION_BUDGET seconds
# (default 480), writing $OUT/gpu-session.md after every step (a cut run leaves its rows).
#
# Before the GPU time, on the CPU machine:
#   make gpu-wheels                   # the pinned wheels of requirements/gpu-session.txt into .gpu-wheels
#                                     # (Python 3.12, the device image's; the time it took: .gpu-wheels/BUILT)
#   bash tools/gpu_session.sh --dry-run   # the same control flow on the CPU (tiny shape; tests/test_gpu_session.py)
# Then through the device tool, with carry=[".gpu-wheels"] and a timeout that leaves time to rerun once:
#   bash tools/gpu_session.sh
# GPU_SESSION_STEPS=expandable,tests runs some steps alone (a rerun of what a cut run left).
# Record the table ($OUT/gpu-session.md) in docs/training.md, "The GPU session".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
if [ "${1:-}" = "--dry-run" ]; then
    PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
    exec "$PYTHON" tools/gpu_session.py run --dry-run --out "$OUT"
fi
t0=$(date +%s)
if [ -d .gpu-wheels ]; then
    python3 -m pip install -q --no-index --no-deps .gpu-wheels/*.whl 2>&1 | tail -3
else
    echo "warning: no .gpu-wheels (make gpu-wheels, then carry it): the preflight will name what is missing"
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
echo "installed in $(( $(date +%s) - t0 )) s" | tee "$OUT/install.txt"
exec python3 tools/gpu_session.py run --out "$OUT"
