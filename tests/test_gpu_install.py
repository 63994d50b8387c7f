"""The GPU install: setup.py's ``[gpu]`` extras pin the Transformer Engine range that the installed
megatron-core pins in its own metadata, megatron-core itself is pinned to the release the project
reads, and the install lines in README.md and docs/training.md say what TE's build needs.

setup.py is read with ``ast`` (its module-level constants), never run: running it would call
``setup()``."""

import ast
import os
import re
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup_py():
    """setup.py's module-level literal constants, and the keyword nodes of its ``setup()`` call."""
    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    constants, call = {}, None
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                constants[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue  # computed, not a literal: no pin the test compares
        elif (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", "") == "setup"
        ):
            call = node.value
    assert call is not None, "setup.py: no setup() call at module level"
    return constants, {k.arg: k.value for k in call.keywords}


def _requirement(reqs, name):
    found = [r for r in reqs if r.name.lower().replace("_", "-") == name]
    assert len(found) == 1, f"{name}: {found}"
    return found[0]


def _megatron_core_te():
    """The transformer-engine requirement of the installed megatron-core's metadata."""
    reqs = [Requirement(r) for r in metadata.requires("megatron-core") or []]
    te = {str(r.specifier): r for r in reqs if r.name.lower().replace("_", "-") == "transformer-engine"}
    assert len(te) == 1, f"megatron-core's metadata pins transformer-engine more than one way: {sorted(te)}"
    return next(iter(te.values()))


def test_gpu_extras_pin_what_megatron_core_pins():
    constants, _ = _setup_py()
    extras = constants["GPU_EXTRAS"]
    theirs = _megatron_core_te()
    assert {"core_cu13", "pytorch"} <= theirs.extras  # what the cu12 / cu13 split below assumes
    for extra, core in (("gpu", "core_cu13"), ("gpu-cu12", "core_cu12")):
        ours = _requirement([Requirement(r) for r in extras[extra]], "transformer-engine")
        assert ours.specifier == theirs.specifier, (extra, str(ours.specifier), str(theirs.specifier))
        assert ours.extras == {core, "pytorch"}, (extra, ours.extras)
        assert ours.marker is None
    # the CUDA 13 extra is megatron-core's own choice, extras and range alike
    assert _requirement([Requirement(r) for r in extras["gpu"]], "transformer-engine").extras == theirs.extras
    # no flash-attn: cuDNN fused attention takes THD and context parallelism (docs/training.md)
    assert not any(Requirement(r).name == "flash-attn" for reqs in extras.values() for r in reqs)


def test_megatron_core_is_pinned_to_the_installed_release_line():
    constants, keywords = _setup_py()
    pin = Requirement(constants["MEGATRON_CORE"])
    assert pin.name == "megatron-core"
    installed = Version(metadata.version("megatron-core"))
    assert pin.specifier.contains(installed), (str(pin.specifier), str(installed))
    # a later minor release (another TE pin, other internals) is outside the range
    nxt = Version(f"{installed.major}.{installed.minor + 1}.0")
    assert not pin.specifier.contains(nxt), str(pin.specifier)
    # setup() uses the constants, not copies of them
    names = {n.id for n in ast.walk(keywords["install_requires"]) if isinstance(n, ast.Name)}
    assert "MEGATRON_CORE" in names
    spread = [v for k, v in zip(keywords["extras_require"].keys, keywords["extras_require"].values) if k is None]
    assert any(isinstance(v, ast.Name) and v.id == "GPU_EXTRAS" for v in spread)


@pytest.mark.parametrize("doc", ["README.md", "docs/training.md"])
def test_install_lines_build_te_without_isolation(doc):
    """TE's PyTorch part compiles against the installed torch: every documented line that installs a
    GPU extra (alone or with others, ``'.[gpu,logging,data]'``) passes --no-build-isolation and the
    constraints file; docs/training.md has a line for each GPU extra, README.md for ``[gpu]``; the
    text says which CUDA each one targets."""
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        text = f.read()
    constants, _ = _setup_py()
    wanted = list(constants["GPU_EXTRAS"]) if doc == "docs/training.md" else ["gpu"]
    for extra in constants["GPU_EXTRAS"]:
        lines = [
            ln
            for ln in text.splitlines()
            if any(extra in m.split(",") for m in re.findall(r"pip install .*'\.\[([^\]]+)\]'", ln))
        ]
        assert lines or extra not in wanted, f"{doc}: no install line for .[{extra}]"
        assert all("--no-build-isolation" in ln for ln in lines), (doc, lines)
        assert all("-c requirements/gpu-constraints.txt" in ln for ln in lines), (doc, lines)
    assert "core_cu13" in text and "core_cu12" in text, doc
