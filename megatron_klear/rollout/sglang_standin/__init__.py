"""The SGLang stand-in: an SGLang-compatible HTTP server (a subset of SGLang 0.5.23's native API, on
FastAPI + uvicorn as SGLang's own) in front of the embedded torch engine, for tests and CPU runs
where SGLang (CUDA only) cannot run; and its client :class:`EmbeddedHTTPEngine`, which can launch
one. What it serves, and where it is stricter than SGLang: ``docs/sglang-standin.md``.

- :mod:`.contract`: request decoding and checks against SGLang's contract, SGLang's answer shapes;
- :mod:`.scheduler`: batching requests into engine calls, pause / abort, weight updates between steps;
- :mod:`.state`: one server's state; :mod:`.plumbing`: the error gate, bodies, answers, threads;
- :mod:`.routes`: generation, health, info, pause/continue/abort, memory release/resume;
- :mod:`.weight_routes`: weights from disk and over a process group, versions, checksums;
- :mod:`.app`: the FastAPI app; :mod:`.launcher`: uvicorn, ``main``, the client and its subprocess.

``python -m megatron_klear.rollout.sglang_standin --model DIR --port P`` serves a checkpoint.
"""

from megatron_klear.rollout.sglang_standin.contract import (
    SAMPLING_FIELDS,
    BadRequest,
    ContractError,
    GenerateCall,
    completion_to_sglang,
    decode_sampling_params,
    parse_generate_request,
)
from megatron_klear.rollout.sglang_standin.launcher import (
    EmbeddedHTTPEngine,
    StandinServer,
    main,
    make_server,
    serve_in_thread,
    stop_process,
)
from megatron_klear.rollout.sglang_standin.scheduler import Job, Scheduler

__all__ = [
    "SAMPLING_FIELDS",
    "BadRequest",
    "ContractError",
    "EmbeddedHTTPEngine",
    "GenerateCall",
    "Job",
    "Scheduler",
    "StandinServer",
    "completion_to_sglang",
    "decode_sampling_params",
    "main",
    "make_server",
    "parse_generate_request",
    "serve_in_thread",
    "stop_process",
]
