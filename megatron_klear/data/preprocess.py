"""Tokenize JSONL conversations once, in parallel, into the indexed SFT dataset (see ``indexed``).

The main process reads the input files line by line (hashing them as it goes), hands chunks of
lines to worker processes that parse, validate, render and tokenize them (``chat``), and writes the
results in input order, so the output is byte-identical whatever the number of workers. At most a
few chunks per worker are in flight, so memory stays flat on inputs of any size.

Policies, all explicit:

- ``on_bad_line``: a line that is not valid JSON, lacks a field, has an unknown role, an empty
  assistant turn, or a conversation the chat template cannot render faithfully is either fatal
  (``fail``, the default) or skipped and counted per reason (``skip``).
- ``overlong``: an example longer than ``max_length`` tokens is ``truncate``-d (kept, cut to
  ``max_length``; dropped if no trainable token survives), ``drop``-ped, or ``fail``-s the run.
  Truncated and dropped examples are counted; dropped ones are listed in the rejected report.

Every rejected line, whatever the policy, is written to ``PREFIX.rejected.jsonl`` with its file and
line number; the first few are also printed.
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Optional, TextIO

import numpy as np

from megatron_klear.data.jsonl import (
    NO_LOSS_AFTER_TRUNCATION,
    TOO_LONG,
    BadLineError,
    BadLinePolicy,
    ExampleError,
    HashingLineReader,
    check_input_files,
    parse_json_object,
)
from megatron_klear.utils.progress import Progress

OVERLONG_CHOICES = ("truncate", "drop", "fail")


@dataclass
class PreprocessConfig:
    inputs: list
    tokenizer: str
    output_prefix: str
    max_length: int
    overlong: str = "fail"
    on_bad_line: str = "fail"
    workers: int = 1
    loss_on: str = "all"
    template_kwargs: dict = field(default_factory=dict)
    chunk_lines: int = 32
    progress_every_s: float = 5.0

    def validate(self) -> None:
        check_input_files(self.inputs)
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")
        if self.overlong not in OVERLONG_CHOICES:
            raise ValueError(f"overlong must be one of {OVERLONG_CHOICES}, got {self.overlong!r}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        BadLinePolicy(self.on_bad_line)  # validates the choice


# ---------------------------------------------------------------------------------------------
# Worker side: one renderer per process.

_RENDERER = None
_SETTINGS = None


def _init_worker(tokenizer_path: str, loss_on: str, template_kwargs: dict, max_length: int, overlong: str):
    global _RENDERER, _SETTINGS
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from megatron_klear.data.chat import ChatRenderer, load_tokenizer

    _RENDERER = ChatRenderer(load_tokenizer(tokenizer_path), loss_on=loss_on, template_kwargs=template_kwargs)
    _SETTINGS = (max_length, overlong)


def _process_line(text) -> tuple:
    """``("ok", ids, spans, original_length)`` or ``("bad", reason, detail)``."""
    from megatron_klear.data.chat import messages_from_example

    max_length, overlong = _SETTINGS
    try:
        if isinstance(text, ExampleError):
            raise text
        example = _RENDERER.render(messages_from_example(parse_json_object(text)))
    except ExampleError as e:
        return ("bad", e.reason, e.detail)
    n = len(example)
    if n > max_length:
        if overlong != "truncate":
            return ("bad", TOO_LONG, f"{n} tokens > max_length {max_length}")
        example = example.truncated(max_length)
        if not example.loss_spans:
            return (
                "bad",
                NO_LOSS_AFTER_TRUNCATION,
                f"{n} tokens truncated to {max_length} leave no assistant token",
            )
    ids = np.asarray(example.token_ids, dtype=np.int32)
    return ("ok", ids, example.loss_spans, n)


def _process_chunk(chunk):
    source_index, items = chunk
    return source_index, [(lineno, _process_line(text)) for lineno, text in items]


# ---------------------------------------------------------------------------------------------
# Main side.


def _length_summary(lengths: np.ndarray, max_length: int) -> dict:
    if lengths.size == 0:
        return {"count": 0}
    top = max(int(lengths.max()), max_length)
    edges = [0] + [1 << k for k in range(6, 64) if (1 << k) < top] + [top + 1]
    counts, _ = np.histogram(lengths, bins=edges)
    return {
        "count": int(lengths.size),
        "min": int(lengths.min()),
        "max": int(lengths.max()),
        "mean": float(lengths.mean()),
        "p50": float(np.percentile(lengths, 50)),
        "p90": float(np.percentile(lengths, 90)),
        "p99": float(np.percentile(lengths, 99)),
        "histogram": {
            "edges": edges,
            "counts": counts.tolist(),
            "note": "counts[i] = examples with edges[i] <= length < edges[i+1]",
        },
    }


def _chunks(readers, chunk_lines: int):
    """``(position, (source_index, lines))`` in input order; ``position``: the bytes of every input
    read up to the chunk's end (the progress once the chunk is processed)."""
    before = 0
    for source_index, reader in enumerate(readers):
        items = []
        for lineno, text in reader:
            items.append((lineno, text))
            if len(items) >= chunk_lines:
                yield before + reader.bytes_read, (source_index, items)
                items = []
        if items:
            yield before + reader.bytes_read, (source_index, items)
        before += reader.bytes_read


