"""Settings of the reward graders, as dataclasses the global job config can embed.

Everything a reward depends on lives here so that a run's rewards are reproducible from its config:
the format scores of the Klear recipe, how many code tests are sampled (and with which seed), and
the limits every untrusted program runs under. Validation happens at construction time and names
the offending field, so a bad YAML value fails at start-up instead of mid-run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

__all__ = ["RewardConfig", "SandboxConfig", "ISOLATION_LEVELS"]

#: "auto": bubblewrap when its probe passes, else the fallback if allowed, else refuse.
#: "bwrap": bubblewrap or refuse.  "fallback": rlimits + separate uid + seccomp, no namespaces.
ISOLATION_LEVELS = ("auto", "bwrap", "fallback")


def _require(cond: bool, cls: str, name: str, value, expected: str) -> None:
    if not cond:
        raise ValueError(f"{cls}.{name}={value!r}: expected {expected}")


@dataclass
class SandboxConfig:
    """Limits and isolation for one run of an untrusted program (one test case).

    Small defaults on purpose: competitive-programming tests need far less than a machine, and a
    grader that lets a hostile program take 10 GB or a minute per test is a denial of service on
    the RL loop.
    """

    isolation: str = "auto"
    #: Only with this set does "auto" degrade to the fallback when bubblewrap cannot create namespaces.
    allow_fallback: bool = False
    #: Interpreter for the programs. None: /usr/bin/python3 when present, else this interpreter.
    python: str | None = None
    cpu_s: float = 4.0  # RLIMIT_CPU per process (whole seconds, rounded up)
    wall_s: float = 6.0  # wall clock per test, then everything is killed
    memory_mb: int = 1024  # RLIMIT_AS
    file_size_mb: int = 16  # RLIMIT_FSIZE: largest file the program may write
    open_files: int = 64  # RLIMIT_NOFILE
    processes: int = 32  # RLIMIT_NPROC for the run's private uid (threads count)
    output_limit_bytes: int = 8 << 20  # stdout+stderr cap; exceeding it kills the run
    tmpfs_mb: int = 64  # size of the private writable /tmp (bubblewrap only)
    #: Each concurrent sandbox runs as its own uid base_uid + slot, so that programs of different
    #: samples cannot signal or read each other. Chosen far from system and login ranges.
    base_uid: int = 1_900_000_000
    max_slots: int = 1024

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (also callable after fields were set one by one, e.g. by overrides)."""
        c = type(self).__name__
        _require(self.isolation in ISOLATION_LEVELS, c, "isolation", self.isolation, f"one of {ISOLATION_LEVELS}")
        for name in ("cpu_s", "wall_s"):
            v = getattr(self, name)
            _require(
                isinstance(v, (int, float)) and math.isfinite(v) and v > 0, c, name, v, "a positive number of seconds"
            )
        for name in (
            "memory_mb",
            "file_size_mb",
            "open_files",
            "processes",
            "output_limit_bytes",
            "tmpfs_mb",
            "max_slots",
        ):
            v = getattr(self, name)
            _require(isinstance(v, int) and v > 0, c, name, v, "a positive integer")
        _require(self.open_files >= 16, c, "open_files", self.open_files, ">= 16 (the interpreter itself needs a few)")
        _require(
            isinstance(self.base_uid, int) and 1000 <= self.base_uid and self.base_uid + self.max_slots < 2**31,
            c,
            "base_uid",
            self.base_uid,
            "an integer >= 1000 with base_uid + max_slots < 2**31",
        )


