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

Limits: unquantized weights whose loaders write with ``copy_`` (SGLang's linear, embedding,
norm and unquantized MoE loaders do; a loader that assigns by index would write the NaN and the
probe check after the sync fails it); a changed value that is NaN goes whole (the sender's rule).
SGLang answers a loader's exception by ending the server (its scheduler's handler sends SIGQUIT to
the parent): a failed delta bucket loses that server, which the fleet drops and which rejoins with a
full sync; the sender sends full syncs after any failure. Start servers with
``--custom-weight-loader megatron_klear.rollout.sglang.delta_loader.apply_delta``, this package
installed in the server's environment (docs/sglang.md, "Delta syncs").

Only ``torch`` and :mod:`megatron_klear.rollout.servers.update_group` are needed at the server."""

from __future__ import annotations

import base64
import contextlib
import json
import pickle
import threading

import torch

from megatron_klear.rollout.servers.update_group import delta_segments, receive_delta_bucket

#: the import path SGLang's ``--custom-weight-loader`` must list (and the bucket's ``load_format``)
LOADER = f"{__name__}.apply_delta"
#: the name of the one tensor a delta bucket's request carries: its description
SPEC_NAME = "megatron_klear.delta_bucket"
#: the widest chunk of NaN-filled tensors handed to ``load_weights`` at once
CHUNK_BYTES = 512 << 20


def request_body(names, dtypes, shapes, counts, *, group_name: str, load_format, ranks: int) -> dict:
    """The ``/update_weights_from_tensor`` body of one delta bucket (``UpdateWeightsFromTensorReqInput``
    of SGLang 0.5.23's ``io_struct.py``): the description pickled once, repeated for each of the
    ``ranks`` TP ranks of the widest server (each rank reads its own entry)."""
    spec = {
        "group_name": group_name,
        "load_format": load_format,
        "names": list(names),
        "dtypes": [str(d) for d in dtypes],
        "shapes": [[int(x) for x in s] for s in shapes],
        "counts": [int(c) for c in counts],
    }
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


def apply_delta(model, named_tensors) -> None:
    """SGLang's custom loader for a delta bucket: receive its pieces over the update group and load
    them through ``model.load_weights``, changed elements only."""
    spec = read_spec(named_tensors)
    group = find_update_group(spec["group_name"])
    segments = delta_segments(spec["names"], spec["dtypes"], spec["shapes"], spec["counts"])
    device = next(model.parameters()).device
    tensors = receive_delta_bucket(group, device, segments, spec["load_format"] or "auto")
    whole, masked, size = [], [], 0
    shapes = dict(zip(spec["names"], spec["shapes"]))
    for name, t, is_whole in densified(segments, tensors, shapes):
        if is_whole:
            whole.append((name, t))
            continue
        masked.append((name, t))
        size += t.numel() * t.element_size()
        if size >= CHUNK_BYTES:
            with nan_masked_copies():
                model.load_weights(masked)
            masked, size = [], 0
    if masked:
        with nan_masked_copies():
            model.load_weights(masked)
    if whole:
        model.load_weights(whole)
