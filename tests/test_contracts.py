"""Every declared contract, checked for every implementation: a class that another module relies on
implements a protocol written down in the package (rollout/base.py, servers/client.py,
weight_sync/push.py, rl/rollout/schedules.py and placement.py), with the protocol's methods and
parameters. The implementations of the weight-push, producer, schedule and placement protocols are
found by searching the package for classes with the protocol's members (:func:`implementations`),
not listed by hand: a new path is checked the day it is written. ``isinstance`` against a
``runtime_checkable`` protocol sees only that the names exist; :func:`conforms` also checks that
each method takes the protocol's parameters (by name, or through ``**kwargs``), its positional ones
at the protocol's positions (callers pass ``step`` and ``weight_version`` by position), and asks
for nothing more."""

import importlib
import inspect
import pkgutil
import typing

import pytest

import megatron_klear
from megatron_klear.rl.rollout.partial import PartialRollouts
from megatron_klear.rl.rollout.placement import Colocated, Dedicated, Placement
from megatron_klear.rl.rollout.sampling import FullBatches
from megatron_klear.rl.rollout.schedules import OneStepAhead, Producer, Schedule, Synchronous
from megatron_klear.rollout.base import BucketPosting, ServerEngine, WeightWire
from megatron_klear.rollout.servers.client import Upkeep
from megatron_klear.rollout.servers.wire import BucketPost
from megatron_klear.rollout.sglang import SGLangEngine
from megatron_klear.rollout.vllm import VLLMEngine
from megatron_klear.rollout.weight_sync import DiskPush, DistributedWeightSync, InProcessPush, WeightPush
from megatron_klear.rollout.weight_sync.in_memory import InMemoryPush

POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _members(proto) -> dict:
    """{name: the protocol's function, or None for a data member} of ``proto`` (not its bases')."""
    out = {name: None for name in getattr(proto, "__annotations__", {})}
    for name, value in vars(proto).items():
        if not name.startswith("_") and inspect.isfunction(value):
            out[name] = value
    return out


def conforms(impl, proto) -> list:
    """What ``impl`` (a class or an instance) lacks of ``proto``: missing members, and methods that
    do not take a parameter of the protocol's, take its positional ones in another order, or
    require one it does not pass."""
    problems = []
    for name, wanted in _members(proto).items():
        if not hasattr(impl, name):
            problems.append(f"no {name}")
            continue
        if wanted is None:
            continue
        got = getattr(impl, name)
        if not callable(got):
            problems.append(f"{name} is not callable")
            continue
        have = inspect.signature(got).parameters
        if inspect.isclass(impl) and inspect.isfunction(got):  # an unbound method: drop self
            have = dict(list(have.items())[1:])
        want = dict(list(inspect.signature(wanted).parameters.items())[1:])
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in have.values())
        takes_args = any(p.kind is p.VAR_POSITIONAL for p in have.values())
        for pname, p in want.items():
            if pname not in have and not (takes_kwargs or (takes_args and p.kind is p.POSITIONAL_OR_KEYWORD)):
                problems.append(f"{name} does not take {pname}")
        # a caller passes the protocol's positional parameters by position: the same names, in order
        have_pos = [pname for pname, p in have.items() if p.kind in POSITIONAL]
        want_pos = [pname for pname, p in want.items() if p.kind in POSITIONAL]
        for i, pname in enumerate(want_pos):
            if i < len(have_pos) and have_pos[i] != pname:
                problems.append(f"{name} takes {have_pos[i]} at position {i + 1}, where callers pass {pname}")
            elif i >= len(have_pos) and not takes_args:
                problems.append(f"{name} does not take {pname} at position {i + 1}")
        for pname, p in have.items():
            required = p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
            if required and pname not in want:
                problems.append(f"{name} requires {pname}, which callers do not pass")
    return problems


def _package_classes() -> list:
    """Every class defined in a module of the package that imports here (modules that need a GPU
    extra at import are left out: none declares an implementation today)."""
    found = []
    for info in pkgutil.walk_packages(megatron_klear.__path__, "megatron_klear."):
        if info.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:
            continue
        found += [c for c in vars(module).values() if inspect.isclass(c) and c.__module__ == info.name]
    return found


