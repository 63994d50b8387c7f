"""rollout.colocate: SGLang servers on the trainer's GPUs release their memory while the actor
trains. SGLang 0.5.23's protocol, read from its wheel: ``srt/entrypoints/http_server.py``
(``/release_memory_occupation``, ``/resume_memory_occupation``), ``srt/managers/io_struct.py``
(``{"tags"}``), ``srt/managers/scheduler_components/weight_updater.py`` (an idle server required;
no tags = weights, kv_cache and cuda_graph; released weights come back with their content lost, so a
weight update must follow; resuming a tag that is not released fails its scheduler). SGLang needs
CUDA: our embedded server, started with ``--enable-memory-saver``, stands in for it and frees its
parameters for real."""

import json
import os
import threading
import time

import httpx
import pytest
import torch

from megatron_klear.rollout.sglang import MEMORY_TAGS, EngineError, SGLangEngine


def _params(engine):
    return list(engine.model.parameters())


# what docs/sglang.md gives colocated servers: /health must not generate on released memory (SGLang's
# default does, and the server dies of it: tests/rollout/test_sglang_divergences.py), CUDA graphs are
# released with the rest, and the trainer can read both from /server_info
COLOCATED_ENV = {
    "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false",
    "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "true",
    "SGLANG_EXPOSE_OWN_ENV_VARS": "true",
}


@pytest.fixture
def served(tiny_hf, monkeypatch):
    """Two in-thread embedded servers of the tied tiny model, with --enable-memory-saver and the
    colocated servers' environment (in-thread servers read this process's)."""
    from megatron_klear.rollout.embedded import EmbeddedEngine
    from megatron_klear.rollout.sglang_standin import serve_in_thread

    for name, value in COLOCATED_ENV.items():
        monkeypatch.setenv(name, value)
    out = []
    for _ in range(2):
        engine = EmbeddedEngine.from_pretrained(tiny_hf["tied"])
        server, url = serve_in_thread(engine, enable_memory_saver=True, batch_window=0.001)
        out.append((engine, server, url))
    yield [(e, u) for e, _, u in out]
    for _, server, _ in out:
        server.shutdown()
        server.server_close()


def _info(url):
    return httpx.get(url + "/server_info", timeout=10).json()


def test_release_frees_the_weights_and_a_reload_brings_them_back(served, tiny_hf):
    (engine, url), _ = served
    client = SGLangEngine.at([url], control_timeout_s=30)
    client.check_memory_saver()
    before = client.probe(url, [5, 17, 3], 6)
    sums = engine.weights.checksums()
    nbytes = sum(p.numel() * p.element_size() for p in _params(engine))
    assert nbytes > 0

    client.release_memory()
    assert sum(p.numel() for p in _params(engine)) == 0  # every parameter's storage is gone
    assert _info(url)["released_memory_tags"] == sorted(MEMORY_TAGS)
    r = httpx.post(url + "/generate", json={"input_ids": [5, 17], "sampling_params": {"max_new_tokens": 2}}, timeout=10)
    assert r.status_code == 503 and "released" in r.text, r.text
    with pytest.raises(EngineError, match="released"):  # weights cannot load into released memory
        client.load_from_disk(tiny_hf["tied"], version=5)

    client.resume_memory(["weights"])
    # the storage is back, its content lost (NaN), as SGLang's memory saver gives it back
    assert sum(p.numel() * p.element_size() for p in _params(engine)) == nbytes
    assert all(torch.isnan(p).all() for p in _params(engine))
    with pytest.raises(EngineError, match="not released"):
        client.resume_memory(["weights"])
    assert (
        httpx.post(url + "/generate", json={"input_ids": [5]}, timeout=10).status_code == 503
    )  # KV cache still released

    client.load_from_disk(tiny_hf["tied"], version=5)
    client.resume_memory(["kv_cache", "cuda_graph"])
    assert engine.weights.checksums() == sums
    after = client.probe(url, [5, 17, 3], 6)
    # bit-identical weights (the checksums); float32 kernels may still differ in the last bits
    assert after.token_ids == before.token_ids and after.logprobs == pytest.approx(before.logprobs, abs=1e-5)
    info = _info(url)
    assert info["released_memory_tags"] == [] and info["memory_releases"] == 1 and info["weight_version"] == "5"


