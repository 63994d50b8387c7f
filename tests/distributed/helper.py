"""Run a function in N fresh processes that form a gloo process group.

Megatron's parallel state is process-global, so every distributed test runs in its own processes.
They are forked from a fork server of this module's own (``_FORK_SERVER``) that has already
imported what the ranks use (``_PRELOAD``: torch, Megatron-Core, transformers, the package's
training, RL and rollout modules): a spawned process would spend 5-10 s of CPU on those imports,
for every rank of every test. The server is this module's, not multiprocessing's process-wide
one, because whoever starts that one first fixes its preload list for the whole process: the
grading pool (megatron_klear/rewards/pool.py) starts it with math-verify alone, and ranks forked
from it then imported everything afresh. The fork server only imports (it never runs an
operator, so no thread pool is copied into the children), and each rank gets the caller's
environment and working directory at the time of the call, as a spawned process would.
"""

from __future__ import annotations

import io
import os
import pickle
import queue as _q
import sys
import time
import traceback
from multiprocessing import context, forkserver, popen_forkserver, spawn, util

import torch.multiprocessing as mp

# imported once by the fork server; the ranks are forked from it with these modules loaded. What a
# rank imports beyond them costs every rank of every test (KLEAR_TEST_IMPORTS=1 prints it).
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "transformers",
    "transformers.models.qwen2.tokenization_qwen2",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.auto.modeling_auto",
    "megatron.core",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.dist_checkpointing",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.pipeline_parallel",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.post_training",
    "multiprocessing.managers",
    "multiprocessing.popen_spawn_posix",
    "torch.utils.serialization",
    "math_verify",
    "httpx",
    "fastapi",
    "uvicorn",
    "megatron_klear.models.builder",
    "megatron_klear.training.step",
    "megatron_klear.platform.cpu_compat",
    "megatron_klear.training.setup",
    "megatron_klear.training.checkpointing",
    "megatron_klear.sft.trainer",
    "megatron_klear.rl.loop",
    "megatron_klear.checkpoint.convert",
    "megatron_klear.rollout.embedded",
    "megatron_klear.rollout.sglang",
    "megatron_klear.rollout.weight_sync",
    "megatron_klear.rollout.sglang_standin",
    "megatron_klear.rewards.math",
    "tests.distributed.helper",
]


class _Popen(popen_forkserver.Popen):
    """multiprocessing's forkserver Popen, asking ``_FORK_SERVER`` for the child."""

    def _launch(self, process_obj):
        data = io.BytesIO()
        context.set_spawning_popen(self)  # the pickled pipes and locks are sent as fds to the child
        try:
            context.reduction.dump(spawn.get_preparation_data(process_obj._name), data)
            context.reduction.dump(process_obj, data)
        finally:
            context.set_spawning_popen(None)
        self.sentinel, w = _FORK_SERVER.connect_to_new_process(self._fds)
        keep_alive = os.dup(w)  # the child's sign that this process still lives
        self.finalizer = util.Finalize(self, util.close_fds, (keep_alive, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(data.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _Process(context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        return _Popen(process_obj)


class _Context(context.ForkServerContext):
    Process = _Process


#: the toy RL runs' training settings (a constant, large lr: a tiny random model moves within 2-4
#: steps), one grading worker, TP=1
TOY_RL_TRAINING = [
    "optim.lr=5e-3",
    "optim.min_lr=5e-3",
    "optim.decay_style=constant",
    "reward.workers=1",
    "parallel.tp=1",
]

_FORK_SERVER = forkserver.ForkServer()
_FORK_SERVER.set_forkserver_preload(_PRELOAD)


def _cuda_machine() -> bool:
    import torch

    return torch.cuda.is_available()


def _context(backend: str = "gloo"):
    # NCCL ranks use CUDA, which a child forked from the fork server cannot initialise once one of
    # the preloaded imports has touched it ("Cannot re-initialize CUDA in forked subprocess", seen
    # on an H200 with torch 2.11): they start the plain way, and so does every rank on a machine
    # with CUDA (a gloo world of the GPU tests may put tensors on the device too)
    if backend == "nccl" or os.environ.get("KLEAR_TEST_START_METHOD") == "spawn" or _cuda_machine():
        return mp.get_context("spawn")
    return _Context()


def _worker(rank, world_size, port, fn, args, queue, backend="gloo", env=None, cwd=None):
    if env is not None:  # the caller's environment now, not the fork server's at its start
        os.environ.clear()
        os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        # the rendezvous store is the parent's (see run_distributed): connect to it as a client
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        before = set(sys.modules)
        result = fn(rank, world_size, *args)
        if os.environ.get("KLEAR_TEST_IMPORTS") == "1":
            print(
                f"rank {rank} of {fn.__module__}.{fn.__name__} imported: "
                f"{sorted(m for m in set(sys.modules) - before if '.' not in m or m.count('.') < 3)}",
                file=sys.stderr,
                flush=True,
            )
        # Pickled here, with plain pickle: an unpicklable result fails in this rank with its
        # traceback (not silently in the queue's feeder thread), and tensors travel as bytes
        # rather than as shared-memory handles that die with this process.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0, backend: str = "gloo"):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes.

    ``fn`` must be a module-level function (it is pickled). Returns the per-rank return values
    (which must be picklable). Raises RuntimeError with the failing rank's traceback.
    """
    import torch.distributed as dist

    ctx = _context(backend)
    queue = ctx.Queue()
    # The rendezvous store listens in this process, on a port the OS picks at bind and that stays
    # held until the ranks are done. (A port found free, released, then bound by rank 0 seconds
    # later, after spawning and imports, could meanwhile be taken by another process.)
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, fn, args, queue, backend, dict(os.environ), os.getcwd()),
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = {}, {}
    try:
        deadline = time.time() + timeout
        while len(results) + len(errors) < world_size:
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except _q.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in errors]
                if dead:
                    raise RuntimeError(
                        f"rank {dead[0]} of {world_size} died with exit code {procs[dead[0]].exitcode} "
                        "before reporting (killed? out of memory? a crash in native code?)"
                    ) from None
                if time.time() > deadline:
                    raise RuntimeError(
                        f"distributed test timed out after {timeout:.0f}s; got results from ranks "
                        f"{sorted(results)} and errors from {sorted(errors)}"
                    ) from None
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
            if errors:
                break
    finally:
        t0 = time.monotonic()
        for p in procs:
            p.join(timeout=5 if errors else 30)
        if os.environ.get("KLEAR_TEST_EXITS") == "1" and time.monotonic() - t0 > 1.0:
            print(
                f"\n[exit] {fn.__module__}.{fn.__name__}: ranks took {time.monotonic() - t0:.1f} s to exit "
                f"after reporting (alive: {[r for r, p in enumerate(procs) if p.is_alive()]})",
                file=sys.stderr,
                flush=True,
            )
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        rank = min(errors)
        raise RuntimeError(f"rank {rank} of {world_size} failed:\n{errors[rank]}")
    return [results[r] for r in range(world_size)]
