"""RL prompt data: JSONL -> chat-rendered, tokenized prompts with what grading needs.

Each line is one problem::

    {"id": "aime-1", "task": "math", "prompt": "Find ...", "answer": "204"}
    {"id": "lc-7", "task": "code", "messages": [{"role": "user", "content": "..."}],
     "tests": {"inputs": [...], "outputs": [...], "fn_name": "optional"}}

``prompt`` (a user turn) or ``messages`` (ending with a user turn) is rendered with the
tokenizer's chat template and a generation prompt, then *left*-truncated to ``max_prompt_length``
tokens (the recipe keeps the end of a long prompt, where the question is). Bad lines are errors
with file and line, or skipped and counted (``on_bad_line``): with ``skip`` each rejected line is
printed once (by global rank 0; the first 20), the total with a count per reason follows, and
every one of them is listed in ``<report_dir>/skipped_prompt_lines.jsonl`` (the RL loop's
``train.save_dir``; its metrics log the total as ``data/skipped_prompt_lines``). The order is a
seeded shuffle per epoch; :meth:`PromptDataset.state_dict` makes it resumable.

Files in a published layout (Klear's verl parquet, LiveCodeBench releases, math sets; docs/data.md)
are read by :mod:`megatron_klear.data.formats` into problems of this layout first: the format is
detected per file (``format="auto"``, ``rl.prompts_format``) or given, and the format and a
summary of what was read are printed; their bad rows follow ``on_bad_line`` like bad lines.
"""

from __future__ import annotations

import os
import sys
import zlib
from dataclasses import dataclass

import numpy as np

from megatron_klear.data.jsonl import BadLineError, BadLinePolicy, ExampleError, iter_jsonl_objects
from megatron_klear.platform import is_rank0
from megatron_klear.utils import atomic

TASKS = ("math", "code")
REPORT_NAME = "skipped_prompt_lines.jsonl"


@dataclass
class Prompt:
    id: str
    task: str
    prompt_ids: list
    answer: object = None  # math
    tests: dict | None = None  # code
    truncated: bool = False

    def grade_item(self, response: str) -> dict:
        """The rewards package's item for one response to this prompt."""
        item = {"id": self.id, "task": self.task, "response": response}
        if self.task == "math":
            item["answer"] = self.answer
        else:
            item["tests"] = self.tests
        return item


def _messages(obj: dict) -> list:
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise ExampleError("bad_messages", "'messages' must be a non-empty list of objects")
        if msgs[-1].get("role") != "user":
            raise ExampleError("bad_messages", "the last message must be a user turn")
        return msgs
    if not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
        raise ExampleError("missing_field", "need a non-empty 'prompt' string or 'messages'")
    return [{"role": "user", "content": obj["prompt"]}]


