"""The GPPO actor update of a Qwen3-MoE model at EP=2 (issue 12) equals the one-process update: the
old-log-prob pass, losses, grad norms, the load-balancing loss (logged) and every parameter's change,
experts included (each EP rank updates its own half of them; the deltas are gathered over EP)."""

import math

import pytest

from tests.distributed.helper import run_distributed
from tests.distributed.test_actor import _update


def _tiny_moe(tmp_path_factory, name: str, **kwargs) -> str:
    """A tiny Qwen3-MoE whose layer 1 is dense."""
    from megatron_klear.models.tiny import make_tiny_qwen3_moe

    return make_tiny_qwen3_moe(str(tmp_path_factory.mktemp(name) / "m"), mlp_only_layers=(1,), **kwargs)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return _tiny_moe(tmp_path_factory, "moe_actor", num_layers=3, seed=41, router_aux_loss_coef=0.1)


@pytest.mark.slow
def test_moe_actor_update_at_ep2_matches_one_process(moe_dir):
    import torch

    ref_metrics, ref_delta = run_distributed(_update, 1, moe_dir, [])[0]
    results = run_distributed(_update, 2, moe_dir, ["parallel.ep=2"])
    metrics, delta = results[0]
    assert ref_metrics["actor/optimizer_steps"] == 2 and ref_metrics["actor/ratio_max"] > 1.0
    assert set(delta) == set(ref_delta)
    assert sum(".mlp.experts." in k for k in delta) == 2 * 8 * 3  # every expert of the two MoE layers
    for a, b in zip(metrics["actor/steps"], ref_metrics["actor/steps"]):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5, abs_tol=1e-7), (a, b)
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4), (a, b)
        # logged per mini-batch: ~1 for a balanced router (num_experts * sum f_e P_e / top-k)
        assert b["moe_aux_loss"] > 0.5
        assert math.isclose(a["moe_aux_loss"], b["moe_aux_loss"], rel_tol=1e-5), (a, b)
    for k in (
        "actor/moe_aux_loss",
        "actor/clip_frac_high",
        "actor/clip_frac_low",
        "actor/entropy",
        "actor/logprob_mismatch_mean",
    ):
        assert math.isclose(metrics[k], ref_metrics[k], rel_tol=1e-4, abs_tol=1e-7), k
    moved = 0
    for k, v in ref_delta.items():
        assert torch.allclose(delta[k], v, atol=2e-4, rtol=0), (k, (delta[k] - v).abs().max())
        moved += ".mlp.experts." in k and float(v.abs().max()) > 1e-3
    assert moved > 24  # most experts received tokens and moved (not a vacuous comparison)


# ---- rollout.router_replay: the old-log-prob pass with the engine's expert choices -----------------------
def _response_logprobs(model, sample, forced=None):
    """transformers' float64 log-probs of ``sample``'s response tokens (differentiable), routing each
    token to ``forced`` ([tokens, MoE layers, top_k]) when given: the router's own softmax, gathered
    at the forced experts and renormalised as Qwen3MoeTopKRouter does."""
    import torch
    import torch.nn.functional as F

    originals = []
    routers = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    for j, router in enumerate(routers if forced is not None else []):

        def forward(hidden, router=router, idx=forced[:, j].long()):  # noqa: B008 -- bound per router, on purpose
            hidden = hidden.reshape(-1, router.hidden_dim)
            logits = F.linear(hidden, router.weight)
            top = torch.softmax(logits, dtype=torch.float, dim=-1).gather(1, idx)
            if router.norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), idx

        originals.append((router, router.forward))
        router.forward = forward
    try:
        ids = torch.tensor([list(sample.prompt_ids) + list(sample.response_ids)[:-1]])
        logits = model(input_ids=ids).logits[0].double()
    finally:
        for router, f in originals:
            router.forward = f
    lp = torch.log_softmax(logits[len(sample.prompt_ids) - 1 :], dim=-1)
    return lp.gather(1, torch.tensor(sample.response_ids).unsqueeze(1))[:, 0]


