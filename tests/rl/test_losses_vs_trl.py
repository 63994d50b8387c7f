"""The project's policy losses against TRL's, an independent implementation (trl 1.16, pinned in
setup.py's [dev]): for one tiny Qwen3 in float64 and one fixed batch (prompts, completions of
different lengths, old log-probs moved off the current ones so that every clip region is met,
advantages of both signs), the loss value and the gradient of every parameter computed through
TRL's own ``GRPOTrainer.compute_loss`` equal those of :func:`megatron_klear.rl.losses.policy_loss`
on the same model's log-probs, packed into one row as the actor packs them.

The rules both implement, and how their settings map (checked here, written in docs/gppo.md):

=====================  ==============================================================================
TRL ``loss_type``      the project
=====================  ==============================================================================
``dapo``               ``clip_higher``, ``agg=token_mean`` over the whole batch; TRL's ``delta``
                       (a cap on the unclipped ratio) is the dual clip ``rl.dual_clip``
``bnpo``               the same rule, ``token_mean`` over one micro-batch (one here)
``grpo``               ``clip_higher``, ``agg=seq_mean_token_mean``
``dr_grpo``            ``clip_higher``, ``agg=seq_mean_token_sum_norm``, ``norm_constant`` = TRL's
                       ``max_completion_length``
``cispo``              ``cispo``; TRL's ``epsilon_high`` bounds the ratio itself (``r <= eps``), the
                       project's ``eps_high`` its excess (``r <= 1 + eps_high``); neither has a lower
                       bound (the project's cispo default ``eps_low=1``). The values differ
                       (TRL ``-sg(clip(r)) * A * logp``, the project ``-A * clip(r)``): only gradients
                       are compared for cispo
=====================  ==============================================================================

Truncated importance sampling: TRL multiplies the per-token loss by the capped engine ratio
(``vllm_importance_sampling_mode="token_truncate"``), the actor multiplies the advantage by it
(rl/actor.py): the same for every rule here, since the weight is positive and each per-token loss is
positively homogeneous in A. ``test_tis_...`` runs the actor's own loss function (its weights from
rl/importance.py, ``rl.tis_cap``) on the engine's log-probs against TRL's.

Log-probs: TRL 1.16 computes them through transformers' fused LM head, in float32 whatever the
model's dtype (4.8e-7 from float64 on this batch). So that the rules are compared in float64, the
trainer's log-prob method is given the float64 log-softmax below (TRL's loss code, clip, aggregation
and normalisers run as shipped); ``test_trl_s_own_float32_log_probs_agree`` checks its own path at a
float32 tolerance.

Tolerance: both sides run the same float64 arithmetic in a different order over ~60 tokens and two
layers, so they agree to ~1e-15 relative; 1e-10 leaves room for summation order, while a changed sign,
clip bound or normaliser moves the gradient by a factor of order one."""

from __future__ import annotations

import pytest
import torch

from megatron_klear.rl.losses import LossBatch, LossSettings, policy_loss

PROMPT_LEN, MAX_COMPLETION = 5, 12
LENGTHS = [12, 7, 3, 10, 1, 9]  # completion tokens per sequence
ADVANTAGES = [1.1, -0.7, 0.4, -1.3, 0.9, -0.2]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from megatron_klear.models.tiny import make_tiny_qwen3

    model_dir = make_tiny_qwen3(str(tmp_path_factory.mktemp("trl") / "m"), seed=11)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    model.train()  # the tiny Qwen3 has no dropout: train and eval forwards are the same function
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    b = len(LENGTHS)
    prompt_ids = torch.randint(0, vocab, (b, PROMPT_LEN), generator=g)
    completion_ids = torch.randint(0, vocab, (b, MAX_COMPLETION), generator=g)
    completion_mask = (torch.arange(MAX_COMPLETION)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    with torch.no_grad():
        logps = _completion_logprobs(model, prompt_ids, completion_ids)
    # old log-probs moved by up to +-0.6 nats: ratios from 0.55 to 1.8, every clip region is met
    old = logps + (torch.rand(logps.shape, generator=g, dtype=torch.float64) - 0.5) * 1.2
    # the engine's log-probs (for TIS): a small mismatch with the trainer's old log-probs
    sampling = old + (torch.rand(logps.shape, generator=g, dtype=torch.float64) - 0.5) * 0.4
    batch = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor(ADVANTAGES, dtype=torch.float64),
        "old_per_token_logps": old,
        "num_items_in_batch": completion_mask.sum(),
    }
    return model_dir, model, batch, sampling


