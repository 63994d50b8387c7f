"""Weight-update routes, as SGLang 0.5.23's ``http_server.py`` names them: from disk, over a process
group (``update_weights_from_distributed`` inside a begin/end session, applied whole at its end),
from serialized tensors (``update_weights_from_tensor``: SGLang's loaders, or a custom loader named
by ``--custom-weight-loader``, applied at once), versions, and checksums. Each call's work runs in a
thread of its own (reading a checkpoint, joining a group, receiving broadcasts), one at a time
under the state's weight lock."""

from __future__ import annotations

import base64
import binascii
import hashlib
import importlib
import sys

from fastapi import APIRouter, Request

from megatron_klear.rollout.sglang_standin.contract import (
    DEFAULT_GROUP_NAME,
    BadRequest,
    control_fields,
    expect_bool,
    expect_int,
    expect_map,
    expect_optional_str,
    expect_seq,
    expect_str,
    expect_str_list,
    expect_token_ids,
)
from megatron_klear.rollout.sglang_standin.plumbing import (
    StandinRoute,
    error,
    off_loop,
    read_json,
    reply,
    server_state,
)

router = APIRouter(route_class=StandinRoute)

_RELEASED_WEIGHTS = (
    "the weights are released (release_memory_occupation): resume_memory_occupation with tag "
    "'weights' before updating them"
)


def _weights_reply(ok: bool, message: str, **extra):
    return reply(200 if ok else 400, {"success": ok, "message": message, **extra})


# -- versions and disk ---------------------------------------------------------------------------
@router.post("/update_weight_version")
async def update_weight_version(request: Request):
    f = control_fields(
        await read_json(request),
        {"new_version": (expect_str, None), "abort_all_requests": (expect_bool, True)},
        required=("new_version",),
    )
    state = server_state(request)
    if f["abort_all_requests"]:
        state.scheduler.abort(abort_all=True)
    state.engine.weight_version = f["new_version"]
    return reply(
        200,
        {"success": True, "message": f"Weight version updated to {f['new_version']}", "new_version": f["new_version"]},
    )


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request):
    """Not paused: waits for the running requests and holds new ones (SGLang's writer lock); paused:
    at once. All or nothing: every tensor is read and checked before the first copy."""
    f = control_fields(
        await read_json(request),
        {
            "model_path": (expect_str, None),
            "load_format": (expect_optional_str, None),
            "abort_all_requests": (expect_bool, False),
            "weight_version": (expect_str, None),
            "is_async": (expect_bool, False),
            "torch_empty_cache": (expect_bool, False),
            "keep_pause": (expect_bool, False),
            "recapture_cuda_graph": (expect_bool, False),
            "token_step": (expect_int, 0),
            "flush_cache": (expect_bool, True),
            "manifest": (expect_map, None),
        },
        required=("model_path",),
    )
    return await off_loop(_update_from_disk, server_state(request), f)


def _update_from_disk(state, f):
    if f["load_format"] not in (None, "auto", "safetensors"):
        return reply(
            400,
            {
                "success": False,
                "num_paused_requests": 0,
                "message": f"load_format {f['load_format']!r} is not supported by the embedded engine "
                "(auto | safetensors)",
            },
        )
    if "weights" in state.offload_tags:
        return reply(400, {"success": False, "num_paused_requests": 0, "message": _RELEASED_WEIGHTS})
    if f["abort_all_requests"]:
        state.scheduler.abort(abort_all=True)
    version = f["weight_version"] if f["weight_version"] is not None else state.engine.weight_version
    try:
        _, held = state.scheduler.run_update(
            lambda: state.engine.load_weights_from_dir(f["model_path"], version=version)
        )
    except (OSError, ValueError) as e:
        return reply(
            400,
            {
                "success": False,
                "num_paused_requests": 0,
                "message": f"Failed to update weights: {e}.\nRolling back to original weights.",
            },
        )
    message = "Succeeded to update model weights."
    if f["weight_version"] is not None:
        message += f" Weight version updated to {f['weight_version']}."
    return reply(200, {"success": True, "message": message, "num_paused_requests": held})


# -- weights over a process group (SGLang's update_weights_from_distributed) ---------------------
@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request):
    """Joins the group as rank ``rank_offset`` (this server is one TP rank) through the sender's TCP
    store; answers once the whole group has formed, or fails after --weight-sync-timeout."""
    f = control_fields(
        await read_json(request),
        {
            "master_address": (expect_str, None),
            "master_port": (expect_int, None),
            "rank_offset": (expect_int, None),
            "world_size": (expect_int, None),
            "group_name": (expect_str, DEFAULT_GROUP_NAME),
            "backend": (expect_str, "nccl"),
        },
        required=("master_address", "master_port", "rank_offset", "world_size"),
    )
    return await off_loop(_init_group, server_state(request), f)


