"""The client of rollout servers, written once for every family (SGLang, vLLM): each part has its
own state and is given its family's :class:`~.dialect.ServerDialect` explicitly.

- :mod:`.client`: :class:`~.client.ServerClient`, the engine composed of the parts below, and the
  :class:`~.client.Upkeep` contract a family's upkeep part fulfils;
- :mod:`.dialect`: what differs between the families' HTTP APIs (routes, bodies, answers);
- :mod:`.transport`: the synchronous HTTP client and its errors; :mod:`.call_http`: the
  event-loop HTTP client of concurrent generation;
- :mod:`.membership` and :mod:`.fleet`: the workers (listed, or asked from sglang-router), live /
  rejoining / lost;
- :mod:`.generation`: concurrent generate requests, retries, the health watchdog, stale answers;
- :mod:`.streams`: abortable streams of requests (partial rollouts);
- :mod:`.versions`: each token's weight version, the stale-answer rule;
- :mod:`.wire`: the distributed weight update's calls and the probe (a
  :class:`~megatron_klear.rollout.base.WeightWire`);
- :mod:`.update_group`: the process-group side of the weight update, shared by the trainer's sync,
  the stand-in server and vLLM's transfer engine.

A family is a dialect, an upkeep part and a :class:`~.client.ServerClient` subclass naming them
(:mod:`megatron_klear.rollout.sglang`, :mod:`megatron_klear.rollout.vllm`), plus its entry in the
table of engines (:mod:`megatron_klear.rollout.engines`).
"""
