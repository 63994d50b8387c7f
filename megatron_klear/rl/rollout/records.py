"""The rollouts of an RL run on disk (``rl.dump_rollouts``): what the policy said at each step.

Rank 0 keeps a record of every graded response while a batch is built -- the trained ones and those
the filters dropped (a group without reward spread, an overlong response, a grader error, a group
past the step's quota) -- and every ``rl.dump_rollouts`` steps writes the step's records as
compressed JSONL, ``<save_dir>/rollouts/step_<N>.jsonl.gz`` (temporary name, then rename), keeping
the last ``rl.dump_rollouts_keep`` files (0: all). One line per response:

``step``, ``group``, ``sample`` (its index in the group), ``prompt`` and ``response`` (text),
``prompt_ids``, ``response_ids``, ``reward``, ``solved``, ``grader_error``, ``grader_detail``,
``advantage``, ``trained`` (bool) and ``dropped`` (why not: ``zero_spread``, ``overlong``,
``grader_error``, ``over_quota``, or null), ``finish_reason``, ``length``,
``behaviour_logprob_mean`` (the engine's log-probs of the response, averaged),
``old_logprob_mean`` (the trainer's, recomputed at the weights the update started from, averaged
over the same tokens; null for a response not trained), ``weight_versions`` (``[oldest, newest]``
version that sampled its tokens, null when the engine did not say). A step's file is written once
its update has ended (at the push that follows it), or at the end of the run.

``tools/rollouts.py`` reads them (show a step, filter by reward, diff two steps).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import threading

from megatron_klear.utils import atomic

STEP_FILE = re.compile(r"step_(\d+)\.jsonl\.gz$")


class RolloutRecorder:
    """Rank 0: the records of the responses graded since the last :meth:`take` (thread-safe: a
    batch generated one step ahead adds them from its own thread)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._records = []

    def add(self, prompt, completion, grade, *, group: int, sample: int, advantage: float, dropped: str | None):
        logprobs = list(getattr(completion, "logprobs", None) or [])
        versions = [v for v in (getattr(completion, "versions", None) or []) if v is not None]
        record = {
            "group": group,
            "sample": sample,
            "prompt_ids": list(prompt.prompt_ids),
            "response_ids": list(completion.token_ids),
            "reward": float(grade.reward),
            "solved": bool(grade.solved),
            "grader_error": grade.error,
            "grader_detail": grade.detail,
            "advantage": float(advantage),
            "trained": dropped is None,
            "dropped": dropped,
            "finish_reason": completion.finish_reason,
            "length": len(completion.token_ids),
            "behaviour_logprob_mean": sum(logprobs) / len(logprobs) if logprobs else None,
            "weight_versions": [min(versions), max(versions)] if versions else None,
            "prompt_id": getattr(prompt, "id", None),
            # the response's own token list, held until the manager matches it against the samples
            # the step trains on (dynamic sampling may still cut its group past the quota)
            "_ref": completion.token_ids,
        }
        with self._lock:
            self._records.append(record)

    def take(self) -> list:
        """The records added since the last call (and forget them)."""
        with self._lock:
            out, self._records = self._records, []
        return out


class RolloutDump:
    """Rank 0: writes a step's records every ``every`` steps, keeping the last ``keep`` files."""

    def __init__(self, save_dir: str, every: int, keep: int, tokenizer):
        self.dir = os.path.join(save_dir or "runs/rl", "rollouts")
        self.every, self.keep, self.tokenizer = int(every), int(keep), tokenizer

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def path(self, step: int) -> str:
        return os.path.join(self.dir, f"step_{step:07d}.jsonl.gz")

    def write(self, step: int, records: list) -> str:
        """The records of RL step ``step`` (decoded to text here), atomically; then the rotation."""
        os.makedirs(self.dir, exist_ok=True)
        final = self.path(step)
        with atomic.atomic_path(final) as tmp:
            with gzip.open(tmp, "wt", encoding="utf-8") as f:
                for r in records:
                    text = {
                        "prompt": self.tokenizer.decode(r["prompt_ids"], skip_special_tokens=False),
                        "response": self.tokenizer.decode(r["response_ids"], skip_special_tokens=False),
                    }
                    f.write(json.dumps({"step": step, **r, **text}) + "\n")
        if self.keep > 0:
            for old in dumped_steps(self.dir)[: -self.keep]:
                os.remove(self.path(old))
        return final


def dumped_steps(directory: str) -> list:
    """The steps with a dump in ``directory`` (a run's ``rollouts/``), in order."""
    steps = []
    for path in glob.glob(os.path.join(directory, "step_*.jsonl.gz")):
        m = STEP_FILE.search(os.path.basename(path))
        if m:
            steps.append(int(m.group(1)))
    return sorted(steps)


def read_step(directory: str, step: int) -> list:
    """The records of ``step`` from ``directory``."""
    path = os.path.join(directory, f"step_{step:07d}.jsonl.gz")
    if not os.path.exists(path):
        have = dumped_steps(directory)
        raise FileNotFoundError(f"{path}: no dump of step {step} (dumped steps: {have or 'none'})")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
