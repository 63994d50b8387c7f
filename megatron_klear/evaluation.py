"""avg@k evaluation of a model on math / code benchmarks, with the same engines, prompts and
graders as RL (docs/recipe.md, "Evaluation": AIME24/25, HMMT25 avg@64, LiveCodeBench avg@8;
temperature 0.6, top_p 0.95, top_k 20, a 32K budget).

For each prompt, ``k`` responses are sampled; a response scores 1 when it is *solved* (the math
answer is right / every test passes). Reported per benchmark: ``avg@k`` (mean over prompts of the
fraction of solved responses, the paper's number, in %), ``pass@k`` (any solved), the mean
response length, the fraction cut by the length limit, and grader errors (which count as unsolved
and are listed, never hidden).

"Every test" means all of a problem's tests (LiveCodeBench semantics), not RL's sample of
``code_max_tests``: the grading pool must be built with :func:`evaluation_reward_config`, and
:func:`evaluate` refuses a pool that samples tests when a benchmark has code problems. Chat
templates that open ``<think>`` inside the prompt (the response continues the thought and never
writes ``<think>`` itself) need ``think_in_prompt``, else every response would score the missing
``<think>`` format penalty; :func:`prompts_open_think` detects them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from megatron_klear.utils import atomic

PAPER_SAMPLING = dict(temperature=0.6, top_p=0.95, top_k=20)
#: each benchmark's figures of :func:`evaluate` that ``rl.eval`` logs (``{k}``: the k of avg@k)
EVAL_METRICS = ("avg@{k}", "pass@{k}", "response_length_mean", "truncated_frac", "grader_errors")


def parse_named(specs, flag: str) -> dict:
    """``["NAME=VALUE", ...]`` -> ``{NAME: VALUE}``; ValueError naming ``flag`` for a spec without
    ``=`` or a name given twice (one benchmark reads several files as NAME=FILE1,FILE2)."""
    out = {}
    for spec in specs or []:
        if "=" not in str(spec):
            raise ValueError(f"{flag} {spec!r}: expected NAME=VALUE")
        name, value = str(spec).split("=", 1)
        if name in out:
            raise ValueError(
                f"{flag} {name}=... given twice ({out[name]!r} and {value!r}): give each name once; one benchmark "
                "reads several files as NAME=FILE1,FILE2 or a quoted glob"
            )
        out[name] = value
    return out


def bench_window(name: str, value: str) -> tuple:
    """``(since, until)`` of a LiveCodeBench window: ``v5``, ``v6`` or ``SINCE..UNTIL``."""
    from megatron_klear.data.formats.livecodebench import WINDOWS

    if value in WINDOWS:
        return WINDOWS[value]
    if ".." in value:
        since, until = value.split("..", 1)
        return since or None, until or None
    raise ValueError(f"--bench-window {name}={value}: expected v5, v6 or SINCE..UNTIL")


def read_benchmarks(
    files: dict, tokenizer, *, max_prompt_length: int, formats=None, windows=None, report=None, flag="--bench"
) -> dict:
    """``{NAME: prompts}`` from ``{NAME: "FILE[,FILE...]"}`` (paths or globs, each matching
    something), read in the published formats ``tools/eval.py`` and ``rl.eval`` take
    (``formats``: ``{NAME: format}``, auto-detected by default; ``windows``: ``{NAME: window}``
    of a LiveCodeBench file). ``report(line)`` hears each benchmark's problem count. A bad name or
    file is a ValueError naming it (as ``flag`` NAME=VALUE)."""
    from megatron_klear.data.formats.livecodebench import PUBLISHED_COUNTS
    from megatron_klear.data.jsonl import expand_input_files
    from megatron_klear.data.prompts import PromptDataset

    formats, windows = formats or {}, windows or {}
    for flag, named in (("--bench-format", formats), ("--bench-window", windows)):
        for name in set(named) - set(files):
            raise ValueError(f"{flag} {name}=...: no --bench named {name!r}")
    benchmarks = {}
    for name, value in files.items():
        try:
            paths = expand_input_files([x.strip() for x in value.split(",") if x.strip()])
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"{flag} {name}={value}: {e}") from None
        since, until = bench_window(name, windows[name]) if name in windows else (None, None)
        benchmarks[name] = PromptDataset(
            paths,
            tokenizer,
            max_prompt_length=max_prompt_length,
            format=formats.get(name, "auto"),
            since=since,
            until=until,
        ).prompts
        count = len(benchmarks[name])
        line = f"{name}: {count} problems from {len(paths)} file(s)"
        published = PUBLISHED_COUNTS.get(windows.get(name))
        if published is not None:
            line += f"; LiveCodeBench's {windows[name]} window has {published}"
            if count != published:
                line += " (a window spans several release files: pass every one, e.g. 'data/lcb/test*.jsonl')"
        if report is not None:
            report(line)
    return benchmarks


def evaluation_reward_config(base=None, *, think_in_prompt: bool = False):
    """The grading settings of evaluation: every test of a code problem (no sample), and no
    ``<think>`` required in the response when the prompt opens it."""
    from megatron_klear.rewards import RewardConfig

    base = base or RewardConfig()
    return dataclasses.replace(
        base, code_max_tests=None, code_test_sampling="fixed", require_think_open=not think_in_prompt
    )


def prompts_open_think(tokenizer, prompts, tail_tokens: int = 32) -> bool:
    """True when every prompt ends inside an open ``<think>`` block (its rendered tail has a
    ``<think>`` after the last ``</think>``)."""
    if not prompts:
        return False
    for p in prompts:
        tail = tokenizer.decode(list(p.prompt_ids)[-tail_tokens:], skip_special_tokens=False)
        if tail.rfind("<think>") < 0 or tail.rfind("<think>") < tail.rfind("</think>"):
            return False
    return True


def evaluate(
    engine,
    benchmarks: dict,
    tokenizer,
    pool,
    *,
    k: int,
    params,
    progress=print,
    on_benchmark=None,
    on_prompt=None,
    finished: dict | None = None,
) -> tuple:
    """``benchmarks``: name -> list of :class:`megatron_klear.data.prompts.Prompt`.
    Returns ``(summary, records)``: per-benchmark metrics and one record per response.
    ``on_benchmark(name, summary, records)``: called as each benchmark finishes, with its own.
    ``on_prompt(name, index, records)``: called as each prompt's ``k`` responses are graded.
    ``finished``: ``{name: {prompt index: its records}}`` of an interrupted evaluation at the same
    setting (what ``on_prompt`` was given): those prompts are not generated again, and each of the
    others is seeded by its index in the benchmark (the engines' ``seed_keys``), as in a run of the
    whole list, so the results equal an uninterrupted evaluation's."""
    from dataclasses import replace

    from megatron_klear.data.chat import generation_stop_ids

    cfg = getattr(pool, "cfg", None)
    has_code = any(p.task == "code" for ps in benchmarks.values() for p in ps)
    if has_code and cfg is not None and cfg.code_max_tests is not None:
        raise ValueError(
            f"evaluation grades every test of a code problem, but the grading pool samples "
            f"code_max_tests={cfg.code_max_tests}: build it with evaluation_reward_config()"
        )
    summary, records = {}, []
    # responses end at EOS or at the chat template's end-of-turn token (a base model's EOS differs)
    stop_ids = sorted(set(params.stop_token_ids) | set(generation_stop_ids(tokenizer)))
    params = replace(params, stop_token_ids=stop_ids)
    strip = [t for t in (tokenizer.eos_token, tokenizer.pad_token, *tokenizer.convert_ids_to_tokens(stop_ids)) if t]

    def text_of(completion) -> str:
        text = tokenizer.decode(completion.token_ids, skip_special_tokens=False)
        for t in strip:
            text = text.replace(t, "")
        return text

    for name, prompts in benchmarks.items():
        t0 = time.time()
        done = {int(i): recs for i, recs in ((finished or {}).get(name) or {}).items()}
        if done:
            progress(f"{name}: {len(done)} of {len(prompts)} prompts kept from the interrupted run")
        _generate_and_grade(engine, pool, name, prompts, done, k=k, params=params, text_of=text_of, on_prompt=on_prompt)
        mine = [r for i in sorted(done) for r in done[i]]
        records.extend(mine)
        summary[name] = {**summarize(mine, k, len(prompts)), "seconds": time.time() - t0}
        progress(
            f"{name}: avg@{k} {summary[name][f'avg@{k}']:.1f}  pass@{k} {summary[name][f'pass@{k}']:.1f}  "
            f"({len(prompts)} prompts, {summary[name]['seconds']:.0f}s)"
        )
        if on_benchmark is not None:
            on_benchmark(name, summary[name], mine)
    return summary, records


def _generate_and_grade(engine, pool, name, prompts, done: dict, *, k, params, text_of, on_prompt) -> None:
    """The prompts of one benchmark not in ``done`` (index -> records), generated, graded as they
    arrive and recorded into ``done`` as their grades come back; each prompt seeded by its index."""
    todo = [i for i in range(len(prompts)) if i not in done]
    grading: dict = {}  # prompt index -> [(sample, completion, text, future)]

    def record(i: int) -> None:
        recs = [_record(name, prompts[i], j, c, text, fut.result()) for j, c, text, fut in grading.pop(i)]
        done[i] = recs
        if on_prompt is not None:
            on_prompt(name, i, recs)

    for local, cs in engine.generate_iter([prompts[i].prompt_ids for i in todo], params, n=k, seed_keys=todo):
        i = todo[local]
        texts = [text_of(c) for c in cs]
        grading[i] = [(j, c, t, pool.submit(prompts[i].grade_item(t))) for j, (c, t) in enumerate(zip(cs, texts))]
        for ready in [i for i, items in grading.items() if all(f.done() for *_, f in items)]:
            record(ready)
    for i in list(grading):
        record(i)


def _record(name: str, prompt, sample: int, completion, text: str, grade) -> dict:
    return {
        "benchmark": name,
        "id": prompt.id,
        "sample": sample,
        "solved": grade.solved,
        "reward": grade.reward,
        "error": grade.error,
        "detail": grade.detail,
        "length": len(completion.token_ids),
        "finish_reason": completion.finish_reason,
        "response": text,
    }


def summarize(records: list, k: int, prompts: int) -> dict:
    """A benchmark's metrics from its response records (:func:`evaluate`'s)."""
    per_prompt: dict = {}
    for r in records:
        per_prompt.setdefault(r["id"], []).append(r["solved"])
    return {
        "prompts": prompts,
        "k": k,
        f"avg@{k}": 100.0 * sum(sum(v) / len(v) for v in per_prompt.values()) / len(per_prompt),
        f"pass@{k}": 100.0 * sum(any(v) for v in per_prompt.values()) / len(per_prompt),
        "response_length_mean": sum(r["length"] for r in records) / len(records),
        "truncated_frac": sum(r["finish_reason"] != "stop" for r in records) / len(records),
        "grader_errors": sum(r["error"] is not None for r in records),
    }


def partial_path(out_path: str) -> str:
    """Where tools/eval.py keeps each graded prompt of ``out_path`` until the evaluation ends."""
    return os.path.splitext(out_path)[0] + ".partial.jsonl"


class PartialResults:
    """The graded prompts of an evaluation in progress, one JSON line each (``{"benchmark", "index",
    "records"}``) after a header line holding the setting (``{"setting": ...}``): appended and
    flushed to the disk as each prompt is graded, so that an evaluation killed halfway loses at most
    the prompts in flight. A torn last line (the kill came mid-write) is ignored on reading."""

    def __init__(self, path: str):
        self.path = path
        self._f = None

    def read(self, setting: dict) -> dict | None:
        """``{benchmark: {index: records}}`` kept at ``setting``; None when there is no file; a file
        of another setting raises ValueError naming the first key that differs."""
        if not os.path.exists(self.path):
            return None
        with open(self.path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        out: dict = {}
        for n, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                if n >= len(lines) - 2:  # the torn last line of a killed run
                    break
                raise ValueError(f"{self.path}, line {n + 1}: not JSON") from None
            if n == 0:
                saved = entry.get("setting") if isinstance(entry, dict) else None
                if not isinstance(saved, dict):
                    raise ValueError(f"{self.path}, line 1: no setting header")
                now = json.loads(json.dumps(setting))
                for key in [*now, *(k for k in saved if k not in now)]:
                    if saved.get(key) != now.get(key):
                        raise ValueError(
                            f"{self.path} was written at another setting ({key}: {saved.get(key)!r} there, "
                            f"{now.get(key)!r} now)"
                        )
                continue
            out.setdefault(entry["benchmark"], {})[int(entry["index"])] = entry["records"]
        return out

    def start(self, setting: dict, keep: bool) -> None:
        """Open for appending: after what :meth:`read` found (``keep``), or a new file with the header."""
        if not keep:
            with atomic.atomic_file(self.path) as f:
                f.write(json.dumps({"setting": setting}) + "\n")
        self._f = open(self.path, "a", encoding="utf-8")

    def add(self, name: str, index: int, records: list) -> None:
        self._f.write(json.dumps({"benchmark": name, "index": index, "records": records}) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def finish(self) -> None:
        """The evaluation ended: its results file holds everything; the partial file goes."""
        self.close()
        if os.path.exists(self.path):
            os.remove(self.path)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def samples_path(out_path: str) -> str:
    """Where :func:`write_results` puts the responses of ``out_path``."""
    return os.path.splitext(out_path)[0] + ".samples.jsonl"


def write_results(out_path: str, summary: dict, records: list, meta: dict) -> None:
    """``out_path`` (JSON summary) and ``out_path`` with .samples.jsonl, both atomically."""
    os.makedirs(os.path.dirname(os.path.abspath(out_path)) or ".", exist_ok=True)
    samples = samples_path(out_path)
    for path, write in (
        (samples, lambda f: [f.write(json.dumps(r) + "\n") for r in records]),
        (out_path, lambda f: json.dump({"meta": meta, "results": summary}, f, indent=2)),
    ):
        with atomic.atomic_file(path) as f:
            write(f)