def test_refusals_name_the_cause(served):
    (engine, url), _ = served
    bad = httpx.post(url + "/release_memory_occupation", json={"tags": ["weights", "gpu"]}, timeout=10)
    assert bad.status_code == 400 and "'gpu'" in bad.text and "kv_cache" in bad.text
    assert httpx.post(url + "/resume_memory_occupation", json={"tags": ["kv_cache"]}, timeout=10).status_code == 400

    # a server still generating cannot release (SGLang asserts it is idle)
    done = {}

    def long_request():
        done["r"] = httpx.post(
            url + "/generate",
            json={
                "input_ids": [5, 17],
                "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 1.0},
            },
            timeout=120,
        )

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 30
    while _info(url)["internal_states"][0]["num_running_reqs"] == 0:
        assert time.monotonic() < deadline and t.is_alive()
        time.sleep(0.01)
    busy = httpx.post(url + "/release_memory_occupation", json={}, timeout=10)
    t.join()
    assert busy.status_code == 400 and "idle" in busy.text, busy.text
    assert done["r"].status_code == 200 and _info(url)["released_memory_tags"] == []
    assert all(p.numel() for p in _params(engine))


def test_a_server_without_the_memory_saver_is_named(tiny_hf):
    """Without --enable-memory-saver SGLang's release frees nothing (a no-op saver): the client names
    the flag before a colocated run starts."""
    from megatron_klear.rollout.embedded import EmbeddedEngine
    from megatron_klear.rollout.sglang_standin import serve_in_thread

    engine = EmbeddedEngine.from_pretrained(tiny_hf["tied"])
    server, url = serve_in_thread(engine)
    try:
        client = SGLangEngine.at([url], control_timeout_s=30)
        with pytest.raises(EngineError, match="--enable-memory-saver"):
            client.check_memory_saver()
        client.release_memory(["weights"])  # only recorded: the weights stay
        assert _info(url)["released_memory_tags"] == ["weights"] and all(p.numel() for p in _params(engine))
        client.resume_memory(["weights"])
    finally:
        server.shutdown()
        server.server_close()


def test_config_picks_disk_and_refuses_what_cannot_work():
    from megatron_klear.config import ConfigError, load_config

    base = [
        "rollout.engine=sglang",
        "rollout.urls=[http://127.0.0.1:1]",
        "rl.prompts=[p.jsonl]",
        "rollout.max_new_tokens=64",
    ]
    assert load_config(None, base).rollout.weight_sync == "distributed"
    assert load_config(None, base + ["rollout.colocate=true"]).rollout.weight_sync == "memory"
    assert load_config(None, base + ["rollout.colocate=true", "rollout.weight_sync=disk"]).rollout.weight_sync == "disk"
    with pytest.raises(ConfigError, match="NCCL"):
        load_config(None, base + ["rollout.colocate=true", "rollout.weight_sync=distributed"])
    with pytest.raises(
        ConfigError, match="rollout.weight_sync=memory hands the trainer's weights to servers on its own"
    ):
        load_config(None, base + ["rollout.weight_sync=memory"])
    with pytest.raises(ConfigError, match="engine=sglang"):
        load_config(None, ["rollout.colocate=true", "rl.prompts=[p.jsonl]", "rollout.max_new_tokens=64"])


