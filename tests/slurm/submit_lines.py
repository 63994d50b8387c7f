"""The sbatch submit lines of README.md and docs/: each with the variables its block sets, so that
the tests check them against the scripts and run them (tests/test_submit_lines.py,
tests/slurm/test_slurm_smoke.py)."""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shlex

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = re.compile(r"(examples/slurm/[\w.]+\.sbatch)")
ASSIGN = re.compile(r"^[A-Z][A-Z0-9_]*=")


@dataclasses.dataclass
class SubmitLine:
    page: str  # relative to the repository
    line: int  # 1-based
    text: str
    script: str  # examples/slurm/<name>.sbatch
    sbatch_args: list  # sbatch's own flags, before the script
    env: dict  # what the block set before it (export lines) and the line's own VAR=value prefixes


def pages() -> list:
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def _words(text: str) -> list:
    try:
        return shlex.split(text, comments=True)
    except ValueError:  # an unbalanced quote in prose: nothing to read
        return []


def submit_lines(paths: list | None = None) -> list:
    """Every ``sbatch ... examples/slurm/X.sbatch`` line of a fenced bash block of ``paths``."""
    out = []
    for path in paths or pages():
        rel = os.path.relpath(path, ROOT)
        env, in_bash = {}, False
        for no, raw in enumerate(open(path), 1):
            line = raw.strip()
            if line.startswith("```"):
                in_bash = not in_bash and line[3:].strip() in ("bash", "sh", "shell")
                env = {}
                continue
            if not in_bash:
                continue
            words = _words(line)
            if words[:1] == ["export"]:
                env.update(w.split("=", 1) for w in words[1:] if ASSIGN.match(w))
                continue
            if "sbatch" not in words:
                continue
            at = words.index("sbatch")
            script = next((w for w in words[at + 1 :] if SCRIPT.fullmatch(w)), None)
            if script is None:
                continue
            prefix = dict(w.split("=", 1) for w in words[:at] if ASSIGN.match(w))
            args = words[at + 1 : words.index(script)]
            out.append(SubmitLine(rel, no, line, script, args, {**env, **prefix}))
    return out


def variables_read(script: str) -> set:
    """The variables a script reads from the environment: its own ``VAR=${VAR...}`` settings and
    those of examples/slurm/common.sh."""
    names = set()
    for path in (os.path.join(ROOT, script), os.path.join(ROOT, "examples/slurm/common.sh")):
        names |= set(re.findall(r"\b([A-Z][A-Z0-9_]*)=\$\{\1[:}-]", open(path).read()))
    return names