@dataclass
class RewardConfig:
    """Scores and grading settings (Klear-Reasoner defaults, paper section 4).

    Math: +1 correct, -1 wrong, -0.5 when `</think>` is missing (checked first, like the authors'
    code), -2 when `<think>` is missing. Code ("soft reward"): the fraction of up to
    `code_max_tests` sampled tests that pass, in [0, 1]; with `code_think_format` the authors'
    scale instead (below).
    """

    correct: float = 1.0
    wrong: float = -1.0
    no_think_close: float = -0.5
    no_think_open: float = -2.0
    #: Math: a decimal answer for an irrational value (or the reverse) counts within this relative
    #: error; rationals are compared exactly, and there is never an absolute tolerance (math.py).
    math_float_rel_tol: float = 1e-6
    #: The authors' code also applies the two think-format scores to code responses. On, the code
    #: reward is theirs: the mean of +1 per passed and -1 per failed test (2 * fraction - 1, in
    #: [-1, 1]), with `no_think_close` / `no_think_open` on that same scale, so a truncated
    #: response (-0.5) ranks above an all-fail one (-1), as in their runs. Off (the default), the
    #: reward is the paper's pass fraction in [0, 1] and the think format is not scored.
    code_think_format: bool = False
    #: Some chat templates put `<think>` in the prompt, so responses never contain it; then the
    #: -2 score would hit every sample. Set False for such templates.
    require_think_open: bool = True
    code_max_tests: int | None = 16  # None: run every test
    code_seed: int = 0
    #: Which tests: "fixed" (a sample seeded by code_seed and the problem's tests: every response
    #: to a problem, at every step, runs the same ones) or "per_call" (a fresh random sample on
    #: every grading call, as the authors' code does).
    code_test_sampling: str = "fixed"
    #: Relative tolerance for non-integer numbers in code outputs (integers and equal decimals
    #: match exactly; never an absolute tolerance: 1e-9 is not 2e-9).
    code_float_tol: float = 1e-6
    #: Wall budget for all tests of one code sample; tests after it count as failed.
    code_sample_budget_s: float = 120.0
    math_timeout_s: float = 5.0  # per item, enforced inside the worker and by the parent
    math_memory_mb: int = 4096  # RLIMIT_AS of a grading worker
    #: An item whose worker died is retried this many times on a fresh worker before it is
    #: reported as a crash (a worker can die for reasons that are not the item's).
    crash_retries: int = 1
    workers: int = 0  # 0: one per CPU core
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)

    def __post_init__(self) -> None:
        if isinstance(self.sandbox, dict):
            self.sandbox = SandboxConfig(**self.sandbox)
        self.validate()

    def validate(self) -> None:
        """Check every field, the sandbox's too (callable again after overrides)."""
        c = type(self).__name__
        _require(
            isinstance(self.sandbox, SandboxConfig),
            c,
            "sandbox",
            self.sandbox,
            "a SandboxConfig or a mapping of its fields",
        )
        self.sandbox.validate()
        for name in (
            "correct",
            "wrong",
            "no_think_close",
            "no_think_open",
            "code_float_tol",
            "math_float_rel_tol",
            "code_sample_budget_s",
            "math_timeout_s",
        ):
            v = getattr(self, name)
            _require(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
                c,
                name,
                v,
                "a finite number",
            )
        _require(self.correct > self.wrong, c, "correct", self.correct, f"greater than wrong={self.wrong}")
        _require(
            self.code_max_tests is None or (isinstance(self.code_max_tests, int) and self.code_max_tests > 0),
            c,
            "code_max_tests",
            self.code_max_tests,
            "a positive integer or None",
        )
        _require(isinstance(self.code_seed, int), c, "code_seed", self.code_seed, "an integer")
        _require(
            0 <= self.code_float_tol < 1, c, "code_float_tol", self.code_float_tol, "a relative tolerance in [0, 1)"
        )
        _require(
            0 <= self.math_float_rel_tol < 1,
            c,
            "math_float_rel_tol",
            self.math_float_rel_tol,
            "a relative tolerance in [0, 1)",
        )
        _require(
            self.code_test_sampling in ("fixed", "per_call"),
            c,
            "code_test_sampling",
            self.code_test_sampling,
            "'fixed' or 'per_call'",
        )
        for name in ("code_sample_budget_s", "math_timeout_s"):
            _require(getattr(self, name) > 0, c, name, getattr(self, name), "> 0 seconds")
        _require(
            isinstance(self.math_memory_mb, int) and self.math_memory_mb >= 256,
            c,
            "math_memory_mb",
            self.math_memory_mb,
            "an integer >= 256",
        )
        _require(
            isinstance(self.crash_retries, int) and self.crash_retries >= 0,
            c,
            "crash_retries",
            self.crash_retries,
            "an integer >= 0",
        )
        _require(
            isinstance(self.workers, int) and self.workers >= 0,
            c,
            "workers",
            self.workers,
            "an integer >= 0 (0 = one per core)",
        )

    @classmethod
    def from_dict(cls, d: dict) -> "RewardConfig":
        """Build from a mapping (YAML), naming unknown keys instead of ignoring them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"RewardConfig: unknown key(s) {unknown}; known: {sorted(known)}")
        sb = d.get("sandbox")
        if isinstance(sb, dict):
            known_sb = {f.name for f in fields(SandboxConfig)}
            bad = sorted(set(sb) - known_sb)
            if bad:
                raise ValueError(f"RewardConfig.sandbox: unknown key(s) {bad}; known: {sorted(known_sb)}")
        return cls(**d)
