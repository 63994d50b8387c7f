"""Rewards for Klear-Reasoner RL: math verification and sandboxed code tests, graded in a pool.

A leaf package: it imports nothing else of megatron_klear and nothing of torch/megatron, so it can
run inside the trainer or as a separate grading service. Heavy modules (math-verify, the pool)
load on first use; `from megatron_klear.rewards import RewardConfig` stays cheap.

    grade_math(response, gold, cfg)        -> GradeResult        (math.py)
    grade_code(response, tests, cfg, sb)   -> GradeResult        (code.py, sandbox.py)
    GradingPool(cfg).submit(item)          -> Future[GradeResult] (pool.py)
"""

from .config import RewardConfig, SandboxConfig
from .result import GradeResult

__all__ = [
    "RewardConfig",
    "SandboxConfig",
    "GradeResult",
    "grade_math",
    "grade_code",
    "GradingPool",
    "Sandbox",
    "SandboxUnavailable",
    "probe_isolation",
    "GradeItem",
    "parse_item",
]

_LAZY = {
    "grade_math": ".math",
    "grade_code": ".code",
    "GradingPool": ".pool",
    "Sandbox": ".sandbox",
    "SandboxUnavailable": ".processes",
    "probe_isolation": ".isolation_probe",
    "GradeItem": ".items",
    "parse_item": ".items",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
