"""The RL loop with rollout.weight_sync=distributed (the default for servers): generation through the
real sglang-router over two embedded servers, weights to each server over the update group (no
file), a probe check after the first sync, every verify_interval steps and after a resume; a
tensor corrupted in transit stops the run at the check, naming the server."""

import json
import os

import pytest

from tests.distributed.helper import run_distributed
from tests.distributed.test_rl_loop import _overrides, _probe_logprobs_of_trainer, _run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megatron_klear.data.synthetic import write_rl_prompts_jsonl
    from megatron_klear.models.tiny import make_tiny_qwen3

    root = tmp_path_factory.mktemp("rlsync")
    model = make_tiny_qwen3(str(root / "m"), num_layers=2, seed=21)
    prompts = write_rl_prompts_jsonl(str(root / "prompts.jsonl"), 24, seed=3)
    return {"model": model, "prompts": prompts, "root": str(root)}


@pytest.fixture(scope="module")
def servers(setup):
    from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine

    servers = [EmbeddedHTTPEngine.launch(setup["model"], weight_sync_timeout=30, startup_timeout=120) for _ in range(2)]
    yield servers
    for s in servers:
        s.close()


def test_rl_loop_with_distributed_weights_through_the_router_verifies_and_resumes(setup, servers):
    from megatron_klear.rollout.base import SamplingParams
    from megatron_klear.rollout.sglang import SGLangEngine
    from tests.rollout.processes import router

    with router([s.url for s in servers]) as router_url:
        save = os.path.join(setup["root"], "run")
        args = _overrides(setup, save) + [
            "rollout.engine=sglang",
            f"rollout.urls=[{router_url}]",
            "parallel.tp=1",
            "train.steps=2",
            "optim.lr=5e-3",
            "optim.min_lr=5e-3",
            "rollout.max_concurrent_requests=4",
            "rl.oversample_prompts=8",
            "rl.responses_per_prompt=8",
            "rollout.max_new_tokens=48",
            "rollout.verify_interval=1",
            "rollout.sync_bucket_mb=0.05",
        ]
        run_distributed(_run, 1, args)
        lines = [json.loads(x) for x in open(os.path.join(save, "metrics.jsonl"))]
        assert [m["step"] for m in lines] == [1, 2]
        trained = [m for m in lines if m.get("actor/optimizer_steps")]
        assert trained, lines
        for m in trained:  # weights went over the groups, in buckets, and the check ran after every sync
            assert m["weights/sync_buckets"] > 1 and m["weights/sync_bytes"] > 0, m
            assert m["weights/verify_mean_diff_max"] < 1e-4, m
            assert m["actor/logprob_mismatch_max"] < 1e-3, m  # the sampling log-probs came from synced weights
        assert not os.path.exists(os.path.join(save, "weights"))  # no file on the way
        # resume: the restarted job syncs (and checks) before generating, then runs step 3
        _, _, trainer_w = run_distributed(_run, 1, [a.replace("train.steps=2", "train.steps=3") for a in args])[0]
        lines = [json.loads(x) for x in open(os.path.join(save, "metrics.jsonl"))]
        assert [m["step"] for m in lines] == [1, 2, 3]
        # the restart synced the saved version; step 3 pushes the next one unless dynamic sampling
        # filtered every group (sampling on the servers depends on how requests batch)
        version = str(lines[-1]["weights/version"])
        assert version == str(sum(1 for m in lines if m.get("actor/optimizer_steps"))), lines
        probe = [5, 17, 33, 60, 7]
        for s in servers:  # independently of the loop's own check
            client = SGLangEngine.at([s.url])
            assert client.model_info()["weight_version"] == version, (version, lines[-1])
            out = client.generate([probe], SamplingParams(top_k=1, max_new_tokens=6))[0][0]
            want = _probe_logprobs_of_trainer(setup["model"], trainer_w, probe, out.token_ids)
            assert max(abs(a - b) for a, b in zip(out.logprobs, want)) < 1e-4, (s.url, out.logprobs, want)


def _run_corrupted(rank, world, overrides, tensor):
    """The loop's start-up with ``tensor`` corrupted on its way to the servers (the trainer's own
    weights untouched)."""
    import torch

    from megatron_klear.config import load_config
    from megatron_klear.rl.loop import RLLoop
    from megatron_klear.rollout.weight_sync import (
        distributed_buckets as weight_sync,
    )  # where the sync reads iter_buckets

    buckets = weight_sync.iter_buckets

    def corrupting(named, bucket_bytes):
        for bucket in buckets(named, bucket_bytes):
            yield [(n, t + 0.05 * torch.randn_like(t) if n == tensor else t) for n, t in bucket]

    weight_sync.iter_buckets = corrupting
    try:
        RLLoop(load_config(None, overrides)).close()
    except Exception as e:  # noqa: BLE001 -- the message is the result
        return f"{type(e).__name__}: {e}"
    return None


def test_a_tensor_corrupted_in_transit_fails_the_probe_check_naming_the_server(setup, servers):
    save = os.path.join(setup["root"], "corrupt")
    urls = [s.url for s in servers]
    args = _overrides(setup, save) + ["rollout.engine=sglang", f"rollout.urls=[{urls[0]},{urls[1]}]", "parallel.tp=1"]
    error = run_distributed(_run_corrupted, 1, args, "model.layers.1.mlp.down_proj.weight")[0]
    assert error is not None and error.startswith("WeightVerificationError"), error
    assert f"the server {urls[0]} does not serve the trainer's weights" in error, error
    assert "above the tolerance 0.001" in error
    # the same start-up without the corruption passes the check
    assert run_distributed(_run_corrupted, 1, args + ["train.overwrite=true"], "no such tensor")[0] is None
