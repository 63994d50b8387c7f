"""A real Slurm cluster of three nodes on this machine, for the launch tests (``make test-slurm``).

Debian's ``slurm-wlm`` and ``munge`` (``make slurm`` installs them): one ``munged`` with its own
key and socket, one ``slurmctld`` and three ``slurmd`` (``n1``-``n3``: all ``localhost``, each on
its own port, addresses given to Slurm as ``NodeAddr=127.0.0.1`` because the node names resolve to
nothing, as on clusters where the scripts must take addresses from Slurm). Everything lives under
one temporary directory with free ports (below the ephemeral range); :meth:`LocalSlurm.stop` cancels the jobs, stops the
daemons and checks that none is left running.

Each node declares ``Gres=gpu:4``, four character devices (copies of ``/dev/null``: slurmd accepts
them, nothing opens them), so Slurm checks every GPU request and sets ``CUDA_VISIBLE_DEVICES`` per
job and per step as on a GPU cluster. Settings that matter to the tests:
``cred_expire=10`` (a requeued job becomes eligible again after ~11 s instead of Slurm's default
121 s), ``sched_interval=2,bf_interval=2`` (the scheduler starts it within seconds of that, not at
its next periodic pass: 60 s by default, which had a requeued test job wait up to a minute),
``KillWait=30`` (a job told to stop has 30 s to save before SIGKILL),
``proctrack/linuxproc`` and ``task/none`` (no cgroups in a container).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import time

from megatron_klear.platform.process import free_port
from megatron_klear.rollout.servers.update_group import ephemeral_range

DAEMONS = ("munged", "slurmctld", "slurmd")
GPUS_PER_NODE = 4  # the GPU GRES each test node declares
# three nodes: the GPPO script's default layout (one rollout node, two trainer nodes) fits
NODES = ("n1", "n2", "n3")


def missing_binaries() -> list:
    return [b for b in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol") if shutil.which(b) is None]


def _free_port_run(count: int) -> int:
    """The first of ``count`` consecutive free TCP ports, below the host's ephemeral range: a job
    keeps its ports across restarts, and a port inside the range (as bind(0) hands out) can be taken
    meanwhile by any outgoing connection or bind(0), e.g. a trainer's gloo listeners, which then
    fails the restarted job's bind (megatron_klear/rollout/servers/update_group.py
    ``port_in_use_message``). Where the range starts too low, any free run."""
    low = (ephemeral_range() or (32768, 60999))[0]
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, low - count) if low - count > 20000 else free_port()
        if base + count > 65000:
            continue
        ok = True
        for p in range(base, base + count):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no run of free ports")


class LocalSlurm:
    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.conf = os.path.join(self.root, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        self.pids: dict = {}

    def _run(self, *cmd, check=True, timeout=60) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, check=check, timeout=timeout)

    def start(self) -> "LocalSlurm":
        r = self.root
        for d in ("munge", "state", *(f"spool/{n}" for n in NODES), "log"):
            os.makedirs(os.path.join(r, d), exist_ok=True)
        key = os.path.join(r, "munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o600)
        sock = os.path.join(r, "munge", "sock")
        self._run(
            "munged",
            "-f",
            f"--socket={sock}",
            f"--key-file={key}",
            f"--log-file={r}/munge/log",
            f"--pid-file={r}/munge/pid",
            f"--seed-file={r}/munge/seed",
        )
        base = _free_port_run(1 + len(NODES))
        nodes = (
            f"NodeName=n[1-{len(NODES)}] NodeHostname=localhost NodeAddr=127.0.0.1 "
            f"Port=[{base + 1}-{base + len(NODES)}] "
            f"CPUs={os.cpu_count()} RealMemory=1000 Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN"
        )
        # GPUs as Slurm binds them: character devices (each a copy of /dev/null, as mknod makes it),
        # which slurmd accepts as GRES files (it refuses plain files: "not a valid character or block
        # device") and so sets CUDA_VISIBLE_DEVICES per job and per step, as on a GPU cluster
        os.makedirs(os.path.join(r, "dev"), exist_ok=True)
        for k in range(GPUS_PER_NODE):
            path = os.path.join(r, "dev", f"gpu{k}")
            if not os.path.exists(path):
                os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        with open(os.path.join(r, "gres.conf"), "w") as f:
            f.write(f"AutoDetect=off\nNodeName=n[1-{len(NODES)}] Name=gpu File={r}/dev/gpu[0-{GPUS_PER_NODE - 1}]\n")
        with open(self.conf, "w") as f:
            f.write(
                f"""ClusterName=klear-test
GresTypes=gpu
SlurmctldHost=localhost
SlurmctldPort={base}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock},cred_expire=10
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
KillWait=30
MinJobAge=600
{nodes}
PartitionName=main Nodes=n[1-{len(NODES)}] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
            )
        self._run("slurmctld", "-c", "-f", self.conf)
        for node in NODES:
            self._run("slurmd", "-N", node, "-f", self.conf)
        deadline = time.time() + 60
        while time.time() < deadline:
            out = self._run("sinfo", "-h", "-o", "%T %D", check=False).stdout.split()
            if out[:2] == ["idle", str(len(NODES))]:
                return self
            time.sleep(1)
        raise RuntimeError(f"the local Slurm did not come up: sinfo says {out}; see {r}/log")

    # -- jobs -------------------------------------------------------------------------------------
    def sbatch(
        self, script: str, *args: str, env: dict | None = None, cwd: str | None = None, gpus: int = GPUS_PER_NODE
    ) -> str:
        """Submit ``script`` asking ``gpus`` GPUs a node (the scripts ask for 8: more than these nodes have)."""
        out = subprocess.run(
            ["sbatch", "--parsable", f"--gres=gpu:{gpus}", *args, script],
            env={**self.env, **(env or {})},
            cwd=cwd,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return out.strip().split(";")[0]

    def job(self, job_id: str) -> dict:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, ...)."""
        out = self._run("scontrol", "show", "job", "-o", job_id, check=False).stdout
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def wait_done(self, job_id: str, timeout: float) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                return info
            time.sleep(1)
        raise TimeoutError(f"job {job_id} still {self.job(job_id).get('JobState')} after {timeout:.0f}s")

    # -- teardown ---------------------------------------------------------------------------------
    def stop(self) -> None:
        self._run("scancel", "--full", "--user=root", check=False)
        self._run("scontrol", "shutdown", check=False)
        for name in ("slurmctld.pid", *(f"slurmd-{n}.pid" for n in NODES), "munge/pid"):
            path = os.path.join(self.root, name)
            if os.path.exists(path):
                try:
                    pid = int(open(path).read().strip() or 0)
                except ValueError:
                    continue
                for _ in range(50):
                    try:
                        os.kill(pid, 0)
                    except OSError:
                        break
                    if name == "munge/pid" or _ > 20:
                        os.kill(pid, signal.SIGTERM)
                    time.sleep(0.2)
        left = [line for line in _processes() if self.root in line]
        if left:
            raise RuntimeError(f"the local Slurm left processes running: {left}")


def _processes() -> list:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines()[1:] if any(d in line for d in DAEMONS)]
