"""Reading JSONL input line by line, with every error naming its file and line.

Training data comes in large hand-assembled JSONL files; a single malformed line among millions
must be findable, so every problem with a line becomes a :class:`BadLineError` carrying the path,
the 1-based line number, a short machine-readable ``reason`` (used for per-reason counts in the
metadata) and a human-readable detail. What happens to a bad line is one explicit policy
(:class:`BadLinePolicy`): fail on the first one, or skip it and count it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Optional, TextIO

# Reasons a line can be rejected. Kept as plain strings so counts serialise directly to JSON.
INVALID_JSON = "invalid_json"
NOT_AN_OBJECT = "not_an_object"
MISSING_FIELD = "missing_field"
INVALID_FIELD = "invalid_field"
UNKNOWN_ROLE = "unknown_role"
EMPTY_ASSISTANT = "empty_assistant_turn"
NO_ASSISTANT = "no_assistant_turn"
TEMPLATE_ERROR = "chat_template_error"
NOT_PREFIX_STABLE = "template_not_prefix_stable"
TOO_LONG = "too_long"
NO_LOSS_AFTER_TRUNCATION = "no_loss_tokens_after_truncation"

ON_BAD_LINE_CHOICES = ("skip", "fail")


class ExampleError(ValueError):
    """A problem with one example, before we know (or care) where it came from."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail

    def __reduce__(self):  # picklable across worker processes
        return (type(self), (self.reason, self.detail))


class BadLineError(ValueError):
    """A rejected input line: ``path:line: reason: detail``."""

    def __init__(self, path: str, line: int, reason: str, detail: str):
        super().__init__(f"{path}:{line}: {reason}: {detail}")
        self.path = path
        self.line = line
        self.reason = reason
        self.detail = detail

    def __reduce__(self):
        return (type(self), (self.path, self.line, self.reason, self.detail))

    @classmethod
    def from_example_error(cls, path: str, line: int, err: ExampleError) -> "BadLineError":
        return cls(path, line, err.reason, err.detail)

    def to_record(self) -> dict:
        return {"file": self.path, "line": self.line, "reason": self.reason, "detail": self.detail}


@dataclass
class BadLinePolicy:
    """Skip-and-count or fail on the first bad line; always report where.

    ``report`` receives every rejected line (one JSON object per line) so that a skipped line is
    never silently lost; the first ``echo_first`` are also printed to ``stream`` (None: printed
    nowhere, e.g. on all ranks but one), the note after them naming ``report_name``.
    """

    on_bad_line: str = "fail"
    report: Optional[TextIO] = None
    echo_first: int = 20
    stream: Optional[TextIO] = field(default_factory=lambda: sys.stderr)
    counts: Counter = field(default_factory=Counter)
    report_name: Optional[str] = None

    def __post_init__(self):
        if self.on_bad_line not in ON_BAD_LINE_CHOICES:
            raise ValueError(f"on_bad_line must be one of {ON_BAD_LINE_CHOICES}, got {self.on_bad_line!r}")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def handle(self, err: BadLineError, *, force_fail: bool = False) -> None:
        """Fail (raise ``err``) or record it and carry on."""
        if force_fail or self.on_bad_line == "fail":
            raise err
        self.record(err)

    def record(self, err: BadLineError) -> None:
        """Count and report a rejected line without consulting the policy."""
        self.counts[err.reason] += 1
        if self.report is not None:
            self.report.write(json.dumps(err.to_record(), ensure_ascii=False) + "\n")
        n = self.total
        if n <= self.echo_first and self.stream is not None:
            print(f"rejected {err}", file=self.stream)
            if n == self.echo_first:
                print(
                    f"(further rejected lines go only to {self.report_name or 'the report'})"
                    if self.report is not None
                    else "(further rejected lines are counted, not shown)",
                    file=self.stream,
                )

    def reasons(self) -> str:
        """``invalid_json: 1, missing_field: 2``: the count of each reason."""
        return ", ".join(f"{r}: {n}" for r, n in sorted(self.counts.items()))


