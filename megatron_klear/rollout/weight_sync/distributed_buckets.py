"""The bucket schedule of ``rollout.weight_sync=distributed``: how one stage's tensors reach every
server over its update group.

The stage leader packs its HF tensors into buckets of ``bucket_bytes`` (one dtype per bucket,
:func:`~megatron_klear.rollout.weight_sync.gather.iter_buckets`) and for each bucket: rank 0 posts
``/update_weights_from_distributed`` (names, dtypes, shapes, ``flush_cache``, and
``load_format="flattened_bucket"`` with NCCL) to every server while the leader broadcasts the bucket
(``src=0``: its bytes back to back with NCCL, each tensor in order with gloo, SGLang's two receive
paths). A leader other than rank 0 announces each bucket to rank 0, which posts it and sends the
servers' answer back (:meth:`BucketSchedule.coordinate`). Two schedules
(:meth:`BucketSchedule.send_stage`): the first sync gathers bucket ``k+1`` (the TP peers' shards)
while bucket ``k`` is on the wire; later syncs (per-tensor format) announce each bucket from the
layout the last sync recorded and broadcast each tensor as soon as it is gathered.

:class:`BucketSchedule` holds the schedule's own state (the layouts of the last sync, the attempt's
posts and the servers they lost) and sends over the sync's
:class:`~megatron_klear.rollout.weight_sync.distributed_groups.UpdateGroups`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_klear.platform import rank, recv_object, send_object
from megatron_klear.rollout.servers.update_group import (
    DENSE,
    FLATTENED_BUCKET,
    dtype_name,
    dtype_of,
    flatten_bucket,
    flatten_segments,
)
from megatron_klear.rollout.weight_sync.gather import iter_buckets, iter_stage_hf_tensors


def on_wire_device(t, dev):
    """``t`` on the update group's device ``dev``. Asynchronous only toward CUDA: a GPU tensor copied
    to the CPU (a gloo group) with ``non_blocking`` may be read, and broadcast, before the copy has
    finished, since nothing waits on the stream in between."""
    return t.to(dev, non_blocking=getattr(dev, "type", str(dev)) == "cuda")


class BucketSchedule:
    """How ``model_chunks``' tensors reach the servers over ``groups``: buckets of ``bucket_bytes``,
    in ``load_format`` (``flattened_bucket`` or ``auto``: per tensor); a bucket is broadcast once
    every server has had ``post_grace`` seconds to refuse its post; ``control_timeout``: a post's
    answer beyond the bucket's own wait."""

    def __init__(
        self,
        groups,
        model_chunks,
        *,
        bucket_bytes: int,
        load_format: str,
        post_grace: float,
        control_timeout: float,
        delta=None,
    ):
        self.groups, self.model_chunks = groups, model_chunks
        self.delta = delta  # a DeltaImages (rollout.sync_delta): buckets carry each tensor's changes
        self.bucket_bytes, self.load_format = int(bucket_bytes), load_format
        self.post_grace, self.control_timeout = float(post_grace), float(control_timeout)
        self.layouts = {}  # stage -> [(names, dtypes, shapes) per bucket] of the last sync (per-tensor format)
        self.started = None  # rank 0: the future of the servers' pause + flush + begin of the attempt
        self.disconnected, self.posts = set(), []  # rank 0: the attempt's lost members, its bucket posts
        # rank 0: {worker: its marked group name} of the members whose delta loader failed (they
        # are alive and keep their place: the next attempt sends them everything), and whether the
        # attempt posted a delta bucket
        self.load_failed, self.delta_posted = {}, False

    def begin_attempt(self, started) -> None:
        """A new attempt of a sync: ``started`` (rank 0) is the future of the servers' start calls."""
        self.started, self.disconnected, self.posts = started, set(), []
        self.load_failed, self.delta_posted = {}, False

    # -- the delta loader's failures (rank 0) --------------------------------------------------------
    # A server's delta loader cannot fail a call (SGLang ends a server whose custom loader raises):
    # it marks the update group instead, and the server then refuses any call naming the group
    # (megatron_klear/rollout/in_server/sglang_delta.py). The group is checked before each delta
    # bucket (a server restarted since it joined is found there too) and at the end of the sync.
    def check_loads(self, workers=None, stages=None) -> str | None:
        """The groups of ``stages`` (default: every stage's) on ``workers`` (default: the groups'
        members): the error naming the servers that do not hold them (each noted: restarted, or its
        loader failed), or None."""
        from megatron_klear.rollout.servers.wire import bucket_error

        wire, errors = self.groups.engine.wire, {}
        for stage in sorted(self.groups.leaders) if stages is None else stages:
            refused = wire.check_group(self.groups.name(stage), self.groups.workers if workers is None else workers)
            self._note_disconnected(refused)
            errors.update(refused)
        if not errors:
            return None
        return f"rollout: the delta sync's update groups are not whole on the servers: {bucket_error(errors)}"

    def forget_failed_loads(self, timeout: float | None = None) -> None:
        """Drop the marked groups on the servers whose loader failed (best effort, as any leave)."""
        for marked in sorted(set(self.load_failed.values())):
            self.groups.engine.wire.leave_group(marked, timeout=timeout)

    def _post_bucket(self, stage: int, meta, *, admit: bool = True):
        """Rank 0: post one bucket's metadata to every member of the group (once they paused and
        opened the session) and, with ``admit``, wait until each post is under way (:meth:`_admit`):
        ``(post, None)``, or ``(None, error text naming the servers)``. Without ``admit`` the caller
        admits the post later (gathering the bucket's tensors meanwhile)."""
        names, dtypes, shapes = meta[:3]
        counts = meta[3] if len(meta) > 3 else None  # a delta bucket's
        started = self.started.result()
        if started is not None:
            return None, started
        if counts is not None:  # a delta bucket: every server must still hold its group (see check_loads)
            refused = self.check_loads(stages=[stage])
            if refused is not None:
                return None, self._bucket_failed(stage, names, refused) + " (not posted)"
            self.delta_posted = True
        try:
            post = self.groups.engine.wire.post_bucket(
                names,
                dtypes,
                shapes,
                group_name=self.groups.name(stage),
                workers=self.groups.workers,
                load_format=self.load_format if self.load_format != "auto" else None,
                timeout=self.groups.bucket_wait() + self.control_timeout,
                counts=counts,
            )
        except Exception as e:  # noqa: BLE001
            return None, self._bucket_failed(stage, names, e)
        self.posts.append(post)
        return self._admit(stage, meta, post) if admit else (post, None)

    def _admit(self, stage: int, meta, post):
        """Rank 0: wait until every post of a bucket is under way (``post_grace`` seconds from the
        post, or every server answered): ``(post, None)``, or ``(None, error)`` when a server refused
        it or could not be reached before the broadcast (see
        :class:`~megatron_klear.rollout.base.BucketPosting`): then the bucket is not
        broadcast at all."""
        from megatron_klear.rollout.servers.wire import bucket_error

        refused = post.refusals(self.post_grace)
        self._note_disconnected(refused)
        if refused:
            return None, self._bucket_failed(stage, meta[0], bucket_error(refused)) + " (not broadcast)"
        return post, None

    @staticmethod
    def _bucket_failed(stage: int, names, e) -> str:
        return f"rollout: bucket of stage {stage} ({len(names)} tensors, first {names[0]}) failed: {e}"

    def _post_answer(self, stage: int, meta, post):
        """Rank 0: the servers' answer to a bucket that was broadcast (waits for every post)."""
        from megatron_klear.rollout.servers.wire import bucket_error

        errors = post.result()
        self._note_disconnected(errors)
        return self._bucket_failed(stage, meta[0], bucket_error(errors)) if errors else None

    def _note_disconnected(self, errors: dict) -> None:
        """Rank 0: remember the servers whose bucket post lost its connection (refused, reset, closed
        without an answer): the process that took part in this attempt's group is gone, even if a
        restarted one answers at its URL by the time the failure is examined. (A post that timed
        out is not counted: a survivor waits for a bucket a broken broadcast never completed; the
        liveness probe judges it.) A server that answers that it does not know the group (SGLang
        0.5.23's ``Group ... not in [...]. Please call init_weights_update_group first``) restarted
        since the groups were formed: it is gone from them too -- unless it holds the group under
        the name its delta loader marked it with (:attr:`load_failed`)."""
        from megatron_klear.rollout.base import WorkerGone

        wire = self.groups.engine.wire
        for w, e in errors.items():
            if isinstance(e, WorkerGone):
                if "did not answer within" not in str(e):
                    self.disconnected.add(w)
                continue
            marked = next(filter(None, (wire.failed_load(e, self.groups.name(k)) for k in self.groups.leaders)), None)
            if marked:  # its delta loader failed: alive, the next attempt sends it everything
                self.load_failed[w] = marked
            elif "init_weights_update_group" in str(e) and " not in " in str(e):
                self.disconnected.add(w)

    def coordinate(self, stage: int, totals: dict):
        """Rank 0 for a stage led by another rank: post each bucket the leader announces, tell it
        whether to broadcast (every post under way) and then the servers' answer; returns the
        stage's error or None."""
        err = None
        while True:
            kind, payload = recv_object(self.groups.leaders[stage])
            if kind == "end":
                stage_err, stage_totals = payload
                for k, v in stage_totals.items():
                    totals[k] += v
                return stage_err or err
            post, refused = self._post_bucket(stage, payload)
            send_object(refused, self.groups.leaders[stage])  # go (None) or not
            err = refused if post is None else self._post_answer(stage, payload, post)
            send_object(err, self.groups.leaders[stage])

    def send_stage(self, stage: int, totals: dict):
        """The stage leader: stream the stage's buckets (see the module docstring); returns the first
        error or None. Drains the tensors after an error (the TP peers keep sending their shards).

        Two schedules. Without a layout (the first sync, or ``flattened_bucket``, whose bucket is
        one tensor made of all of them): gather a whole bucket, then announce and broadcast it,
        gathering the next one meanwhile. With the layout the last sync recorded (names, dtypes and
        shapes per bucket: a model's structure does not change), a bucket is announced before its
        tensors are gathered and each tensor is broadcast as soon as it is: the first tensors are
        on the wire at once instead of after a whole bucket's gather, and the gathers overlap the
        broadcasts throughout."""
        flattened = self.load_format == FLATTENED_BUCKET
        tensors = iter_stage_hf_tensors(self.model_chunks, self.groups.part)
        # a delta bucket's pieces are known once its tensors are compared: gathered whole
        layout = None if flattened or self.delta is not None or not self.groups.warm else self.layouts.get(stage)
        if layout is None:
            error, layout = self._send_gathered_buckets(stage, tensors, totals)
            if error is None and not flattened:
                self.layouts[stage] = layout
            return error
        totals["streamed_stages"] += 1
        return self._send_streamed_buckets(stage, tensors, totals, layout)

    # A bucket on the wire: {"meta": (names, dtypes, shapes), "post": rank 0's BucketPost or None,
    # "refused": the error that stopped its broadcast or None, "admitted": whether its posts are
    # under way, "held": its tensors gathered before that, "taken": its tensors handed over so far,
    # "works": its broadcasts, "payload": the tensors they send (referenced until they end), "nbytes"}
    def _launch_bucket(self, stage: int, meta, payload, totals: dict, *, hold: bool = False, posted=None) -> dict:
        """Announce one bucket (rank 0 posts it to the servers; another stage's leader asks rank 0
        to), and once every post is under way broadcast the tensors of it already at hand. A bucket
        whose post failed is never broadcast (``refused``). ``hold`` (rank 0 leading): do not wait
        for the posts to be under way; the tensors handed over meanwhile are held and go out once
        they are (:meth:`_broadcast_into`), so the wait overlaps the gathering. ``posted``: rank 0's
        ``(post, refused)`` of a bucket already posted (:meth:`_post_after`)."""
        admitted = rank() != 0 or not hold
        if posted is not None:
            post, refused = posted
        elif rank() == 0:
            post, refused = self._post_bucket(stage, meta, admit=admitted)
        else:
            send_object(("bucket", meta), 0)
            post, refused = None, recv_object(0)
        flight = {"meta": meta, "post": post, "refused": refused, "admitted": admitted or refused is not None}
        flight.update(stage=stage, totals=totals, held=[], taken=0, works=[], payload=[], nbytes=0)
        totals["buckets"] += 1
        if flight["admitted"]:
            self._agree(flight)
        for x in payload:
            self._broadcast_into(flight, x, totals)
        return flight

    def _admit_flight(self, flight: dict) -> None:
        """Rank 0: wait until a held bucket's posts are under way (or refused), then broadcast what
        it holds."""
        flight["admitted"] = True
        post, flight["refused"] = self._admit(flight["stage"], flight["meta"], flight["post"])
        flight["post"] = post or flight["post"]  # (a refused bucket's posts are still consumed)
        self._agree(flight)
        held, flight["held"] = flight["held"], []
        for x in held:
            self._broadcast_into(flight, x, flight["totals"], count=False)

    def _agree(self, flight: dict) -> None:
        """A delta bucket admitted for broadcast: first every member of the group says whether it can
        take it (:func:`~megatron_klear.rollout.servers.update_group.agree_ready`); one that cannot
        (its loader refused it before the receive and marked its group) makes the bucket refused,
        never broadcast. The wait is bounded (``rollout.control_timeout_s`` once the group is warm: the
        receivers only have to reach their loader)."""
        from megatron_klear.rollout.servers.update_group import agree_ready

        if len(flight["meta"]) <= 3 or flight["refused"] is not None:
            return
        work, flag = agree_ready(self.groups.pg, self.groups.device(), True, async_op=True)
        wait = min(self.control_timeout, self.groups.bucket_wait()) if self.groups.warm else self.groups.bucket_wait()
        names = flight["meta"][0]
        try:
            self._wait_works([work], wait)
        except Exception as e:  # noqa: BLE001 -- a member that never reached its loader
            flight["refused"] = self._bucket_failed(
                flight["stage"], names, f"no agreement to receive within {wait:g} s: {e}"
            )
            return
        if not bool(flag.item()):
            flight["refused"] = (
                self._bucket_failed(
                    flight["stage"], names, "a server's delta loader could not take it (its update group is marked)"
                )
                + " (not broadcast)"
            )

    def _broadcast_into(self, flight: dict, x: torch.Tensor, totals: dict, *, count: bool = True) -> None:
        if count:
            flight["taken"] += 1
        if flight["refused"] is not None:
            return
        if not flight["admitted"]:
            flight["held"].append(x)
            if flight["post"].grace_over(self.post_grace):
                self._admit_flight(flight)
            return
        flight["works"].append(dist.broadcast(x, src=0, group=self.groups.pg, async_op=True))
        flight["payload"].append(x)
        nbytes = x.numel() * x.element_size()
        flight["nbytes"] += nbytes
        totals["bytes"] += nbytes

    def _wait_works(self, works, seconds: float) -> None:
        """Wait for a bucket's collectives, at most ``seconds``
        (:func:`~megatron_klear.rollout.servers.update_group.wait_bounded`)."""
        from megatron_klear.rollout.servers.update_group import wait_bounded

        wait_bounded(self.groups.pg, works, seconds, backend=self.groups.backend)

    def _finish_bucket(self, stage: int, flight: dict):
        """Wait for a bucket: the servers' answer first, always consumed (rank 0's answers stay in
        step with the buckets), then the broadcasts. The error text, or None; once per bucket (a
        second call answers the same)."""
        if "finished" not in flight:
            flight["finished"] = self._finish(stage, flight)
        return flight["finished"]

    def _finish(self, stage: int, flight: dict):
        if not flight["admitted"]:  # a held bucket: its posts under way first, then its broadcasts
            self._admit_flight(flight)
        if flight["refused"] is not None:
            if rank() != 0:
                recv_object(0)  # rank 0's answer of a bucket that was not broadcast: the same error
            return flight["refused"]
        ack = self._post_answer(stage, flight["meta"], flight["post"]) if rank() == 0 else recv_object(0)
        if ack is not None:
            return ack
        try:
            self._wait_works(flight["works"], self.groups.bucket_wait())
        except Exception as e:  # noqa: BLE001 -- a dead peer, or the bucket timeout
            names = flight["meta"][0]
            return (
                f"rollout: the broadcast of a bucket of stage {stage} ({flight['nbytes'] / 2**20:.0f} MiB, "
                f"{len(names)} tensors from {names[0]}) failed within {self.groups.bucket_wait():g} s "
                f"(rollout.sync_bucket_timeout_s; a new group's first: rollout.sync_group_timeout_s): "
                f"{type(e).__name__}: {e}"
            )
        self.groups.warm = True
        return None

    @staticmethod
    def _meta_of(bucket) -> tuple:
        return ([n for n, _ in bucket], [dtype_name(t.dtype) for _, t in bucket], [list(t.shape) for _, t in bucket])

    def _buckets(self, tensors):
        """The stage's buckets; on a new NCCL group the first one is its first tensor alone, a small
        broadcast that builds NCCL's communicator under the group timeout (``groups.bucket_wait``)."""
        for k, bucket in enumerate(iter_buckets(tensors, self.bucket_bytes)):
            if k == 0 and not self.groups.warm and self.groups.backend == "nccl" and len(bucket) > 1:
                yield bucket[:1]
                bucket = bucket[1:]
            yield bucket

    def _send_gathered_buckets(self, stage: int, tensors, totals: dict):
        """Gather a bucket whole, then send it while the next one is gathered. ``(error, layout)``."""
        dev = self.groups.device()
        error, flight, layout = None, None, []
        for bucket in self._buckets(tensors):
            if error is not None:
                continue
            meta = self._meta_of(bucket)
            if self.delta is not None:  # each tensor whole or its changes (positions, then values)
                counts, pieces, changed, elements = self.delta.encode(bucket)
                # only a bucket that carries changes goes through the servers' delta loader: whole
                # tensors take the family's own update (SGLang answers a failure there, where an
                # exception in a custom loader ends its scheduler)
                if any(c != DENSE for c in counts):
                    meta = (*meta, counts)
                totals["changed"] += changed
                totals["elements"] += elements
            else:
                pieces = [t for _, t in bucket]
            if self.load_format == FLATTENED_BUCKET:  # one broadcast of the bucket's bytes back to back
                pieces = [on_wire_device(p, dev) for p in pieces]
                payload = [flatten_segments(pieces) if len(meta) > 3 else flatten_bucket(pieces)]
            else:  # SGLang's default: one broadcast per tensor, in order
                payload = [on_wire_device(p.detach(), dev).contiguous() for p in pieces]
            if flight is not None:
                error, flight = self._finish_bucket(stage, flight), None
                if error is not None:
                    continue
            layout.append(meta[:3])
            flight = self._launch_bucket(stage, meta, payload, totals)
        if flight is not None:
            error = self._finish_bucket(stage, flight)
        return error, layout

    def _post_after(self, stage: int, meta, before: dict):
        """Rank 0, in a thread: once every server answered the bucket ``before`` without an error
        (it took that one up first, and has it), post the bucket ``meta`` (admitted later, its grace
        counted from now). ``(post, refused)``, or None when ``before`` failed: nothing follows it."""
        if before["post"].result():
            return None
        return self._post_bucket(stage, meta, admit=False)

    def _send_streamed_buckets(self, stage: int, tensors, totals: dict, layout) -> str | None:
        """Each bucket announced before its tensors are gathered (``layout``: the last sync's), each
        tensor broadcast as soon as it is gathered. The next bucket's tensors are gathered while the
        current one is on the wire (at most one bucket ahead) and go out once the servers answered
        it. A bucket's post waits for its refusals (``post_grace``, :meth:`_admit`) while its tensors
        are gathered: rank 0 leading posts the next bucket the moment every server has answered the
        current one (:meth:`_post_after`, a thread), not when the loop next looks. The error text,
        or None."""
        import concurrent.futures

        dev = self.groups.device()
        expected = [(n, d, list(s), b) for b, meta in enumerate(layout) for n, d, s in zip(*meta)]
        counts = [len(meta[0]) for meta in layout]
        poster = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-next-bucket")
        b, ahead, i, following = 0, [], 0, None  # following: rank 0, the future of the next bucket's post
        flight = self._launch_bucket(stage, layout[0], [], totals, hold=True)
        error = flight["refused"]

        def done_now(f) -> bool:  # rank 0 can tell without blocking; another leader learns it from rank 0
            return f["post"] is not None and f["post"].done() and all(w.is_completed() for w in f["works"])

        for name, t in tensors:
            if error is not None:
                continue  # drain: the TP / EP peers keep sending
            got = (name, dtype_name(t.dtype), list(t.shape))
            if i >= len(expected) or got != expected[i][:3]:
                want = expected[i][:3] if i < len(expected) else "the end of the stage"
                error = (
                    f"rollout: stage {stage}'s weights no longer follow the layout of the last sync: tensor {i} "
                    f"is {got}, expected {want}"
                )
                continue
            x = on_wire_device(t.detach(), dev).contiguous()
            if expected[i][3] == b:
                self._broadcast_into(flight, x, totals)
                error = flight["refused"]  # (a held bucket's posts found refused once under way)
            else:  # the next bucket's: held until the servers have the current one
                ahead.append(x)
            i += 1
            if (
                rank() == 0
                and error is None
                and following is None
                and flight["taken"] == counts[b]
                and b + 1 < len(layout)
            ):
                following = poster.submit(self._post_after, stage, layout[b + 1], flight)
            while (
                error is None
                and flight["taken"] == counts[b]
                and b + 1 < len(layout)
                and (len(ahead) == counts[b + 1] or done_now(flight))
            ):
                error = self._finish_bucket(stage, flight)
                if error is None:
                    b += 1
                    posted = following.result() if following is not None else None
                    following = None
                    flight = self._launch_bucket(stage, layout[b], ahead, totals, hold=True, posted=posted)
                    ahead, error = [], flight["refused"]
        poster.shutdown(wait=False)
        if error is None and i != len(expected):
            error = f"rollout: stage {stage} yielded {i} tensors, the layout of the last sync has {len(expected)}"
        if error is None:
            return self._finish_bucket(stage, flight)
        self.layouts.pop(stage, None)  # the next sync gathers whole buckets again
        # The servers wait for the rest of an announced bucket (and then for the next, if it was
        # posted): send zeros in its place (the sync fails, so nothing of it is served), then take
        # their answer (rank 0's stay in step). A bucket never announced to every server has nothing
        # to complete, and nothing follows it.
        while flight is not None and flight["refused"] is None:
            start = sum(counts[:b])
            for _, d, shape, _ in expected[start + flight["taken"] : start + counts[b]]:
                self._broadcast_into(flight, torch.zeros(shape, dtype=dtype_of(d), device=dev), totals)
            if self._finish_bucket(stage, flight) is not None or following is None:
                break
            posted, following = following.result(), None  # (after the answer above: it posts or not)
            b += 1
            flight = (
                None if posted is None else self._launch_bucket(stage, layout[b], [], totals, hold=True, posted=posted)
            )
        if flight is not None and flight["refused"] is not None:
            self._finish_bucket(stage, flight)
        return error
