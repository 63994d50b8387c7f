"""The package's layering, as docs/architecture.md states it: imports only run down the layers,
no module imports itself back through others, the engines never import the server that stands in
for SGLang, and no module grows past what a reader can hold. Read from the source (every
``import`` statement, those inside functions included), so a lazy import counts as much as a
top-level one."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "megatron_klear")
MAX_LINES = 800

# package -> the lowest layer it is in; a module may import its own layer and those below
LAYERS = {
    "platform": 0,
    "utils": 0,
    "models": 1,
    "data": 1,
    "rewards": 1,
    "checkpoint": 1,
    "training": 2,
    "evaluation": 3,
    "rollout": 3,
    "rl": 4,
    "sft": 4,
    "demo_recipe": 4,  # the demo's recipe: its evaluation runs the embedded engine
    "config": 5,
}
# modules above their package's layer: the commands (python -m megatron_klear sft|rl), which read the
# whole job config; the training loops themselves sit in their packages' layer
ENTRY_POINTS = {"megatron_klear.__main__": 6}
# (importer prefix, imported prefix) that must never exist whatever the layers say
FORBIDDEN = [
    ("megatron_klear.rollout.embedded", "megatron_klear.rollout.sglang_standin"),  # an engine and its server
    ("megatron_klear.rollout.sglang", "megatron_klear.rollout.sglang_standin"),  # the client and the stand-in
    ("megatron_klear.rollout.weight_sync", "megatron_klear.rollout.sglang_standin"),
    ("megatron_klear.rollout", "megatron_klear.training"),  # engines get weights by name, not trainer state
    # the RL side talks to engines through rollout/base.py (and the factory), never a client's parts
    ("megatron_klear.rl", "megatron_klear.rollout.sglang"),
    ("megatron_klear.rl", "megatron_klear.rollout.embedded"),
]
# leaves: (package or module, the megatron_klear modules it may import, third-party roots it must not)
LEAVES = [
    (
        "megatron_klear.rewards",
        (
            "megatron_klear.rewards",
            "megatron_klear.platform.process",
            "megatron_klear.utils.atomic",
            "megatron_klear.utils.progress",
        ),
        ("torch", "megatron"),
    ),
    ("megatron_klear.rl.losses", (), ("megatron",)),
]


def _modules() -> dict:
    out = {}
    for d, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


MODULES = _modules()


def _imports(name: str) -> set:
    """The megatron_klear modules ``name`` imports (``from pkg import sub`` counts as pkg.sub)."""
    path = MODULES[name]
    is_pkg = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_pkg else name.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for t in targets:
            while t not in MODULES and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in MODULES and t != name and t.startswith("megatron_klear"):
                found.add(t)
    return found


GRAPH = {m: _imports(m) for m in MODULES}


def _layer(module: str):
    if module in ENTRY_POINTS:
        return ENTRY_POINTS[module]
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


# inside a package: its children (subfolders and modules) -> their layer, as for the top level
SUBLAYERS = {
    "megatron_klear.rollout": {
        "base": 0,  # the interfaces and errors every engine and caller shares
        "engines": 0,  # the table of engines (builders named, not imported)
        "config": 1,
        "servers": 2,  # the client of rollout servers, written once
        "in_server": 2,  # what runs inside the servers' processes (torch and servers.update_group only)
        "embedded": 2,
        "sglang": 3,  # a family of servers: its dialect and upkeep
        "vllm": 3,
        "sglang_standin": 4,  # a server (stands in for SGLang), over the embedded engine
        "weight_sync": 4,  # the trainer's side of the weight paths
        "factory": 5,
    },
}


def _folder(module: str) -> str:
    """The package folder (or top-level module) a module belongs to: megatron_klear.rl.rollout.x -> rl."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _sibling_edges() -> dict:
    """{(child a, child b): [module arrows]} for every arrow between two children of one package, at
    every level: megatron_klear.rollout.sglang.x -> megatron_klear.rollout.weight_sync.y is the
    edge (rollout.sglang, rollout.weight_sync); rollout.factory -> rollout.sglang.engine is
    (rollout.factory, rollout.sglang)."""
    edges = {}
    for a, bs in GRAPH.items():
        for b in bs:
            pa, pb = a.split("."), b.split(".")
            k = 0
            while k < min(len(pa), len(pb)) - 1 and pa[k] == pb[k]:
                k += 1
            ea, eb = ".".join(pa[: k + 1]), ".".join(pb[: k + 1])
            if ea != eb:
                edges.setdefault((ea, eb), []).append((a, b))
    return edges


