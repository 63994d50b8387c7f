"""The shell commands of the manual (README.md and docs/*.md) name things that exist, and paste.

Every fenced block tagged bash/sh/shell, and every untagged block whose first command looks like
shell, is read as commands (backslash continuations joined, comments dropped), and each command is
checked offline:

- a backslash must end its line: one followed by anything else (a comment after a continuation
  backslash, a trailing space) breaks the command when it is pasted;
- ``python tools/X.py``, ``bash examples/X.sh``, ``sbatch examples/...``: the file exists;
- every ``--flag`` given to one of the project's tools (``tools/*.py``, ``examples/*.py``, a
  ``python -m megatron_klear.<module>`` with a command line) is one of that tool's flags, read from
  its ``--help`` (once per tool);
- every ``key=value`` given to the trainer (after ``-m megatron_klear sft|rl``, to the launch
  scripts that pass their arguments on to it, in ``TRAIN_ARGS``) is a key of the job config, and its
  value has the key's type unless it is a placeholder;
- ``-m megatron_klear.X`` is a module that runs, and every ``megatron_klear.x.y`` named (a custom
  weight loader, say) resolves; ``make X`` is a target of the Makefile;
- ``sbatch --export`` carries no values (the manual exports them in the shell first: sbatch splits
  the list at every comma, values included);
- paths: one under a directory of this repository exists; an absolute one is one of the manual's
  places (:data:`PLACEHOLDER_ROOTS`); a relative file path is under the repository or one of the
  working directories the manual's commands create (:data:`WORKING_DIRS`).

Other programs (SGLang, vLLM, sglang-router, hf, pip, torchrun's own flags) are checked only for
the paths and modules of this repository that they name.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(
    os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")
)
#: Top-level directories of this repository: a path under one of them must exist.
REPO_DIRS = ("megatron_klear", "tools", "examples", "benchmarks", "tests", "docs", "requirements", ".ci")
#: Placeholders the manual uses for places on a cluster that this repository cannot hold: the
#: models as downloaded (/models), the filesystem shared by the trainer and the rollout servers
#: (/shared: the SFT export, the RL weight directory, containers), environments of their own for
#: SGLang (/envs), a checkout elsewhere (/path/to), a tmpfs (/dev/shm). Any other absolute path in a
#: command is a new place the rest of the manual does not know.
PLACEHOLDER_ROOTS = ("/models", "/shared", "/envs", "/path/to", "/dev/shm", "/dev/null")
#: Working directories the manual's commands create or read relative to the repository's root
#: (data sets, checkpoints, run directories, results, logs, plots, the authors' outputs and a
#: clone of their repository): not in the repository, so not checked for existence.
WORKING_DIRS = ("data", "ckpt", "runs", "results", "logs", "plots", "outputs", "KlearReasoner")
FILE_SUFFIXES = (".py", ".sh", ".sbatch", ".yaml", ".yml", ".json", ".jsonl", ".parquet", ".txt", ".md")
SHELL_LANGS = {"bash", "sh", "shell"}
#: First words that make an untagged block a shell block.
SHELL_WORDS = {"python", "python3", "torchrun", "bash", "sh", "sbatch", "srun", "pip", "hf", "make", "export", "mkdir"}
TRAINER_JOBS = ("sft", "rl")
#: torchrun options that take no value (every other option takes one, as --opt V or --opt=V).
TORCHRUN_SWITCHES = {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "--module"}
PLACEHOLDER = re.compile(r"\.\.\.|<[^>]*>|\$|\*|\bNNN")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")
KEY = re.compile(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)+$")
DOTTED = re.compile(r"\bmegatron_klear(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
SEPARATORS = {";", "&", "&&", "|", "||"}
#: Commands that no longer exist where the manual's commands run, and what replaced them.
RETIRED_PROGRAMS = {"huggingface-cli": "`hf` (hf download REPO --repo-type dataset --local-dir DIR)"}


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


# -- extraction -------------------------------------------------------------------------------------
@dataclasses.dataclass
class Command:
    doc: str
    line: int  # of the command's first line in the document
    text: str  # continuations joined
    words: list

    def where(self) -> str:
        return f"{self.doc}:{self.line}: {self.text.strip()[:100]}"


def _blocks(text: str):
    """(language, first line number, lines) of every fenced block, its indentation removed."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"(\s*)```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start, body = len(m.group(1)), m.group(2).lower(), i + 2, []
        i += 1
        while i < len(lines) and not re.match(r"\s*```\s*$", lines[i]):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1
        yield lang, start, body