def test_a_failed_update_gives_the_servers_back_the_last_weights(served, tiny_hf):
    """The actor update fails while the servers are released: the rollout manager resumes them and
    reloads the last pushed weights, so they serve that version (and not freed or NaN weights)."""
    from types import SimpleNamespace

    from megatron_klear.config import load_config
    from megatron_klear.rl.batch import RolloutSample
    from megatron_klear.rl.loop import RLLoop
    from megatron_klear.rl.rollout.manager import RolloutManager

    urls = [u for _, u in served]
    cfg = load_config(
        None,
        [
            "rollout.engine=sglang",
            f"rollout.urls=[{','.join(urls)}]",
            "rollout.colocate=true",
            "rollout.offload_trainer=false",  # no trainer here: the servers' side only
            "rl.prompts=[p.jsonl]",
            "rl.prompts_per_step=1",
            "rl.mini_batch_prompts=1",
            "rollout.max_new_tokens=64",
        ],
    )
    manager = RolloutManager(cfg)  # colocated: the servers release everything before the trainer exists
    assert [e.weights.released for e, _ in served] == [True, True]
    assert all(_info(u)["released_memory_tags"] == sorted(MEMORY_TAGS) for u in urls)
    manager.placement.load(manager.engine, tiny_hf["tied"], 1)  # the first push: weights, load, the rest
    assert all(_info(u)["released_memory_tags"] == [] for u in urls)
    sums = [e.weights.checksums() for e, _ in served]
    loop = object.__new__(RLLoop)
    loop.cfg, loop.rl_step, loop.steps, loop.rollout = cfg, 1, 10, manager
    loop.prompts = SimpleNamespace(take=lambda n: [SimpleNamespace(id="p0")], state_dict=dict)
    sample = RolloutSample(prompt_ids=[1], response_ids=[2, 3], advantage=1.0, group=0, meta={})
    from megatron_klear.rl.rollout.sampling import FullBatches
    from megatron_klear.rl.rollout.schedules import Synchronous

    manager.batches = Synchronous(FullBatches(cfg, manager.engine, None, None, []))
    manager.batches.producer.generate_batch = lambda prompts, step, batch: (
        [sample],
        {"rollout/groups_generated": 1, "rollout/groups_kept": 1},
    )
    seen = []

    def update(samples):
        seen.append([e.weights.released for e, _ in served])
        raise RuntimeError("out of memory in the actor")

    loop.actor = SimpleNamespace(update=update, weight_version=1)
    with pytest.raises(RuntimeError, match="out of memory"):
        loop.step()
    assert seen == [[True, True]]  # both servers were released while the actor ran
    for (engine, url), s in zip(served, sums):
        info = _info(url)
        assert info["released_memory_tags"] == [] and info["weight_version"] == "1"
        assert engine.weights.checksums() == s
    assert not manager.placement.released and not manager.placement.weights_lost
    manager.close()


def _colocated(urls: list) -> list:
    """A colocated RL run's overrides against the servers ``urls``, its weights checked after every push."""
    return [
        "rollout.engine=sglang",
        f"rollout.urls=[{','.join(urls)}]",
        "rollout.colocate=true",
        "rollout.sync_bucket_mb=0.05",  # several buckets a push (the tiny model is ~0.1 MB)
        "rollout.verify_interval=1",
        "rl.filter_zero_spread=false",
        "rollout.max_concurrent_requests=4",
    ]