def _init_group(state, f):
    from megatron_klear.rollout.servers.update_group import join_update_group, set_group_timeout

    prefix = "Failed to initialize custom process group: "
    name, backend, rank = f["group_name"], f["backend"], f["rank_offset"]  # this server is TP rank 0 of 1
    if backend not in ("gloo", "nccl"):
        return _weights_reply(False, f"{prefix}backend {backend!r} is not supported (gloo | nccl).")
    if backend == "nccl" and state.engine.device.type != "cuda":
        return _weights_reply(
            False,
            f"{prefix}backend nccl needs CUDA; this embedded engine runs on "
            f"{state.engine.device.type}: use backend gloo.",
        )
    if state.gpus.tp_size > 1:
        return _weights_reply(
            False,
            f"{prefix}this stand-in serves one model for its --tp-size {state.gpus.tp_size} ranks and joins "
            "update groups as one rank only (in-memory pushes reach each rank; distributed ones need --tp-size 1).",
        )
    if not 0 < rank < f["world_size"]:
        return _weights_reply(
            False,
            f"{prefix}rank_offset {rank} is not a receiver rank of a group of "
            f"world_size {f['world_size']} (rank 0 is the sender).",
        )
    with state.weight_lock:
        if name in state.update_groups:
            return _weights_reply(
                False, f"{prefix}The specified group name has already been created, please use a different group name."
            )
        try:
            pg = join_update_group(
                backend=backend,
                master_address=f["master_address"],
                master_port=f["master_port"],
                rank=rank,
                world_size=f["world_size"],
                group_name=name,
                timeout=state.weight_sync_timeout,
            )
            set_group_timeout(pg, state.weight_sync_timeout)
        except Exception as e:  # noqa: BLE001 -- answered
            return _weights_reply(False, f"{prefix}{type(e).__name__}: {e}.")
        state.update_groups[name] = pg
    return _weights_reply(True, "Succeeded to initialize custom process group.")


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request):
    """Leaves the group; what its sender staged in the open session is discarded."""
    f = control_fields(await read_json(request), {"group_name": (expect_str, DEFAULT_GROUP_NAME)})
    return await off_loop(_destroy_group, server_state(request), f["group_name"])


def _destroy_group(state, name):
    from megatron_klear.rollout.servers.update_group import destroy_update_group

    with state.weight_lock:
        pg = state.update_groups.pop(name, None)
        if pg is None:
            return _weights_reply(False, "The group to be destroyed does not exist.")
        session = state.weight_session
        if session is not None and name in session.groups:
            state.weight_session = None  # what a gone sender staged is never applied
        destroy_update_group(pg)
    return _weights_reply(True, "Succeeded to destroy custom process group.")


class _WeightSession:
    """A begin/end weight-update session: what was received (applied at end, whole), the version
    to report with it, the groups it came from, and the first failure (nothing is applied then)."""

    def __init__(self):
        self.staged, self.version, self.groups, self.error = {}, None, set(), None
        self.loaded = False  # tensors were loaded in place (update_weights_from_tensor)


@router.post("/begin_weight_update")
async def begin_weight_update(request: Request):
    """Opens a session (SGLang 0.5.23 refuses updates outside one, and a second begin)."""
    f = control_fields(await read_json(request), {"selector": (expect_str, "all")})
    if f["selector"] not in ("target", "draft", "all"):
        raise BadRequest(f"invalid selector {f['selector']!r}; expected 'target', 'draft', or 'all'")
    return await off_loop(_begin_update, server_state(request))


def _begin_update(state):
    if "weights" in state.offload_tags:
        return _weights_reply(False, _RELEASED_WEIGHTS)
    with state.weight_lock:
        if state.weight_session is not None:
            return _weights_reply(False, "a weight-update session is already open; call end_weight_update() first")
        state.weight_session = _WeightSession()
    return _weights_reply(True, "Success")


def _outside_session(route: str):
    """SGLang 0.5.23's refusal of an update outside a begin/end session."""
    return _weights_reply(False, f"{route} must run between begin_weight_update() and end_weight_update()")


