"""One place that turns a ``rollout`` config section into an engine (the RL loop and tools/eval.py),
through the table of engines (:mod:`.engines`)."""

from __future__ import annotations

from megatron_klear.rollout.base import RolloutEngine
from megatron_klear.rollout.config import RolloutConfig
from megatron_klear.rollout.engines import engine_spec


def make_engine(
    r: RolloutConfig,
    model_dir: str = "",
    *,
    device: str = "cpu",
    hf_config=None,
    routed_experts: tuple | None = None,
    weight_sync: bool = True,
) -> RolloutEngine:
    """The engine ``r.engine`` names, built by its registered builder from the (validated) section
    and the job's context: ``model_dir`` (an HF directory: the in-process engine loads it, on
    ``device``; ``hf_config``: a transformers config overriding the directory's, e.g. with RoPE
    scaling), ``routed_experts`` (``(MoE layer numbers, top_k)`` of the model when
    ``r.router_replay`` asks the engine for the experts of every token), ``weight_sync`` (the
    engine will receive the trainer's weights by ``r.weight_sync``; False for evaluation, which
    pushes none). Engines of servers check that their servers answer and can serve the run."""
    return engine_spec(r.engine).build(
        r,
        model_dir=model_dir,
        device=device,
        hf_config=hf_config,
        routed_experts=routed_experts,
        weight_sync=weight_sync,
    )
