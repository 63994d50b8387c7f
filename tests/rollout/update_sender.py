"""The trainer's side of one server's update group in a test: this process is group rank 0 (gloo),
the server rank 1, joined and driven through a client's wire (``engine.wire``), the buckets' pieces
broadcast from here. Used by the delta-sync tests against the stand-in and the real vLLM server."""

from __future__ import annotations

import threading

import torch.distributed as dist

from megatron_klear.rollout.servers.update_group import (
    agree_ready,
    destroy_update_group,
    dtype_name,
    join_update_group,
    open_master_store,
)


class GroupSender:
    """``engine``: a client of the one server at ``url`` (its ``wire`` makes the calls)."""

    def __init__(self, engine, url: str, name: str, timeout: float = 60.0):
        self.engine, self.url, self.name = engine, url, name
        store = open_master_store("127.0.0.1", 0, 2, timeout)
        joined = {}
        join = dict(master_address="127.0.0.1", master_port=store.port, world_size=2, group_name=name)
        t = threading.Thread(
            target=lambda: joined.update(
                f=engine.wire.join_group_async(rank_offsets={url: 1}, backend="gloo", timeout=timeout, **join)
            )
        )
        t.start()
        self.pg = join_update_group(backend="gloo", rank=0, timeout=timeout, store=store, **join)
        t.join()
        for f in joined["f"].values():
            f.result(timeout=timeout)
        self.store = store

    def sync(self, bucket, version, images=None) -> int:
        """One sync of ``bucket`` ([(name, tensor)]): whole, or with ``images`` (a DeltaImages)
        each tensor's changes. Returns the bytes broadcast."""
        names = [n for n, _ in bucket]
        dtypes = [dtype_name(t.dtype) for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        counts, pieces = None, [t for _, t in bucket]
        if images is not None:
            images.begin()
            counts, pieces, _, _ = images.encode(bucket)
        wire = self.engine.wire
        wire.start_update()
        post = wire.post_bucket(names, dtypes, shapes, group_name=self.name, counts=counts, timeout=60)
        assert post.refusals(0.2) == {}
        if counts is not None:  # a delta bucket: every member agrees to take it before any piece
            assert agree_ready(self.pg, "cpu", True)
        for p in pieces:
            dist.broadcast(p.contiguous(), src=0, group=self.pg)
        errors = post.result()
        assert errors == {}, errors
        wire.finish_update(version, check_received=False)
        if images is not None:
            images.commit()
        return sum(p.numel() * p.element_size() for p in pieces)

    def close(self) -> None:
        self.engine.wire.leave_group(self.name)
        destroy_update_group(self.pg)