def _looks_like_shell(body: list) -> bool:
    for line in body:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        first = line.split()[0]
        return os.path.basename(first) in SHELL_WORDS or bool(re.match(r"[A-Z_][A-Z0-9_]*=", first))
    return False


def shell_blocks(text: str):
    """(tagged, first line number, lines) of the blocks read as shell."""
    for lang, start, body in _blocks(text):
        if lang in SHELL_LANGS or (lang == "" and _looks_like_shell(body)):
            yield lang != "", start, body


def stray_backslashes(doc: str, text: str) -> list:
    """A backslash anywhere but at the end of its line: pasted, the shell reads the rest (a comment,
    a space) as arguments and the command ends there."""
    bad = []
    for tagged, start, body in shell_blocks(text):
        for k, line in enumerate(body):
            for m in re.finditer(r"\\", line):
                if m.end() != len(line):
                    bad.append(f"{doc}:{start + k}: a backslash before {line[m.end() :][:30]!r} (it must end the line)")
            after_continuation = k > 0 and body[k - 1].endswith("\\")
            if tagged and not after_continuation and re.match(r"\s+-", line):
                bad.append(
                    f"{doc}:{start + k}: {line.strip()[:40]!r} continues a command without a backslash before it"
                )
    return bad


def commands(doc: str, text: str) -> list:
    out = []
    for tagged, start, body in shell_blocks(text):
        k = 0
        while k < len(body):
            first, parts = k, []
            while k < len(body):
                line = body[k]
                k += 1
                if line.endswith("\\"):
                    parts.append(line[:-1])
                    continue
                parts.append(line)
                # an untagged block is a synopsis: an indented line goes on with the command above
                if tagged or k >= len(body) or not re.match(r"\s+\S", body[k]):
                    break
            joined = "".join(parts)  # as the shell does: backslash-newline is removed
            while True:
                try:
                    words = shlex.split(joined, comments=True)
                    break
                except ValueError as e:
                    if k < len(body):  # a quoted string that goes on over the next line
                        joined += "\n" + body[k]
                        k += 1
                        continue
                    words = [f"<unparsable: {e}>"]
                    break
            for simple in _split_simple(words):
                out.append(Command(doc, start + first, joined, simple))
    return out


def _split_simple(words: list) -> list:
    """Simple commands of a line: split at ; & && | ||."""
    out, cur = [], []
    for w in words:
        if w in SEPARATORS:
            out.append(cur)
            cur = []
        elif w.endswith(";") and w != ";":
            cur.append(w[:-1])
            out.append(cur)
            cur = []
        else:
            cur.append(w)
    out.append(cur)
    return [c for c in out if c]


# -- what the repository holds ----------------------------------------------------------------------
def _python_word(w: str) -> bool:
    return bool(re.fullmatch(r"python[0-9.]*", os.path.basename(w))) or w in ("$PY", "${PY:-python}")


