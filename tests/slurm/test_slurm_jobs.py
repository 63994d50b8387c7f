"""The sbatch scripts of examples/slurm/ under a real Slurm of three nodes (tests/slurm/cluster.py),
and the plain launch scripts as two launchers on one host (``make test-slurm``; docs/slurm.md).

GPPO: the shipped 8B math config sized down by overrides, a tiny Qwen3 at PP=2 (one stage per
node: both stage leaders push their layers), one stand-in server and the real sglang-router on the
first node. Preempted twice (Slurm's ``--signal`` path to the batch script, then ``scontrol
requeue``), it saves, is requeued, resumes and ends at the last step with the data order of an
uninterrupted run (the prompt order's digest) and the servers holding the trainer's weights (the
log-prob probe after every push). SFT the same way, once."""

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable


def _ports(n: int) -> list:
    from tests.slurm.cluster import _free_port_run

    base = _free_port_run(n)
    return list(range(base, base + n))


def _steps(path: str) -> list:
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


def _wait_for(what, check, timeout, job=None, cluster=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return
        if job and cluster.job(job).get("JobState") in ("FAILED", "CANCELLED", "COMPLETED"):
            raise AssertionError(f"job {job} ended ({cluster.job(job)}) while waiting for {what}")
        time.sleep(1)
    raise AssertionError(f"{what}: not within {timeout}s")


GPPO_STEPS = 16  # the second preemption must land before the last step: an idle machine trains ~3 steps a second


def _stop_saves(log: str) -> list:
    """The steps the trainer saved on a stop signal (its ``stopped on SIGTERM after step K/N`` lines)."""
    import re

    return [int(m.group(1)) for m in re.finditer(r"^stopped on \w+ after step (\d+)/\d+", open(log).read(), re.M)]


def _trained_steps(log: str) -> list:
    """The ``step N/M`` lines of a trainer's log (all its runs: the job's output is appended)."""
    import re

    return [int(m.group(1)) for m in re.finditer(r"^step (\d+)/\d+ \|", open(log).read(), re.M)]


def _gppo_env(files, save_dir, logs):
    server, router, metrics, master, sync = _ports(5)
    train = [
        f"model.path={files['hf']}",
        "parallel.tp=1",
        "parallel.sequence_parallel=false",
        "parallel.cp=1",
        "parallel.pp=2",
        f"rl.prompts=[{files['rl']}]",
        "rl.prompts_per_step=4",
        "rl.oversample_prompts=8",
        "rl.max_generation_batches=1",  # one draw of prompts per step: the order is the seed's
        "rl.responses_per_prompt=4",
        "rl.mini_batch_prompts=2",
        "rl.max_tokens_per_micro_batch=512",
        "rl.max_prompt_length=128",
        "rollout.max_new_tokens=32",
        "rollout.verify_interval=1",  # the servers' log-probs probed after every push
        # every step trains, so every step pushes and is probed (the tiny model's groups often all
        # score alike: a step whose groups are all filtered changes no weight and pushes nothing)
        "rl.filter_zero_spread=false",
        "reward.workers=1",
        f"train.steps={GPPO_STEPS}",
        "train.save_interval=100",  # saves only on the stop signal and at the end
        f"train.save_dir={save_dir}",
        "optim.warmup_steps=1",
    ]
    return {
        "ROLLOUT_NODES": "0",
        "TRAIN_NODES": "2",
        "GPUS_PER_NODE": "1",
        "SERVERS_PER_NODE": "1",
        "ENGINE": "standin",
        "SERVER_MODEL": files["hf_other"],
        "SERVER_ARGS": "",
        "PY": PY,
        "LOG_DIR": logs,
        "STARTUP_TIMEOUT": "180",
        "SERVER_PORT": str(server),
        "ROUTER_PORT": str(router),
        "ROUTER_METRICS_PORT": str(metrics),
        "MASTER_PORT": str(master),
        "SYNC_MASTER_PORT": str(sync),
        "TRAIN_ARGS": " ".join(train),
        "WANDB_MODE": "offline",
        "WANDB_DIR": logs,
    }


def _submit(cluster, script: str, out: str, env: dict, *args: str, nodes: int = 2, **kw) -> str:
    """``examples/slurm/<script>`` on ``nodes`` nodes, its output in ``out`` (``kw``: LocalSlurm.sbatch's,
    e.g. ``gpus``): the job id."""
    return cluster.sbatch(
        os.path.join(ROOT, "examples/slurm", script),
        f"--nodes={nodes}",
        f"--output={out}",
        *args,
        env=env,
        cwd=ROOT,
        **kw,
    )


def _expected_digests(files, steps, per_step=8, seed=1234):
    """The prompt order's digest after each step of an uninterrupted run: the same dataset, seed
    and draws (one batch of rl.oversample_prompts per step)."""
    from megatron_klear.data.prompts import PromptDataset
    from megatron_klear.rollout.embedded import load_tokenizer

    data = PromptDataset([files["rl"]], load_tokenizer(files["hf"]), max_prompt_length=128, seed=seed)
    out = []
    for _ in range(steps):
        data.take(per_step)
        out.append(data.digest)
    return out


def test_gppo_job_in_the_scripts_default_layout_survives_two_preemptions(cluster, files, tmp_path):
    """The script's default layout (``#SBATCH --nodes=3``, ROLLOUT_NODES=1, TRAIN_NODES=2, their
    defaults left unset) at the size of this cluster: two servers and the router on n1, the trainer
    on n2 and n3 with two GPUs each (TP=2 inside a node, PP=2 across the two). Before, the trainer's
    step inherited the job's three tasks and started several launchers on a node that all bound the
    rendezvous port: the job failed in seconds.

    Preempted twice. First through Slurm's --signal path (USR1 to the batch script) in the middle of
    step 3's generation (the servers run one request at a time, so that a step generates for
    seconds; at 8B it is minutes, more than the grace): the generation is cut, step 2 is saved at
    once, and the requeued job draws step 3's prompts again. Then with ``scontrol requeue`` (Slurm
    stops every step with SIGTERM): the trainer saves its step and the job comes back a third time.
    Every step is trained once, in the prompt order of an uninterrupted run, and the servers hold
    the trainer's weights after every push. (One job for what two jobs checked before: the layout
    with the servers on the first trainer node runs in the role-failure jobs.)"""
    save, logs = str(tmp_path / "rl"), str(tmp_path / "logs")
    out = str(tmp_path / "job.out")
    env = _gppo_env(files, save, logs)
    steps_wanted = 6
    for key in ("ROLLOUT_NODES", "TRAIN_NODES"):
        env.pop(key)  # the script's defaults
    env.update(GPUS_PER_NODE="2", SERVERS_PER_NODE="2", SERVER_ARGS="--max-running-requests 1")
    # server k listens on SERVER_PORT + k: two servers need two ports before the router's
    server, _, router, metrics, master, sync = map(str, _ports(6))
    env.update(SERVER_PORT=server, ROUTER_PORT=router, ROUTER_METRICS_PORT=metrics)
    env.update(MASTER_PORT=master, SYNC_MASTER_PORT=sync)
    env["TRAIN_ARGS"] = (
        env["TRAIN_ARGS"]
        .replace("parallel.tp=1", "parallel.tp=2")
        .replace(f"train.steps={GPPO_STEPS}", f"train.steps={steps_wanted}")
        .replace("rollout.max_new_tokens=32", "rollout.max_new_tokens=64")
    )
    job = _submit(cluster, "gppo_qwen3_8b.sbatch", out, env, nodes=3)
    metrics = os.path.join(save, "metrics.jsonl")
    # 1. Slurm's --signal path, in step 3's generation
    _wait_for("two steps", lambda: len(_steps(metrics)) >= 2, 300, job, cluster)
    time.sleep(1)  # step 3 generates (seconds: 32 responses of 64 tokens, one at a time on each server)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=cluster.env, check=True)
    _wait_for("the first requeue", lambda: cluster.job(job).get("Restarts") == "1", 120)
    # 2. scontrol requeue: Slurm stops every step (SIGTERM) and requeues; the trainer saves
    trainer_log = os.path.join(logs, "trainer-node0.log")
    _wait_for("a step after the restart", lambda: len(_trained_steps(trainer_log)) >= 3, 300, job, cluster)
    subprocess.run(["scontrol", "requeue", job], env=cluster.env, check=True)
    info = cluster.wait_done(job, 600)
    text = open(out).read()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text[-3000:])
    assert info["Restarts"] == "2", info
    assert "(restart 1)" in text and "(restart 2)" in text, text[-3000:]
    assert "preempted (SIGUSR1)" in text and "Slurm stops the job (SIGTERM)" in text, text[-3000:]
    assert "rollout on n1, trainer on n2 n3" in text, text[-3000:]
    # one launcher per trainer node (rank 0's prints the steps: each once across the three runs; the
    # metrics file is rewound to the checkpoint on resume, so it would not show a repeated step)
    assert _trained_steps(trainer_log) == list(range(1, steps_wanted + 1))
    assert os.path.exists(os.path.join(logs, "trainer-node1.log"))
    assert not os.path.exists(os.path.join(logs, "trainer-node2.log"))
    # each role's GPUs as Slurm gave them (four a node): the servers one each, every trainer node two
    firsts = {
        role: open(os.path.join(logs, f"{role}.log")).readline().strip()
        for role in ("server-n1-0", "server-n1-1", "trainer-node0", "trainer-node1")
    }
    assert firsts == {
        "server-n1-0": "server-n1-0 on n1: CUDA_VISIBLE_DEVICES=0",
        "server-n1-1": "server-n1-1 on n1: CUDA_VISIBLE_DEVICES=1",
        "trainer-node0": "trainer-node0 on n2: CUDA_VISIBLE_DEVICES=0,1",
        "trainer-node1": "trainer-node1 on n3: CUDA_VISIBLE_DEVICES=0,1",
    }, firsts
    # the first stop came in step 3's generation: cut, step 2 saved at once (its bound reported)
    import re

    stop = re.search(
        r"^stopped on SIGTERM after step 2/\d+ \(the generation of step 3, aborted ([\d.]+) s after the stop "
        r"signal; nothing of it trained\): checkpoint of step 2 saved .*; ([\d.]+) s after the signal$",
        open(trainer_log).read(),
        re.M,
    )
    assert stop, open(trainer_log).read()[-3000:]
    assert float(stop.group(1)) < 5 and float(stop.group(2)) < 30, stop.group(0)
    saved = sorted(int(n[5:]) for n in os.listdir(save) if n.startswith("iter_"))
    stops = _stop_saves(trainer_log)
    assert len(stops) == 2 and stops[0] == 2 and stops[-1] < steps_wanted, stops  # both came mid-run
    assert set(stops) | {steps_wanted} == set(saved), (stops, saved)  # saved on each, and at the end
    steps = _steps(metrics)
    assert [m["step"] for m in steps] == list(range(1, steps_wanted + 1))
    # the data order of an uninterrupted run, step by step, across both restarts
    assert [m["data/order_digest"] for m in steps] == _expected_digests(files, steps_wanted)
    # PP=2 over the two trainer nodes: both stage leaders pushed their layers (bf16: 2 bytes a parameter)
    from safetensors import safe_open

    params = 0
    for name in os.listdir(files["hf"]):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(files["hf"], name), "pt") as f:
                params += sum(int(__import__("math").prod(f.get_slice(k).get_shape())) for k in f.keys())
    pushed = [m for m in steps if m.get("weights/pushed")]
    assert pushed and all(m["weights/sync_bytes"] == 2 * params for m in pushed), pushed
    # the servers (started from other weights) hold the trainer's: the probe after every push
    verified = [m for m in steps if "weights/verify_mean_diff_max" in m]
    assert verified and verified[-1]["step"] == steps_wanted, [m["step"] for m in verified]
    assert all(m["weights/verify_mean_diff_max"] < 0.05 for m in verified), verified


