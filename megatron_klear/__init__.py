"""megatron-klear: Klear-Reasoner SFT + GPPO on Megatron-Core."""

__version__ = "0.1.0"

# third-party console noise (Apex/TE fallback notes, GPU tuning hints on CPU, ...): filtered in
# one place, before anything of ours imports Megatron-Core or transformers; KLEAR_SHOW_WARNINGS=1
# shows it all
from megatron_klear.platform.quiet import quiet_third_party as _quiet

_quiet()
del _quiet

# on a CPU, Megatron-Core's fusions are compiled at their first call rather than at its import
# (TorchDynamo and Inductor, ~3 s a process, are not imported: platform/deferred_compile.py)
from megatron_klear.platform.deferred_compile import install as _install_deferred_compile  # noqa: E402

_install_deferred_compile()
del _install_deferred_compile
