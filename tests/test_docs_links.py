"""Every reference a user can follow points at something that exists: links (and their #anchors) in
README.md and docs/, repository paths they name in backticks, and the docs/ files that code,
configs and scripts cite."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(
    os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")
)
REPO_DIRS = ("megatron_klear/", "tools/", "examples/", "benchmarks/", "tests/", "docs/", "requirements/", ".ci/")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_PATH = re.compile(r"`([A-Za-z0-9_./-]+)`")
PLACEHOLDER = re.compile(r"[<>*]|N{3,}|X{3,}")


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def _anchors(rel: str) -> set:
    """GitHub's heading ids: formatting marks dropped, lower-cased, punctuation other than - and _
    dropped, spaces -> -."""
    out = set()
    for line in _read(rel).splitlines():
        m = re.match(r"#+\s+(.*)", line)
        if m:
            text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda g: g.group(1) or "", m.group(1)).strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return out


def _without_code_blocks(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


@pytest.mark.parametrize("doc", DOCS)
def test_links_and_anchors_exist(doc):
    base = os.path.dirname(doc)
    bad = []
    for target in LINK.findall(_without_code_blocks(_read(doc))):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        rel = os.path.normpath(os.path.join(base, path)) if path else doc
        if not os.path.exists(os.path.join(ROOT, rel)):
            bad.append(f"{target} (no {rel})")
        elif anchor and rel.endswith(".md") and anchor not in _anchors(rel):
            bad.append(f"{target} (no heading #{anchor} in {rel})")
    assert not bad, f"{doc}: broken links: {bad}"


@pytest.mark.parametrize("doc", DOCS)
def test_repository_paths_named_in_backticks_exist(doc):
    bad = []
    for path in CODE_PATH.findall(_without_code_blocks(_read(doc))):
        if not path.startswith(REPO_DIRS) or PLACEHOLDER.search(path):
            continue
        if not os.path.exists(os.path.join(ROOT, path.split("#")[0])):
            bad.append(path)
    assert not bad, f"{doc} names paths that do not exist: {bad}"


def test_code_configs_and_scripts_cite_only_docs_that_exist():
    bad = []
    for top in ("megatron_klear", "tools", "examples", "benchmarks", "tests"):
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if not f.endswith((".py", ".yaml", ".sh", ".md")):
                    continue
                rel = os.path.relpath(os.path.join(d, f), ROOT)
                for cited in re.findall(r"docs/[A-Za-z0-9_.-]+\.md", _read(rel)):
                    if not os.path.exists(os.path.join(ROOT, cited)):
                        bad.append(f"{rel}: {cited}")
    assert not bad, f"citations of missing docs: {bad}"


def test_the_checker_finds_a_heading_and_refuses_a_missing_one():
    assert "where-this-project-departs-from-the-authors-code" in _anchors("README.md")
    assert "no-such-heading" not in _anchors("README.md")