def _hf_logprobs(model, samples, forced=None):
    """transformers' log-probs of each response, each token routed to ``forced[i]`` when given."""
    import torch

    with torch.no_grad():
        return [_response_logprobs(model, s, None if forced is None else forced[i]) for i, s in enumerate(samples)]


def _trainer_old_logprobs(actor, samples):
    """{sample index: {position: old log-prob}} of the response tokens this rank computed (the last
    pipeline stage; with CP its load-balanced chunks of each sample, found as the step finds them)."""
    import torch
    from megatron.core import parallel_state

    from megatron_klear.checkpoint.model_weights import unwrap
    from megatron_klear.training.batches import model_padding_rule, prepare_packed

    cp, cp_rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    multiple = model_padding_rule(
        unwrap(actor.state.model[0]).config, parallel_state.get_tensor_model_parallel_world_size(), cp
    ).row_multiple
    plans = actor.plan(samples)
    actor.recompute_old_logprobs(plans)
    got = {}
    for _, mbs in plans:
        for mb in mbs:
            if "old_logprobs_local" not in mb:  # not the last pipeline stage
                continue
            local, _ = prepare_packed(
                mb,
                cp_rank=cp_rank,
                cp_size=cp,
                total_multiple=multiple,
                per_token_keys=("seq_ids", "loss_mask", "position_ids"),
            )
            seq, mask, pos = local["seq_ids"][0], local["loss_mask"][0], local["position_ids"][0]
            old = mb["old_logprobs_local"][0].double()
            for i in torch.nonzero(mask > 0).flatten().tolist():
                got.setdefault(int(seq[i].round()), {})[int(pos[i])] = old[i]
    return got


def _replay(rank, world, model_dir, overrides=()):
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM

    from megatron_klear.config import load_config
    from megatron_klear.platform import init_parallel
    from megatron_klear.rl.actor import Actor
    from megatron_klear.training.setup import build_training_state
    from tests.distributed.test_actor import make_samples

    cfg = load_config(
        None,
        [
            f"model.path={model_dir}",
            "rl.mini_batch_prompts=2",
            "rl.prompts_per_step=4",
            "rl.max_tokens_per_micro_batch=48",
            *overrides,
        ],
    )
    init_parallel(cfg.parallel, seed=1)
    state = build_training_state(cfg, total_steps=1)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    samples = make_samples()
    n_layers, topk, experts = sum(state.arch.moe_layer_pattern), 2, 8
    gen = torch.Generator().manual_seed(0)
    forced = [
        torch.rand(len(s) - 1, n_layers, experts, generator=gen).argsort(-1)[..., :topk].to(torch.int16)
        for s in samples
    ]
    replayed = [dataclasses.replace(s, routed_experts=f) for s, f in zip(samples, forced)]
    return {
        "own": _trainer_old_logprobs(Actor(state, cfg.rl, logprob_chunk_size=7), samples),
        "replayed": _trainer_old_logprobs(Actor(state, cfg.rl, logprob_chunk_size=7, router_replay=True), replayed),
        # replay off: the routed experts are carried but ignored
        "ignored": _trainer_old_logprobs(Actor(state, cfg.rl, logprob_chunk_size=7), replayed),
        # after a replayed pass the routers choose for themselves again
        "own_after": _trainer_old_logprobs(Actor(state, cfg.rl, logprob_chunk_size=7), samples),
        "hf_own": dict(enumerate(_hf_logprobs(hf, samples))) if rank == 0 else {},
        "hf_forced": dict(enumerate(_hf_logprobs(hf, samples, forced))) if rank == 0 else {},
    }


@pytest.fixture(scope="module")
def moe4_dir(tmp_path_factory):
    from megatron_klear.models.tiny import make_tiny_qwen3_moe

    return make_tiny_qwen3_moe(
        str(tmp_path_factory.mktemp("moe_replay") / "m"), num_layers=4, mlp_only_layers=(1,), seed=42
    )


