"""megatron-klear: Klear-Reasoner SFT + GPPO on Megatron-Core."""

__version__ = "0.1.0"

# third-party console noise (Apex/TE fallback notes, GPU tuning hints on CPU, ...): filtered in
# one place, before anything of ours imports Megatron-Core or transformers; KLEAR_SHOW_WARNINGS=1
# shows it all
from megatron_klear.platform.quiet import quiet_third_party as _quiet

_quiet()
del _quiet