#: the fields SGLang 0.5.23's update requests share (``io_struct.py``: from distributed, from tensor)
_UPDATE_FIELDS = {
    "flush_cache": (expect_bool, True),
    "abort_all_requests": (expect_bool, False),
    "weight_version": (expect_str, None),
    "load_format": (expect_optional_str, None),
    "selector": (expect_str, "all"),
    "torch_empty_cache": (expect_bool, False),
}


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request):
    """Receives the tensors group rank 0 broadcasts (one per tensor, or one ``uint8`` bucket for
    ``load_format="flattened_bucket"``), checks and stages them; /end_weight_update applies them."""
    f = control_fields(
        await read_json(request),
        {
            "names": (expect_str_list, None),
            "dtypes": (expect_str_list, None),
            "shapes": (lambda v, w: [expect_token_ids(x, f"{w}[{k}]") for k, x in enumerate(expect_seq(v, w))], None),
            "group_name": (expect_str, DEFAULT_GROUP_NAME),
            **_UPDATE_FIELDS,
        },
        required=("names", "dtypes", "shapes"),
    )
    return await off_loop(_update_from_distributed, server_state(request), f)


def _update_from_distributed(state, f):
    from megatron_klear.rollout.servers.update_group import destroy_update_group

    if f["abort_all_requests"]:
        state.scheduler.abort(abort_all=True)
    with state.weight_lock:
        session = state.weight_session
        if session is None:
            return _outside_session("update_weights_from_distributed")
        name = f["group_name"]
        pg = state.update_groups.get(name)
        if pg is None:
            message = (
                f"Failed to receive weights: Group {name} not in {sorted(state.update_groups)}. "
                "Please call `init_weights_update_group` first."
            )
            if f["names"]:  # (a call of no tensor misses nothing: the session stays whole)
                session.error = message
            return _weights_reply(False, message)
        session.groups.add(name)

        def receive():  # with no decoding under way (SGLang: paused, or behind the model-update lock)
            try:
                tensors = _receive_weights(
                    pg,
                    f["names"],
                    f["dtypes"],
                    f["shapes"],
                    f["load_format"],
                    state.engine.device,
                    state.receive_buffers,
                )
            except Exception as e:  # noqa: BLE001 -- a broken group (sender or a peer gone, a timeout) is dropped
                if not isinstance(e, ValueError):
                    state.update_groups.pop(name, None)
                    destroy_update_group(pg)
                return None, f"Failed to receive weights: {type(e).__name__}: {e}"
            try:
                state.engine.weights.check_named_weights(tensors)
            except (TypeError, ValueError) as e:
                return None, f"Failed to update parameter online: {e}. Nothing was applied."
            if f["flush_cache"] and not state.scheduler.cache_flushable():
                # SGLang's answer when requests hold KV cache computed with the old weights
                return None, (
                    "Weights were updated, but the cache was not flushed because requests are still "
                    "running or queued. Retract or finish them, then call /flush_cache. (Nothing "
                    "was applied: the embedded engine commits a session whole.)"
                )
            return tensors, None

        (tensors, error), _ = state.scheduler.run_update(receive)
        if error is not None:
            session.error = error
            return _weights_reply(False, error)
        session.staged.update(tensors)
        state.weight_updates["update_weights_from_distributed"] += 1
        if f["weight_version"] is not None:
            session.version = f["weight_version"]
    message = f"Succeeded to update parameter online ({len(tensors)} tensors staged; applied by end_weight_update)."
    if f["weight_version"] is not None:
        message += f" Weight version updated to {f['weight_version']}."
    return _weights_reply(True, message)


def _receive_weights(pg, names, dtypes, shapes, load_format, device, buffers=None) -> list:
    """(name, tensor) received from group rank 0: one broadcast per tensor in order, or one
    ``uint8`` broadcast for ``load_format="flattened_bucket"`` (SGLang's two receive paths).
    ``buffers``: {(shape, dtype): [free tensors]} to receive into before allocating."""
    import torch
    import torch.distributed as dist

    from megatron_klear.rollout.servers.update_group import (
        FLATTENED_BUCKET,
        bucket_layout,
        dtype_of,
        unflatten_bucket,
    )

    if load_format == FLATTENED_BUCKET:
        layout = bucket_layout(names, dtypes, shapes)
        flat = torch.empty(layout[-1][4], dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=0, group=pg)
        return unflatten_bucket(flat, layout)
    if load_format not in (None, "auto"):
        raise ValueError(
            f"load_format {load_format!r} is not supported by the embedded engine (auto | {FLATTENED_BUCKET})"
        )
    out, works = [], []
    for name, dt, shape in zip(names, dtypes, shapes):
        shape, dt = tuple(int(d) for d in shape), dtype_of(dt)
        free = (buffers or {}).get((shape, dt))
        t = free.pop() if free else torch.empty(shape, dtype=dt, device=device)
        works.append(dist.broadcast(t, src=0, group=pg, async_op=True))
        out.append((name, t))
    for w in works:
        w.wait()
    return out


