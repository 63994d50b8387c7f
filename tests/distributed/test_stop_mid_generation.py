"""A stop signal in the middle of a step's generation (issue 52, item 4; docs/slurm.md, Preemption):
at 8B a step's generation takes far longer than a preemption's grace, so the RL loop does not finish
it: the generation is cancelled (the requests in flight abandoned; the server ends them as SGLang
does when its client disconnects), nothing of the step is trained, the last completed step is saved
at once, and the run resumes drawing the cut step's prompts again: every step is trained once, on
the prompts of an uninterrupted run.

Two ranks (rank 1 waits for rank 0's samples in a collective and must learn of the cut too), one
stand-in SGLang server running one request at a time, so that a step's generation lasts seconds."""

import json
import os
import signal
import time

import pytest

from tests.distributed.helper import TOY_RL_TRAINING, run_distributed

STEPS, PER_STEP = 3, 4  # train.steps; prompts drawn and trained per step (one batch a step)


def _run(rank, world, overrides, stop_in_generation=None, stop_in_update=None):
    """The RL loop; with ``stop_in_generation=k``, every rank gets SIGTERM once generation call k
    (1-based) has yielded its first prompt's responses; with ``stop_in_update=k``, at the start of
    update k. Returns (the steps' trained prompt ids, how many prompts that generation yielded,
    seconds from the signal to the end of ``run``)."""
    import torch.distributed as dist

    from megatron_klear.config import load_config
    from megatron_klear.rl.loop import RLLoop

    loop = RLLoop(load_config(None, overrides))
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    trained, calls, signalled = [], [], []
    update = loop.actor.update

    def recording(samples):
        trained.append(sorted({tuple(s.prompt_ids) for s in samples}))
        if rank == 0 and len(trained) == stop_in_update:
            signalled.append(time.monotonic())
            for pid in pids:
                os.kill(pid, signal.SIGTERM)
        return update(samples)

    loop.actor.update = recording
    if rank == 0 and stop_in_generation:
        engine = loop.rollout.engine
        generate_iter = engine.generate_iter

        def signalling(*args, **kwargs):
            calls.append(0)
            for item in generate_iter(*args, **kwargs):
                calls[-1] += 1
                yield item
                if len(calls) == stop_in_generation and calls[-1] == 1:
                    signalled.append(time.monotonic())
                    for pid in pids:  # as Slurm and torchrun do: every rank
                        os.kill(pid, signal.SIGTERM)

        engine.generate_iter = signalling
    loop.run()
    took = time.monotonic() - signalled[0] if signalled else None
    return trained, calls, took


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megatron_klear.data.synthetic import write_rl_prompts_jsonl
    from megatron_klear.models.tiny import make_tiny_qwen3

    root = tmp_path_factory.mktemp("stop-mid-generation")
    model = make_tiny_qwen3(str(root / "m"), num_layers=2, seed=21)
    prompts = write_rl_prompts_jsonl(str(root / "prompts.jsonl"), 32, seed=3)
    return {"model": model, "prompts": prompts, "root": str(root)}


def _expected_prompt_order(setup, seed=1234):
    """The prompt ids each step of an uninterrupted run draws (the same data, seed and draws)."""
    from megatron_klear.data.prompts import PromptDataset
    from megatron_klear.rollout.embedded import load_tokenizer

    data = PromptDataset([setup["prompts"]], load_tokenizer(setup["model"]), max_prompt_length=64, seed=seed)
    return [sorted(tuple(p.prompt_ids) for p in data.take(PER_STEP)) for _ in range(STEPS)]


def _running(url: str) -> int:
    import urllib.request

    with urllib.request.urlopen(f"{url}/get_server_info", timeout=10) as r:
        info = json.load(r)
    states = info.get("internal_states") or [info]
    return sum(int(s.get("num_running_reqs", 0)) + int(s.get("num_waiting_reqs", 0)) for s in states)


def test_a_stop_signal_mid_generation_saves_the_last_step_at_once_and_the_resumed_run_trains_every_step_once(setup):
    from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine

    server = EmbeddedHTTPEngine.launch(setup["model"], startup_timeout=120, max_running_requests=1)
    save = os.path.join(setup["root"], "run")
    args = [
        f"model.path={setup['model']}",
        f"rl.prompts=[{setup['prompts']}]",
        f"train.save_dir={save}",
        f"train.steps={STEPS}",
        "train.save_interval=100",  # saves only on the signal and at the end
        f"rl.prompts_per_step={PER_STEP}",
        "rl.max_generation_batches=1",
        "rl.on_shortfall=train",
        "rl.filter_zero_spread=false",  # every drawn prompt is trained: the order is checkable
        "rl.responses_per_prompt=4",
        "rl.mini_batch_prompts=2",
        "rl.max_tokens_per_micro_batch=512",
        "rl.max_prompt_length=64",
        "rollout.max_new_tokens=96",  # 16 responses one at a time: seconds of generation a step
        f"rollout.urls=[{server.url}]",
        "rollout.engine=sglang",
        "rollout.weight_sync=disk",
        *TOY_RL_TRAINING,
    ]
    try:
        results = run_distributed(_run, 2, args, 2)
        (trained, calls, took), (trained_1, _, _) = results
        # the run stopped in step 2's generation, after its first prompt's responses came back
        assert len(calls) == 2 and calls[1] == 1, calls
        assert trained == trained_1 == [_expected_prompt_order(setup)[0]]
        ckpts = sorted(n for n in os.listdir(save) if n.startswith("iter_"))
        assert ckpts == ["iter_0000001"], ckpts
        # saved at once: not after the 15 responses left of step 2 (seconds each run one at a time)
        assert took < 10, took
        lines = [json.loads(x) for x in open(os.path.join(save, "metrics.jsonl"))]
        assert [m["step"] for m in lines] == [1]
        # the server ended what the cut generation left running, as SGLang does for a client gone
        deadline = time.time() + 6  # (SGLang polls its client every 4 s)
        while _running(server.url) and time.time() < deadline:
            time.sleep(0.5)
        assert _running(server.url) == 0

        # resumed, and stopped again during step 3's update: the update ends and is saved, its
        # weights are not pushed (the servers stop with the job; the next run pushes at start-up)
        resumed = run_distributed(_run, 2, args, None, 2)
        (trained, calls, _), _ = resumed
        assert trained == _expected_prompt_order(setup)[1:]  # step 2's prompts drawn again, then step 3's
        lines = [json.loads(x) for x in open(os.path.join(save, "metrics.jsonl"))]
        assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
        assert lines[1]["weights/pushed"] == 1 and "weights/skipped_on_stop" not in lines[1]
        assert lines[2]["weights/pushed"] == 0 and lines[2]["weights/skipped_on_stop"] == 1
        assert os.path.isdir(os.path.join(save, f"iter_{STEPS:07d}"))
    finally:
        server.close()
