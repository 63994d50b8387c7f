"""What only a GPU can say about the in-memory push (rollout.weight_sync=memory): CUDA IPC handles
opened by a separately launched process, the device named by UUID, and the memory it leaves. Each
check is a line of tools/gpu_session.sh (``pytest -m gpu tests/gpu/test_gpu_ipc.py::<name>``).
Skipped on machines without CUDA (marked ``gpu``)."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# a trainer rank: shares a bucket on its GPU (LOCAL_RANK) and prints the handle, then waits
PRODUCER = textwrap.dedent(
    """
    import sys, torch
    torch.cuda.set_device(int(sys.argv[1]))
    from megatron_klear.rollout.weight_sync.sharing import share_bucket
    t = torch.arange(4096, dtype=torch.float32, device="cuda") * (1 + int(sys.argv[1]))
    payload, buffer = share_bucket([("w", t)])
    print(payload, flush=True)
    sys.stdin.readline()  # alive until the opener is done
    """
)
# a server rank launched on its own: opens a handle as SGLang's patched rebuild would, prints the sum
OPENER = textwrap.dedent(
    """
    import sys, torch
    from megatron_klear.rollout.in_server.shared_tensors import open_shared_bucket
    try:
        named, _ = open_shared_bucket(sys.stdin.readline().strip())
        print("SUM", float(named[0][1].sum()), named[0][1].device, flush=True)
    except Exception as e:
        print("ERROR", type(e).__name__, e, flush=True)
    """
)


def _env(**extra):
    return {**os.environ, "PYTHONPATH": REPO, **extra}


def _open(local_rank: int, opener_env: dict) -> str:
    """A producer on GPU ``local_rank`` (expandable segments on, as the trainer's launchers set
    them), and an opener started apart from it with ``opener_env``; the opener's line."""
    producer = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, str(local_rank)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_env(PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"),
    )
    try:
        payload = producer.stdout.readline().strip()
        assert payload, "the producer printed no handle"
        opened = subprocess.run(
            [sys.executable, "-c", OPENER], input=payload + "\n", capture_output=True, text=True, env=_env(**opener_env)
        )
        return opened.stdout.strip() or opened.stderr[-2000:]
    finally:
        producer.communicate("done\n", timeout=60)


def test_a_handle_made_under_expandable_segments_opens_in_a_separately_launched_process():
    """The share buffer is allocated outside expandable segments (else torch would share it through
    a descriptor taken with pidfd_getfd, refused under ptrace_scope=1 or seccomp), and its device,
    named by UUID, maps back to the opener's index of the same GPU."""
    line = _open(0, {})
    assert line.startswith("SUM") and float(line.split()[1]) == float(sum(range(4096))), line


def test_a_handle_of_a_gpu_the_opener_cannot_see_fails_and_its_own_opens():
    """Two GPUs: the server rank started with CUDA_VISIBLE_DEVICES=1 opens GPU 1's copy, and fails
    on GPU 0's with SGLang's error (Invalid device_uuid), what the stand-in's rule copies."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: the per-GPU push between a trainer rank and a server rank on another GPU")
    own = _open(1, {"CUDA_VISIBLE_DEVICES": "1"})
    assert own.startswith("SUM") and float(own.split()[1]) == 2.0 * sum(range(4096)), own
    other = _open(0, {"CUDA_VISIBLE_DEVICES": "1"})
    assert other.startswith("ERROR") and "Invalid device_uuid" in other, other


def test_the_push_buffers_go_back_to_the_device_after_the_push():
    """memory_reserved before and after a bucket is shared and dropped: the cached blocks are given
    back (in_memory._return_cached_memory) before the servers take back their KV cache."""
    import torch

    from megatron_klear.rollout.weight_sync.in_memory import _return_cached_memory
    from megatron_klear.rollout.weight_sync.sharing import share_bucket

    torch.cuda.set_device(0)
    _return_cached_memory()
    before = torch.cuda.memory_reserved()
    t = torch.ones(64 << 20, dtype=torch.uint8, device="cuda")  # 64 MiB
    payload, buffer = share_bucket([("w", t)])
    assert torch.cuda.memory_reserved() >= before + (64 << 20)
    del payload, buffer, t
    _return_cached_memory()
    assert torch.cuda.memory_reserved() <= before, (before, torch.cuda.memory_reserved())