@pytest.mark.parametrize("weight_sync", ["memory", "disk"])
def test_the_rl_loop_releases_the_servers_while_training(tmp_path, weight_sync):
    """rollout.colocate against two embedded servers (--enable-memory-saver) behind the real
    sglang-router: both servers release their memory before the trainer builds its state and
    before every actor update; each sync first offloads the trainer's gradient buffers, then gives
    the servers their memory back and loads the weights: from the trainer's memory (the default,
    weight_sync=memory: buckets shared through SGLang's update_weights_from_tensor, nothing written
    under rollout.sync_dir) or from disk; verify_interval=1 checks after every sync that both serve
    exactly the trainer's weights."""
    from megatron_klear.data.synthetic import write_rl_prompts_jsonl
    from megatron_klear.models.tiny import make_tiny_qwen3
    from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine
    from tests.distributed.helper import run_distributed
    from tests.distributed.test_rl_loop import _overrides, _run
    from tests.rollout.processes import router

    model = make_tiny_qwen3(str(tmp_path / "m"), num_layers=2, seed=21)
    prompts = write_rl_prompts_jsonl(str(tmp_path / "prompts.jsonl"), 12, seed=3)
    # in memory each server rank maps the copy of the trainer rank on its GPU: one server per GPU of a
    # two-GPU node, each its own with --base-gpu-id, and a trainer rank per GPU (TP=2)
    ranks = 2 if weight_sync == "memory" else 1
    servers = [
        EmbeddedHTTPEngine.launch(
            model, enable_memory_saver=True, startup_timeout=120, env=COLOCATED_ENV, base_gpu_id=k % ranks
        )
        for k in range(2)
    ]
    save = str(tmp_path / "run")
    try:
        with router([s.url for s in servers], extra=("--disable-health-check",)) as url:  # the launch script's
            args = [
                a
                for a in _overrides({"model": model, "prompts": prompts}, save)
                if not a.startswith(("parallel.tp", "train.steps"))
            ]
            args += [f"parallel.tp={ranks}", "train.steps=2", f"rollout.weight_sync={weight_sync}", *_colocated([url])]
            run_distributed(_run, ranks, args)
        lines = [json.loads(x) for x in open(os.path.join(save, "metrics.jsonl"))]
        assert len([m for m in lines if m.get("actor/optimizer_steps")]) == 2, lines
        for m in lines:
            assert m["weights/verify_mean_diff_max"] < 1e-4, m  # verified after every sync
            assert m["memory/trainer_offloaded_gb"] > 0, m  # the trainer's gradient buffers freed meanwhile
        for s in servers:
            info = _info(s.url)
            # one release before the trainer builds its state, one per step before the update
            assert info["memory_releases"] == 3 and info["released_memory_tags"] == [], info
            assert info["weight_version"] == "2"
        assert f"weight_sync: {weight_sync}" in open(os.path.join(save, "config.yaml")).read()
        if weight_sync == "disk":
            assert sorted(os.listdir(os.path.join(save, "weights"))) == ["step_0000002"]  # older versions removed
        else:
            assert not os.path.exists(os.path.join(save, "weights"))  # nothing written for the servers
            assert all(m["weights/in_memory"] == 1 and m["weights/sync_buckets"] > 1 for m in lines), lines
            for s in servers:  # each server mapped the copy on its own GPU, one rank's
                info = _info(s.url)
                assert info["gpu_opens"]["cross_device_opens"] == 0 and len(info["tensor_sharers"]) == 1, info
    finally:
        for s in servers:
            s.close()


def _share_buckets_and_return(url, queue):
    """A trainer's part of weight_sync=memory on the CPU: share three buckets with the server at
    ``url`` (rollout/weight_sync/sharing.py), then end."""
    from megatron_klear.rollout.weight_sync.sharing import share_bucket

    client = SGLangEngine.at([url], control_timeout_s=30)
    client.wire.start_update()
    for k in range(3):
        payload, buffer = share_bucket([("model.norm.weight", torch.full((64,), 1.0 + k))])
        client.wire.load_tensors({url: [payload]})
        del buffer
    client.wire.finish_update(3, check_received=False)
    queue.put("shared")


def test_a_trainer_that_shared_buckets_ends_while_the_servers_live(tiny_hf):
    """The shared-memory manager torch forks for the CPU's file-name sharing outlives the trainer
    while a server holds its connection; started as torch starts it, it held the trainer's
    descriptors (here the sentinel its parent waits on), and the trainer's ``join`` waited for the
    server to exit."""
    import multiprocessing as mp

    from megatron_klear.rollout.embedded import EmbeddedEngine
    from megatron_klear.rollout.sglang_standin import serve_in_thread

    engine = EmbeddedEngine.from_pretrained(tiny_hf["untied"])
    server, url = serve_in_thread(engine)
    try:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        trainer = ctx.Process(target=_share_buckets_and_return, args=(url, queue))
        trainer.start()
        assert queue.get(timeout=120) == "shared"
        t0 = time.monotonic()
        trainer.join(timeout=30)
        assert trainer.exitcode == 0 and time.monotonic() - t0 < 10, time.monotonic() - t0
        assert engine.weights.model.model.norm.weight.tolist() == [3.0] * 64  # the last bucket, copied
    finally:
        server.shutdown()
        server.server_close()


