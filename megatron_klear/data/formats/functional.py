"""`functional` test code (Python asserts) -> (call, expected) pairs the grader compares itself.

The authors run a solution concatenated with check code and count exit status 0 as a pass, so a
solution that exits early, patches ``assert``/``__eq__`` or prints a verdict passes. Here each
check becomes an expression test (rewards/code.py, ``"kind": "expr"``): setup statements plus the
call, evaluated after the solution's code in the sandbox, and the expected value, kept by the
grader and never shown to the program. Shapes read (Code-R1/rLLM ``leetcode``, KodCode pytest
files, HumanEval+; the layouts are listed in docs/data.md):

- ``def check(candidate): assert candidate(...) == 4`` with a ``check(Solution().f)`` call;
- top-level asserts and ``def test_*():`` functions (``from solution import f`` works);
- asserts ``E == LIT``, ``LIT == E``, ``E``, ``not E``, ``E is None|True|False``,
  ``E == pytest.approx(LIT)`` (the grader's float tolerance); a name bound to a literal in the same
  test counts as that literal (and its assignment is not sent to the sandbox);
- HumanEval+'s ``inputs = [...]``/``results = [...]`` lists in ``check`` with ``check(entry)``:
  function-call tests of ``entry``.

Anything else (loops, ``with pytest.raises``, an expected value that is not a literal) is refused
naming its line: such a row is reported as bad, never graded by a rule it does not follow.
"""

from __future__ import annotations

import ast
import json


class NotConvertible(ValueError):
    """Check code this module cannot turn into (call, expected) pairs; the message names the line."""


_MISSING = object()


def _literal(node, names: dict):
    """The JSON value of a literal expression (names bound to literals resolved), or _MISSING."""
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _MISSING
    return _jsonable(value)


def _jsonable(value):
    if isinstance(value, (set, frozenset)):
        try:
            value = sorted(value)
        except TypeError:
            return _MISSING
    if isinstance(value, tuple):
        value = list(value)
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return _MISSING
    return json.loads(text)


def _is_approx(node) -> bool:
    f = node.func if isinstance(node, ast.Call) else None
    return (
        f is not None
        and len(node.args) == 1
        and not node.keywords
        and ((isinstance(f, ast.Attribute) and f.attr == "approx") or (isinstance(f, ast.Name) and f.id == "approx"))
    )


def _split_assert(node: ast.Assert, names: dict):
    """(expression node, expected value) of one assert; NotConvertible otherwise."""
    t = node.test
    if isinstance(t, ast.Compare) and len(t.ops) == 1:
        left, op, right = t.left, t.ops[0], t.comparators[0]
        if isinstance(op, ast.Eq):
            for call, exp in ((left, right), (right, left)):
                if _is_approx(exp):
                    exp = exp.args[0]
                value = _literal(exp, names)
                if value is not _MISSING and _literal(call, names) is _MISSING:
                    return call, value
        if isinstance(op, ast.Is) and isinstance(right, ast.Constant) and right.value in (None, True, False):
            return left, right.value
        raise NotConvertible(f"line {node.lineno}: assert {ast.unparse(t)[:120]}: not `call == literal`")
    if isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not):
        return t.operand, False
    if isinstance(t, (ast.Call, ast.Name, ast.Attribute, ast.Subscript)):
        return t, True
    raise NotConvertible(f"line {node.lineno}: assert {ast.unparse(t)[:120]}: not a form read here")


def _expected_names(body: list) -> set:
    """Names used only on the literal side of asserts (their values stay with the grader)."""
    used_in_exprs, used_as_expected = set(), set()
    for st in body:
        if isinstance(st, ast.Assert) and isinstance(st.test, ast.Compare) and len(st.test.ops) == 1:
            for side in (st.test.left, st.test.comparators[0]):
                if isinstance(side, ast.Name):
                    used_as_expected.add(side.id)
                else:
                    used_in_exprs |= {n.id for n in ast.walk(side) if isinstance(n, ast.Name)}
        elif not isinstance(st, ast.Assign):
            used_in_exprs |= {n.id for n in ast.walk(st) if isinstance(n, ast.Name)}
    return used_as_expected - used_in_exprs


