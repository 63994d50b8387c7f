"""Start-up checks that SGLang servers can serve this run as configured, from what SGLang 0.5.23
reports about itself (``GET /server_info``), before the first step:

- :func:`check_nccl_build`: ``rollout.weight_sync=distributed`` over NCCL puts the trainer's stage
  leaders and the servers in one NCCL communicator, which needs one NCCL build on both sides. SGLang
  reports its own version (``version``) but neither torch's nor NCCL's, so the check goes through
  the torch each SGLang release pins (its wheel's ``Requires-Dist``), :data:`SGLANG_TORCH`;
- :func:`check_colocated_env`: colocated servers (``rollout.colocate``) must run with
  ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false`` (else every ``/health`` probe, the router's
  too, generates, also on released memory) and ``SGLANG_MEMORY_SAVER_CUDA_GRAPH=true`` (else
  releasing ``cuda_graph`` frees nothing). A server lists its SGLang variables in ``/server_info``
  (``internal_states[i].env_vars``) only when started with ``SGLANG_EXPOSE_OWN_ENV_VARS=true``;
  without it the check cannot tell and warns.

:func:`check_servers` runs those a config needs (the SGLang engine's builder, ``rollout.engine=sglang``).
Which SGLang behaviour each follows is in docs/sglang.md.
"""

from __future__ import annotations

import warnings

from megatron_klear.rollout.base import EngineError

#: the torch each SGLang release pins (``Requires-Dist: torch==...`` of its wheel's METADATA)
SGLANG_TORCH = {"0.5.23": "2.14.1"}
HEALTH_GENERATION = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"
MEMORY_SAVER_CUDA_GRAPH = "SGLANG_MEMORY_SAVER_CUDA_GRAPH"
EXPOSE_ENV_VARS = "SGLANG_EXPOSE_OWN_ENV_VARS"


def env_bool(value: str | None, default: bool) -> bool:
    """A value as SGLang's ``EnvBool`` reads it (``srt/environ.py``): true/1/yes/y, false/0/no/n (any
    case); unset or anything else: ``default``."""
    if value is None:
        return default
    v = value.lower()
    if v in ("true", "1", "yes", "y"):
        return True
    if v in ("false", "0", "no", "n"):
        return False
    return default


def get_bool_env_var(value: str | None) -> bool:
    """A value as SGLang's ``get_bool_env_var`` reads it (default false; only true and 1): how its CUDA
    graph runners read ``SGLANG_MEMORY_SAVER_CUDA_GRAPH``."""
    return (value or "false").lower() in ("true", "1")


def _base_version(version: str) -> str:
    return str(version).split("+", 1)[0]


def trainer_build() -> tuple:
    """(torch version, NCCL version or None) of this process (NCCL only where CUDA is)."""
    import torch

    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
        except (AttributeError, RuntimeError):  # a torch built without NCCL
            nccl = None
    return torch.__version__, nccl


def _server_infos(engine) -> dict:
    """``{worker: /server_info}`` of the workers that answer (one that is gone is dropped, as
    everywhere in the fleet: the checks concern the servers that will serve)."""
    return engine.members.on_workers(engine.server_info, tolerate_loss=True)


def check_nccl_build(engine, *, trainer_torch: str | None = None, trainer_nccl: str | None = None) -> None:
    """Every worker's SGLang must pin the trainer's torch (and so its NCCL); fails naming both
    versions and the fix. A server whose SGLang version is not in :data:`SGLANG_TORCH` (or that does
    not report one) cannot be checked: a warning says what to make sure of."""
    if trainer_torch is None:
        trainer_torch, trainer_nccl = trainer_build()
    for w, info in _server_infos(engine).items():
        version = (info or {}).get("version")
        pinned = SGLANG_TORCH.get(str(version))
        if pinned is None:
            warnings.warn(
                f"rollout: {w} reports SGLang version {version!r}, whose torch pin is unknown here: make "
                f"sure the servers' torch and NCCL are the trainer's (torch {trainer_torch}, NCCL "
                f"{trainer_nccl or 'unknown'}) for rollout.weight_sync=distributed over NCCL",
                stacklevel=2,
            )
            continue
        if _base_version(trainer_torch) != pinned:
            raise EngineError(
                f"rollout: {w} runs SGLang {version}, which pins torch {pinned} (and the NCCL built with it), but the "
                f"trainer runs torch {trainer_torch} (NCCL {trainer_nccl or 'unknown'}): rollout.weight_sync="
                f"distributed puts both in one NCCL communicator, which needs one NCCL build. Install torch=={pinned} "
                "in the trainer's environment (the same CUDA flavour as the servers'), or use "
                "rollout.weight_sync=disk"
            )


def own_env_vars(info) -> dict | None:
    """The SGLang variables a server lists in its ``/server_info`` answer ``info``
    (``internal_states[0].env_vars``, with ``SGLANG_EXPOSE_OWN_ENV_VARS=true``), or None."""
    states = (info or {}).get("internal_states") or []
    listed = [s["env_vars"] for s in states if isinstance(s, dict) and isinstance(s.get("env_vars"), dict)]
    return listed[0] if listed else None


def check_colocated_env(engine) -> None:
    """Colocated servers must run with health generation off and the CUDA-graph memory saver on,
    where they say so (``SGLANG_EXPOSE_OWN_ENV_VARS=true``); fails naming the variable."""
    unknown = []
    for w, info in _server_infos(engine).items():
        env = own_env_vars(info)
        if env is None:
            unknown.append(w)
            continue
        if env_bool(env.get(HEALTH_GENERATION), True):
            raise EngineError(
                f"rollout.colocate: {w} runs with {HEALTH_GENERATION} "
                f"{'unset (true by default)' if env.get(HEALTH_GENERATION) is None else '=' + env[HEALTH_GENERATION]}: "
                "every /health probe (the router's, the client's) then generates a token, also while the server's "
                f"memory is released, which crashes it. Restart it with {HEALTH_GENERATION}=false"
            )
        if not get_bool_env_var(env.get(MEMORY_SAVER_CUDA_GRAPH)):
            raise EngineError(
                f"rollout.colocate: {w} runs without {MEMORY_SAVER_CUDA_GRAPH}=true, so releasing its cuda_graph "
                "memory frees nothing (SGLang allocates CUDA graphs in the memory saver's region only with it) and "
                f"the trainer meets the graphs on its GPU. Restart it with {MEMORY_SAVER_CUDA_GRAPH}=true"
            )
    if unknown:
        warnings.warn(
            f"rollout.colocate: {', '.join(unknown)} do not list their SGLang environment (start them with "
            f"{EXPOSE_ENV_VARS}=true): make sure they run with {HEALTH_GENERATION}=false and "
            f"{MEMORY_SAVER_CUDA_GRAPH}=true",
            stacklevel=2,
        )


def check_servers(engine, r, *, weight_sync: bool = True) -> None:
    """The checks a ``rollout`` config needs: colocated servers' environment; for
    ``weight_sync=distributed`` (dedicated servers' default) a layout SGLang can update from a process
    group (dp_size 1, no pipeline parallelism), and the NCCL build over NCCL (``sync_backend`` auto:
    NCCL where CUDA is), unless the engine receives no weights (``weight_sync=False``: evaluation)."""
    if r.colocate:
        check_colocated_env(engine)
        return
    if not weight_sync or r.weight_sync not in ("distributed", "auto"):
        return
    engine.wire.check_update_group_layout()  # dp_size > 1 or pipeline parallelism: refused by name now
    backend = r.sync_backend
    if backend == "auto":
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        check_nccl_build(engine)
