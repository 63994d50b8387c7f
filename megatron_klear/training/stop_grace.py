"""What a stop signal can cost a run, against the time its launcher gives it (docs/slurm.md, Sizing
the grace).

At a stop signal a job finishes what cannot be cut and saves: SFT its whole step; RL its update in
flight, or a push already under way (the generation is cut: rl/loop.py). torchrun waits
``SHUTDOWN_TIMEOUT`` seconds for that (``--shutdown-timeout``: the launch scripts export it), then
kills the ranks, and the run falls back to its previous checkpoint. The longest such part seen so
far plus the last save's time (measured: the checkpoint's size over this file system's write
speed) is the cost; the first time it exceeds the grace, rank 0 prints one line saying so, with the
numbers, so that the grace is raised before a preemption finds out."""

from __future__ import annotations

import os

#: The environment variable holding the grace in seconds (the launch scripts' torchrun flag).
GRACE_ENV = "SHUTDOWN_TIMEOUT"


class StopGrace:
    """The running estimate of a stop's cost. ``grace_s``: the seconds the launcher gives (None:
    unknown, nothing is said)."""

    def __init__(self, grace_s: float | None):
        self.grace_s = grace_s
        self.uncut_s = 0.0  # the longest part of a step a stop signal does not cut
        self.uncut_what = ""
        self.save_s: float | None = None
        self.warned = False

    @classmethod
    def from_env(cls, env=None) -> "StopGrace":
        raw = (os.environ if env is None else env).get(GRACE_ENV, "")
        try:
            return cls(float(raw)) if raw.strip() else cls(None)
        except ValueError:
            return cls(None)

    def step(self, metrics: dict, wall_s: float) -> None:
        """A step ended: RL reports its update and push (``time/train_s``, ``time/weight_sync_s``),
        the parts a stop does not cut; otherwise (SFT) the whole step is."""
        if "time/train_s" in metrics:
            parts = {"the update": metrics["time/train_s"], "a push": metrics.get("time/weight_sync_s", 0.0)}
        else:
            parts = {"a step": wall_s}
        what, seconds = max(parts.items(), key=lambda kv: kv[1])
        if seconds > self.uncut_s:
            self.uncut_s, self.uncut_what = float(seconds), what

    def saved(self, seconds: float) -> str | None:
        """A save took ``seconds``: the warning line when the cost now exceeds the grace (once)."""
        self.save_s = float(seconds)
        cost = self.cost_s
        if self.warned or self.grace_s is None or cost is None or cost <= self.grace_s:
            return None
        self.warned = True
        return (
            f"warning: a stop signal can now cost {cost:.0f} s ({self.uncut_what} {self.uncut_s:.0f} s, the "
            f"longest seen, then a save, {self.save_s:.0f} s as the last one took), more than the "
            f"{GRACE_ENV}={self.grace_s:g} s the launcher gives before it kills the ranks: a stop then loses "
            f"everything since the previous checkpoint. Raise {GRACE_ENV} and the Slurm --signal lead above it "
            "(docs/slurm.md, Sizing the grace)"
        )

    @property
    def cost_s(self) -> float | None:
        return None if self.save_s is None else self.uncut_s + self.save_s