def _body_cases(body: list, prelude: list, cases: list) -> None:
    """Cases of one test body: statements before an assert are its setup."""
    hidden = _expected_names(body)
    names: dict = {}
    setup = list(prelude)
    for st in body:
        if isinstance(st, ast.Assert):
            expr, expected = _split_assert(st, names)
            src = "\n".join([*(ast.unparse(s) for s in setup), ast.unparse(expr)])
            cases.append((src, expected))
        elif (
            isinstance(st, ast.Assign)
            and len(st.targets) == 1
            and isinstance(st.targets[0], ast.Name)
            and st.targets[0].id in hidden
            and _literal(st.value, names) is not _MISSING
        ):
            names[st.targets[0].id] = _literal(st.value, names)  # an expected value: kept here
        elif isinstance(
            st, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)
        ) or (isinstance(st, ast.Expr) and not isinstance(st.value, ast.Constant)):
            setup.append(st)
        elif isinstance(st, (ast.Pass,)) or (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant)):
            continue  # pass, docstrings
        else:
            raise NotConvertible(
                f"line {st.lineno}: a {type(st).__name__} statement in a test: only "
                f"assignments, imports and asserts are read"
            )


def _humaneval(check: ast.FunctionDef, entry: str):
    assigned = {}
    for st in check.body:
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
            assigned[st.targets[0].id] = st.value
    if "inputs" not in assigned or "results" not in assigned:
        return None
    inputs, results = (_literal(assigned[k], {}) for k in ("inputs", "results"))
    if inputs is _MISSING or results is _MISSING or not isinstance(inputs, list) or not isinstance(results, list):
        raise NotConvertible(f"line {check.lineno}: check()'s inputs/results are not JSON literals")
    if len(inputs) != len(results) or not all(isinstance(x, list) for x in inputs):
        raise NotConvertible(
            f"line {check.lineno}: check() has {len(inputs)} inputs (argument lists) and {len(results)} results"
        )
    return {"inputs": inputs, "outputs": results, "fn_name": entry}


def convert(code: str) -> dict:
    """The tests (project layout) of one piece of check code; NotConvertible names what is not read."""
    if not isinstance(code, str) or not code.strip():
        raise NotConvertible("empty test code")
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        raise NotConvertible(f"line {e.lineno}: not Python ({e.msg})") from None
    prelude, cases, checks, tests_fns, check_calls = [], [], {}, [], []
    for st in tree.body:
        if isinstance(st, ast.FunctionDef) and st.name == "check" and len(st.args.args) == 1:
            checks[st.name] = st
        elif isinstance(st, ast.FunctionDef) and st.name.startswith("test"):
            tests_fns.append(st)
        elif (
            isinstance(st, ast.Expr)
            and isinstance(st.value, ast.Call)
            and isinstance(st.value.func, ast.Name)
            and st.value.func.id == "check"
            and len(st.value.args) == 1
        ):
            check_calls.append(st.value.args[0])
        elif isinstance(st, ast.If) and "__main__" in ast.unparse(st.test):
            continue  # `if __name__ == "__main__": pytest.main(...)`
        elif isinstance(st, (ast.Import, ast.ImportFrom)) and any(a.name == "pytest" for a in st.names):
            continue  # pytest.approx is read here, not run
        elif isinstance(st, ast.Assert):
            _body_cases([st], prelude, cases)
        else:
            prelude.append(st)
    check = checks.get("check")
    if check is not None:
        if len(check_calls) != 1:
            raise NotConvertible(f"line {check.lineno}: def check(...) but {len(check_calls)} check(...) calls")
        target = check_calls[0]
        if isinstance(target, ast.Name):
            he = _humaneval(check, target.id)
            if he is not None:
                return he
        param = check.args.args[0].arg
        bind = ast.parse(f"{param} = {ast.unparse(target)}").body[0]
        _body_cases(check.body, [*prelude, bind], cases)
    for fn in tests_fns:
        if fn.args.args:
            raise NotConvertible(f"line {fn.lineno}: test function {fn.name} takes fixtures")
        _body_cases(fn.body, prelude, cases)
    if not cases:
        raise NotConvertible("no asserts found")
    return {"kind": "expr", "inputs": [c[0] for c in cases], "outputs": [c[1] for c in cases]}