SFT_STEPS = 60  # enough that the preemption after step 3 lands mid-run on a fast machine too


def test_sft_job_on_two_nodes_survives_a_preemption(cluster, files, tmp_path):
    """The SFT script: torchrun on both nodes (PP=2), preempted once through Slurm's --signal path,
    requeued, resumed: every step trained once, and each step's loss that of an uninterrupted run
    (the same launch script without Slurm)."""
    save, logs, out = str(tmp_path / "sft"), str(tmp_path / "logs"), str(tmp_path / "job.out")
    (master,) = _ports(1)
    train = [
        f"model.path={files['hf']}",
        f"data.prefix={files['sft']}",
        "data.seq_length=256",
        "data.micro_batches_per_step=2",
        "parallel.tp=1",
        "parallel.sequence_parallel=false",
        "parallel.cp=1",
        "parallel.pp=2",
        "train.epochs=0",
        f"train.steps={SFT_STEPS}",
        "train.save_interval=100",
        f"train.save_dir={save}",
        "optim.warmup_steps=1",
    ]
    # one thread a rank in both runs: the same summation order, so each step's loss can be compared closely
    env = {"TRAIN_NODES": "2", "GPUS_PER_NODE": "1", "PY": PY, "LOG_DIR": logs, "MASTER_PORT": str(master)}
    env["OMP_NUM_THREADS"] = "1"
    env.update(TRAIN_ARGS=" ".join(train), WANDB_MODE="offline", WANDB_DIR=logs)
    job = _submit(cluster, "sft_qwen3_8b.sbatch", out, env)
    metrics = os.path.join(save, "metrics.jsonl")
    _wait_for("three steps", lambda: len([m for m in _steps(metrics) if "loss" in m]) >= 3, 300, job, cluster)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=cluster.env, check=True)
    info = cluster.wait_done(job, 400)
    text = open(out).read()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "1", (info, text)
    assert _trained_steps(os.path.join(logs, "trainer-node0.log")) == list(range(1, SFT_STEPS + 1))
    saved = sorted(int(n[5:]) for n in os.listdir(save) if n.startswith("iter_"))
    stops = _stop_saves(os.path.join(logs, "trainer-node0.log"))
    assert len(stops) == 1 and stops[0] < SFT_STEPS and saved == [stops[0], SFT_STEPS], (stops, saved)
    # every step's loss is the uninterrupted run's (the same launch script, two launchers, no Slurm)
    ref_save = str(tmp_path / "sft-uninterrupted")
    ref_args = [a.replace(save, ref_save) if a.startswith("train.save_dir=") else a for a in train]
    (ref_master,) = _ports(1)
    ref_env = dict(os.environ, NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ref_master), GPUS_PER_NODE="1")
    ref_env.update(PY=PY, WANDB_MODE="offline", WANDB_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    codes, outs = _two_launchers("examples/run_sft_qwen3_8b.sh", ref_args, ref_env)
    assert codes == [0, 0], outs[0][-3000:]
    got = {m["step"]: m["loss"] for m in _steps(metrics) if "loss" in m}
    want = {m["step"]: m["loss"] for m in _steps(os.path.join(ref_save, "metrics.jsonl")) if "loss" in m}
    assert sorted(got) == sorted(want) == list(range(1, SFT_STEPS + 1))
    assert all(abs(got[k] - want[k]) <= 1e-5 * abs(want[k]) for k in want), [
        (k, got[k], want[k]) for k in want if got[k] != want[k]
    ][:5]


def _two_launchers(script: str, args: list, env: dict, timeout: float = 600) -> tuple:
    """``script`` started twice on this host as two "nodes" (``env`` has NNODES=2; NODE_RANK 0 and 1):
    their exit statuses and outputs."""
    procs = [
        subprocess.Popen(
            ["bash", script, *args],
            cwd=ROOT,
            env=dict(env, NODE_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    return [p.returncode for p in procs], outs


@pytest.mark.parametrize("job", ["sft", "gppo"])
def test_the_plain_launch_scripts_as_two_nodes_on_one_host(files, tmp_path, job):
    """Without any scheduler: the launch script started twice on one host, NNODES=2 NODE_RANK=0|1,
    one process each, a pipeline stage per "node"; both launchers end with status 0 and the run
    reaches its last step (GPPO: with a stand-in server, the weights verified on it)."""
    master, server = _ports(2)
    save = str(tmp_path / "run")
    common = [f"model.path={files['hf']}", "parallel.tp=1", "parallel.sequence_parallel=false", "parallel.cp=1"]
    common += ["parallel.pp=2", "train.steps=2", f"train.save_dir={save}", "optim.warmup_steps=1"]
    env = dict(os.environ, NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master), GPUS_PER_NODE="1", PY=PY)
    env.update(WANDB_MODE="offline", WANDB_DIR=str(tmp_path))
    standin = None
    if job == "sft":
        script = "examples/run_sft_qwen3_8b.sh"
        args = common + [f"data.prefix={files['sft']}", "data.seq_length=256", "data.micro_batches_per_step=2"]
        args += ["train.epochs=0"]
    else:
        from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine

        # the server starts from other weights: only the trainer's pushes can make it hold the trainer's
        standin = EmbeddedHTTPEngine.launch(files["hf_other"], startup_timeout=120)
        script = "examples/run_gppo_qwen3_8b.sh"
        args = common + [f"rl.prompts=[{files['rl']}]", "rl.prompts_per_step=2", "rl.oversample_prompts=4"]
        args += ["rl.responses_per_prompt=4", "rl.mini_batch_prompts=1", "rl.max_tokens_per_micro_batch=512"]
        args += ["rl.max_prompt_length=128", "rollout.max_new_tokens=32", f"rollout.urls=[{standin.url}]"]
        # every step trains (a tiny model's groups often all score alike, and a step whose groups
        # are all filtered changes no weight and pushes nothing), so every step's push is checked
        args += ["rollout.verify_interval=1", "reward.workers=1", "rl.filter_zero_spread=false"]
    try:
        codes, outs = _two_launchers(script, args, env)
        assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
        steps = _steps(os.path.join(save, "metrics.jsonl"))
        assert [m["step"] for m in steps if "step" in m][-1] == 2
        assert os.path.isdir(os.path.join(save, "iter_0000002"))
        if job == "gppo":
            pushed = [m for m in steps if "step" in m]
            assert [m.get("weights/pushed") for m in pushed] == [1, 1], pushed
            assert all(m["weights/verify_mean_diff_max"] < 0.05 for m in pushed), pushed
            # the last push landed: the server holds the saved step-2 weights, every one of them
            # (checksums of its parameters against the checkpoint's, cast to the server's dtype)
            _assert_server_holds(standin.url, os.path.join(save, "iter_0000002"), version=pushed[-1]["weights/version"])
    finally:
        if standin is not None:
            standin.close()


def _assert_server_holds(url, ckpt_dir, version):
    """The stand-in server at ``url`` serves weight version ``version`` and its every parameter's
    ``/weights_checker`` checksum is that of ``ckpt_dir``'s weight (exported to HF names) in the
    server's dtype."""
    import tempfile

    import httpx

    from megatron_klear.checkpoint.convert import megatron_to_hf
    from megatron_klear.checkpoint.hf_io import HFReader
    from megatron_klear.platform.dtypes import torch_dtype
    from megatron_klear.rollout.embedded.weights import tensor_checksum
    from megatron_klear.rollout.sglang import SGLangEngine

    engine = SGLangEngine.at([url])
    engine.members.check_weight_versions(version)
    dtype = torch_dtype(engine.worker_dtypes()[url])
    out = tempfile.mkdtemp(prefix="klear-served-")
    megatron_to_hf(ckpt_dir, out, progress=False)
    reader = HFReader(out)
    got = httpx.get(url + "/weights_checker", timeout=60).json()["ranks"][0]["checksums"]
    compared = [k for k in reader.keys() if k in got]
    assert len(compared) >= len(list(reader.keys())) - 1, (sorted(got)[:5], sorted(reader.keys())[:5])
    differ = [k for k in compared if got[k] != tensor_checksum(reader.get(k).to(dtype))]
    assert not differ, f"{len(differ)} of {len(compared)} weights differ on {url}, first {differ[:1]}"


@pytest.mark.parametrize("role", ["server-n1-0", "router"])
def test_a_role_that_dies_ends_the_job_naming_it(cluster, files, tmp_path, role):
    """The rollout server, or the router, is killed while the trainer runs: the job does not hang,
    the trainer is stopped, and the job fails (status 3) with a line naming the role and its log."""
    save, logs, out = str(tmp_path / "rl"), str(tmp_path / "logs"), str(tmp_path / "job.out")
    env = _gppo_env(files, save, logs)
    env["TRAIN_ARGS"] = env["TRAIN_ARGS"].replace(f"train.steps={GPPO_STEPS}", "train.steps=50")
    env["DEAD_ROLE_GRACE"] = "15"  # without the router the trainer's step cannot finish: killed after 15 s
    job = _submit(cluster, "gppo_qwen3_8b.sbatch", out, env, "--no-requeue")
    _wait_for("a step", lambda: len(_steps(os.path.join(save, "metrics.jsonl"))) >= 1, 300, job, cluster)
    pattern = (
        f"sglang_standin --model {files['hf_other']} --host 0.0.0.0 --port {env['SERVER_PORT']}"
        if role.startswith("server")
        else f"sglang_router.launch_router --host 0.0.0.0 --port {env['ROUTER_PORT']}"
    )
    pids = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    assert pids
    subprocess.run(["kill", "-KILL", *pids], check=True)
    killed = time.time()
    info = cluster.wait_done(job, 300)
    ended = time.time() - killed
    text = open(out).read()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "3:0", (info, text[-3000:])
    assert f"error: {role} exited while the trainer runs; see {logs}/{role}.log" in text, text[-3000:]
    assert ended < 15 + 60, ended  # the grace, and Slurm's own bookkeeping; not torchrun's 270 s
    assert not subprocess.run(["pgrep", "-f", f"megatron_klear rl .*{save}"], capture_output=True).stdout


def test_a_server_that_never_comes_up_ends_the_job_naming_it(cluster, files, tmp_path):
    """A server that starts but never answers /health (here: an interpreter that only sleeps) ends
    the job within STARTUP_TIMEOUT with status 3 and a line naming what did not come up; no role is
    left running."""
    save, logs, out = str(tmp_path / "rl"), str(tmp_path / "logs"), str(tmp_path / "job.out")
    env = _gppo_env(files, save, logs)
    hung = tmp_path / "hung-python"  # answers the job's check of the interpreter, then hangs as a server
    hung.write_text(f'#!/bin/sh\n[ "$1" = -c ] && exec {sys.executable} "$@"\nexec sleep 600\n')
    hung.chmod(0o755)
    env.update(SERVER_PY=str(hung), STARTUP_TIMEOUT="10")
    env["SHUTDOWN_TIMEOUT"] = "590"  # past the script's --signal lead (600) less 30 s: said at start
    job = _submit(cluster, "gppo_qwen3_8b.sbatch", out, env, "--no-requeue")
    info = cluster.wait_done(job, 120)
    text = open(out).read()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "3:0", (info, text[-3000:])
    url = f"http://127.0.0.1:{env['SERVER_PORT']}"
    assert f"error: rollout server {url} did not come up within 10s; see the logs in {logs}" in text, text[-3000:]
    assert "start the trainer" not in text
    assert "warning: SHUTDOWN_TIMEOUT=590 s leaves less than 30 s of the --signal lead (600 s)" in text, text[:3000]
    assert not subprocess.run(["pgrep", "-f", str(hung)], capture_output=True).stdout


def test_a_role_whose_interpreter_lacks_its_modules_ends_the_job_before_any_step(cluster, files, tmp_path):
    """SERVER_PY defaults to the trainer's `python`, while SGLang (and vLLM) live in an environment of
    their own: a server interpreter without what its role runs (here one that sees no site-packages)
    ends the job at once with status 2, naming the variable and the missing modules, before any step
    started (before: the servers failed on their nodes, after the job had waited for them).

    Where the role has srun flags of its own (a pyxis image: its python exists only inside), the
    check runs in a step with them: here SERVER_SRUN_ARGS gives the server's steps the variable that
    makes the same interpreter complete, so SERVER_PY passes there although it is bare on the batch
    host, and the job goes on to the router's check (a bare ROUTER_PY), which ends it."""
    save, logs, out = str(tmp_path / "rl"), str(tmp_path / "logs"), str(tmp_path / "job.out")
    env = _gppo_env(files, save, logs)
    bare = tmp_path / "bare-python"  # complete only where KLEAR_IMAGE is set (the "container")
    bare.write_text(f'#!/bin/sh\n[ -n "$KLEAR_IMAGE" ] && exec {sys.executable} "$@"\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    env["SERVER_PY"] = str(bare)
    job = _submit(cluster, "gppo_qwen3_8b.sbatch", out, env, "--no-requeue")
    info = cluster.wait_done(job, 120)
    text = open(out).read()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", (info, text[-3000:])
    assert f"error: SERVER_PY={bare} has no module torch, uvicorn (here): set SERVER_PY to the python" in text, text
    assert not os.path.exists(os.path.join(logs, "server-n1-0.log")) and "start the trainer" not in text
    # the same interpreter, complete in the server's "image": checked there, it passes
    out2 = str(tmp_path / "job2.out")
    env.update(SERVER_SRUN_ARGS="--export=ALL,KLEAR_IMAGE=1", ROUTER_PY=str(bare))
    job = _submit(cluster, "gppo_qwen3_8b.sbatch", out2, env, "--no-requeue")
    info = cluster.wait_done(job, 120)
    text = open(out2).read()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", (info, text[-3000:])
    assert "error: SERVER_PY" not in text, text
    assert f"error: ROUTER_PY={bare} has no module sglang_router (here)" in text, text


def test_one_trainer_nodes_launcher_dying_ends_the_job_naming_the_node(cluster, files, tmp_path):
    """The trainer's launcher on the second node is killed (SIGKILL: a crash, the node's OOM
    killer) mid-run: its ranks die with it, srun ends the first node's launcher instead of leaving
    its ranks waiting in a collective for the lost stage, and the job fails within Slurm's KillWait
    with a line naming the node that failed first and its log; no trainer process is left."""
    save, logs, out = str(tmp_path / "rl"), str(tmp_path / "logs"), str(tmp_path / "job.out")
    env = _gppo_env(files, save, logs)
    env["TRAIN_ARGS"] = env["TRAIN_ARGS"].replace(f"train.steps={GPPO_STEPS}", "train.steps=50")
    job = _submit(cluster, "gppo_qwen3_8b.sbatch", out, env, "--no-requeue")
    _wait_for("a step", lambda: len(_steps(os.path.join(save, "metrics.jsonl"))) >= 1, 300, job, cluster)
    launcher = f"megatron_klear.platform.launch --nnodes 2 --node-rank 1 .*--master-port {env['MASTER_PORT']}"
    pids = subprocess.run(["pgrep", "-f", launcher], capture_output=True, text=True).stdout.split()
    assert len(pids) == 1, pids
    subprocess.run(["kill", "-KILL", *pids], check=True)
    killed = time.time()
    info = cluster.wait_done(job, 300)
    ended = time.time() - killed
    text = open(out).read()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "137:0", (info, text[-3000:])
    assert (
        "error: the trainer's launcher on n2 (trainer node 1) failed first, with status 137 (killed by SIGKILL); "
        f"see {logs}/trainer-node1.log" in text
    ), text[-3000:]
    assert ended < 30 + 30, ended  # KillWait (30 s here) and Slurm's bookkeeping; not a collective's timeout
    assert not subprocess.run(["pgrep", "-f", f"megatron_klear rl .*{save}"], capture_output=True).stdout


VLLM_PY = os.path.join(ROOT, ".venv-vllm", "bin", "python")


def test_gppo_job_with_vllm_servers_in_their_own_environment(cluster, tmp_path):
    """``ENGINE=vllm`` with the real vLLM CPU server run by its own interpreter (``SERVER_PY``:
    .venv-vllm, not the trainer's), on a dedicated rollout node (n1) with the trainer on n2: the
    trainer talks to the server itself (no router), pushes its weights into it over the
    weight-transfer API after each step (distributed sync) and probes them; the server starts from
    other weights, so a push that did not land fails the probe. Its context (1024) is beyond the
    checkpoint's positions (512), as Klear's 36864 is beyond Qwen3-Base's 32768: vLLM refuses that
    unless the script sets VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."""
    from megatron_klear.data.synthetic import write_rl_prompts_jsonl
    from megatron_klear.models.tiny import make_tiny_qwen3

    if not os.path.exists(VLLM_PY):
        pytest.fail(f"vLLM's CPU build is not installed ({VLLM_PY}): `make venv` builds it")
    # head_dim 64: vLLM's CPU attention has no kernel for the other tiny models' 24
    shape = {"head_dim": 64, "flavor": "base", "num_layers": 2, "max_position_embeddings": 512}
    hf = make_tiny_qwen3(str(tmp_path / "hf"), seed=11, **shape)
    other = make_tiny_qwen3(str(tmp_path / "hf-other"), seed=12, **shape)
    prompts = write_rl_prompts_jsonl(str(tmp_path / "rl.jsonl"), 32, seed=1)
    save, logs, out = str(tmp_path / "rl"), str(tmp_path / "logs"), str(tmp_path / "job.out")
    env = _gppo_env({"hf": hf, "hf_other": other, "rl": prompts}, save, logs)
    env["TRAIN_ARGS"] = (
        env["TRAIN_ARGS"]
        .replace("parallel.pp=2", "parallel.pp=1")
        .replace(f"train.steps={GPPO_STEPS}", "train.steps=3")
        .replace("rl.oversample_prompts=8", "rl.oversample_prompts=4")
    )
    # the CPU build's flags (megatron_klear/rollout/vllm/launcher.py server_command) and the RL ones
    # the script's vLLM defaults carry
    server_args = "--max-model-len 1024 --enable-scale-out --logprobs-mode processed_logprobs --seed 0"
    server_args += " --dtype float32 --enforce-eager --no-enable-chunked-prefill --max-num-batched-tokens 2048"
    server_args += """ --weight-transfer-config '{"backend": "megatron_klear"}'"""
    env.update(ENGINE="vllm", ROLLOUT_NODES="1", TRAIN_NODES="1", SERVER_PY=VLLM_PY, SERVER_ARGS=server_args)
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1")
    env.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", STARTUP_TIMEOUT="400")
    job = _submit(cluster, "gppo_qwen3_8b.sbatch", out, env, "--no-requeue")
    info = cluster.wait_done(job, 900)
    text = open(out).read()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text[-3000:])
    assert "rollout on n1, trainer on n2, engine vllm" in text, text[-3000:]
    assert "start server-n1-0 on n1" in text and "start router" not in text  # the trainer talks to vLLM itself
    steps = _steps(os.path.join(save, "metrics.jsonl"))
    assert [m["step"] for m in steps] == [1, 2, 3]
    # the first push (start-up) and every step's reached the vLLM server: the probe after each
    verified = [m for m in steps if "weights/verify_mean_diff_max" in m]
    assert [m["step"] for m in verified] == [1, 2, 3], verified
    assert all(m["weights/verify_mean_diff_max"] < 0.05 for m in verified), verified
    server_log = open(os.path.join(logs, "server-n1-0.log")).read()
    assert "vllm" in server_log.lower() and VLLM_PY in open(out).read(), server_log[-2000:]


def test_the_evaluation_script_serves_the_model_and_evaluates_it(cluster, files, tmp_path):
    """examples/slurm/eval.sbatch on one node (two nodes of this one host would bind the same server
    port): a stand-in server and the router, then tools/eval.py against the router; the results
    file holds every problem's k samples, and the servers are gone when the job ends."""
    from megatron_klear.data.synthetic import write_rl_prompts_jsonl

    bench = write_rl_prompts_jsonl(str(tmp_path / "bench.jsonl"), 4, seed=5)
    logs, out, results = str(tmp_path / "logs"), str(tmp_path / "job.out"), str(tmp_path / "res" / "eval.json")
    server, router, metrics = map(str, _ports(3))
    env = {
        "MODEL": files["hf"],
        "ENGINE": "standin",
        "SERVERS_PER_NODE": "1",
        "GPUS_PER_NODE": "1",
        "SERVER_PORT": server,
        "ROUTER_PORT": router,
        "ROUTER_METRICS_PORT": metrics,
        "BENCH_ARGS": f"--bench arith={bench}",
        "EVAL_ARGS": "--k 2 --max-new-tokens 16 --workers 1",  # (a tiny model's context, not 32K)
        "OUTPUT": results,
        "LOG_DIR": logs,
        "PY": PY,
        "STARTUP_TIMEOUT": "120",
    }
    job = _submit(cluster, "eval.sbatch", out, env, "--export=ALL", nodes=1)
    info = cluster.wait_done(job, 300)
    text = open(out).read()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text[-3000:])
    assert "standin servers on n1," in text and "start router on n1" in text, text[-3000:]
    assert f"--url http://127.0.0.1:{router}" in text
    res = json.load(open(results))["results"]["arith"]
    assert res["prompts"] == 4 and res["k"] == 2
    samples = [json.loads(x) for x in open(os.path.join(tmp_path, "res", "eval.samples.jsonl"))]
    assert len(samples) == 8
    assert not subprocess.run(
        ["pgrep", "-f", f"sglang_standin --model {files['hf']} --host 0.0.0.0 --port {server}"], capture_output=True
    ).stdout
