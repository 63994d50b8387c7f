"""requirements/gpu-constraints.txt, the versions a GPU cluster installs together (docs/training.md,
"Installing on a GPU cluster"): its pins agree with each other, with setup.py, with what the code
checks at start-up (the torch each SGLang release pins, megatron-core's Transformer Engine range,
the torchrun flags the launch scripts pass), with the install lines the docs print, and with the
container that follows them. The error messages for a missing extra name a line that works from a
clone. Nothing is installed or downloaded: the files are read and compared."""

import ast
import os
import re
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from megatron_klear.rollout.sglang.compat import SGLANG_TORCH
from tests.test_gpu_install import _megatron_core_te, _setup_py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONSTRAINTS = "requirements/gpu-constraints.txt"
DOCKERFILE = "examples/container/Dockerfile"
# the install section of each page: from its heading to the next heading of the same level
RECIPES = {"docs/training.md": "## Installing on a GPU cluster", "README.md": "## Quick start on a GPU cluster"}
LAUNCH_SCRIPTS = ("examples/run_sft_qwen3_8b.sh", "examples/run_gppo_qwen3_8b.sh")
# The torchrun flags the launch scripts pass, and a torch whose torch/distributed/run.py was read
# and has both (the CPU venv's 2.13.0). They are not in torch 2.5-2.7: SIGUSR1/SIGUSR2 forwarding
# was asked of torchrun in 2025 (pytorch/pytorch#154849); the first release with the flags was not
# confirmed here, so the floor is the release that was read.
TORCHRUN_FLAGS = ("--signals-to-handle", "--shutdown-timeout")
TORCHRUN_FLAGS_READ_IN = Version("2.13.0")
# name==version in prose, code and comments (the version ends before punctuation or a quote)
PIN = re.compile(r"(?<![\w.-])([A-Za-z][A-Za-z0-9._-]*)==([0-9]+(?:\.[0-9A-Za-z]+)*(?:\+[0-9A-Za-z.]+)?)")


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def _requirements_file(rel: str) -> dict:
    """{canonical name: Requirement} of a requirements / constraints file (comments dropped)."""
    out = {}
    for n, line in enumerate(_read(rel).splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        assert not line.startswith("-"), f"{rel}:{n}: an option ({line}): a plain list of versions is expected"
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name not in out, f"{rel}:{n}: {name} twice"
        out[name] = req
    return out


def _pin(req: Requirement) -> str:
    """The exact version of an ``==`` pin."""
    specs = list(req.specifier)
    assert len(specs) == 1 and specs[0].operator == "==" and "*" not in specs[0].version, str(req)
    return specs[0].version


def _extras() -> dict:
    """setup.py's extras_require as {extra: [Requirement]} (literal entries and the spread GPU_EXTRAS)."""
    constants, keywords = _setup_py()
    node = keywords["extras_require"]
    out = {}
    for k, v in zip(node.keys, node.values):
        if k is None:  # **GPU_EXTRAS
            out.update(constants[v.id])
        else:
            out[ast.literal_eval(k)] = ast.literal_eval(v)
    return {extra: [Requirement(r) for r in reqs] for extra, reqs in out.items()}


def _named(reqs, name) -> Requirement:
    found = [r for r in reqs if canonicalize_name(r.name) == name]
    assert len(found) == 1, (name, [str(r) for r in reqs])
    return found[0]


def _section(rel: str, heading: str) -> str:
    text = _read(rel)
    assert heading + "\n" in text, f"{rel}: no {heading!r}"
    start = text.index(heading + "\n")
    level = heading.split(" ", 1)[0] + " "
    nxt = text.find("\n" + level, start + len(heading))
    return text[start : nxt if nxt >= 0 else len(text)]


def _pip_lines(text: str) -> list:
    """Every ``pip install`` command of a text, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.split(" #", 1)[0]
        for part in re.split(r"&&|;", line):
            m = re.search(r"\bpip install\b.*", part)
            if m:
                out.append(m.group(0).strip())
    return out


C = _requirements_file(CONSTRAINTS)


def test_the_constraints_file_pins_the_stack_without_extras_or_markers():
    assert {"torch", "megatron-core", "transformer-engine", "sglang", "sglang-router"} <= set(C), sorted(C)
    for name, req in C.items():
        assert not req.extras, f"{name}: pip refuses extras in a constraints file"
        assert req.marker is None, name
        assert req.url is None, name
    for name in ("torch", "megatron-core", "sglang", "sglang-router"):
        _pin(C[name])  # exact versions: one tested combination


def test_torch_is_the_one_the_pinned_sglang_pins():
    """The start-up check (rollout/sglang/compat.py) refuses a trainer whose torch is not the one its
    servers' SGLang pins: the constraints give the trainer exactly that torch."""
    sglang = _pin(C["sglang"])
    assert sglang in SGLANG_TORCH, f"compat.SGLANG_TORCH does not know SGLang {sglang}: {SGLANG_TORCH}"
    assert _pin(C["torch"]) == SGLANG_TORCH[sglang]


def test_the_stack_the_sglang_wheel_pins_is_the_constraints_and_the_start_up_checks():
    """Read from the pinned SGLang wheel's own METADATA (fetched with its contract by ``make venv``:
    tools/fetch_sglang_contract.py), not from the project's tables: its torch is the constraints'
    and compat.SGLANG_TORCH's, and its transformers and tokenizers are the constraints' (the trainer
    tokenises with the releases the servers detokenise with)."""
    sglang = _pin(C["sglang"])
    path = os.path.join(ROOT, ".venv", "sglang-contract", f"sglang-{sglang}.dist-info", "METADATA")
    assert os.path.isfile(path), f"{path}: missing (make venv fetches it: tools/fetch_sglang_contract.py)"
    pins = {}
    for line in open(path, encoding="utf-8"):
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None and str(req.specifier).startswith("=="):
                pins[canonicalize_name(req.name)] = str(req.specifier)[2:]
    assert pins["torch"] == _pin(C["torch"]) == SGLANG_TORCH[sglang], pins.get("torch")
    for name in ("transformers", "tokenizers"):
        assert pins[name] == _pin(C[name]), (name, pins.get(name))


def test_sglang_and_its_router_are_the_versions_of_setup_py_and_the_contract():
    extras = _extras()
    assert _pin(_named(extras["sglang"], "sglang")) == _pin(C["sglang"])
    for extra in ("sglang", "dev"):  # the servers' extra and the router the tests run
        assert _pin(_named(extras[extra], "sglang-router")) == _pin(C["sglang-router"]), extra
    cpu = _requirements_file("requirements/cpu-constraints.txt")
    assert _pin(cpu["sglang-router"]) == _pin(C["sglang-router"])
    # the wheel whose request contract the client is checked against (tools/fetch_sglang_contract.py)
    fetched = re.search(r'^SGLANG_VERSION = "([^"]+)"', _read("tools/fetch_sglang_contract.py"), re.M)
    assert fetched and fetched.group(1) == _pin(C["sglang"])


def test_megatron_core_and_transformer_engine_are_setup_pys_and_megatron_cores_own():
    constants, _ = _setup_py()
    mcore = Version(_pin(C["megatron-core"]))
    assert Requirement(constants["MEGATRON_CORE"]).specifier.contains(mcore), (constants["MEGATRON_CORE"], mcore)
    # the exact release the CPU tests run, whose metadata the TE range comes from
    assert _pin(_requirements_file("requirements/cpu-constraints.txt")["megatron-core"]) == str(mcore)
    assert Version(metadata.version("megatron-core")) == mcore
    te = C["transformer-engine"].specifier
    assert te == _megatron_core_te().specifier, (str(te), str(_megatron_core_te().specifier))
    for extra, reqs in constants["GPU_EXTRAS"].items():
        assert _named([Requirement(r) for r in reqs], "transformer-engine").specifier == te, extra
    # the range holds a TE that passes every TE version check of the model builder (fp32 THD: 2.11)
    checked = [
        Version(".".join(str(a.value) for a in node.args))
        for node in ast.walk(ast.parse(_read("megatron_klear/models/builder.py")))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "te_at_least"
    ]
    assert checked, "no te_at_least() check found in models/builder.py"
    newest = max(checked)
    assert any(te.contains(Version(f"{newest.major}.{m}.0")) for m in range(newest.minor, newest.minor + 5)), (
        str(te),
        str(newest),
    )


def test_torch_has_the_torchrun_flags_the_launch_scripts_pass():
    for script in LAUNCH_SCRIPTS:
        text = _read(script)
        for flag in TORCHRUN_FLAGS:
            assert flag in text, f"{script} no longer passes {flag}: revisit TORCHRUN_FLAGS"
    assert Version(_pin(C["torch"])) >= TORCHRUN_FLAGS_READ_IN
    import torch
    from torch.distributed.run import get_args_parser

    if Version(torch.__version__.split("+")[0]) < TORCHRUN_FLAGS_READ_IN:
        pytest.skip(f"torch {torch.__version__} is older than the release whose torchrun was read")
    args = get_args_parser().parse_args(
        ["--signals-to-handle", "SIGTERM,SIGUSR1", "--shutdown-timeout", "30", "train.py"]
    )
    assert args.signals_to_handle == "SIGTERM,SIGUSR1" and args.shutdown_timeout == 30


@pytest.mark.parametrize("doc", sorted(RECIPES))
def test_the_install_recipe_names_the_constraints_versions(doc):
    """Every name==version of the install section is the constraints' pin (vllm: setup.py's [vllm]
    extra), so the docs and the file cannot drift; the Transformer Engine range the section quotes
    is the constraints' range."""
    section = _section(doc, RECIPES[doc])
    vllm = _pin(_named(_extras()["vllm"], "vllm"))
    found = {}
    for name, version in PIN.findall(section):
        name = canonicalize_name(name)
        if name in C:
            assert version == _pin(C[name]), f"{doc}: {name}=={version}, the constraints pin {C[name]}"
        elif name == "vllm":
            assert version == vllm, f"{doc}: vllm=={version}, setup.py's [vllm] extra pins {vllm}"
        found[name] = version
    assert {"torch", "sglang", "sglang-router"} <= set(found), (doc, found)
    if doc == "docs/training.md":
        assert "vllm" in found, doc
    for m in re.finditer(r"transformer-engine\[[a-z0-9_,]+\]([<>=!~][^`\s]*)", section):
        assert Requirement("transformer-engine" + m.group(1)).specifier == C["transformer-engine"].specifier, m.group(0)


@pytest.mark.parametrize("doc", sorted(RECIPES))
def test_every_pip_line_of_the_recipe_takes_the_constraints(doc):
    """A pip line resolves with the constraints file unless it takes no dependencies (--no-deps),
    is torch from PyTorch's CUDA index at the pinned version, or is vLLM's (which pins its own torch)."""
    lines = _pip_lines(_section(doc, RECIPES[doc]))
    assert lines, doc
    for line in lines:
        if "--no-deps" in line or "vllm==" in line:
            continue
        if "--index-url" in line:
            assert f"torch=={_pin(C['torch'])}" in line, (doc, line)
            continue
        assert f"-c {CONSTRAINTS}" in line, (doc, line)
    # the trainer's line: the extras the shipped configs need, TE built against the installed torch
    trainer = [ln for ln in lines if re.search(r"-e '\.\[gpu,", ln)]
    assert trainer and all("--no-build-isolation" in ln for ln in trainer), (doc, trainer)
    assert any({"gpu", "logging", "data"} <= set(re.search(r"\[([^\]]+)\]", ln).group(1).split(",")) for ln in trainer)


def _dockerfile_torch_index() -> str:
    m = re.search(r"^ARG TORCH_INDEX_URL=(\S+)", _read(DOCKERFILE), re.M)
    assert m, f"{DOCKERFILE}: no ARG TORCH_INDEX_URL"
    return m.group(1)


def test_the_dockerfile_follows_the_recipe_with_the_constraints_file():
    text = _read(DOCKERFILE)
    lines = _pip_lines("\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
    assert lines
    for line in lines:
        assert "--no-deps" in line or f"-c {CONSTRAINTS}" in line, line
    assert re.search(rf"^COPY {re.escape(os.path.dirname(CONSTRAINTS))}/", text, re.M), "the constraints file is copied"
    for name, version in PIN.findall(text):
        name = canonicalize_name(name)
        if name in C:
            assert version == _pin(C[name]), (name, version)
    # CUDA 13 base image, Python 3.11, torch from the CUDA index the docs name, both roles
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:13\.", text, re.M)
    assert "python3.11 -m venv" in text
    assert re.search(r"^FROM \S+ AS trainer$", text, re.M) and re.search(r"^FROM \S+ AS sglang$", text, re.M)
    index = _dockerfile_torch_index()
    assert any("torch" in ln and "--index-url" in ln for ln in lines)
    for doc, heading in RECIPES.items():
        assert f"--index-url {index}" in _section(doc, heading), (doc, index)
    assert any("--no-build-isolation" in ln and "'.[gpu,logging,data]'" in ln for ln in lines)
    assert any("sglang==" in ln and "sglang-router==" in ln for ln in lines)


def _code_files():
    for top in ("megatron_klear", "tools", "examples"):
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith((".py", ".sh")):
                    yield os.path.relpath(os.path.join(d, f), ROOT)


def test_install_advice_in_the_code_names_a_line_that_works_from_a_clone():
    """No message says ``pip install 'megatron-klear[...]'`` (no registry serves that name); every
    ``pip install -e '.[extra]'`` names an extra of setup.py, and the GPU extras' lines carry what
    Transformer Engine's build needs and the constraints file."""
    extras = set(_extras())
    stale, bad = [], []
    for rel in _code_files():
        text = _read(rel)
        if "megatron-klear[" in text:
            stale.append(rel)
        joined = re.sub(r'"\s*\n\s*f?"', "", text)  # implicitly concatenated string literals
        for m in re.finditer(r"pip install[^'\n]*'\.\[([^\]]+)\]'[^\n]*", joined):
            for extra in m.group(1).split(","):
                if extra.startswith("{"):
                    continue  # formatted: checked through the builder below
                if extra not in extras:
                    bad.append(f"{rel}: [{extra}]")
                if extra.startswith("gpu") and not ("--no-build-isolation" in m.group(0) and CONSTRAINTS in m.group(0)):
                    bad.append(f"{rel}: {m.group(0)}")
    assert not stale, f"pip install 'megatron-klear[...]' in {stale}"
    assert not bad, bad


@pytest.mark.parametrize("cuda, extra", [("13.0", "gpu"), ("12.8", "gpu-cu12"), (None, "gpu")])
def test_a_missing_transformer_engine_names_the_extra_of_torchs_cuda(cuda, extra):
    from megatron_klear.models.builder import ModelOptions, resolve_backend
    from megatron_klear.platform.device_facts import DeviceFacts

    facts = DeviceFacts(cuda=cuda is not None, capability=(9, 0) if cuda else None, cuda_version=cuda)
    line = f"pip install --no-build-isolation -e '.[{extra}]' -c {CONSTRAINTS}"
    assert extra in _extras()
    with pytest.raises(ImportError, match=re.escape(line)):
        resolve_backend(ModelOptions(backend="te"), facts)
