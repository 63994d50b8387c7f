"""The table of policy losses (rl/losses.py, ``POLICY_LOSSES``) is the single source of ``rl.algo``:
every registered loss passes the config's validation with its defaults, an unknown name is refused
with the registered ones listed, and a loss registered from outside the package trains through the
config and the actor with nothing else edited."""

import pytest
import torch

from megatron_klear.config import load_config
from megatron_klear.platform.errors import ConfigError
from megatron_klear.rl.actor import Actor
from megatron_klear.rl.config import RLConfig
from megatron_klear.rl.losses import (
    POLICY_LOSSES,
    LossBatch,
    LossCounts,
    PolicyLossSpec,
    TokenLoss,
    loss_names,
    loss_spec,
    per_token_policy_loss,
    register_loss,
    unregister_loss,
)

BUILT_IN = ("ppo", "clip_higher", "gppo", "cispo", "gspo", "dppo_tv", "dppo_kl")


@pytest.mark.parametrize("name", loss_names())
def test_every_registered_loss_is_accepted_by_the_config_with_its_defaults(name):
    spec = loss_spec(name)
    rl = load_config(None, [f"rl.algo={name}"]).rl
    low, high = spec.eps
    assert rl.loss_settings.clip_range() == ((low, low) if spec.symmetric else (low, high))


def test_the_built_in_losses_are_registered_in_order():
    assert loss_names()[: len(BUILT_IN)] == BUILT_IN
    assert [n for n in BUILT_IN if loss_spec(n).uses_rollout_logprobs] == ["dppo_tv", "dppo_kl"]
    assert [n for n in BUILT_IN if loss_spec(n).sequence_level] == ["gspo"]


def test_an_unknown_algo_is_refused_naming_the_registered_ones():
    with pytest.raises(ConfigError, match="rl.algo must be one of") as e:
        load_config(None, ["rl.algo=grpo"])
    assert "'grpo'" in str(e.value) and all(repr(n) in str(e.value) for n in loss_names())
    with pytest.raises(ValueError, match="algo='grpo' is not one of") as e:
        loss_spec("grpo")
    assert all(repr(n) in str(e.value) for n in loss_names())


def test_the_config_refuses_what_the_table_declares():
    """A symmetric loss given two eps, a bad eps or beta: refused when the config loads, by key."""
    with pytest.raises(ConfigError, match="rl.algo='ppo' clips symmetrically"):
        load_config(None, ["rl.algo=ppo", "rl.eps_low=0.2", "rl.eps_high=0.28"])
    with pytest.raises(ConfigError, match="rl.eps_low=1.5 must be in"):
        load_config(None, ["rl.eps_low=1.5"])
    with pytest.raises(ConfigError, match="rl.beta1=-1.0"):
        load_config(None, ["rl.beta1=-1"])
    assert load_config(None, ["rl.algo=ppo", "rl.eps_high=0.1"]).rl.loss_settings.clip_range() == (0.1, 0.1)


def test_registering_a_name_twice_is_refused():
    with pytest.raises(ValueError, match="'gppo' is already registered"):
        register_loss(PolicyLossSpec("gppo", (0.2, 0.28), loss_spec("cispo").per_token))
    assert loss_spec("gppo").per_token is not loss_spec("cispo").per_token


def test_a_sequence_level_loss_needs_the_mask():
    x = torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="algo='gspo' needs the response mask"):
        per_token_policy_loss(LossBatch(x, x, x), RLConfig(algo="gspo").loss_settings)


# -- a loss of a test's own ---------------------------------------------------------------------------
SEEN = []  # per call of the toy loss: whether it was given the engine's log-probs


def _plain_policy_gradient(t):
    """The toy loss: ``-A * r``, never clipped (F = r), against the engine's log-probs when given."""
    SEEN.append(t.batch.rollout_logprobs is not None)
    anchor = t.batch.old_logprobs if t.batch.rollout_logprobs is None else t.batch.rollout_logprobs
    loss = -t.adv * torch.exp(t.batch.logprobs - anchor)
    return TokenLoss(loss, t.no_flags(), t.no_flags(), t.no_flags())


@pytest.fixture(params=[False, True], ids=["plain", "reads_rollout"])
def toy(request):
    """``rl.algo=toy_pg`` registered for one test (eps 0.3 / 0.4), unregistered after it."""
    register_loss(PolicyLossSpec("toy_pg", (0.3, 0.4), _plain_policy_gradient, uses_rollout_logprobs=request.param))
    SEEN.clear()
    try:
        yield request.param
    finally:
        if "toy_pg" in POLICY_LOSSES:  # (the test takes it out itself when it passes)
            unregister_loss("toy_pg")


def _micro_batch(n=6, seed=0):
    """One packed sequence of ``n`` response tokens, as the actor's loss function gets it."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(1, n, generator=g, dtype=torch.float64) - 0.1
    return {
        "loss_mask": torch.ones(1, n, dtype=torch.float64),
        "advantages": torch.full((1, n), 0.5, dtype=torch.float64),
        "seq_ids": torch.zeros(1, n, dtype=torch.long),
        "positive": torch.zeros(1, n, dtype=torch.bool),
        "old_logprobs_local": old,
        "rollout_logprobs": old - 0.2,
        "has_rollout_logprobs": True,
    }


def test_a_registered_loss_trains_through_rl_algo_and_leaves_no_trace(toy):
    reads_rollout = toy
    rl = load_config(None, ["rl.algo=toy_pg"]).rl
    assert rl.loss_settings.clip_range() == (0.3, 0.4)  # its defaults, from its entry
    local = _micro_batch()
    n = local["loss_mask"].shape[1]
    logprobs = (local["old_logprobs_local"] + 0.1).requires_grad_()
    loss_fn = Actor(None, rl)._loss_fn(LossCounts(num_tokens=float(n), num_seqs=1.0))
    loss, out = loss_fn(local, logprobs, torch.zeros_like(logprobs))
    (grad,) = torch.autograd.grad(loss, logprobs)
    # the actor gave the engine's log-probs to the loss exactly when its entry declares it reads them
    assert SEEN == [reads_rollout]
    anchor = local["rollout_logprobs"] if reads_rollout else local["old_logprobs_local"]
    r = torch.exp(logprobs.detach() - anchor)
    torch.testing.assert_close(grad, -0.5 * r / n, rtol=1e-12, atol=0)  # F = r, token mean, no NLL term
    assert out["pg_loss"].item() == pytest.approx(float((-0.5 * r).mean()), rel=1e-12)
    assert out["clip_frac_low"] == out["clip_frac_high"] == 0
    unregister_loss("toy_pg")
    assert "toy_pg" not in loss_names()
    with pytest.raises(ConfigError, match="rl.algo must be one of"):
        load_config(None, ["rl.algo=toy_pg"])


def test_a_registered_sequence_level_loss_is_refused_with_context_parallelism_by_its_declaration():
    register_loss(PolicyLossSpec("toy_seq", (0.2, 0.2), loss_spec("gspo").per_token, sequence_level=True))
    try:
        with pytest.raises(ConfigError, match="rl.algo=toy_seq takes a ratio over whole sequences"):
            load_config(None, ["rl.algo=toy_seq", "parallel.cp=2", "rl.agg=token_mean"])
        assert load_config(None, ["rl.algo=toy_seq"]).rl.algo == "toy_seq"
    finally:
        unregister_loss("toy_seq")