@functools.lru_cache(maxsize=None)
def tool_usage(argv: tuple) -> str:
    """The usage of ``python <argv> --help`` (its first paragraph); raises RuntimeError with what it
    printed when it failed."""
    r = subprocess.run(
        [sys.executable, *argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120, env=_env()
    )
    if r.returncode != 0:
        raise RuntimeError(f"`python {' '.join(argv)} --help` fails: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return r.stdout.split("\n\n", 1)[0]


def tool_flags(argv: tuple) -> frozenset | str:
    """The long options in the usage of ``python <argv> --help``, or what it printed when it failed."""
    try:
        usage = tool_usage(argv)
    except RuntimeError as e:
        return str(e)
    return frozenset(re.findall(r"--[A-Za-z0-9][\w-]*", usage))


def subcommands(argv: tuple) -> set:
    """The subcommands a tool's usage offers (argparse's ``{a,b,c}``), or none."""
    try:
        usage = tool_usage(argv)
    except RuntimeError:
        return set()
    return {name for group in re.findall(r"\{([\w,-]+)\}", usage) for name in group.split(",")}


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _module_file(name: str) -> str | None:
    path = os.path.join(ROOT, *name.split("."))
    if os.path.isfile(path + ".py"):
        return path + ".py"
    if os.path.isfile(os.path.join(path, "__init__.py")):
        return os.path.join(path, "__init__.py")
    return None


def runnable_module(name: str) -> str | None:
    """The file ``python -m name`` runs, or None."""
    path = os.path.join(ROOT, *name.split("."))
    if os.path.isfile(os.path.join(path, "__main__.py")):
        return os.path.join(path, "__main__.py")
    return path + ".py" if os.path.isfile(path + ".py") else None


def dotted_error(name: str) -> str | None:
    """``megatron_klear.a.b[.attr]``: the longest prefix is a module and what is left one name
    defined at its top level."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        module = _module_file(".".join(parts[:n]))
        if module is None:
            continue
        rest = parts[n:]
        if not rest:
            return None
        if len(rest) == 1 and re.search(rf"^(def|class)\s+{rest[0]}\b|^{rest[0]}\s*[:=]", _read(module), re.M):
            return None
        return f"{name}: {os.path.relpath(module, ROOT)} defines no {'.'.join(rest)}"
    return f"{name}: no such module"


def override_error(item: str) -> str | None:
    """``key=value`` for the trainer: a key of the job config, a value of its type."""
    from megatron_klear.config import ConfigError, JobConfig, _set

    if "=" not in item:
        return f"{item!r} is not a key=value override"
    key, raw = item.split("=", 1)
    if not KEY.match(key):
        return f"{item!r}: {key!r} is not a config key"
    target = JobConfig()
    for i, part in enumerate(key.split(".")):
        if not dataclasses.is_dataclass(target):
            break
        names = {f.name for f in dataclasses.fields(target)}
        if part not in names:
            return f"{item!r}: no config key {key!r} ({'.'.join(key.split('.')[: i + 1])} is unknown)"
        if part.endswith("_kwargs"):  # a mapping handed on as it is
            return None
        target = getattr(target, part)
    if PLACEHOLDER.search(raw):
        return None
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
        _set(JobConfig(), key, value, "the manual")
    except (ConfigError, yaml.YAMLError) as e:
        return f"{item!r}: {e}"
    return None


def path_errors(value: str) -> list:
    """The paths inside one word: a list's items, a NAME=FILE's file."""
    out = []
    for piece in re.split(r"[,\[\]]", value):
        if "=" in piece and not piece.startswith("/"):
            piece = piece.split("=", 1)[1]
        piece = piece.strip().strip("'\"")
        if not piece or "://" in piece or PLACEHOLDER.search(piece) or " " in piece:
            continue
        if piece.startswith("/"):
            path = piece.split(":", 1)[0]  # --container-mounts=/shared:/shared
            if not any(path == r or path.startswith(r + "/") for r in PLACEHOLDER_ROOTS):
                out.append(f"{piece}: an absolute path outside the manual's places {PLACEHOLDER_ROOTS}")
            continue
        first = piece.split("/", 1)[0]
        if "/" in piece and first in REPO_DIRS:
            if not os.path.exists(os.path.join(ROOT, piece.rstrip("/"))):
                out.append(f"{piece}: no such file in the repository")
        elif "/" in piece and first not in WORKING_DIRS and piece.endswith(FILE_SUFFIXES):
            out.append(f"{piece}: neither in the repository nor under the manual's working directories {WORKING_DIRS}")
    return out


# -- the checks of one command ----------------------------------------------------------------------
def check(cmd: Command) -> list:
    words, errors = list(cmd.words), []
    if words and words[0].startswith("<unparsable"):
        return [words[0]]
    for w in words:
        errors += path_errors(w)
        errors += [e for e in map(dotted_error, DOTTED.findall(w)) if e]
    while words and re.match(r"[A-Za-z_][A-Za-z0-9_]*=", words[0]):  # VAR=value cmd ...
        errors += _env_assignment(words.pop(0))
    if not words:
        return errors
    prog, args = words[0], words[1:]
    if prog in RETIRED_PROGRAMS:
        errors.append(f"{prog}: retired, use {RETIRED_PROGRAMS[prog]}")
    if prog == "export":
        for a in args:
            if "=" in a:
                errors += _env_assignment(a)
    elif _python_word(prog):
        errors += _python(args)
    elif os.path.basename(prog) == "torchrun":
        errors += _python(_after_launcher_options(args))
    elif prog in ("bash", "sh"):
        errors += _launch_script(args)
    elif prog == "sbatch":
        errors += _sbatch(args)
    elif prog == "make":
        targets = set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:", _read("Makefile"), re.M))
        errors += [
            f"make {t}: no such target in the Makefile" for t in args if not t.startswith("-") and t not in targets
        ]
    return errors


def _env_assignment(item: str) -> list:
    name, value = item.split("=", 1)
    if name == "TRAIN_ARGS":
        return _trainer_arguments(shlex.split(value))
    if name == "CONFIG" and not PLACEHOLDER.search(value) and not os.path.isfile(os.path.join(ROOT, value)):
        return [f"CONFIG={value}: no such config file"]
    return []


def _after_launcher_options(args: list) -> list:
    """torchrun's (and megatron_klear.platform.launch's) own options skipped: what it runs."""
    i = 0
    while i < len(args):
        a = args[i]
        if a == "-m" or not a.startswith("-"):
            return args[i:]
        i += 1 if ("=" in a or a in TORCHRUN_SWITCHES) else 2
    return []


def _python(args: list) -> list:
    if not args:
        return []
    if args[0] == "-c":
        return []
    if args[0] == "-m":
        if len(args) < 2:
            return ["python -m without a module"]
        module, rest = args[1], args[2:]
        if module == "megatron_klear":
            return _trainer(rest)
        if module == "megatron_klear.platform.launch":
            return _python(_after_launcher_options(rest))
        if not module.startswith("megatron_klear."):
            return []  # another program: its paths were checked
        if runnable_module(module) is None:
            return [f"python -m {module}: no such runnable module (no {module.replace('.', '/')}.py or __main__.py)"]
        return _flags(("-m", module), rest)
    script = args[0]
    if not os.path.isfile(os.path.join(ROOT, script)):
        if script.startswith(REPO_DIRS):
            return [f"{script}: no such script"]
        return []
    if len(args) > 1 and args[1] in subcommands((script,)):  # a tool's subcommand: its own options
        return _flags((script, args[1]), args[2:])
    return _flags((script,), args[1:])


def _flags(argv: tuple, args: list) -> list:
    known = tool_flags(argv)
    if isinstance(known, str):
        return [known]
    bad = []
    for a in args:
        flag = a.lstrip("[(").rstrip("])").split("=", 1)[0]
        if flag.startswith("--") and flag not in known:
            bad.append(f"{' '.join(argv)}: no option {flag} (it has {', '.join(sorted(known))})")
    return bad


def _trainer(args: list) -> list:
    if not args or args[0] not in TRAINER_JOBS:
        return [f"python -m megatron_klear {args[0] if args else ''}: the jobs are {TRAINER_JOBS}"]
    return _trainer_arguments(args[1:])


def _trainer_arguments(args: list) -> list:
    """What follows ``python -m megatron_klear sft|rl``: ``--config FILE`` (argparse keeps the last)
    and ``key=value`` overrides."""
    bad, i = [], 0
    while i < len(args):
        a = args[i]
        if a == "--config":
            i += 2
            continue
        if a.startswith("--config="):
            i += 1
            continue
        if a.startswith("-"):
            bad.append(f"python -m megatron_klear: no option {a} (only --config and key=value)")
        elif a != "..." and (e := override_error(a)):
            bad.append(e)
        i += 1
    return bad


def _launch_script(args: list) -> list:
    if not args or args[0].startswith("-"):
        return []
    script = args[0]
    path = os.path.join(ROOT, script)
    if not os.path.isfile(path):
        return [f"bash {script}: no such script"] if not PLACEHOLDER.search(script) else []
    if re.search(r"-m megatron_klear (sft|rl)\b[\s\S]*\"\$@\"", _read(script)):  # hands its arguments on
        return _trainer_arguments(args[1:])
    return []


def _sbatch(args: list) -> list:
    bad, script = [], None
    for a in args:
        if a.startswith("--export="):
            for item in a.split("=", 1)[1].split(","):
                if item in ("ALL", "NONE", "NIL") or ENV_NAME.match(item):
                    continue
                bad.append(
                    f"sbatch --export: {item!r}: pass values by exporting them in the shell and "
                    "--export=ALL (sbatch splits the list at every comma, values included)"
                )
        elif not a.startswith("-") and script is None:
            script = a
    if script and not os.path.isfile(os.path.join(ROOT, script)):
        bad.append(f"sbatch {script}: no such script")
    return bad


# -- the tests ---------------------------------------------------------------------------------------
def _all_commands() -> list:
    return [c for doc in DOCS for c in commands(doc, _read(doc))]


@pytest.fixture(scope="module", autouse=True)
def _help_of_every_tool():
    """Ask every tool the manual runs for its options at once, in parallel (cached)."""
    argvs = set()
    for c in _all_commands():
        words = [w for w in c.words if not re.match(r"[A-Za-z_][A-Za-z0-9_]*=", w)] or [""]
        for i, w in enumerate(words):
            if w.startswith(("tools/", "examples/")) and w.endswith(".py") and os.path.isfile(os.path.join(ROOT, w)):
                argvs.add((w,))
            if w == "-m" and i + 1 < len(words) and words[i + 1].startswith("megatron_klear."):
                if words[i + 1] != "megatron_klear.platform.launch" and runnable_module(words[i + 1]):
                    argvs.add(("-m", words[i + 1]))
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(tool_flags, sorted(argvs)))


@pytest.mark.parametrize("doc", DOCS)
def test_every_command_of_the_manual_names_what_exists(doc):
    text = _read(doc)
    errors = stray_backslashes(doc, text)
    for cmd in commands(doc, text):
        errors += [f"{cmd.where()}\n    -> {e}" for e in check(cmd)]
    assert not errors, f"{doc}: {len(errors)} problem(s):\n" + "\n".join(errors)


def test_the_manual_has_the_commands_this_test_reads():
    """The extraction finds the pages' commands: the trainer, the tools, the scripts, sbatch."""
    cmds = _all_commands()
    joined = [" ".join(c.words) for c in cmds]
    assert len(cmds) > 50, len(cmds)
    for needle in (
        "-m megatron_klear sft",
        "-m megatron_klear rl",
        "tools/check_parity.py",
        "tools/eval.py",
        "bash examples/run_gppo_qwen3_8b.sh",
        "sbatch",
        "python -m vllm.entrypoints.openai.api_server",
    ):
        assert any(needle in j for j in joined), needle


BROKEN = r"""
```bash
python tools/check_parity.py --hf-dir H --ckpt M --tolerance 1e-3
torchrun --nproc-per-node 2 -m megatron_klear rl --config examples/configs/gppo_qwen3_8b_math.yaml rollout.urlz=[http://r:31000]
python -m megatron_klear rl optim.lr=fast
bash examples/run_gppo_qwen3_8b.sh model.paht=runs/x
python tools/no_such_tool.py --x
python -m megatron_klear.sft --config x.yaml
python -m vllm.entrypoints.openai.api_server --model /ckpt/qwen3-8b-sft \
    --enable-scale-out \   # the token route
    --max-model-len 36864
sbatch --export=ALL,TRAIN_ARGS="a=1 rl.prompts=[a.jsonl,b.jsonl]" examples/slurm/gppo_qwen3_8b.sbatch
export TRAIN_ARGS="model.path=runs/x rl.promts=[a.jsonl]"
python -m sglang.launch_server --custom-weight-loader megatron_klear.rollout.in_server.sglang_delta.no_such_hook
make no-such-target
huggingface-cli download --repo-type dataset x/y --local-dir data/y
python tools/grade.py --input elsewhere/samples.jsonl --output graded.jsonl
python tools/eval.py --model m --bench x=examples/configs/no_such.jsonl --output o.json
```
"""


def test_the_checks_catch_what_breaks_a_pasted_command():
    """Each line of BROKEN has one mistake; every one is reported."""
    errors = stray_backslashes("x.md", BROKEN) + [e for c in commands("x.md", BROKEN) for e in check(c)]
    text = "\n".join(errors)
    for expected in (
        "no option --tolerance",
        "rollout.urlz",
        "optim.lr=fast",
        "model.paht",
        "tools/no_such_tool.py: no such script",
        "python -m megatron_klear.sft --help` fails",
        "a backslash before",
        "/ckpt/qwen3-8b-sft: an absolute path outside",
        "sbatch --export",
        "rl.promts",
        "defines no no_such_hook",
        "make no-such-target",
        "huggingface-cli: retired",
        "elsewhere/samples.jsonl: neither in the repository nor under",
        "examples/configs/no_such.jsonl: no such file",
    ):
        assert expected in text, f"{expected!r} not reported in:\n{text}"


def test_every_page_of_the_manual_is_in_both_indexes():
    """docs/README.md's table and the project README's list of the manual name every page."""
    pages = {os.path.basename(d) for d in DOCS if d.startswith("docs/") and not d.endswith("README.md")}
    in_docs_index = set(re.findall(r"\]\(([\w.-]+\.md)\)", _read("docs/README.md")))
    in_readme = set(re.findall(r"\]\(docs/([\w.-]+\.md)\)", _read("README.md")))
    assert not pages - in_docs_index, f"missing from docs/README.md: {sorted(pages - in_docs_index)}"
    assert not pages - in_readme, f"missing from README.md's list of the manual: {sorted(pages - in_readme)}"