def parse_json_object(text: str) -> dict:
    """Parse one line as a JSON object, raising :class:`ExampleError` otherwise (a JSON error names
    its column in the line, counted in characters from 1)."""
    line = text.rstrip("\r\n")  # the line's end is not part of the object: an error there is at the last column + 1
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        where = (
            f"column {e.pos + 1}, the end of the line (an unclosed object, array or string?)"
            if e.pos >= len(line.rstrip())
            else f"column {e.pos + 1}"
        )
        raise ExampleError(INVALID_JSON, f"{e.msg.removesuffix(' at')} at {where}") from None
    if not isinstance(obj, dict):
        raise ExampleError(NOT_AN_OBJECT, f"expected a JSON object, got {type(obj).__name__}")
    return obj


class HashingLineReader:
    """Iterate ``(line_number, text)`` over a file's non-blank lines, hashing every byte read.

    The sha256 of the whole file (``.sha256``, valid once iteration is complete) goes into the
    dataset metadata, so one pass gives both the content and its fingerprint. ``bytes_read``
    feeds progress reports. Blank lines are skipped but still counted in line numbers.
    """

    def __init__(self, path: str):
        self.path = path
        self.size = os.path.getsize(path)
        self.bytes_read = 0
        self.num_lines = 0
        self._sha = hashlib.sha256()
        self._done = False

    @property
    def sha256(self) -> str:
        if not self._done:
            raise RuntimeError(f"{self.path}: sha256 requested before the file was fully read")
        return self._sha.hexdigest()

    def __iter__(self) -> Iterator[tuple[int, str]]:
        with open(self.path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                self._sha.update(raw)
                self.bytes_read += len(raw)
                self.num_lines = lineno
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    # Let the caller treat it like any other bad line.
                    yield lineno, ExampleError(INVALID_JSON, f"not valid UTF-8 ({e.reason})")
                    continue
                if text.strip():
                    yield lineno, text
        self._done = True


def iter_jsonl_objects(path: str, policy: BadLinePolicy) -> Iterator[tuple[int, dict]]:
    """``(line_number, object)`` for every valid JSON-object line; bad ones go to ``policy``."""
    for lineno, text in HashingLineReader(path):
        try:
            if isinstance(text, ExampleError):
                raise text
            yield lineno, parse_json_object(text)
        except ExampleError as e:
            policy.handle(BadLineError.from_example_error(path, lineno, e))


def expand_input_files(specs) -> list:
    """Paths and quoted globs (each ``*``/``?``/``[`` pattern expanded, sorted) -> the files, each of
    which exists; a pattern that matches nothing or a missing file is an error naming it."""
    import glob

    files = []
    for spec in specs:
        matched = sorted(glob.glob(spec)) if glob.has_magic(spec) else [spec]
        if not matched:
            raise FileNotFoundError(f"{spec!r} matches no file")
        files += matched
    check_input_files(files)
    return files


def check_input_files(paths) -> None:
    """At least one path, each an existing file (errors name the path)."""
    if not paths:
        raise ValueError("no input files given")
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"input file {path!r} does not exist")


class RejectedRows:
    """A tool's bad rows, kept in memory and written beside its output as ``<output>.rejected.jsonl``
    (one record per row; a stale report of an earlier run is removed when none was rejected).
    ``policy`` is the :class:`BadLinePolicy` that feeds it (``on_bad_line``: fail or skip)."""

    def __init__(self, output: str, on_bad_line: str):
        self.path = output + ".rejected.jsonl"
        self.lines: list = []
        self.policy = BadLinePolicy(on_bad_line=on_bad_line, report=self, stream=sys.stderr, report_name=self.path)

    def write(self, line: str) -> None:  # (the policy's report stream)
        self.lines.append(line)

    def save(self) -> None:
        from megatron_klear.utils import atomic

        if self.lines:
            atomic.write_text(self.path, "".join(self.lines))
        elif os.path.exists(self.path):  # an earlier run's, about other data
            os.remove(self.path)