PACKAGE_CLASSES = _package_classes()


def implementations(proto) -> list:
    """The package's classes that have every member of ``proto`` by name (data members as class
    attributes or annotations): the implementations the protocol's callers may be handed, found
    rather than listed, so that a new one cannot be left out of the check."""
    names = list(_members(proto))
    out = []
    for c in PACKAGE_CLASSES:
        if c is proto or getattr(c, "_is_protocol", False):
            continue
        have = set(dir(c)) | set(typing.get_type_hints(c) if hasattr(c, "__annotations__") else ())
        if all(n in have for n in names):
            out.append(c)
    return sorted(out, key=lambda c: (c.__module__, c.__qualname__))


def _ids(classes):
    return [c.__qualname__ for c in classes]


@pytest.fixture(scope="module", params=[SGLangEngine, VLLMEngine], ids=["sglang", "vllm"])
def engine(request):
    e = request.param.at(["http://127.0.0.1:9"])  # nothing is asked of the server before a call
    yield e
    e.close()


def test_every_engine_of_servers_is_a_server_engine_with_a_conforming_wire_and_upkeep(engine):
    assert isinstance(engine, ServerEngine)
    assert isinstance(engine.wire, WeightWire) and conforms(engine.wire, WeightWire) == []
    assert isinstance(engine.upkeep, Upkeep) and conforms(engine.upkeep, Upkeep) == []


def test_a_bucket_post_is_what_the_sync_waits_on():
    post = BucketPost(lambda w, path, body, timeout=None: None, ["w"], ("/p", {}), 1.0)
    assert post.result() == {} and isinstance(post, BucketPosting) and conforms(post, BucketPosting) == []


#: what each protocol's implementations must at least include (the search's own check: a protocol
#: whose member names changed would find nothing, and its test would pass on no class)
KNOWN = {
    WeightPush: {InProcessPush, DiskPush, DistributedWeightSync, InMemoryPush},
    Producer: {FullBatches, PartialRollouts},
    Schedule: {Synchronous, OneStepAhead},
    Placement: {Dedicated, Colocated},
}
CASES = [(proto, impl) for proto in KNOWN for impl in implementations(proto)]


def test_the_search_finds_every_known_implementation():
    for proto, known in KNOWN.items():
        assert known <= set(implementations(proto)), (proto.__name__, _ids(implementations(proto)))


@pytest.mark.parametrize("proto,impl", CASES, ids=[f"{p.__name__}-{c.__qualname__}" for p, c in CASES])
def test_every_implementation_found_conforms(proto, impl):
    assert conforms(impl, proto) == []


def test_the_checker_sees_a_missing_method_and_a_parameter_too_many():
    class Short:
        def update_group_layout(self):
            return []

        def leave_group(self, group_name, timeout=None, *, extra):
            """Asks for ``extra``, which no caller passes."""

    problems = conforms(Short, WeightWire)
    assert "no start_update" in problems and "leave_group requires extra, which callers do not pass" in problems
    assert not any(p.startswith("update_group_layout") for p in problems)


def test_the_checker_sees_positional_parameters_in_another_order():
    class Swapped:
        def produce(self, prompts, weight_version, step):
            """Callers pass ``(prompts, step, weight_version)``: the two ints would be swapped."""

        def cancel(self):
            """A double: the checker reads its signature only."""

        def state_dict(self):
            return {}

        def load_state_dict(self, state, /):
            """A double: the checker reads its signature only."""

    class KeywordOnly(Swapped):
        def produce(self, prompts, *, step, weight_version):
            """Takes the names, but not by position."""

    assert conforms(Swapped, Producer) == [
        "produce takes weight_version at position 2, where callers pass step",
        "produce takes step at position 3, where callers pass weight_version",
    ]
    assert conforms(KeywordOnly, Producer) == [
        "produce does not take step at position 2",
        "produce does not take weight_version at position 3",
    ]
    assert conforms(FullBatches, Producer) == []  # the same names in the protocol's order