def _cycles(edges) -> list:
    """The strongly connected groups of more than one node in the graph of ``edges`` (Tarjan)."""
    graph = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_folder_imports_a_folder_that_imports_it_back_at_any_level():
    # module-level layers can hold while two folders point at each other (rl/loop.py -> config.py ->
    # rl/config.py, or once rollout/sglang/ -> rollout/weight_sync/ -> rollout/sglang/): a reader of
    # the tree then finds a folder both above and below another
    edges = _sibling_edges()
    circles = _cycles(edges)
    detail = [
        f"{' -> '.join(c)} (e.g. {next(e for (x, y), arrows in edges.items() if x in c and y in c for e in arrows)})"
        for c in circles
    ]
    assert not circles, "folders that import each other: " + "; ".join(detail)


@pytest.mark.parametrize("package", sorted(SUBLAYERS))
def test_inside_a_package_imports_only_run_down_its_layers(package):
    layers = SUBLAYERS[package]
    children = {m[len(package) + 1 :].split(".")[0] for m in MODULES if m.startswith(package + ".")}
    assert children == set(layers), f"children of {package} without a layer here: {sorted(children - set(layers))}"
    upward = [
        arrow
        for (a, b), arrows in _sibling_edges().items()
        if a.rsplit(".", 1)[0] == package == b.rsplit(".", 1)[0]
        for arrow in arrows
        if layers[a.rsplit(".", 1)[1]] < layers[b.rsplit(".", 1)[1]]
    ]
    assert not upward, f"imports running up {package}'s layers: {upward}"


def test_the_folder_checker_sees_a_cycle_below_the_top_level():
    assert _cycles({("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")}) == [["p.a", "p.b", "p.c"]]
    edges = _sibling_edges()
    assert ("megatron_klear.rollout.weight_sync", "megatron_klear.rollout.servers") in edges  # one floor down


def test_every_package_has_a_layer():
    missing = sorted({m.split(".")[1] for m in MODULES if "." in m and m not in ENTRY_POINTS} - set(LAYERS))
    assert not missing, f"packages without a layer in this test (and in docs/architecture.md): {missing}"


def test_imports_only_run_down_the_layers():
    upward = [
        (a, b)
        for a, bs in GRAPH.items()
        for b in bs
        if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a)
    ]
    assert not upward, "imports running up the layers: " + ", ".join(f"{a} -> {b}" for a, b in sorted(upward))


def test_no_import_circle():
    edges = {(a, b) for a, bs in GRAPH.items() for b in bs}
    # a package re-exporting its own submodule lazily is not a circle a reader follows
    circles = [c for c in _cycles(edges) if not all(m == min(c) or m.startswith(min(c) + ".") for m in c)]
    assert not circles, f"import circles: {circles}"


@pytest.mark.parametrize("importer,imported", FORBIDDEN)
def test_arrows_that_must_never_exist(importer, imported):
    bad = [
        (a, b)
        for a, bs in GRAPH.items()
        for b in bs
        if (a == importer or a.startswith(importer + ".")) and (b == imported or b.startswith(imported + "."))
    ]
    assert not bad, f"{bad}"


