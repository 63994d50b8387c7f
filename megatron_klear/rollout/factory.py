"""One place that turns a ``rollout`` config section into an engine (the RL loop and tools/eval.py)."""

from __future__ import annotations

from megatron_klear.rollout.base import RolloutEngine
from megatron_klear.rollout.config import RolloutConfig


def make_engine(
    r: RolloutConfig,
    model_dir: str = "",
    *,
    device: str = "cpu",
    hf_config=None,
    routed_experts: tuple | None = None,
    weight_sync: bool = True,
    pause_mode: str = "abort",
) -> RolloutEngine:
    """``engine=embedded``: the torch engine on ``model_dir`` (an HF directory) in this process, on
    ``device``, in ``r.dtype`` (``hf_config``: a transformers config overriding the directory's, e.g.
    with RoPE scaling). ``engine=http``: the SGLang client of ``r.urls`` / ``r.workers``, taking the
    section as it is (its timeouts and limits); it checks the servers answer, and what :mod:`.sglang.compat` checks
    (colocated servers' environment, the NCCL build). ``routed_experts``: ``(MoE layer numbers,
    top_k)`` of the model when ``r.router_replay`` asks the engine for the experts of every token.
    ``weight_sync``: the engine will receive the trainer's weights by ``r.weight_sync`` (False for
    evaluation, which pushes none: the NCCL build is then not checked). ``engine=vllm``: the vLLM
    client of ``r.urls`` (:class:`~megatron_klear.rollout.vllm.VLLMEngine`), its servers checked.
    ``pause_mode``: how a push pauses the servers (:attr:`~.base.ServerEngine.sync_pause_mode`; the
    in-process engine has none)."""
    if r.engine == "embedded":
        from megatron_klear.rollout.embedded import EmbeddedEngine

        extra = {"config": hf_config} if hf_config is not None else {}
        return EmbeddedEngine.from_pretrained(
            model_dir, dtype=r.dtype, device=device, record_routing=r.router_replay, **extra
        )
    if r.engine == "vllm":
        from megatron_klear.rollout.vllm import VLLMEngine

        engine = VLLMEngine(r, sync_pause_mode=pause_mode, check=True)  # checks what vLLM servers need
        if weight_sync and r.weight_sync == "distributed":
            engine.control.check_update_group_layout()  # the plugin's transfer engine, no data parallelism
        return engine
    from megatron_klear.rollout.sglang import SGLangEngine
    from megatron_klear.rollout.sglang.compat import check_servers

    engine = SGLangEngine(
        r, routed_experts=routed_experts if r.router_replay else None, sync_pause_mode=pause_mode, check=True
    )
    check_servers(engine, r, weight_sync=weight_sync)  # colocated servers' environment; the NCCL build
    return engine