@pytest.mark.parametrize(
    "world,overrides",
    [
        (1, []),
        pytest.param(2, ["parallel.pp=2"], marks=pytest.mark.slow),
        pytest.param(2, ["parallel.ep=2"], marks=pytest.mark.slow),
        pytest.param(2, ["parallel.tp=2", "parallel.sequence_parallel=true"], marks=pytest.mark.slow),
        pytest.param(2, ["parallel.cp=2"], marks=pytest.mark.slow),
    ],
    ids=["one", "pp2", "ep2", "tp2-sp", "cp2"],
)
def test_router_replay_routes_the_old_logprob_pass_to_the_given_experts(moe4_dir, world, overrides):
    import torch

    results = run_distributed(_replay, world, moe4_dir, overrides)
    r = {k: {} for k in results[0]}
    # PP: the last stage has the log-probs; EP (= DP here): each rank its micro-batches; CP: each
    # rank two chunks of every sample (merged by position)
    for res in results:
        for k, v in res.items():
            for sid, x in v.items():
                if isinstance(x, dict):
                    r[k].setdefault(sid, {}).update(x)
                else:
                    r[k][sid] = x
    r = {
        k: [torch.stack([v[i][p] for p in sorted(v[i])]) if isinstance(v[i], dict) else v[i] for i in sorted(v)]
        for k, v in r.items()
    }

    def close(a, b, tol=1e-4):
        assert len(a) == len(b) == 12, (len(a), len(b))  # every sample on both sides (zip stops at the shorter)
        return all(x.shape == y.shape and float((x - y).abs().max()) < tol for x, y in zip(a, b))

    assert len(r["own"]) == 12
    assert close(r["own"], r["hf_own"])  # parity: the trainer's own routing is transformers'
    assert close(r["replayed"], r["hf_forced"])  # replay: transformers with the same experts forced
    assert not close(r["hf_forced"], r["hf_own"], tol=1e-2)  # forcing them changes the log-probs
    assert close(r["ignored"], r["own"], tol=1e-6) and close(r["own_after"], r["own"], tol=1e-6)


# ---- router replay in the update itself (R3): the training forward and its recompute -----------------
@pytest.fixture(scope="module")
def moe_noaux_dir(tmp_path_factory):
    """A tiny Qwen3-MoE without the load-balancing loss (its gradient is not the policy's)."""
    return _tiny_moe(tmp_path_factory, "moe_r3", num_layers=4, seed=43, router_aux_loss_coef=0.0)


MOE_LAYERS = 3  # of moe_noaux_dir's 4 layers (layer 1 is dense)


def _forced_routes(lengths, n_layers, topk=2, experts=8):
    """The engine's routes of each sample (``lengths``: prompt + response), chosen at random: most
    differ from the trainer's own choice."""
    import torch

    gen = torch.Generator().manual_seed(5)
    return [
        torch.rand(n - 1, n_layers, experts, generator=gen).argsort(-1)[..., :topk].to(torch.int16) for n in lengths
    ]


