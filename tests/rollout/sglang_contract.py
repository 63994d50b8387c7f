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
        raise ContractMissing(
            f"SGLang's API contract is missing ({CONTRACT_FILE}): run make venv (tools/fetch_sglang_contract.py)"
        )
    try:
        import msgspec  # noqa: F401 -- the contract's only dependency
    except ImportError as e:
        raise ContractMissing(
            f"SGLang's API contract needs msgspec ({e}): run make venv (tools/fetch_sglang_contract.py)"
        ) from None
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


# ------------------------------------------------------------------------------------------------
# The control calls: request structs of sglang/srt/managers/io_struct.py, read as source
# ------------------------------------------------------------------------------------------------
IO_STRUCT_FILE = os.path.join(CONTRACT_DIR, "sglang", "srt", "managers", "io_struct.py")
#: route -> the struct SGLang 0.5.23's http_server.py decodes its body into
CONTROL_ROUTES = {
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
}


@functools.lru_cache(maxsize=None)
def io_structs() -> dict:
    """{struct name: {field: (annotation source, required)}} of io_struct.py, BaseReq's fields
    included (``rid``, ``http_worker_ipc``)."""
    import ast

    if not os.path.isfile(IO_STRUCT_FILE):
        raise ContractMissing(
            f"SGLang's io_struct.py is missing ({IO_STRUCT_FILE}): run make venv (tools/fetch_sglang_contract.py)"
        )
    tree = ast.parse(open(IO_STRUCT_FILE, encoding="utf-8").read())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}

    def fields(name):
        node = classes[name]
        out = {}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                out.update(fields(base.id))
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                out[stmt.target.id] = (ast.unparse(stmt.annotation), stmt.value is None)
        return out

    return {name: fields(name) for name in classes}


def _matches(annotation: str, value) -> bool:
    """Does a JSON value fit an io_struct annotation (the subset those structs use)?"""
    a = annotation.replace("typing.", "").strip()
    if a.startswith("Optional[") and a.endswith("]"):
        return value is None or _matches(a[9:-1], value)
    if a.startswith("Literal["):
        import ast

        return value in ast.literal_eval("[" + a[8:-1] + "]")
    if a.startswith(("List[", "list[")):
        inner = a[5:-1]
        return isinstance(value, list) and all(_matches(inner, v) for v in value)
    if a.startswith(("Dict[", "dict[")):
        return isinstance(value, dict)
    simple = {"str": str, "int": int, "float": (int, float), "bool": bool}
    if a in simple:
        return isinstance(value, simple[a]) and (a == "bool" or not isinstance(value, bool))
    return True  # Any, unions the tests do not exercise


def control_contract_errors(route: str, body) -> list:
    """What SGLang would refuse in a control call's body: unknown fields, missing required ones,
    values of the wrong type (empty when it passes)."""
    spec = io_structs()[CONTROL_ROUTES[route]]
    if not isinstance(body, dict):
        return [f"{route}: the body is {type(body).__name__}, not an object"]
    errors = [f"{route}: unknown field {k!r}" for k in body if k not in spec]
    errors += [f"{route}: missing required field {k!r}" for k, (_, req) in spec.items() if req and k not in body]
    errors += [
        f"{route}: {k}={body[k]!r} is not {spec[k][0]}" for k in body if k in spec and not _matches(spec[k][0], body[k])
    ]
    return errors


# ------------------------------------------------------------------------------------------------
# update_weights_from_tensor's payload: SafeUnpickler of sglang/srt/utils/common.py, read as source
# ------------------------------------------------------------------------------------------------
COMMON_FILE = os.path.join(CONTRACT_DIR, "sglang", "srt", "utils", "common.py")


@functools.lru_cache(maxsize=None)
def safe_unpickler_globals() -> frozenset:
    """``SafeUnpickler.ALLOWED_GLOBALS`` of SGLang 0.5.23: the (module, name) pairs its servers
    unpickle (``torch.storage._load_from_bytes`` is admitted too, read by ``torch.load`` with
    ``weights_only``)."""
    import ast

    if not os.path.isfile(COMMON_FILE):
        raise ContractMissing(f"SGLang's common.py is missing ({COMMON_FILE}): run make venv")
    tree = ast.parse(open(COMMON_FILE, encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "SafeUnpickler":
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and getattr(stmt.targets[0], "id", "") == "ALLOWED_GLOBALS":
                    return frozenset(ast.literal_eval(stmt.value)) | {("torch.storage", "_load_from_bytes")}
    raise ContractMissing(f"no SafeUnpickler.ALLOWED_GLOBALS in {COMMON_FILE}")


def sglang_unpickle(data: bytes):
    """``data`` unpickled as SGLang 0.5.23's server does (only its allow-listed globals)."""
    import io
    import pickle

    allowed = safe_unpickler_globals()

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) not in allowed:
                raise pickle.UnpicklingError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")
            if (module, name) == ("torch.storage", "_load_from_bytes"):
                import torch

                return lambda b: torch.load(io.BytesIO(b), weights_only=True)
            return super().find_class(module, name)

    return Unpickler(io.BytesIO(data)).load()
