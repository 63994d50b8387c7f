"""Delta weight syncs into SGLang 0.5.23 servers (``rollout.sync_delta``), unpatched: the custom
weight loader the servers are started with, and the request body that calls it.

SGLang 0.5.23's ``update_weights_from_distributed`` always loads whole tensors (an unknown
``load_format`` is read as one broadcast per tensor), and its only hook for custom loading is
``--custom-weight-loader``, which ``update_weights_from_tensor`` alone consults
(``srt/model_executor/model_runner_components/weight_updater.py``: with ``load_format`` one of the
listed import paths, it calls ``loader(model, named_tensors)`` on every TP rank's scheduler
thread). So a delta bucket travels as:

- ``POST /update_weights_from_tensor`` inside the begin/end session, ``load_format`` = :data:`LOADER`,
  its ``serialized_named_tensors`` one small tensor per TP rank: the bucket's description (names,
  dtypes, shapes, per tensor its count of changed elements, the update group), plain-pickled (SGLang
  unpickles it with its ``SafeUnpickler``, which admits a CPU tensor);
- then the bucket's pieces broadcast by the sender on the update group the server already joined
  (:mod:`megatron_klear.rollout.servers.update_group`'s delta format, the one vLLM's transfer engine
  takes): :func:`apply_delta` finds the group by its name and receives them, as SGLang's own
  receive does, on every TP rank;
- each tensor then goes through the model's own ``load_weights`` by HF name (the fused q/k/v and
  gate/up parameters, the TP shards, the experts: SGLang's weight loaders do the mapping): a tensor
  sent whole as it is, a tensor sent as changes as a full-shape tensor of NaN with the changed
  elements written in, loaded while ``Tensor.copy_`` keeps the destination where the source is NaN
  (:func:`nan_masked_copies`). The server's parameters are the image the changes apply to: nothing
  else is kept.

A failure is answered, never fatal. SGLang answers an exception of a custom loader by ending the
server (its scheduler's handler sends SIGQUIT to the parent), so the loader raises only where it
cannot reach SGLang's table of update groups; every failure -- a description that does not hold
together, too little free memory to densify the bucket (both found before anything is received,
and then agreed with every other member of the group, which all skip the bucket:
``agree_ready`` of :mod:`megatron_klear.rollout.servers.update_group`), a receive that breaks, a
NaN among the changed values, a weight loader that copies a delta into another shape -- is logged
and *marks the group*: SGLang's table of this process's update groups (the
``_model_update_group`` dict of the ``WeightUpdater`` whose ``update_weights_from_tensor`` called
the loader) holds the group under ``"<name> (delta load failed: <why>)"`` instead of its name. The
server keeps serving; its next call naming the group is answered with SGLang's own graceful
``Group <name> not in ['<name> (delta load failed: <why>)']``, which the sender asks before each
delta bucket and at the end of the sync (:func:`failed_load`), and answers by sending every weight
again over new groups (the failed server included). Where the loader cannot reach that table (a
SGLang other than 0.5.23's layout) it raises, as before.

Limits: unquantized weights (the client refuses delta syncs to servers that report a
``quantization``) whose loaders write with ``copy_`` (SGLang's linear, embedding, norm and
unquantized MoE loaders do; a loader that assigns by index would write the NaN and the probe check
after the sync fails it); a changed value that is NaN goes whole (the sender's rule); a bucket's
tensors reach ``load_weights`` in one call (loaders that fuse two checkpoint tensors see both).
Start servers with ``--custom-weight-loader megatron_klear.rollout.in_server.sglang_delta.apply_delta``,
this package installed in the server's environment (docs/sglang.md, "Delta syncs").

Only ``torch`` and :mod:`megatron_klear.rollout.servers.update_group` are imported at the server.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import json
import pickle
import sys
import threading

import torch

from megatron_klear.rollout.servers.update_group import delta_segments, receive_delta_bucket

#: the import path SGLang's ``--custom-weight-loader`` must list (and the bucket's ``load_format``)
LOADER = f"{__name__}.apply_delta"
#: the name of the one tensor a delta bucket's request carries: its description
SPEC_NAME = "megatron_klear.delta_bucket"
#: how a group whose delta load failed is listed in SGLang's table (followed by the reason and ")")
FAILED_MARK = " (delta load failed: "


def request_body(
    names, dtypes, shapes, counts, *, group_name: str, load_format, ranks: int, timeout: float | None = None
) -> dict:
    """The ``/update_weights_from_tensor`` body of one delta bucket (``UpdateWeightsFromTensorReqInput``
    of SGLang 0.5.23's ``io_struct.py``): the description pickled once, repeated for each of the
    ``ranks`` TP ranks of the widest server (each rank reads its own entry). ``timeout``: how long the
    loader waits for the bucket's pieces over NCCL (the sender's own wait for the bucket)."""
    spec = {
        "group_name": group_name,
        "load_format": load_format,
        "names": list(names),
        "dtypes": [str(d) for d in dtypes],
        "shapes": [[int(x) for x in s] for s in shapes],
        "counts": [int(c) for c in counts],
    }
    if timeout is not None:
        spec["timeout_s"] = float(timeout)
    raw = torch.frombuffer(bytearray(json.dumps(spec).encode()), dtype=torch.uint8)
    payload = base64.b64encode(pickle.dumps([(SPEC_NAME, raw)], protocol=pickle.HIGHEST_PROTOCOL)).decode()
    return {
        "serialized_named_tensors": [payload] * max(1, int(ranks)),
        "load_format": LOADER,
        "flush_cache": False,
        "abort_all_requests": False,
        "selector": "target",  # the loader receives the broadcast: once per server, not per runner
    }


def read_spec(named_tensors) -> dict:
    """The description of a delta bucket from the loader's ``named_tensors``."""
    items = list(named_tensors)
    if len(items) != 1 or items[0][0] != SPEC_NAME:
        raise ValueError(f"{LOADER}: expected one tensor named {SPEC_NAME!r}, got {[n for n, _ in items]}")
    raw = items[0][1].detach().to("cpu").contiguous()
    return json.loads(bytes(raw.numpy().tobytes()).decode())