@router.post("/end_weight_update")
async def end_weight_update(request: Request):
    """Applies the session's staged tensors at once (the received buffers become the parameters'
    storage, between two decode steps) with its last weight_version; after any failed call,
    nothing, naming the version still served."""
    control_fields(await read_json(request), {})
    return await off_loop(_end_update, server_state(request))


def _end_update(state):
    with state.weight_lock:
        session, state.weight_session = state.weight_session, None
        if session is None:
            return _weights_reply(False, "no weight-update session is open; call begin_weight_update() first")
        if session.error is not None:
            return _weights_reply(
                False,
                f"the weight update failed ({session.error}); nothing was applied: "
                f"weight version {state.weight_version} is still served",
            )
        if session.staged:
            version = session.version if session.version is not None else state.engine.weight_version
            try:
                # the received buffers become the parameters (no copy): the swap is the commit;
                # the storages they replace receive the next update (no fresh allocation)
                replaced, _ = state.scheduler.run_update(
                    lambda: state.engine.weights.load_named_weights(session.staged, version=version, adopt=True)
                )
                state.receive_buffers = {}
                for t in replaced:  # only buffers this server received into (not the loaded checkpoint's)
                    if (
                        t.data_ptr() in state.adopted
                        and t.storage_offset() == 0
                        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
                    ):
                        state.receive_buffers.setdefault((tuple(t.shape), t.dtype), []).append(t)
                state.adopted = {t.data_ptr() for t in session.staged.values()}
            except (TypeError, ValueError) as e:
                return _weights_reply(False, f"Failed to update parameter online: {e}. Nothing was applied.")
        elif session.loaded and session.version is not None:
            state.engine.weights.version = session.version
    return _weights_reply(True, "Success")


# -- from serialized tensors (custom weight loaders) ---------------------------------------------------
class LoaderModel:
    """What SGLang hands a custom weight loader as its model, for the embedded engine:
    ``load_weights([(HF name, tensor)])`` (some parameters, by HF name, written with ``copy_``) and
    ``parameters()``."""

    def __init__(self, weights):
        self.weights = weights

    def parameters(self):
        return self.weights.model.parameters()

    def load_weights(self, named_tensors) -> None:
        self.weights.load_named_weights(list(named_tensors), version=self.weights.version)


class TensorLoader:
    """The part of SGLang 0.5.23's model-runner ``WeightUpdater`` the tensor route runs
    (``srt/model_executor/model_runner_components/weight_updater.py``), laid out as there: the
    update groups in ``_model_update_group`` (the server's own table, by name), and
    ``update_weights_from_tensor`` handing ``(model, named_tensors)`` to the model's
    ``load_weights`` or to a custom loader of ``--custom-weight-loader`` (which may mark a group in
    that table instead of raising: megatron_klear/rollout/in_server/sglang_delta.py)."""

    def __init__(self, state):
        self._model_update_group = state.update_groups
        self.custom_weight_loaders = state.custom_weight_loader
        self.model = LoaderModel(state.engine.weights)

    def get_model(self):
        return self.model

    def update_weights_from_tensor(self, named_tensors, load_format=None) -> None:
        if load_format in (None, "direct"):
            self.get_model().load_weights(named_tensors)
        elif load_format in self.custom_weight_loaders:
            module, _, name = load_format.rpartition(".")
            custom_loader = getattr(importlib.import_module(module), name)
            custom_loader(self.get_model(), named_tensors)
        else:
            # SGLang 0.5.23's own answer (weight_updater.py), which ends its scheduler: not a stub
            raise NotImplementedError(f"Unknown load_format={load_format}")


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request):
    """Loads the tensors of this rank's entry of ``serialized_named_tensors`` (base64 of a pickle,
    read as SGLang's ``SafeUnpickler`` reads it) at once: through the model's ``load_weights``
    (``load_format`` None or ``direct``) or the loader ``load_format`` names, which must be one of
    ``--custom-weight-loader``. As in SGLang 0.5.23, an exception of the load (a loader's, or an
    unknown ``load_format``) ends the server: its scheduler's handler takes the process down."""
    f = control_fields(
        await read_json(request),
        {
            "serialized_named_tensors": (expect_str_list, None),
            **_UPDATE_FIELDS,
        },
        required=("serialized_named_tensors",),
    )
    if not f["serialized_named_tensors"]:
        raise BadRequest("serialized_named_tensors: one entry per TP rank, got none")
    entries = []
    for i, entry in enumerate(f["serialized_named_tensors"]):
        try:
            entries.append(base64.b64decode(entry, validate=True))
        except (binascii.Error, ValueError) as e:
            raise BadRequest(f"serialized_named_tensors[{i}] is not base64: {e}") from None
    return await off_loop(_update_from_tensor, server_state(request), f, entries)


