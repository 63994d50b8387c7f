"""The experts each token was routed to, as SGLang reports them (``meta_info["routed_experts"]``
with ``return_routed_experts``; servers started with ``--enable-return-routed-experts``), for
``rollout.router_replay``: the base64 of an int32 array [tokens, every layer, top_k]."""

from __future__ import annotations

from megatron_klear.rollout.servers.transport import EngineError


def encode_routed_experts(routes) -> str:
    """SGLang's ``meta_info["routed_experts"]``: the base64 of an int32 array [tokens, layers, top_k]
    (``detokenizer_manager._b64_encode_per_request`` of 0.5.23)."""
    import base64

    import numpy as np

    return base64.b64encode(np.ascontiguousarray(np.asarray(routes, dtype=np.int32)).tobytes()).decode("ascii")


def decode_routed_experts(text, *, rows: int, layers: list, top_k: int, where: str = "/generate"):
    """``meta_info["routed_experts"]`` -> int16 tensor [rows, len(layers), top_k]: the experts of the
    MoE layers ``layers`` (indices among the model's layers; SGLang reports every layer, a dense
    one as zeros) for each of the ``rows`` = prompt + response - 1 tokens the model was fed (SGLang:
    positions ``[routed_experts_start_len, seqlen - 1)``, start 0)."""
    import base64
    import binascii

    import numpy as np
    import torch

    if not isinstance(text, str):
        raise EngineError(
            f"rollout: {where} did not return meta_info.routed_experts (rollout.router_replay needs "
            "SGLang started with --enable-return-routed-experts)"
        )
    try:
        flat = np.frombuffer(base64.b64decode(text, validate=True), dtype=np.int32)
    except (binascii.Error, ValueError) as e:
        raise EngineError(f"rollout: {where}: meta_info.routed_experts is not base64 int32 ({e})") from None
    per_token = flat.size // rows if rows else 0
    if rows <= 0 or flat.size != rows * per_token or per_token % top_k or per_token // top_k <= max(layers, default=-1):
        raise EngineError(
            f"rollout: {where}: meta_info.routed_experts holds {flat.size} ids, not {rows} tokens x "
            f"layers x top_k={top_k} covering MoE layers {list(layers)} (prompt + response - 1 = {rows})"
        )
    routes = torch.from_numpy(flat.reshape(rows, per_token // top_k, top_k)[:, list(layers)].astype(np.int16))
    return routes
