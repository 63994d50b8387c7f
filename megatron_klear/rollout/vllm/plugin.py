"""vLLM's ``vllm.general_plugins`` entry point of this package (setup.py): registers the weight
transfer engine of :mod:`.transfer_engine` under its backend name, lazily (vLLM imports it in a
worker only when a server is started with that backend). Runs in every vLLM process; registering
twice is refused by vLLM, so an existing name is left alone."""

from __future__ import annotations

#: the backend name of :class:`~.transfer_engine.UpdateGroupTransferEngine` (``--weight-transfer-config``)
BACKEND = "megatron_klear"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "megatron_klear.rollout.vllm.transfer_engine", "UpdateGroupTransferEngine"
        )