def find_update_group(group_name: str):
    """The process group this process joined as ``group_name`` (SGLang's
    ``init_custom_process_group`` and :func:`~megatron_klear.rollout.servers.update_group.join_update_group`
    both register the name with torch); the latest one of that name."""
    from torch.distributed.distributed_c10d import _world

    found = [pg for pg, name in _world.pg_names.items() if name == group_name]
    if not found:
        raise RuntimeError(
            f"{LOADER}: no weight update group named {group_name!r} here (known: "
            f"{sorted(set(_world.pg_names.values()))}); call /init_weights_update_group first"
        )
    return found[-1]


_copy_lock = threading.Lock()


@contextlib.contextmanager
def nan_masked_copies():
    """While open, ``Tensor.copy_`` from a floating tensor of the destination's shape keeps the
    destination's value wherever the source is NaN (the weight loaders' last step writes only the
    changed elements). A copy from a NaN-bearing source of another shape (a loader that broadcasts,
    reshapes or packs what it was given) raises instead of writing the NaN of the unchanged
    elements into the weights, as vLLM's own masked-copy helper does."""
    original = torch.Tensor.copy_

    def copy_(self, src, non_blocking=False):
        if isinstance(src, torch.Tensor) and src.is_floating_point():
            if src.shape == self.shape:
                src = src.to(device=self.device, dtype=self.dtype)
                return torch.where(torch.isnan(src), self, src, out=self)  # in place: one pass, no copy
            if bool(torch.isnan(src).any()):
                raise ValueError(
                    f"{LOADER}: a weight loader copied a delta tensor of shape {tuple(src.shape)} into "
                    f"one of shape {tuple(self.shape)}: its unchanged elements (NaN) would be written; "
                    "this parameter's loader needs full syncs (rollout.sync_delta=off)"
                )
        return original(self, src, non_blocking)

    with _copy_lock:
        torch.Tensor.copy_ = copy_
        try:
            yield
        finally:
            torch.Tensor.copy_ = original


def densified(segments, tensors, shapes: dict):
    """(name, tensor, whole) per tensor of a received delta bucket: a tensor sent whole as it came,
    a tensor sent as changes (``shapes``: {name: its shape}) as NaN everywhere but at its changed
    elements; a tensor without changes not at all."""
    k = 0
    while k < len(segments):
        name, kind, _, _ = segments[k]
        if kind == "dense":
            yield name, tensors[k], True
            k += 1
            continue
        positions, values = tensors[k], tensors[k + 1]
        k += 2
        if not values.numel():
            continue
        if values.is_floating_point() and bool(torch.isnan(values).any()):
            raise ValueError(f"{LOADER}: tensor {name} has a NaN among its changed values (it must be sent whole)")
        out = torch.full(shapes[name], float("nan"), dtype=values.dtype, device=values.device)
        out.view(-1)[positions.long()] = values
        yield name, out, False


def _sglang_group_table(group_name: str | None):
    """SGLang 0.5.23's table of this process's update groups -- the ``_model_update_group`` dict of
    the ``WeightUpdater`` whose ``update_weights_from_tensor`` called the loader
    (``custom_loader(self.get_model(), named_tensors)`` in
    ``srt/model_executor/model_runner_components/weight_updater.py``) -- when it holds
    ``group_name`` (None: any table); else None."""
    frame = sys._getframe(1)
    for _ in range(8):
        frame = frame.f_back
        if frame is None:
            return None
        table = getattr(frame.f_locals.get("self"), "_model_update_group", None)
        if isinstance(table, dict) and (group_name is None or group_name in table):
            return table
    return None