def _results(cfg: PreprocessConfig, readers):
    """``(position, processed chunk)`` in input order, from a bounded pool of workers (or in-process)."""
    init_args = (cfg.tokenizer, cfg.loss_on, cfg.template_kwargs, cfg.max_length, cfg.overlong)
    if cfg.workers == 1:
        _init_worker(*init_args)
        for position, chunk in _chunks(readers, cfg.chunk_lines):
            yield position, _process_chunk(chunk)
        return
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # fork after tokenizers/torch threads start is unsafe
    with ctx.Pool(cfg.workers, initializer=_init_worker, initargs=init_args) as pool:
        pending = collections.deque()
        for position, chunk in _chunks(readers, cfg.chunk_lines):
            pending.append((position, pool.apply_async(_process_chunk, (chunk,))))
            if len(pending) >= 4 * cfg.workers:
                position, result = pending.popleft()
                yield position, result.get()
        while pending:
            position, result = pending.popleft()
            yield position, result.get()


def preprocess(cfg: PreprocessConfig, stream: Optional[TextIO] = None) -> dict:
    """Run the whole preprocessing; returns the metadata written to ``PREFIX.meta.json``."""
    from megatron_klear.data.chat import load_tokenizer, tokenizer_fingerprint
    from megatron_klear.data.indexed import SFTIndexedWriter

    stream = stream or sys.stderr
    cfg.validate()
    t0 = time.monotonic()
    tokenizer = load_tokenizer(cfg.tokenizer)
    fingerprint = tokenizer_fingerprint(cfg.tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError(f"tokenizer {cfg.tokenizer!r} has neither a pad nor an eos token")
    readers = [HashingLineReader(p) for p in cfg.inputs]
    writer = SFTIndexedWriter(cfg.output_prefix, vocab_size=len(tokenizer))
    bad = BadLinePolicy(cfg.on_bad_line, report=writer.rejected, stream=stream)
    dropped = BadLinePolicy("skip", report=writer.rejected, stream=stream)
    lengths, lines, truncated, total_tokens, loss_tokens = [], 0, 0, 0, 0
    # progress over the input's bytes (kB below 10 MB), with the counts so far
    total_bytes = sum(r.size for r in readers)
    scale, unit = (1e6, "MB") if total_bytes >= 10e6 else (1e3, "kB")
    progress = Progress(total_bytes / scale, "preprocess", unit=unit, every=cfg.progress_every_s, stream=stream)

    def report(bytes_done: int) -> None:
        rate = total_tokens / max(time.monotonic() - progress.start, 1e-9) / 1e6
        rejected = bad.total + dropped.total
        note = f"| {lines:,} lines (kept {len(lengths):,}, rejected {rejected:,}), {rate:,.2f} M tokens/s"
        progress.update(bytes_done / scale, note)

    try:
        for position, (source_index, results) in _results(cfg, readers):
            path = cfg.inputs[source_index]
            for lineno, res in results:
                lines += 1
                if res[0] == "bad":
                    err = BadLineError(path, lineno, res[1], res[2])
                    if res[1] == TOO_LONG and cfg.overlong == "fail":
                        bad.handle(err, force_fail=True)
                    elif res[1] in (TOO_LONG, NO_LOSS_AFTER_TRUNCATION):
                        dropped.record(err)
                    else:
                        bad.handle(err)
                    continue
                _, ids, spans, original_length = res
                writer.add(ids, spans)
                lengths.append(ids.size)
                truncated += original_length > ids.size
                total_tokens += int(ids.size)
                loss_tokens += sum(e - s for s, e in spans)
            report(position)
        report(sum(r.bytes_read for r in readers))  # the end (after any trailing blank lines): the final line
        if not lengths:
            raise ValueError(
                f"no example survived preprocessing of {cfg.inputs} ({lines} lines; skipped "
                f"{dict(bad.counts)}, dropped {dict(dropped.counts)}); see the messages above"
            )
        lengths_arr = np.asarray(lengths, dtype=np.int64)
        metadata = {
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv),
            "config": {k: v for k, v in asdict(cfg).items() if k not in ("progress_every_s",)},
            "tokenizer": {
                "path": os.path.abspath(cfg.tokenizer),
                **fingerprint,
                "chat_template_sha256": hashlib.sha256(tokenizer.chat_template.encode()).hexdigest(),
                "vocab_size": len(tokenizer),
                "eos_token_id": tokenizer.eos_token_id,
                "pad_token_id": pad_id,
            },
            "sources": [
                {"path": os.path.abspath(r.path), "sha256": r.sha256, "bytes": r.size, "lines": r.num_lines}
                for r in readers
            ],
            "counts": {
                "examples_read": lines,  # non-blank lines
                "kept": len(lengths),
                "truncated": int(truncated),
                "skipped": dict(sorted(bad.counts.items())),
                "dropped": dict(sorted(dropped.counts.items())),
            },
            "tokens": {"total": total_tokens, "loss": loss_tokens},
            "lengths": _length_summary(lengths_arr, cfg.max_length),
            "seconds": round(time.monotonic() - t0, 3),
        }
        metadata = writer.commit(metadata)
    except BaseException:
        writer.abort()
        raise
    c = metadata["counts"]
    print(
        f"[preprocess] wrote {cfg.output_prefix}: {c['kept']:,} examples, {total_tokens:,} tokens "
        f"({loss_tokens:,} with loss); truncated {c['truncated']:,}; skipped {c['skipped'] or 0}; "
        f"dropped {c['dropped'] or 0}; {metadata['seconds']:.1f} s",
        file=stream,
        flush=True,
    )
    return metadata
