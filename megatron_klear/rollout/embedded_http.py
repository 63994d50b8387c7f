# TEMPORARY (issue 19, uncommitted): keeps old imports working while the stand-in is split; deleted at the end.
from megatron_klear.rollout.sglang_standin.contract import *  # noqa: F401,F403
