"""The smoke job as docs/slurm.md tells users to submit it (that page's line, read here), on two
nodes of the local Slurm, with the CPU stand-in for SGLang and the tiny model: every line of its
table passes, each having seen what it names (the servers' GPUs, the checksums of two servers)."""

import os
import re

import pytest

from tests.slurm.conftest import PY
from tests.slurm.submit_lines import ROOT, submit_lines

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROWS = (
    "model and data",
    "SFT step and save",
    "SFT resume",
    "GPPO steps, pushes probed",
    "weights pushed to every server",
    "GPUs: servers disjoint, trainer all",
)


def _table(text: str) -> dict:
    """The smoke job's table: {check: (result, rest of the line)}."""
    out = {}
    for row in ROWS:
        m = re.search(rf"^{re.escape(row)}\s+(PASS|FAIL)\s+(.*)$", text, re.M)
        if m:
            out[row] = (m.group(1), m.group(2))
    return out


def test_the_smoke_job_as_the_docs_submit_it(cluster, tmp_path):
    from tests.slurm.test_slurm_jobs import _ports

    (line,) = [s for s in submit_lines([os.path.join(ROOT, "docs/slurm.md")]) if s.script.endswith("smoke.sbatch")]
    work, logs, out = str(tmp_path / "work"), str(tmp_path / "logs"), str(tmp_path / "job.out")
    ports = _ports(6)
    env = dict(line.env)  # the page's variables, their values this machine's
    env.update(SERVER_PY=PY, ROUTER_PY=PY)
    # the sizes of this machine: the stand-in and a tiny model, one trainer process
    env.update(ENGINE="standin", SHAPE="", GPUS_PER_NODE="1", SERVER_ARGS="", SEQ_LENGTH="256")
    one = "parallel.tp=1 parallel.sequence_parallel=false parallel.cp=1 parallel.pp=1"
    env["SFT_ARGS"] = f"{one} data.micro_batches_per_step=2 optim.warmup_steps=1"
    env["GPPO_ARGS"] = (
        f"{one} rl.prompts_per_step=2 rl.oversample_prompts=4 rl.responses_per_prompt=4 rl.mini_batch_prompts=1 "
        "rl.max_tokens_per_micro_batch=512 rl.max_prompt_length=128 rollout.max_new_tokens=32 "
        "rl.filter_zero_spread=false reward.workers=1 optim.warmup_steps=1"
    )
    env.update(WORK_DIR=work, LOG_DIR=logs, PY=PY, STARTUP_TIMEOUT="180", GPPO_STEPS="2")
    env.update(SERVER_PORT=str(ports[0]), ROUTER_PORT=str(ports[2]), ROUTER_METRICS_PORT=str(ports[3]))
    env.update(MASTER_PORT=str(ports[4]), SYNC_MASTER_PORT=str(ports[5]), WANDB_MODE="offline", WANDB_DIR=logs)
    job = cluster.sbatch(
        os.path.join(ROOT, line.script), *line.sbatch_args, f"--output={out}", env=env, cwd=ROOT, gpus=2
    )
    info = cluster.wait_done(job, 600)
    text = open(out).read()
    table = _table(text)
    assert set(table) == set(ROWS), text[-4000:]
    assert all(result == "PASS" for result, _ in table.values()), table
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text[-3000:])
    # what the lines saw: two servers on GPUs 0 and 1 of n1, the trainer on GPU 0 of n2
    assert "server 0: 0; server 1: 1; trainer: 0" in table["GPUs: servers disjoint, trainer all"][1]
    assert "2 servers: checksum" in table["weights pushed to every server"][1]
    assert os.path.isdir(os.path.join(work, "sft", "iter_0000002"))
