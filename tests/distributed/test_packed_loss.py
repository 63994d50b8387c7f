"""A packed row (thd, attention restarted per example) gives every example exactly the log-probs
it gets alone, checked against the HF model run on each example separately; with CP=2 too."""

import pytest

from tests.distributed.helper import run_distributed


def _packed_logprobs(rank, world, model_dir, examples, cp, from_hidden=True):

    from megatron_klear.config import load_config
    from megatron_klear.data.packing import build_packed_micro_batch
    from megatron_klear.platform import init_parallel
    from megatron_klear.training.setup import build_training_state
    from megatron_klear.training.step import reduce_metrics, run_micro_batches

    cfg = load_config(
        None,
        [
            f"model.path={model_dir}",
            f"parallel.cp={cp}",
            "train.steps=1",
            f"train.logprobs_from_hidden={str(from_hidden).lower()}",
        ],
    )
    init_parallel(cfg.parallel)
    state = build_training_state(cfg, total_steps=1)
    masks = [[0] * 3 + [1] * (len(e) - 3) for e in examples]
    row = build_packed_micro_batch(examples, masks, pad_token_id=0, pad_to_multiple=4 * cp)

    def loss_fn(local, logprobs, entropy):
        m = local["loss_mask"]
        return (logprobs * m).sum(), {"lp_sum": (logprobs * m).sum().detach(), "n": m.sum()}

    res = run_micro_batches(state.model, [row], loss_fn, forward_only=True)
    sums = reduce_metrics(res, ("lp_sum", "n"))
    # Megatron's own loss path gives per-token log-probs too (CP=1 only): the full-row list
    per_token = None
    if cp == 1:

        def collect(local, logprobs, entropy):
            return logprobs.sum() * 0, {"lp": logprobs.detach()}

        per_token = run_micro_batches(state.model, [row], collect, forward_only=True)[0]["lp"][0]
    return sums, per_token, row["loss_mask"][0], row["cu_seqlens"].tolist()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import random

    from megatron_klear.models.tiny import make_tiny_qwen3

    model = make_tiny_qwen3(str(tmp_path_factory.mktemp("packed") / "m"), num_layers=2, seed=11)
    rng = random.Random(0)
    examples = [[rng.randrange(5, 389) for _ in range(n)] for n in (13, 7, 21)]
    return model, examples


def _hf_reference(model_dir, examples):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    per_example = []
    with torch.no_grad():
        for e in examples:
            t = torch.tensor([e])
            lp = torch.log_softmax(hf(t).logits[0, :-1], -1).gather(-1, t[0, 1:, None])[:, 0]
            per_example.append(lp)
    return per_example


@pytest.mark.parametrize("from_hidden", [True, False], ids=["logits_from_hidden_chunks", "materialised_logits"])
def test_packed_equals_each_example_alone(setup, from_hidden):
    import torch

    model, examples = setup
    ref = _hf_reference(model, examples)
    sums, per_token, mask, cu = run_distributed(_packed_logprobs, 1, model, examples, 1, from_hidden)[0]
    for i, e in enumerate(examples):
        got = per_token[cu[i] : cu[i] + len(e) - 1]
        assert torch.allclose(got.double(), ref[i], atol=1e-4), (i, (got.double() - ref[i]).abs().max())
        # the loss covers response tokens only (labels at positions >= 2 predict tokens >= 3)
        assert mask[cu[i] : cu[i] + 2].sum() == 0 and mask[cu[i] + 2 : cu[i] + len(e) - 1].all()
        assert mask[cu[i] + len(e) - 1] == 0  # the last token predicts nothing
    expected = sum(float(r[2:].sum()) for r in ref)
    assert abs(sums["lp_sum"] - expected) < 1e-3 and sums["n"] == sum(len(e) - 3 for e in examples)


def test_context_parallel_packed_matches(setup):
    model, examples = setup
    ref = _hf_reference(model, examples)
    expected = sum(float(r[2:].sum()) for r in ref)
    results = run_distributed(_packed_logprobs, 2, model, examples, 2)
    for sums, *_ in results:
        assert abs(sums["lp_sum"] - expected) < 1e-3, (sums, expected)
        assert sums["n"] == sum(len(e) - 3 for e in examples)