def _open_every_rank(state, entries: list) -> list:
    """Each TP rank opens its own entry on its own GPU (:class:`~.gpus.ServerGPUs`, SGLang's
    ``deserialize_own_rank``); the one model here loads rank 0's tensors, and every other rank must
    have been handed the same (a GPU server's ranks would otherwise serve different weights)."""
    import torch

    named = None
    for rank in range(state.gpus.tp_size):
        mine = state.gpus.open(rank, entries, state.tensor_sharers)
        if named is None:
            named = mine
        elif [n for n, _ in mine] != [n for n, _ in named] or not all(
            torch.equal(a, b) for (_, a), (_, b) in zip(mine, named)
        ):
            raise RuntimeError(f"TP rank {rank} was handed other tensors than TP rank 0")
    return named


def _update_from_tensor(state, f, entries: list):
    if f["abort_all_requests"]:
        state.scheduler.abort(abort_all=True)
    with state.weight_lock:
        session = state.weight_session
        if session is None:
            return _outside_session("update_weights_from_tensor")
        load_format = f["load_format"]

        def load():
            named = _open_every_rank(state, entries)
            TensorLoader(state).update_weights_from_tensor(named, load_format)

        try:
            state.scheduler.run_update(load)
        except Exception as e:  # noqa: BLE001 -- SGLang's scheduler dies of any exception here
            state.fault = f"update_weights_from_tensor: {type(e).__name__}: {e}"
            print(f"sglang stand-in: Scheduler hit an exception: {state.fault}", file=sys.stderr, flush=True)
            if state.on_fault is not None:
                state.on_fault()
            return error(500, state.fault)
        session.loaded = True
        state.weight_updates["update_weights_from_tensor"] += 1
        if f["weight_version"] is not None:
            session.version = f["weight_version"]
        if f["flush_cache"] and not state.scheduler.cache_flushable():
            return _weights_reply(
                False,
                "Weights were updated, but the cache was not flushed because requests are still running or "
                "queued. Retract or finish them, then call /flush_cache.",
            )
    return _weights_reply(True, "Success")


# -- checksums -----------------------------------------------------------------------------------
@router.api_route("/weights_checker", methods=["GET", "POST"])
async def weights_checker(request: Request):
    """``{"action": "checksum"}``: per-parameter sha256 prefixes in SGLang's answer shape."""
    body = await read_json(request) if request.method != "GET" else None
    f = control_fields(
        body or {},
        {
            "action": (expect_str, "checksum"),
            "allow_quant_error": (expect_bool, False),
            "skip_tensor_list": (lambda v, w: [expect_str(x, w) for x in expect_seq(v, w)], None),
            "selector": (expect_str, "all"),
        },
    )
    if f["action"] != "checksum":
        return _weights_reply(False, f"action {f['action']!r} is not supported by the embedded engine (checksum)")
    engine = server_state(request).engine
    checksums = await off_loop(lambda: engine.weights.checksums(skip=f["skip_tensor_list"] or ()))
    overall = hashlib.sha256()
    for name in sorted(checksums):
        overall.update(name.encode())
        overall.update(checksums[name].encode())
    per_gpu = overall.hexdigest()
    info = {
        "role": "target",
        "tp_rank": 0,
        "tp_size": 1,
        "dp_rank": 0,
        "dp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "rank": 0,
        "size": 1,
    }
    return _weights_reply(
        True,
        "Success",
        ranks=[{"checksums": checksums, "per_gpu_checksum": per_gpu, "parallelism_info": [info]}],
        per_engine_checksum=hashlib.sha256(per_gpu.encode()).hexdigest(),
    )
