"""Imported only by the grading pool's forkserver process (its first preload module): the
forkserver dies with the process that started it.

Grading workers are forked by the forkserver and die with it (``worker_main`` asks for that), but
the forkserver itself only exits once no process holds its "alive" pipe, and every worker holds
one: a worker stuck in C code (sympy on a hostile answer) kept itself and the forkserver alive
after the trainer was killed. With this module, the trainer's death takes the forkserver, and the
forkserver's the workers (Linux ``PR_SET_PDEATHSIG``; the trainer thread that starts the pool
must live as long as the pool, as the main thread does).

SIGTERM is ignored here, and so in every worker forked from here: a scheduler stopping a job
(Slurm's scancel, scontrol requeue or preemption, a container runtime) sends SIGTERM to every process
of the job, and the trainer answers it by finishing its step and saving, which needs its graders;
they, and this process, end with the trainer instead (the pool's close, or the kernel's SIGKILL
above). Programs the sandbox runs are killed with SIGKILL, never SIGTERM.

It also pays math-verify's one-time costs here (``worker._warm_up``), once: every worker forked
from this process, the replacement of a killed one included, grades its first item as fast as
its next ones."""

import signal

from megatron_klear.platform.process import die_with_parent

from .worker import _warm_up

die_with_parent()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
_warm_up()