def _replayed_update(rank, world, model_dir, overrides, reuse_first_forward):
    """One actor update (one mini-batch) with the engine's routes forced: its metrics and the
    gradient of its optimizer step, by HF name (experts one by one)."""
    import dataclasses

    from megatron.core import parallel_state

    from megatron_klear.checkpoint.model_weights import iter_hf_tensors, unwrap
    from megatron_klear.config import load_config
    from megatron_klear.platform import init_parallel
    from megatron_klear.rl.actor import Actor
    from megatron_klear.training.setup import build_training_state
    from tests.distributed.test_actor import make_samples

    cfg = load_config(
        None,
        [
            f"model.path={model_dir}",
            "rl.mini_batch_prompts=4",
            "rl.prompts_per_step=4",
            "rl.max_tokens_per_micro_batch=48",
            "rl.nll_coef=0.0",
            *overrides,
        ],
    )
    init_parallel(cfg.parallel, seed=1)
    state = build_training_state(cfg, total_steps=1)
    samples = make_samples()
    forced = _forced_routes([len(s.prompt_ids) + len(s.response_ids) for s in samples], MOE_LAYERS)
    samples = [dataclasses.replace(s, routed_experts=f) for s, f in zip(samples, forced)]
    grads = {}
    step = state.optimizer.step

    def capturing_step():
        params = [p for chunk in state.model for p in unwrap(chunk).parameters()]
        saved = [p.data for p in params]
        for p in params:
            p.data = p.main_grad.to(p.dtype).clone()
        group = parallel_state.get_tensor_model_parallel_group()
        grads.update({k: v.detach().cpu().clone() for k, v in iter_hf_tensors(state.model, tp_group=group)})
        for p, d in zip(params, saved):
            p.data = d
        return step()

    state.optimizer.step = capturing_step
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for chunk in state.model for m in unwrap(chunk).modules() if isinstance(m, TopKRouter)]
    queued = [0]  # the longest queue of routes any router held at a forward (its recompute's included)

    def record(router, args):
        queued[0] = max(queued[0], len(router.router_replay.replay_backward_list))

    for router in routers:
        router.register_forward_pre_hook(record)
    actor = Actor(state, cfg.rl, logprob_chunk_size=7, router_replay=True)
    actor.reuse_first_forward = reuse_first_forward
    metrics = actor.update(samples)
    metrics["queued_max"] = queued[0]
    metrics["queued_after"] = sum(len(r.router_replay.replay_backward_list) for r in routers)
    metrics["plan"] = actor.last_plan  # this rank's micro-batches: samples in each, 0 for a filler
    metrics["pp_rank"] = parallel_state.get_pipeline_model_parallel_rank()
    metrics["pp_size"] = parallel_state.get_pipeline_model_parallel_world_size()
    metrics["dp_rank"] = parallel_state.get_data_parallel_rank()
    return {k: v for k, v in metrics.items() if k != "actor/steps"}, grads