def _completion_logprobs(model, prompt_ids, completion_ids):
    """log p(completion token | everything before it), [batch, completion tokens], written here."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    logits = model(input_ids=ids).logits[:, PROMPT_LEN - 1 : -1]
    return torch.log_softmax(logits, dim=-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)


def _trainer(model_dir, model, loss_type, float64_logprobs=True, **config):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(model_dir) + f"-{loss_type}",
        loss_type=loss_type,
        per_device_train_batch_size=len(LENGTHS),
        num_generations=len(LENGTHS) // 2,
        max_completion_length=MAX_COMPLETION,
        beta=0.0,
        report_to=[],
        use_cpu=True,
        bf16=False,  # TRL's default autocasts the forward to bf16; float64 here
        **config,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "1+1"}] * 2),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop; one step, no accumulation
    if float64_logprobs:
        trainer._get_per_token_logps_and_entropies = _float64_logps_and_entropies
    return trainer


def _float64_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **kw):
    """TRL's ``_get_per_token_logps_and_entropies`` contract, in float64 (see the module's docstring)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -logits_to_keep - 1 : -1]
    logp_all = torch.log_softmax(logits, dim=-1)
    logps = logp_all.gather(-1, input_ids[:, -logits_to_keep:].unsqueeze(-1)).squeeze(-1)
    return logps, -(logp_all.exp() * logp_all).sum(-1), None


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _trl_side(setup, loss_type, extra_inputs=None, **config):
    model_dir, model, batch, _ = setup
    trainer = _trainer(model_dir, model, loss_type, **config)
    loss = trainer.compute_loss(trainer.model, {**batch, **(extra_inputs or {})})
    return loss.detach(), _grads(trainer.model, loss), trainer


def _project_side(setup, **kw):
    """The project's loss on the same model's log-probs, packed as the actor packs a micro-batch:
    one row of every sequence's response tokens, ``seq_ids`` telling the sequences apart."""
    _, model, batch, _ = setup
    logps = _completion_logprobs(model, batch["prompt_ids"], batch["completion_ids"])
    mask = batch["completion_mask"].bool()
    adv = batch["advantages"].unsqueeze(1).expand_as(logps)
    seq = torch.arange(len(LENGTHS)).unsqueeze(1).expand_as(logps)
    row = {k: v[mask].unsqueeze(0) for k, v in (("lp", logps), ("old", batch["old_per_token_logps"]), ("adv", adv))}
    row["seq"] = seq[mask].unsqueeze(0)
    loss, _ = policy_loss(
        LossBatch(row["lp"], row["old"], row["adv"], torch.ones_like(row["lp"]), seq_ids=row["seq"]),
        LossSettings(nll_coef=0.0, **kw),  # TRL has no SFT term
    )
    return loss.detach(), _grads(model, loss)


def _assert_same(ours, theirs, *, values=True):
    (loss_a, grads_a), (loss_b, grads_b) = ours, theirs
    if values:
        torch.testing.assert_close(loss_a, loss_b.to(loss_a.dtype), rtol=1e-10, atol=1e-12)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 10
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-10, atol=1e-12, msg=name)
    assert max(float(g.abs().max()) for g in grads_a.values()) > 1e-4  # a gradient that says something


def test_trl_s_own_float32_log_probs_agree(setup):
    model_dir, model, batch, _ = setup
    trainer = _trainer(model_dir, model, "dapo", float64_logprobs=False)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        theirs, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention, MAX_COMPLETION)
        ours = _completion_logprobs(model, batch["prompt_ids"], batch["completion_ids"])
    m = batch["completion_mask"].bool()
    assert theirs.dtype == torch.float32
    torch.testing.assert_close(theirs[m].double(), ours[m], rtol=1e-5, atol=1e-5)


def test_the_batch_meets_every_clip_region(setup):
    _, model, batch, _ = setup
    with torch.no_grad():
        r = (
            _completion_logprobs(model, batch["prompt_ids"], batch["completion_ids"]) - batch["old_per_token_logps"]
        ).exp()
    r = r[batch["completion_mask"].bool()]
    adv = batch["advantages"].unsqueeze(1).expand_as(batch["completion_mask"])[batch["completion_mask"].bool()]
    for region in (r < 0.8, r > 1.28, (r >= 0.8) & (r <= 1.28)):
        assert bool((region & (adv > 0)).any()) and bool((region & (adv < 0)).any())


CLIP_RULES = [
    # (TRL loss_type, TRL config, the project's LossSettings)
    ("dapo", {}, {"agg": "token_mean"}),
    ("bnpo", {}, {"agg": "token_mean"}),
    ("grpo", {}, {"agg": "seq_mean_token_mean"}),
    ("dr_grpo", {}, {"agg": "seq_mean_token_sum_norm", "norm_constant": MAX_COMPLETION}),
    ("dapo", {"delta": 1.5}, {"agg": "token_mean", "dual_clip": 1.5}),
]


@pytest.mark.parametrize(
    "loss_type,config,ours", CLIP_RULES, ids=[f"{r[0]}{'-delta' * bool(r[1])}" for r in CLIP_RULES]
)
def test_clip_higher_equals_trl(setup, loss_type, config, ours):
    theirs = _trl_side(setup, loss_type, epsilon=0.2, epsilon_high=0.28, **config)[:2]
    kw = {"dual_clip": None, **ours}
    _assert_same(_project_side(setup, algo="clip_higher", eps_low=0.2, eps_high=0.28, **kw), theirs)


