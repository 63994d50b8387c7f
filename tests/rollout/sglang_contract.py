"""SGLang 0.5.23's HTTP contract (``sglang/api/v1/api_types.py``: the generated types its ``/generate``
gate enforces) for the tests, loaded from ``.venv/sglang-contract`` (``make venv`` runs
``tools/fetch_sglang_contract.py``) under its own module name, without importing the ``sglang``
package (which needs CUDA)."""
from __future__ import annotations

import functools
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONTRACT_DIR = os.environ.get("SGLANG_CONTRACT_DIR", os.path.join(ROOT, ".venv", "sglang-contract"))
CONTRACT_FILE = os.path.join(CONTRACT_DIR, "sglang", "api", "v1", "api_types.py")
MODULE_NAME = "sglang_api_types_v0_5_23"


class ContractMissing(RuntimeError):
    pass


@functools.lru_cache(maxsize=None)
def load_contract():
    """The contract module (``GenerateRequest``, ``GenerateResponse``, ``SamplingParams``,
    ``JsonContractError``...)."""
    if not os.path.isfile(CONTRACT_FILE):
        raise ContractMissing(f"SGLang's API contract is missing ({CONTRACT_FILE}): run make venv "
                              "(tools/fetch_sglang_contract.py)")
    try:
        import msgspec  # noqa: F401 -- the contract's only dependency
    except ImportError as e:
        raise ContractMissing(f"SGLang's API contract needs msgspec ({e}): run make venv "
                              "(tools/fetch_sglang_contract.py)") from None
    spec = importlib.util.spec_from_file_location(MODULE_NAME, CONTRACT_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE_NAME] = module  # msgspec / dataclass machinery looks the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(MODULE_NAME, None)
        raise
    return module


def validate_generate_request(body: dict):
    """Decode a /generate body as SGLang's gate does; raises ``JsonContractError`` on a violation."""
    return load_contract().GenerateRequest.from_json_value(body)


def validate_generate_response(obj):
    """Decode a /generate answer (one object, or a list of them) as ``GenerateResponse``; returns the
    decoded list. Raises ``JsonContractError`` (or TypeError for another shape)."""
    contract = load_contract()
    items = obj if isinstance(obj, list) else [obj]
    if not isinstance(obj, (list, dict)):
        raise TypeError(f"a /generate answer is an object or a list of objects, got {type(obj).__name__}")
    return [contract.GenerateResponse.from_json_value(o) for o in items]


def contract_error(body: dict) -> str | None:
    """What SGLang's gate (``generate_contract_error``) answers for ``body``, or None when it passes."""
    try:
        validate_generate_request(body)
    except load_contract().JsonContractError as e:
        return str(e)
    return None
