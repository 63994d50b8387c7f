"""The environment the GPU launchers give the trainer (issue 51, items 8 and 11): SGLang starts its
processes with ``NCCL_CUMEM_ENABLE=0`` and ``NCCL_NVLS_ENABLE=0``, and the weight-update groups
put the trainer's stage leaders in one NCCL communicator with them, so the trainer gets the same
(NCCL reads them once per process: they must be in the environment before torchrun starts);
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` for the trainer's processes only. A value the
user exported wins. Each launcher runs for real with ``PY`` set to a stub that prints what it was
given."""

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ("NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE", "PYTORCH_CUDA_ALLOC_CONF")
NCCL_AS_SGLANG = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}
ALLOC = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in NAMES}
    env.update(extra)
    return env


def _stub(tmp_path) -> str:
    """A stand-in for python: prints the variables, unset ones as <unset>."""
    path = tmp_path / "py"
    path.write_text("#!/bin/sh\n" + "".join(f'echo "{n}=${{{n}-<unset>}}"\n' for n in NAMES) + 'echo "ARGS=$*"\n')
    path.chmod(0o755)
    return str(path)


def _parse(out: str) -> dict:
    got = dict(line.split("=", 1) for line in out.splitlines() if line.split("=", 1)[0] in NAMES)
    return {k: v for k, v in got.items() if v != "<unset>"}


def _launcher_output(script: str, tmp_path, **env) -> str:
    """What the launcher ``script`` hands the stub python: its environment and its arguments."""
    return subprocess.run(
        ["bash", script, "train.steps=1"],
        cwd=ROOT,
        env=_clean_env(PY=_stub(tmp_path), **env),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout


def _launcher_args(script: str, tmp_path, **env) -> str:
    return next(line[5:] for line in _launcher_output(script, tmp_path, **env).splitlines() if line.startswith("ARGS="))


@pytest.mark.parametrize("script", ["examples/run_gppo_qwen3_8b.sh", "examples/run_sft_qwen3_8b.sh"])
def test_torchrun_gives_the_ranks_time_to_save_after_a_stop_signal(script, tmp_path):
    """torchrun SIGKILLs the ranks --shutdown-timeout seconds after forwarding a stop signal (30 by
    default: less than a step and a save at 8B); the launchers give 540 (under the sbatch scripts'
    600 s lead), SHUTDOWN_TIMEOUT sets it."""
    assert " --shutdown-timeout 540 " in f" {_launcher_args(script, tmp_path)} "
    assert " --shutdown-timeout 900 " in f" {_launcher_args(script, tmp_path, SHUTDOWN_TIMEOUT='900')} "
    assert "--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in _launcher_args(script, tmp_path)


def _run_launcher(script: str, tmp_path, **env) -> dict:
    return _parse(_launcher_output(script, tmp_path, **env))


@pytest.mark.parametrize(
    "script,expected",
    [
        ("examples/run_gppo_qwen3_8b.sh", {**NCCL_AS_SGLANG, **ALLOC}),
        ("examples/run_sft_qwen3_8b.sh", {**ALLOC}),  # no update group: NCCL's defaults
    ],
)
def test_the_gpu_launchers_set_the_trainers_environment(script, expected, tmp_path):
    assert _run_launcher(script, tmp_path) == expected
    # what the user exported wins
    mine = {"NCCL_NVLS_ENABLE": "1", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    assert _run_launcher(script, tmp_path, **mine) == {**expected, **mine}


def test_the_sbatch_roles_get_the_nccl_settings_and_not_the_allocator_setting(tmp_path):
    """examples/slurm/common.sh's klear_nccl_for_weight_updates, called by the jobs with weight-update
    groups (GPPO, smoke): NCCL's settings for every role (srun passes them on to servers and trainer
    alike: vLLM's servers keep NCCL's defaults otherwise); not by the SFT job, which keeps NCCL's
    defaults; the allocator setting stays the trainer launcher's (SGLang's memory saver does not
    work with expandable segments)."""

    def sourced(call="klear_nccl_for_weight_updates", **env):
        out = subprocess.run(
            [
                "bash",
                "-c",
                f"source examples/slurm/common.sh && {call} && "
                + "; ".join(f'echo "{n}=${{{n}-<unset>}}"' for n in NAMES),
            ],
            cwd=ROOT,
            env=_clean_env(**env),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        return _parse(out)

    assert sourced() == NCCL_AS_SGLANG
    assert sourced(NCCL_CUMEM_ENABLE="1") == {**NCCL_AS_SGLANG, "NCCL_CUMEM_ENABLE": "1"}
    assert sourced(call="true") == {}  # sourcing alone sets nothing
    for sbatch, calls in (("gppo_qwen3_8b.sbatch", True), ("smoke.sbatch", True), ("sft_qwen3_8b.sbatch", False)):
        with open(os.path.join(ROOT, "examples", "slurm", sbatch), encoding="utf-8") as f:
            text = f.read()
        assert "source examples/slurm/common.sh" in text and "examples/run_" in text, sbatch
        assert ("\nklear_nccl_for_weight_updates\n" in text) == calls, sbatch