def test_cispo_gradient_equals_trl_with_the_bound_mapped(setup):
    theirs = _trl_side(setup, "cispo", epsilon_high=1.28)[:2]  # TRL: r <= 1.28
    ours = _project_side(setup, algo="cispo", eps_high=0.28, agg="token_mean")  # the project: r <= 1 + 0.28
    _assert_same(ours, theirs, values=False)


def _actor_side(setup, rl):
    """The actor's own loss function (``Actor._loss_fn``: the engine/trainer weights of
    rl/importance.py on the advantages, then rl/losses.py) under the ``rl`` section ``rl``, on one
    micro-batch packing the batch as the actor packs it, the engine's log-probs as the rollout's.
    Returns ((loss, gradients), the loss function's metrics)."""
    from megatron_klear.rl.actor import Actor
    from megatron_klear.rl.losses import LossCounts

    _, model, batch, sampling = setup
    logps = _completion_logprobs(model, batch["prompt_ids"], batch["completion_ids"])
    mask = batch["completion_mask"].bool()
    n = int(mask.sum())

    def row(t):
        return t[mask].unsqueeze(0)

    local = {
        "loss_mask": torch.ones(1, n, dtype=torch.float64),
        "advantages": row(batch["advantages"].unsqueeze(1).expand_as(logps)),
        "seq_ids": row(torch.arange(len(LENGTHS)).unsqueeze(1).expand_as(logps)),
        "positive": torch.zeros(1, n, dtype=torch.bool),
        "old_logprobs_local": row(batch["old_per_token_logps"]),
        "rollout_logprobs": row(sampling),
        "has_rollout_logprobs": True,
    }
    lp = row(logps)
    loss_fn = Actor(None, rl)._loss_fn(LossCounts(num_tokens=float(n), num_seqs=float(len(LENGTHS))))
    loss, metrics = loss_fn(local, lp, torch.zeros_like(lp))
    return (loss.detach(), _grads(model, loss)), metrics


def test_tis_as_trl_applies_it(setup):
    """TRL's token_truncate correction (capped exp(old - sampling) times the per-token loss) equals the
    actor's with ``rl.tis_cap`` (the advantage times the same weight, computed by the actor from the
    engine's log-probs) for the clip rule and for cispo."""
    from megatron_klear.rl.config import RLConfig

    _, _, batch, sampling = setup
    cap = 1.1
    # TRL's weights, as its generation step computes them for token_truncate (given to its loss)
    w = (batch["old_per_token_logps"] - sampling).exp().clamp(max=cap)
    m = batch["completion_mask"].bool()
    assert bool((w[m] == cap).any()) and bool((w[m] < 1).any())
    for loss_type, ours in (
        ("dapo", {"algo": "clip_higher", "eps_low": 0.2, "eps_high": 0.28, "dual_clip": None}),
        ("cispo", {"algo": "cispo", "eps_high": 0.28}),
    ):
        config = {"epsilon_high": 1.28} if loss_type == "cispo" else {"epsilon": 0.2, "epsilon_high": 0.28}
        model_dir, model, _, _ = setup
        trainer = _trainer(model_dir, model, loss_type, **config)
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = True  # as with vLLM rollouts
        trainer.vllm_importance_sampling_mode = "token_truncate"
        loss = trainer.compute_loss(trainer.model, {**batch, "importance_sampling_ratio": w})
        theirs = (loss.detach(), _grads(trainer.model, loss))
        rl = RLConfig(agg="token_mean", nll_coef=0.0, tis_cap=cap, **ours)  # TRL has no SFT term
        rl.validate()
        got, metrics = _actor_side(setup, rl)
        _assert_same(got, theirs, values=loss_type != "cispo")
        # the actor weighted every counted token (the sum of its weights is TRL's)
        assert float(metrics["tis_weight"]) == pytest.approx(float(w[m].sum()), rel=1e-12)


def test_gspo_equals_trl_sequence_level(setup):
    """TRL's GSPO (``importance_sampling_level="sequence"``, ``loss_type="grpo"``: the sequence ratio
    with its gradient, per-sequence mean) against the project's token form with
    ``seq_mean_token_mean``; the bounds are chosen so that sequences are clipped on both sides and
    others are not."""
    _, model, batch, _ = setup
    m = batch["completion_mask"].bool()
    with torch.no_grad():
        log_r = _completion_logprobs(model, batch["prompt_ids"], batch["completion_ids"]) - batch["old_per_token_logps"]
    s = ((log_r * m).sum(1) / m.sum(1)).exp()
    eps = float((s - 1).abs().median())  # half of the sequences outside [1 - eps, 1 + eps]
    adv = batch["advantages"]
    clipped = ((adv > 0) & (s > 1 + eps)) | ((adv < 0) & (s < 1 - eps))
    assert bool(clipped.any()) and not bool(clipped.all())
    theirs = _trl_side(setup, "grpo", importance_sampling_level="sequence", epsilon=eps, epsilon_high=eps)[:2]
    ours = _project_side(setup, algo="gspo", eps_low=eps, eps_high=eps, agg="seq_mean_token_mean")
    _assert_same(ours, theirs)