def _run_as_two_machines(rank, world, overrides):
    """A trainer rank of a two-machine colocated job on one host: rank 0's machine is 127.0.0.1,
    rank 1's 127.0.0.2 (the addresses each rank reports for itself: the device fact injected). Its
    Megatron groups follow NCCL's suspension rules (tests/training/nccl_guard.py: a collective on a
    suspended group raises) and rollout.suspend_nccl suspends them, as on a GPU with PyTorch 2.12+
    and NCCL 2.29.7+. Returns the suspensions and resumptions, in order."""
    from megatron_klear.rl.rollout import manager
    from megatron_klear.rollout.weight_sync import in_memory
    from tests.distributed.test_rl_loop import _run
    from tests.training import nccl_guard

    in_memory.machine_addresses = lambda: {f"127.0.0.{rank + 1}"}
    # each machine's one GPU, named by its own node (the servers' KLEAR_NODE_NAME says the same)
    os.environ.update(LOCAL_RANK="0", KLEAR_NODE_NAME=f"machine-{rank + 1}")
    manager.nccl_suspension = lambda setting: nccl_guard.suspension()
    _run(rank, world, overrides)
    return nccl_guard.EVENTS


def test_colocated_servers_on_two_machines_each_load_their_machines_copy(tmp_path):
    """rollout.colocate with a server on each of two machines (two loopback addresses of this host
    standing for two nodes) and TP=2 across them: rank 0 gathers the buckets and relays each to
    rank 1 (which meanwhile sends rank 0 its TP shards), each server loads the copy of its own
    machine (the stand-in names the sharing processes' memory managers: one per server, not the
    same), nothing is written under rollout.sync_dir, and both serve exactly the trainer's weights
    after every push (verify_interval=1).

    Meanwhile the trainer's communicators are suspended from each push until the next update, and
    resumed for each collective between (the probe check's scoring, the save), while the servers
    give up their KV cache: no collective runs on a suspended group (the NCCL rules injected), and
    the servers generate only with their KV cache back (the stand-in dies otherwise)."""
    from megatron_klear.data.synthetic import write_rl_prompts_jsonl
    from megatron_klear.models.tiny import make_tiny_qwen3
    from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine
    from tests.distributed.helper import run_distributed
    from tests.distributed.test_rl_loop import _overrides

    model = make_tiny_qwen3(str(tmp_path / "m"), num_layers=2, seed=21)
    prompts = write_rl_prompts_jsonl(str(tmp_path / "prompts.jsonl"), 8, seed=3)
    servers = [
        EmbeddedHTTPEngine.launch(
            model,
            host=host,
            enable_memory_saver=True,
            startup_timeout=120,
            env={**COLOCATED_ENV, "KLEAR_NODE_NAME": f"machine-{k + 1}"},
        )
        for k, host in enumerate(("127.0.0.1", "127.0.0.2"))
    ]
    save = str(tmp_path / "run")
    try:
        args = [a for a in _overrides({"model": model, "prompts": prompts}, save) if not a.startswith("train.steps")]
        args += ["train.steps=1", *_colocated([s.url for s in servers]), "rollout.suspend_nccl=auto"]
        events = run_distributed(_run_as_two_machines, 2, args)
        lines = [json.loads(x) for x in open(os.path.join(save, "metrics.jsonl"))]
        assert len([m for m in lines if m.get("actor/optimizer_steps")]) == 1, lines
        assert events[0] == events[1], events  # the same groups, in the same order, on both ranks
        # suspended at each push (start-up, step 1), resumed for the two probe scorings, the update
        # and the save, and at the end of the run
        blocks = []  # [(groups suspended, groups then resumed)]
        for kind, group in events[0]:
            if kind == "suspend" and (not blocks or blocks[-1][1]):
                blocks.append(([], []))
            blocks[-1][0 if kind == "suspend" else 1].append(group)
        assert len(blocks) == 5 and all(s == r and len(s) >= 2 for s, r in blocks), events[0]
        for m in lines:
            assert m["weights/in_memory"] == 1 and m["weights/in_memory_copies"] == 2, m
            assert m["weights/sync_buckets"] > 1 and m["weights/verify_mean_diff_max"] < 1e-4, m
        assert not os.path.exists(os.path.join(save, "weights"))  # nothing written for the servers
        sharers = []
        for s in servers:
            info = _info(s.url)
            assert info["weight_version"] == "1" and info["released_memory_tags"] == [], info
            # everything before the trainer builds its state and before the update; the KV cache for
            # each probe scoring (2) and the save
            assert info["memory_releases"] == 5, info
            sharers.append(set(info["tensor_sharers"]))
        # each server mapped one process's copies, and not the same process's
        assert [len(x) for x in sharers] == [1, 1] and not sharers[0] & sharers[1], sharers
    finally:
        for s in servers:
            s.close()