def _hf_policy_gradient(model_dir, samples, forced):
    """transformers' gradient (float32 model: its grouped experts take no float64) of the GPPO loss
    at ratio 1 (the first mini-batch: every token inside the clip range), token_mean over the
    mini-batch, no NLL term: -sum_t A * log p(t) / N, each token routed to ``forced``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    n_tokens = sum(len(s.response_ids) for s in samples)
    loss = sum(-s.advantage * _response_logprobs(model, s, forced[i]).sum() / n_tokens for i, s in enumerate(samples))
    loss.backward()
    return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "world,overrides,reuse",
    [
        (1, [], True),
        (1, [], False),  # old log-probs by a pass of their own: the update's forward must route as it did
        (1, ["model.recompute_granularity=full"], False),  # the backward's recompute replays too
        # 1F1B runs later micro-batches' forwards before a backward: the recompute replays its own
        pytest.param(2, ["parallel.pp=2", "model.recompute_granularity=full"], False, marks=pytest.mark.slow),
        # 3 bins over 2 DP ranks: one rank trains a filler row (no samples) beside a real one; its
        # forward, run between a real micro-batch's forward and its backward's recompute, must keep
        # that micro-batch's routes queued (it cleared them: the recompute routed by itself)
        pytest.param(
            4,
            ["parallel.pp=2", "model.recompute_granularity=full", "rl.max_tokens_per_micro_batch=72"],
            False,
            marks=pytest.mark.slow,
        ),
    ],
    ids=["reuse", "separate-pass", "recompute", "pp2-recompute", "pp2-dp2-filler"],
)
def test_router_replay_routes_the_update_as_the_engine_did(moe_noaux_dir, world, overrides, reuse):
    """rollout.router_replay: the update's forward (and the recompute inside its backward) routes
    every token to the engine's experts, so the first mini-batch is on-policy (ratio 1 for every
    token, none clipped) and its gradient is transformers' with those experts forced. Before, only
    the old-log-prob pass replayed: the update routed by itself and the ratios moved off 1.

    No route is left queued after the update, and a router holds at most the routes of the
    micro-batches whose backward is still to come (one at PP=1: before, the old-log-prob pass
    queued every micro-batch's routes until its end)."""
    results = run_distributed(_replayed_update, world, moe_noaux_dir, overrides, reuse)
    check_replayed_update(moe_noaux_dir, results)
    for metrics, _ in results:
        assert metrics["queued_after"] == 0
        # routes are queued from a micro-batch's forward to its backward's recompute: at most the
        # micro-batches 1F1B has in flight on this stage (pp - stage rank, at most its count)
        (micro_batches,) = metrics["plan"]  # one mini-batch
        in_flight = min(metrics["pp_size"] - metrics["pp_rank"], len(micro_batches))
        assert 1 <= metrics["queued_max"] <= in_flight, (metrics["queued_max"], in_flight, metrics["plan"])
    if world == 4:  # the filler case: 3 bins over 2 DP ranks, the filler after a real micro-batch
        first_stage = {m["dp_rank"]: m["plan"][0] for m, _ in results if m["pp_rank"] == 0}
        bins = [n for mbs in first_stage.values() for n in mbs]
        assert len(first_stage) == 2 and sum(n > 0 for n in bins) == 3 and bins.count(0) == 1, first_stage
        (with_filler,) = [mbs for mbs in first_stage.values() if 0 in mbs]
        assert with_filler[0] > 0 and with_filler[1] == 0, with_filler  # forward, filler's forward, backward
        assert next(m for m, _ in results if m["pp_rank"] == 0 and 0 in m["plan"][0])["queued_max"] == 2


def check_replayed_update(model_dir, results, tol=1e-3, ratio_tol=1e-6):
    """The first mini-batch of a replayed update (``results``: each rank's :func:`_replayed_update`)
    is on-policy and its gradient is transformers' with the engine's experts forced (within ``tol``
    of the largest entry of each tensor; the ratio within ``ratio_tol`` of 1)."""
    import dataclasses

    from megatron_klear.rollout.embedded import EmbeddedEngine
    from tests.distributed.test_actor import make_samples

    metrics, grads = results[-1][0], {}  # (the last pipeline stage has the losses)
    for _, g in results:  # each stage its layers
        grads.update(g)
    assert metrics["actor/optimizer_steps"] == 1 and metrics["actor/router_replay_micro_batches"] >= 2
    assert abs(metrics["actor/ratio_max"] - 1.0) < ratio_tol, metrics["actor/ratio_max"]
    for k in ("actor/clip_frac_low", "actor/clip_frac_high", "actor/clip_frac_dual"):
        assert metrics[k] == 0.0, (k, metrics[k])
    samples = make_samples()
    forced = _forced_routes([len(s.prompt_ids) + len(s.response_ids) for s in samples], MOE_LAYERS)
    samples = [dataclasses.replace(s, routed_experts=f) for s, f in zip(samples, forced)]
    want = _hf_policy_gradient(model_dir, samples, forced)
    # the trainer's per-expert gradients in transformers' layout (fused experts), by its own loading
    engine = EmbeddedEngine.from_pretrained(model_dir)
    engine.update_weights(grads.items())
    got = engine.model.state_dict()
    compared = 0
    for k, w in want.items():
        g = got[k].double()
        scale = float(w.abs().max())
        w = w.double()
        assert float((g - w).abs().max()) <= tol * scale + 1e-9, (k, float((g - w).abs().max()), scale)
        compared += ".mlp.experts." in k or ".mlp.gate." in k
    assert compared >= 4  # experts and routers among them
    assert max(float(w.abs().max()) for k, w in want.items() if ".mlp.gate." in k) > 0  # routers learn too
