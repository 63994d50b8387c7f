"""Code that runs inside the inference servers' own processes (SGLang's scheduler, vLLM's workers):
it imports ``torch`` and :mod:`megatron_klear.rollout.servers.update_group` only, none of the
trainer's client side (HTTP clients, the engines, the fleet), so loading it adds little to a server.

- :mod:`.sglang_delta`: SGLang's custom weight loader for delta syncs (``rollout.sync_delta``).
"""