def failed_load(message: str, group_name: str) -> str | None:
    """The reason a delta load failed on the server that answered ``message`` (SGLang's
    ``Group <name> not in [<its groups>]``, one of them marked by :func:`apply_delta`) for
    ``group_name``, or None when the answer is not that."""
    head = f"Group {group_name} not in "
    at = message.find(head)
    if at < 0:
        return None
    rest = message[at + len(head) :]
    # the list ends at one of the "]" after it: not always the first, since a mark's reason may
    # hold brackets of its own (gloo's "[.../pair.cc:553] Connection closed by peer [127.0.0.1]:...")
    names = None
    for end in (k for k, c in enumerate(rest) if c == "]"):
        try:
            names = ast.literal_eval(rest[: end + 1])
            break
        except (ValueError, SyntaxError):
            continue
    for name in names if isinstance(names, list) else []:
        if isinstance(name, str) and name.startswith(group_name + FAILED_MARK):
            return name
    return None


def _check_memory(device, need: int) -> None:
    """Refuse a bucket whose densified tensors would not fit in the device's free memory (checked
    before anything is received: the weights stay as they were)."""
    if device.type != "cuda" or need <= 0:
        return
    free, _ = torch.cuda.mem_get_info(device)
    if need > free:
        raise MemoryError(
            f"densifying this bucket takes {need / 2**20:.0f} MiB, {free / 2**20:.0f} MiB are free on {device} "
            "(lower rollout.sync_bucket_mb, or --mem-fraction-static)"
        )


def _mark_failed(table, group_name: str, e: BaseException) -> None:
    why = f"{type(e).__name__}: {e}".replace("\n", " ")[:300]
    print(f"{LOADER}: the delta load on group {group_name!r} failed ({why}); the group is marked", file=sys.stderr)
    table[f"{group_name}{FAILED_MARK}{why})"] = table.pop(group_name)


def apply_delta(model, named_tensors) -> None:
    """SGLang's custom loader for a delta bucket: receive its pieces over the update group and load
    them through ``model.load_weights`` in one call, changed elements only. A failure marks the
    group (see the module docstring) instead of ending the server: one found before the receive
    makes every member of the group skip the bucket (:func:`agree_ready`). A request it cannot
    read (no group to agree in) marks every update group of the server, and one naming a group this
    process never joined returns: the sender's wait is bounded, and its check of the group then
    finds the mark, or no group."""
    try:
        spec = read_spec(named_tensors)
    except Exception as e:  # (raising here would end SGLang's scheduler)
        table = _sglang_group_table(None)
        if table is None:
            raise
        for name in [n for n in table if FAILED_MARK not in n]:
            _mark_failed(table, name, e)
        return
    try:
        group = find_update_group(spec["group_name"])  # (the sender checked it a moment ago: see failed_load)
    except RuntimeError as e:
        if _sglang_group_table(None) is None:
            raise
        print(f"{LOADER}: {e}", file=sys.stderr)
        return
    table = _sglang_group_table(spec["group_name"])
    try:
        _load_bucket(model, group, spec)
    except Exception as e:
        if table is None:
            raise
        _mark_failed(table, spec["group_name"], e)


def _load_bucket(model, group, spec: dict) -> None:
    device = next(model.parameters()).device
    # whether this rank can take the bucket, decided before anything is received, and agreed by every
    # member of the group (receive_delta_bucket): a rank that cannot makes the others skip it too
    segments, shapes, refusal = None, None, None
    try:
        segments = delta_segments(spec["names"], spec["dtypes"], spec["shapes"], spec["counts"])
        shapes = dict(zip(spec["names"], spec["shapes"]))
        # the pieces received, then a full-shape tensor per tensor sent as changes
        need = sum(torch.Size(shape).numel() * dt.itemsize for _, _, dt, shape in segments)
        need += sum(torch.Size(shapes[n]).numel() * dt.itemsize for n, kind, dt, _ in segments if kind == "value")
        _check_memory(device, need)
    except (ValueError, KeyError, TypeError, MemoryError) as e:
        refusal = e
    tensors = receive_delta_bucket(
        group, device, segments, spec.get("load_format") or "auto", refusal, timeout=spec.get("timeout_s")
    )
    masked, nan_whole = [], []
    for name, t, is_whole in densified(segments, tensors, shapes):
        # a whole tensor holding NaN must be written as it is, outside the masked copy
        if is_whole and t.is_floating_point() and bool(torch.isnan(t).any()):
            nan_whole.append((name, t))
        else:
            masked.append((name, t))
    if masked:
        with nan_masked_copies():
            model.load_weights(masked)
    if nan_whole:
        model.load_weights(nan_whole)
