"""Fetch SGLang's own HTTP request/response contract for the tests (no CUDA needed).

SGLang needs CUDA to run, but its wheel carries the schema its server enforces on ``/generate``
(``sglang/api/v1/api_types.py``, generated msgspec structs that need only ``msgspec``). The tests
validate every request our client sends, and every response our embedded server answers, against
that file; the bodies of the control calls (weight updates over a process group, pause/continue,
versions) are checked against the request structs of ``sglang/srt/managers/io_struct.py``, read as
source (importing it needs SGLang's dependencies), and the tensors the delta syncs send through
``update_weights_from_tensor`` against the allow-list of ``SafeUnpickler`` in
``sglang/srt/utils/common.py``, read as source too, as are the sources the delta loader relies on
(how a custom loader is called, how Qwen3's weight loaders write what they are given). This
script downloads the pinned wheel (no dependencies, the x86_64 / CPython 3.11 build whatever the
host), checks its sha256 and extracts those files::

    python tools/fetch_sglang_contract.py --out .venv/sglang-contract

Afterwards ``<out>/sglang/api/v1/api_types.py``, ``<out>/sglang/srt/managers/io_struct.py`` and
``<out>/sglang/srt/utils/common.py`` exist (``make venv`` runs this; a later run extracts only what is missing).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

SGLANG_VERSION = "0.5.23"
WHEEL = f"sglang-{SGLANG_VERSION}-cp311-cp311-manylinux_2_34_x86_64.whl"
SHA256 = "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937"
MEMBERS = (
    "sglang/api/v1/api_types.py",
    "sglang/srt/managers/io_struct.py",
    "sglang/srt/utils/common.py",  # SafeUnpickler: what update_weights_from_tensor's payload may hold
    # what the delta loader relies on (tests/rollout/test_sglang_loader_contract.py): how a custom
    # loader is called and the update groups kept, and how Qwen3's weight loaders write a tensor
    "sglang/srt/model_executor/model_runner_components/weight_updater.py",
    "sglang/srt/managers/scheduler_components/weight_updater.py",
    "sglang/srt/models/qwen3.py",
    "sglang/srt/models/qwen3_moe.py",
    "sglang/srt/layers/linear.py",
    "sglang/srt/layers/vocab_parallel_embedding.py",
    "sglang/srt/layers/moe/fused_moe_triton/layer.py",
    "sglang/srt/model_loader/weight_utils.py",
    "sglang/srt/layers/utils/common.py",  # pad_or_narrow_weight, a helper those loaders hand the tensor to
    # the wheel's own dependency pins (torch, transformers, tokenizers): what
    # requirements/gpu-constraints.txt must agree with (tests/test_gpu_constraints.py)
    f"sglang-{SGLANG_VERSION}.dist-info/METADATA",
)


def fetch(out: str) -> str:
    target = os.path.join(out, MEMBERS[0])
    missing = [m for m in MEMBERS if not os.path.isfile(os.path.join(out, m))]
    if not missing:
        return target
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sglang-wheel-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            f"sglang=={SGLANG_VERSION}",
            "--no-deps",
            "--only-binary=:all:",
            "--platform",
            "manylinux_2_34_x86_64",
            "--python-version",
            "3.11",
            "-d",
            tmp,
            "-q",
        ]
        subprocess.run(cmd, check=True)
        wheel = os.path.join(tmp, WHEEL)
        if not os.path.isfile(wheel):
            raise SystemExit(f"fetch_sglang_contract: pip did not produce {WHEEL} (got {os.listdir(tmp)})")
        digest = hashlib.sha256(open(wheel, "rb").read()).hexdigest()
        if digest != SHA256:
            raise SystemExit(f"fetch_sglang_contract: {WHEEL} has sha256 {digest}, expected {SHA256}")
        staging = tempfile.mkdtemp(prefix=".tmp-", dir=out)
        try:
            with zipfile.ZipFile(wheel) as zf:
                for member in missing:
                    zf.extract(member, staging)
            for member in missing:
                dst = os.path.join(out, member)
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                os.replace(os.path.join(staging, member), dst)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".venv/sglang-contract")
    args = ap.parse_args(argv)
    print(fetch(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
