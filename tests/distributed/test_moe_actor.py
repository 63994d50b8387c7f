"""The GPPO actor update of a Qwen3-MoE model at EP=2 (issue 12) equals the one-process update: the
old-log-prob pass, losses, grad norms, the load-balancing loss (logged) and every parameter's change,
experts included (each EP rank updates its own half of them; the deltas are gathered over EP)."""
import math

import pytest

from tests.distributed.helper import run_distributed
from tests.distributed.test_actor import _update


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from megatron_klear.models.tiny import make_tiny_qwen3_moe

    return make_tiny_qwen3_moe(str(tmp_path_factory.mktemp("moe_actor") / "m"), num_layers=3, mlp_only_layers=(1,),
                               seed=41, router_aux_loss_coef=0.1)


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
    for k in ("actor/moe_aux_loss", "actor/clip_frac_high", "actor/clip_frac_low", "actor/entropy",
              "actor/logprob_mismatch_mean"):
        assert math.isclose(metrics[k], ref_metrics[k], rel_tol=1e-4, abs_tol=1e-7), k
    moved = 0
    for k, v in ref_delta.items():
        assert torch.allclose(delta[k], v, atol=2e-4, rtol=0), (k, (delta[k] - v).abs().max())
        moved += ".mlp.experts." in k and float(v.abs().max()) > 1e-3
    assert moved > 24  # most experts received tokens and moved (not a vacuous comparison)
