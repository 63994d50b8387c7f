"""``python -m megatron_klear.rollout.embedded``: the embedded engine behind the SGLang stand-in, the
same program as ``python -m megatron_klear.rollout.sglang_standin`` (same flags). Run, not imported:
the engine package never imports its server."""

import runpy

runpy.run_module("megatron_klear.rollout.sglang_standin", run_name="__main__", alter_sys=True)