def parse_prompt(obj: dict, tokenizer, max_prompt_length: int, index: int) -> Prompt:
    task = obj.get("task", "math")
    if task not in TASKS:
        raise ExampleError("bad_task", f"'task' must be one of {TASKS}, got {task!r}")
    if task == "math" and (obj.get("answer") is None or isinstance(obj.get("answer"), (dict, bool))):
        raise ExampleError("missing_field", "a math problem needs an 'answer'")
    if task == "code":
        tests = obj.get("tests")
        if (
            not isinstance(tests, dict)
            or not isinstance(tests.get("inputs"), list)
            or not isinstance(tests.get("outputs"), list)
        ):
            raise ExampleError("missing_field", "a code problem needs 'tests' with 'inputs' and 'outputs' lists")
        if len(tests["inputs"]) != len(tests["outputs"]) or not tests["inputs"]:
            raise ExampleError("bad_tests", "'tests.inputs' and 'tests.outputs' must be non-empty and equally long")
    text = tokenizer.apply_chat_template(_messages(obj), tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    truncated = len(ids) > max_prompt_length
    if truncated:
        ids = ids[-max_prompt_length:]
    return Prompt(
        id=str(obj.get("id", index)),
        task=task,
        prompt_ids=ids,
        answer=obj.get("answer"),
        tests=obj.get("tests"),
        truncated=truncated,
    )


class _Rejected(list):
    """The rejected lines' records, kept until all files are read (then written as the report)."""

    def write(self, line: str) -> None:
        self.append(line)


class PromptDataset:
    """All prompts of some JSONL files, in a resumable seeded order (epoch after epoch).

    ``report_dir``: where the report of skipped lines goes (:data:`REPORT_NAME`; rank 0 writes
    it, replacing an earlier one). ``stream``: where rejected lines and their total are printed
    (default: stderr on global rank 0, nowhere on the other ranks)."""

    def __init__(
        self,
        paths: list,
        tokenizer,
        *,
        max_prompt_length: int = 4096,
        seed: int = 0,
        on_bad_line: str = "fail",
        report_dir: str | None = None,
        stream=None,
        format: str = "auto",
        since: str | None = None,
        until: str | None = None,
    ):
        self.report_path = os.path.join(report_dir, REPORT_NAME) if report_dir else None
        if stream is None and is_rank0():
            stream = sys.stderr
        rejected = _Rejected()
        self.policy = BadLinePolicy(
            on_bad_line=on_bad_line,
            report=rejected if self.report_path else None,
            stream=stream,
            report_name=self.report_path,
        )
        self.prompts = []
        self.summaries = []
        for path in paths:
            for lineno, obj in self._objects(path, format, since, until, stream):
                try:
                    self.prompts.append(parse_prompt(obj, tokenizer, max_prompt_length, len(self.prompts)))
                except ExampleError as e:
                    self.policy.handle(BadLineError.from_example_error(path, lineno, e))
        self._report(rejected, stream)
        if not self.prompts:
            raise ValueError(
                f"no usable prompts in {paths}" + (f" ({self.skipped} lines skipped)" if self.skipped else "")
            )
        self.seed = seed
        self.epoch, self.position = 0, 0
        # crc32 chained over the ids of every prompt taken so far: equal values, equal data order
        # (saved with the position; logged each step as data/order_digest)
        self.digest = 0

    def _objects(self, path: str, fmt: str, since, until, stream):
        """``(row, problem)`` of one file: the project's JSONL as it is, a published layout
        (data/formats: verl, livecodebench, math) converted; the format and a summary are logged."""
        from megatron_klear.data.formats import detect, read_problems

        chosen = detect(path) if fmt == "auto" else fmt
        if chosen == "project" and not (since or until):
            if stream is not None and fmt == "auto" and not path.endswith(".jsonl"):
                print(f"{path}: read as the project's prompt JSONL", file=stream, flush=True)
            yield from iter_jsonl_objects(path, self.policy)
            return
        problems, summary = read_problems(path, chosen, policy=self.policy, since=since, until=until)
        self.summaries.append(summary)
        if stream is not None:
            print(
                f"prompt data ({'detected' if fmt == 'auto' else 'given'} format): {summary.line()}",
                file=stream,
                flush=True,
            )
        yield from zip(summary.problem_rows, problems)

    @property
    def skipped(self) -> int:
        """The number of lines skipped (``on_bad_line=skip``)."""
        return self.policy.total

    def _report(self, rejected: list, stream) -> None:
        """The report file (rank 0: every skipped line, or none when none was) and the total."""
        if self.report_path and is_rank0():
            if rejected:
                with atomic.atomic_file(self.report_path) as f:
                    f.writelines(rejected)
            elif os.path.isfile(self.report_path):  # an earlier run's, about other data
                os.remove(self.report_path)
        if self.skipped and stream is not None:
            where = (
                f"each listed in {self.report_path}"
                if self.report_path
                else "set train.save_dir to get each listed in a report"
            )
            print(
                f"on_bad_line=skip: skipped {self.skipped} bad prompt lines ({self.policy.reasons()}); {where}",
                file=stream,
                flush=True,
            )

    def __len__(self) -> int:
        return len(self.prompts)

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))

    def take(self, n: int) -> list:
        """The next ``n`` prompts (crossing into the next epoch when needed)."""
        out = []
        while len(out) < n:
            order = self._order(self.epoch)
            k = min(n - len(out), len(order) - self.position)
            out += [self.prompts[i] for i in order[self.position : self.position + k]]
            self.position += k
            for p in out[-k:] if k else ():
                self.digest = zlib.crc32(p.id.encode(), self.digest)
            if self.position == len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "size": len(self.prompts),
            "digest": self.digest,
        }

    def progress(self) -> dict:
        """Metrics of where the order stands: ``data/epoch``, ``data/position``, ``data/order_digest``."""
        return {"data/epoch": self.epoch, "data/position": self.position, "data/order_digest": self.digest}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed") != self.seed or state.get("size") != len(self.prompts):
            raise ValueError(
                f"prompt data state was saved with seed={state.get('seed')} and {state.get('size')} prompts; "
                f"this run has seed={self.seed} and {len(self.prompts)}: the order would differ"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.digest = int(state.get("digest", 0))  # (checkpoints before the digest: it restarts)
