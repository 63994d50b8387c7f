"""The real components the tests run against, where they are installed, and what a test does when
one is missing: a bare ``pytest`` skips it, but ``make test`` (``KLEAR_REQUIRE_COMPONENTS=1``, after
``make venv`` and ``make sandbox`` installed them) fails, so that a broken install never passes as
a green run with skipped tests."""

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: vLLM's CPU build (`make venv`)
VLLM_PYTHON = os.environ.get("KLEAR_VLLM_PYTHON") or os.path.join(ROOT, ".venv-vllm", "bin", "python")
REQUIRED = os.environ.get("KLEAR_REQUIRE_COMPONENTS") == "1"


def missing(reason: str, *, module_level: bool = False):
    """Skip (a bare pytest run) or fail (``make test``) for a missing real component; ``reason``
    names it and the command that installs it."""
    if REQUIRED:
        pytest.fail(f"{reason} (make test requires it: KLEAR_REQUIRE_COMPONENTS=1)", pytrace=False)
    pytest.skip(reason, allow_module_level=module_level)


def require_vllm(*, module_level: bool = False) -> None:
    if not os.path.exists(VLLM_PYTHON):
        missing(f"vLLM's CPU build is not installed ({VLLM_PYTHON}): run `make venv`", module_level=module_level)