def _third_party(name: str) -> set:
    roots = set()
    for node in ast.walk(ast.parse(open(MODULES[name], encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("leaf,allowed,banned", LEAVES)
def test_leaves_stay_leaves(leaf, allowed, banned):
    members = [m for m in MODULES if m == leaf or m.startswith(leaf + ".")]
    assert members
    inward = [(m, t) for m in members for t in GRAPH[m] if not any(t == a or t.startswith(a + ".") for a in allowed)]
    assert not inward, f"{leaf} imports the package beyond {allowed}: {inward}"
    outward = [(m, r) for m in members for r in _third_party(m) if r in banned]
    assert not outward, f"{leaf} imports {banned}: {outward}"


def test_no_module_is_longer_than_a_reader_can_hold():
    long = {m: n for m, p in MODULES.items() if (n := sum(1 for _ in open(p, encoding="utf-8"))) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_checker_sees_a_known_arrow_and_its_direction():
    # the graph is not empty by accident: the loop reads the rollout manager, never the reverse
    assert "megatron_klear.rl.rollout.manager" in GRAPH["megatron_klear.rl.loop"]
    assert "megatron_klear.rl.loop" not in GRAPH["megatron_klear.rl.rollout.manager"]
    assert _layer("megatron_klear.rollout.factory") < _layer("megatron_klear.rl.loop")
    assert ("rl", "config") not in {(_folder(a), _folder(b)) for a, bs in GRAPH.items() for b in bs}
    assert "megatron_klear.rl.config" in GRAPH["megatron_klear.config"]  # the arrow that stays: down


# -- docs/architecture.md's table of rooms --------------------------------------------------------
ARCHITECTURE_MD = os.path.join(ROOT, "docs", "architecture.md")


def _rooms_table() -> dict:
    """{room folder relative to the package ("" for its top): the files its row names}."""
    import re

    rooms = {}
    for line in open(ARCHITECTURE_MD, encoding="utf-8"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| `") else []
        if len(cells) >= 3 and cells[0].startswith("`") and cells[0].endswith("/`"):
            room = cells[0].strip("`").rstrip("/")
            rooms["" if room == "megatron_klear" else room] = set(re.findall(r"`([^`]+\.py)`", cells[1]))
    return rooms


def _package_rooms() -> dict:
    out = {}
    for d, _, files in os.walk(PACKAGE):
        mods = {f for f in files if f.endswith(".py") and f != "__init__.py"}
        if mods:
            out[os.path.relpath(d, PACKAGE).replace(os.sep, "/").replace(".", "")] = mods
    return out


def test_every_module_of_the_package_is_in_the_architecture_table():
    table, package = _rooms_table(), _package_rooms()
    assert table, f"no table of rooms found in {ARCHITECTURE_MD}"
    missing = {room: sorted(files - table.get(room, set())) for room, files in package.items()}
    missing = {room: files for room, files in missing.items() if files}
    stale = {room: sorted(files - package.get(room, set())) for room, files in table.items()}
    stale = {room: files for room, files in stale.items() if files}
    assert not missing, f"modules missing from docs/architecture.md's table (room: files): {missing}"
    assert not stale, f"docs/architecture.md's table names files that do not exist (room: files): {stale}"


# -- composition: a class inherits from at most one concrete class of the package ------------------
def _classes() -> dict:
    """{module.Class: (is abstract, [base names as written])} for every class of the package."""
    out = {}
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                abstract = any(b in ("abc.ABC", "ABC") for b in bases) or any(
                    isinstance(d, ast.Name)
                    and d.id == "abstractmethod"
                    or isinstance(d, ast.Attribute)
                    and d.attr == "abstractmethod"
                    for f in node.body
                    if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                    for d in f.decorator_list
                )
                out[f"{name}.{node.name}"] = (abstract, bases)
    return out


def _built_from_several(classes: dict) -> dict:
    """{class: its concrete package bases} for the classes with more than one."""
    by_short = {}
    for full, (abstract, _) in classes.items():
        by_short.setdefault(full.rsplit(".", 1)[1], []).append(abstract)
    several = {}
    for full, (_, bases) in classes.items():
        concrete = [b for b in bases if b.split(".")[-1] in by_short and not all(by_short[b.split(".")[-1]])]
        if len(concrete) > 1:
            several[full] = concrete
    return several


def test_no_class_inherits_from_more_than_one_concrete_class_of_the_package():
    several = _built_from_several(_classes())
    assert not several, f"classes built from several concrete classes of the package (compose parts instead): {several}"


def test_the_composition_rule_sees_two_concrete_bases_and_allows_an_interface():
    classes = {
        "p.A": (False, []),
        "p.B": (False, []),
        "p.I": (True, ["abc.ABC"]),
        "p.AB": (False, ["A", "B"]),
        "p.AI": (False, ["A", "I"]),
        "p.X": (False, ["A", "dict"]),
    }
    assert _built_from_several(classes) == {"p.AB": ["A", "B"]}
    assert _classes()["megatron_klear.rollout.base.ServerEngine"][0]  # read as an interface (abstract)
