"""Which GPUs each role of a job gets, as Slurm itself gives them (``make test-slurm``).

The test cluster declares its GPUs as character devices, so Slurm sets ``CUDA_VISIBLE_DEVICES`` per
job and per step as on a GPU cluster (tests/slurm/cluster.py). The jobs run the scripts' SGLang
command lines: ``SERVER_PY`` is a shim that starts the CPU stand-in with SGLang's flags, and the
stand-in reports the devices it was given in ``/server_info``. The trainer (GPPO) and the
evaluation are replaced by a program that collects every server's ``/server_info`` and ends: what
is checked is the placement, in seconds, not the training (tests/slurm/test_slurm_jobs.py trains).

Before, each server step asked ``srun --overlap --gres=gpu:SERVER_TP``, and Slurm gave every
overlapping step the lowest indices: all servers of a node on GPU 0 (``0,1`` at TP=2)."""

import json
import os

import pytest

from tests.slurm.conftest import PY

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _shims(tmp_path, servers: int, port: int, infos: str) -> tuple:
    """(SERVER_PY, the stand-in behind SGLang's command line; a program standing for the trainer
    or the evaluation that writes each server's /server_info to ``infos`` and ends). Both answer
    the job's check of their interpreter (``-c``) with the real one; the server's also sees an
    (empty) ``sglang`` package, as SGLang's environment would."""
    stub = tmp_path / "stub-site" / "sglang"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("")
    server = tmp_path / "sglang-python"
    server.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = -c ] && PYTHONPATH={stub.parent} exec {PY} "$@"\n'
        '[ "$2" = sglang.launch_server ] || { echo "not SGLang\'s command line: $*" >&2; exit 2; }\n'
        "shift 2\n"
        f'exec {PY} -m megatron_klear.rollout.sglang_standin "$@"\n'
    )
    collect = tmp_path / "collect-python"
    urls = " ".join(f"http://127.0.0.1:{port + k}/server_info" for k in range(servers))
    collect.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = -c ] && exec {PY} "$@"\n'
        f'for u in {urls}; do curl -sf "$u" >> {infos} && echo >> {infos} || exit 3; done\n'
    )
    for p in (server, collect):
        p.chmod(0o755)
    return str(server), str(collect)


def _server_devices(infos: str) -> list:
    return [json.loads(line)["visible_devices"]["cuda_visible_devices"] for line in open(infos) if line.strip()]


def _first_line(log: str) -> str:
    return open(log).readline().strip()


@pytest.mark.parametrize("script", ["gppo", "eval"])
@pytest.mark.parametrize("tp", [1, 2])
def test_each_server_gets_its_own_gpus_and_the_trainer_its_nodes(cluster, files, tmp_path, script, tp):
    """SERVERS_PER_NODE=2 at SERVER_TP=1 and 2, the job asking 2 x SERVER_TP GPUs a node: the two
    servers of the rollout node get disjoint sets that together are the job's GPUs of that node, as
    both their logs and their /server_info say; the GPPO trainer's step gets all of its node's."""
    from tests.slurm.test_slurm_jobs import _ports, _submit

    logs, out, infos = str(tmp_path / "logs"), str(tmp_path / "job.out"), str(tmp_path / "infos.jsonl")
    gpus = 2 * tp
    ports = _ports(6)  # server k listens on SERVER_PORT + k: two servers need two ports
    server, (router, metrics, master, sync) = ports[0], ports[2:]
    server_py, collect_py = _shims(tmp_path, 2, server, infos)
    env = {
        "ENGINE": "sglang",
        "SERVERS_PER_NODE": "2",
        "SERVER_TP": str(tp),
        "GPUS_PER_NODE": str(gpus),
        "SERVER_PY": server_py,
        "ROUTER_PY": PY,
        "SERVER_ARGS": "",
        "SERVER_PORT": str(server),
        "ROUTER_PORT": str(router),
        "ROUTER_METRICS_PORT": str(metrics),
        "LOG_DIR": logs,
        "PY": PY,
        "STARTUP_TIMEOUT": "120",
    }
    if script == "gppo":
        env.update(SERVER_MODEL=files["hf_other"], ROLLOUT_NODES="1", TRAIN_NODES="1", TRAINER_PY=collect_py)
        env.update(MASTER_PORT=str(master), SYNC_MASTER_PORT=str(sync), TRAIN_ARGS="")
        job = _submit(cluster, "gppo_qwen3_8b.sbatch", out, env, "--no-requeue", nodes=2, gpus=gpus)
    else:  # the evaluation script on one node
        env.update(MODEL=files["hf"], EVAL_PY=collect_py, OUTPUT=str(tmp_path / "res.json"))
        job = _submit(cluster, "eval.sbatch", out, env, nodes=1, gpus=gpus)
    info = cluster.wait_done(job, 240)
    text = open(out).read()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text[-3000:])
    node = "n1"
    want = [",".join(str(k * tp + i) for i in range(tp)) for k in range(2)]  # 0 | 1, or 0,1 | 2,3
    assert _server_devices(infos) == want, open(infos).read()
    for k in range(2):
        assert _first_line(os.path.join(logs, f"server-{node}-{k}.log")) == (
            f"server-{node}-{k} on {node}: CUDA_VISIBLE_DEVICES={want[k]}"
        )
    covered = sorted(int(d) for w in want for d in w.split(","))
    assert covered == list(range(gpus))  # the job's GPUs of the node, each once
    if script == "gppo":
        assert _first_line(os.path.join(logs, "trainer-node0.log")) == (
            f"trainer-node0 on n2: CUDA_VISIBLE_DEVICES={','.join(map(str, range(gpus)))}"
        )
