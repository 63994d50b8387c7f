"""Starting a command under torchrun from a test, as a user starts it: one launcher for the tests
that run the package's entry points (or a script) at several ranks.

Every launch gets a master port the OS says is free on 127.0.0.1, and an environment without the
variables an outer launcher leaves in its ranks (a test session started by torchrun or Slurm must
not hand its rank or its master's port on to the job it starts), with one CPU thread per rank and
the repository on the path. ``launcher``: torchrun itself (``torch.distributed.run``) or the
package's ``megatron_klear.platform.launch``, which takes torchrun's arguments."""

from __future__ import annotations

import os
import subprocess
import sys

from megatron_klear.platform.process import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = "torch.distributed.run"
# what torchrun sets in each rank it starts
_LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
)


def launch_env(**extra) -> dict:
    """This process's environment without an outer launcher's variables, ``OMP_NUM_THREADS=1``,
    ``PYTHONPATH`` the repository, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **extra)
    return env


def torchrun_command(*args, nproc: int = 2, launcher: str = TORCHRUN) -> list:
    """``python -m <launcher> --nproc-per-node <nproc>`` on a free master port, then ``args`` (the
    launcher's own options first where there are any, then the script or ``-m`` module and its
    arguments)."""
    return [
        sys.executable,
        "-m",
        launcher,
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        *args,
    ]


def torchrun(
    *args, nproc: int = 2, launcher: str = TORCHRUN, env: dict | None = None, timeout: float = 300, check: bool = False
) -> tuple:
    """Run ``args`` under the launcher from the repository root and wait: ``(exit status, stdout
    and stderr as one text)``. ``env``: variables added to :func:`launch_env`'s; ``check``: fail
    the test, with the command and the end of its output, unless it exits 0."""
    cmd = torchrun_command(*args, nproc=nproc, launcher=launcher)
    r = subprocess.run(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=launch_env(**(env or {})),
        cwd=ROOT,
        timeout=timeout,
    )
    if check:
        assert r.returncode == 0, f"{' '.join(cmd)}\nexit status {r.returncode}\n{r.stdout[-8000:]}"
    return r.returncode, r.stdout


def start_torchrun(*args, nproc: int = 2, launcher: str = TORCHRUN, env: dict | None = None, **popen):
    """Start ``args`` under the launcher from the repository root without waiting: the
    ``subprocess.Popen`` (``popen``: its output streams, ``start_new_session``, ...)."""
    return subprocess.Popen(
        torchrun_command(*args, nproc=nproc, launcher=launcher), env=launch_env(**(env or {})), cwd=ROOT, **popen
    )
