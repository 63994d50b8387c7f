"""Run a function in N fresh processes that form a gloo process group.

Megatron's parallel state is process-global, so every distributed test runs in its own spawned
processes. Spawning costs a few seconds (mostly imports): group several checks into one call.
"""
from __future__ import annotations

import os
import socket
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue):
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
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes.

    ``fn`` must be a module-level function (it is pickled). Returns the per-rank return values
    (which must be picklable). Raises RuntimeError with the failing rank's traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = {}, {}
    try:
        import queue as _q

        for _ in range(world_size):
            try:
                rank, status, payload = queue.get(timeout=timeout)
            except _q.Empty:
                raise RuntimeError(
                    f"distributed test timed out after {timeout:.0f}s; got results from ranks "
                    f"{sorted(results)} and errors from {sorted(errors)}"
                ) from None
            (results if status == "ok" else errors)[rank] = payload
            if errors:
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        rank = min(errors)
        raise RuntimeError(f"rank {rank} of {world_size} failed:\n{errors[rank]}")
    return [results[r] for r in range(world_size)]
