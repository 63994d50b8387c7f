"""Nothing in the job config is silently ignored (issue 11, item 6): every key is read by the code
that runs a job (not only by the schema's own validation), or is refused when set to anything but
its default."""

import ast
import dataclasses
import os

import pytest

from megatron_klear.config import ConfigError, JobConfig, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Keys no code reads, refused at validation unless left at the default (value to try). None today:
#: rl.kl_coef, the last, was removed with the KL path nothing could reach (config.py REMOVED_KEYS);
#: a key added here needs a test that its non-default value is refused.
REFUSED_UNLESS_DEFAULT = {}
_VALIDATION = {"validate", "_validate_across_sections", "__post_init__", "from_dict", "_require"}


def _keys(obj, prefix=""):
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _keys(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def _names_read() -> set:
    """Attribute names and string constants (getattr(cfg, "x"), cfg["x"]) in the package and the
    tools, outside validation functions."""
    names = set()

    def visit(node, in_validation):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_validation = in_validation or node.name in _VALIDATION
        if not in_validation:
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)
        for child in ast.iter_child_nodes(node):
            visit(child, in_validation)

    for top in ("megatron_klear", "tools"):
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            for fn in files:
                if fn.endswith(".py"):
                    with open(os.path.join(d, fn), encoding="utf-8") as f:
                        visit(ast.parse(f.read()), False)
    return names


def test_every_config_key_is_read_somewhere():
    read = _names_read()
    unread = [k for k in _keys(JobConfig()) if k.rsplit(".", 1)[-1] not in read]
    assert sorted(unread) == sorted(REFUSED_UNLESS_DEFAULT), (
        f"config keys no code reads (silently ignored): {sorted(set(unread) - set(REFUSED_UNLESS_DEFAULT))}"
    )


@pytest.mark.parametrize("value", [0, 0.0, 0.01])
def test_a_removed_key_is_refused_by_name_with_its_reason_whatever_its_value(value):
    from megatron_klear.config import REMOVED_KEYS

    with pytest.raises(ConfigError, match=r"'rl\.kl_coef' is not a key: there is no reference-model KL term") as e:
        load_config(None, [f"rl.kl_coef={value}"])
    assert "did you mean" not in str(e.value)
    assert all(k not in {*_keys(JobConfig())} for k in REMOVED_KEYS)


def test_the_scan_sees_an_unread_key(monkeypatch):
    """The check itself: a key nobody reads is reported."""

    @dataclasses.dataclass
    class Extra:
        a_key_that_nothing_reads_xyz: int = 0

    @dataclasses.dataclass
    class Job(JobConfig):
        extra: Extra = dataclasses.field(default_factory=Extra)

    read = _names_read()
    assert [k for k in _keys(Job()) if k.rsplit(".", 1)[-1] not in read and k not in REFUSED_UNLESS_DEFAULT] == [
        "extra.a_key_that_nothing_reads_xyz"
    ]
