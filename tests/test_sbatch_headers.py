"""The ``#SBATCH`` headers of the shipped Slurm scripts agree with the defaults below them. The test
cluster submits every script with ``--gres=gpu:4`` of its own (its nodes have 4 GPU files), so the
Slurm tests never read the header's GPU count: this test does, with the node count, the preemption
signal's lead over the trainer's grace, and what every job asks of its nodes."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLURM = os.path.join(ROOT, "examples", "slurm")
SCRIPTS = sorted(n for n in os.listdir(SLURM) if n.endswith(".sbatch"))
#: the scripts whose job saves and requeues on a stop signal
REQUEUED = {"sft_qwen3_8b.sbatch", "gppo_qwen3_8b.sbatch"}


def headers(path: str) -> dict:
    """``{flag: value}`` of the active ``#SBATCH`` lines (``##SBATCH`` is commented out); a flag
    without a value maps to True."""
    out = {}
    for line in open(path, encoding="utf-8"):
        m = re.match(r"#SBATCH\s+(--[\w-]+)(?:=(\S+))?", line)
        if m:
            out[m.group(1)] = m.group(2) if m.group(2) is not None else True
    return out


def default(path: str, var: str) -> int:
    """The default of ``VAR=${VAR:-N}`` in the script's "edit here" block (the innermost default of
    a nested ``${VAR:-${OTHER:-N}}``), as an int."""
    text = open(path, encoding="utf-8").read()
    m = re.search(rf"^{var}=\$\{{{var}:-(.*)$", text, re.M)
    assert m, f"{path}: no {var}=${{{var}:-...}} line"
    numbers = re.findall(r":-(\d+)\}", m.group(0))
    assert numbers, f"{path}: {var}'s default is not a number: {m.group(0)}"
    return int(numbers[-1])


def test_every_script_is_read():
    assert set(SCRIPTS) == {"eval.sbatch", "gppo_qwen3_8b.sbatch", "sft_qwen3_8b.sbatch", "smoke.sbatch"}


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_header_asks_for_what_the_script_uses(name):
    path = os.path.join(SLURM, name)
    h = headers(path)
    gpus = default(path, "GPUS_PER_NODE")
    assert h.get("--gres") == f"gpu:{gpus}", (name, h.get("--gres"), gpus)
    # one batch task a node (the script starts its roles as steps), whole nodes, all their memory
    assert h.get("--ntasks-per-node") == "1" and h.get("--exclusive") is True and h.get("--mem") == "0", h
    assert h.get("--output") == "logs/%x-%j.out", h
    nodes = {
        "gppo_qwen3_8b.sbatch": lambda: default(path, "ROLLOUT_NODES") + default(path, "TRAIN_NODES"),
        "sft_qwen3_8b.sbatch": lambda: default(path, "TRAIN_NODES"),
        "eval.sbatch": lambda: 1,  # the servers and the evaluation on one node
        "smoke.sbatch": lambda: 2,  # one rollout node, one trainer node
    }[name]()
    assert h.get("--nodes") == str(nodes), (name, h.get("--nodes"), nodes)
    if "SERVERS_PER_NODE" in open(path).read():
        used = default(path, "SERVERS_PER_NODE") * default(path, "SERVER_TP")
        assert used <= gpus, (name, used, gpus)
        if name != "smoke.sbatch":  # a rollout node's servers take all of its GPUs
            assert used == gpus, (name, used, gpus)


@pytest.mark.parametrize("name", sorted(REQUEUED))
def test_a_stop_signal_comes_early_enough_for_the_save_and_the_requeue(name):
    """``--signal=B:USR1@LEAD``: the script passes the signal on, the trainer gets SHUTDOWN_TIMEOUT
    to finish and save, and the script needs 30 s more to requeue (its own start-up check)."""
    path = os.path.join(SLURM, name)
    h = headers(path)
    assert h.get("--requeue") is True and h.get("--open-mode") == "append", h
    m = re.fullmatch(r"B:USR1@(\d+)", str(h.get("--signal")))
    assert m, h.get("--signal")
    assert int(m.group(1)) >= default(path, "SHUTDOWN_TIMEOUT") + 30, (name, m.group(1))


def test_the_reader_sees_a_header_that_disagrees(tmp_path):
    path = tmp_path / "x.sbatch"
    path.write_text(
        "#SBATCH --gres=gpu:4\n##SBATCH --time=1:00:00\n#SBATCH --exclusive\nGPUS_PER_NODE=${GPUS_PER_NODE:-8}\n"
        "TRAIN_NODES=${TRAIN_NODES:-${SLURM_JOB_NUM_NODES:-4}}\n"
    )
    h = headers(str(path))
    assert h == {"--gres": "gpu:4", "--exclusive": True}
    assert default(str(path), "GPUS_PER_NODE") == 8 and default(str(path), "TRAIN_NODES") == 4