def test_a_step_that_changes_no_weight_pushes_the_same_version_again_in_memory(tmp_path):
    """A step that changes no weight after the servers released theirs for the update (fp16 with
    the dynamic loss scale started at 2**32, ``train.initial_loss_scale``: the first updates
    overflow and are skipped):
    with weight_sync=memory nothing holds a copy to reload but the trainer, so the same version is
    pushed again in memory (before: the servers were given back released memory, with a warning,
    and the next rollout ran on it); they serve exactly the trainer's weights after it
    (verify_interval=1)."""
    from megatron_klear.data.synthetic import write_rl_prompts_jsonl
    from megatron_klear.models.tiny import make_tiny_qwen3
    from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine
    from tests.distributed.helper import run_distributed
    from tests.distributed.test_rl_loop import _overrides, _run

    model = make_tiny_qwen3(str(tmp_path / "m"), num_layers=2, seed=21)
    prompts = write_rl_prompts_jsonl(str(tmp_path / "prompts.jsonl"), 8, seed=4)
    server = EmbeddedHTTPEngine.launch(
        model, dtype="float16", enable_memory_saver=True, startup_timeout=120, env=COLOCATED_ENV
    )
    save = str(tmp_path / "run")
    try:
        args = [
            a
            for a in _overrides({"model": model, "prompts": prompts}, save)
            if not a.startswith(("parallel.tp", "train.steps"))
        ]
        args += ["parallel.tp=1", "train.steps=1", "model.dtype=fp16", "train.initial_loss_scale=4294967296"]
        args += _colocated([server.url])
        # seeded samples (the same every run): among the 6 groups some have reward spread, so the
        # update runs on released servers and fp16's first update overflows
        args += ["rl.filter_zero_spread=true", "rollout.send_seed=true"]
        run_distributed(_run, 1, args)
        (step,) = [json.loads(x) for x in open(os.path.join(save, "metrics.jsonl"))]
        assert step["rollout/groups_kept"] > 0 and step["actor/skipped_updates"] == 1, step  # the overflow
        assert step["weights/version"] == 0 and not step.get("actor/optimizer_steps"), step  # no weight changed
        assert step["weights/pushed"] == 1 and step["weights/repushed"] == 1 and step["weights/in_memory"] == 1, step
        assert step["weights/verify_mean_diff_max"] < 1e-2, step  # (fp16 on both sides)
        info = _info(server.url)
        # released before the trainer built its state and before the step's update, back each time
        assert info["memory_releases"] == 2 and info["released_memory_tags"] == [], info
        assert info["weight_version"] == "0", info
    finally:
        server.close()
