"""The generation client's connection shards (rollout/sglang/generation.py ShardedClient): requests
spread over clients of CONNECTIONS_PER_CLIENT connections each, a new shard only when every one is
full, never more than the call's connections allow."""

import asyncio

import httpx

from megatron_klear.rollout.sglang.generation import CONNECTIONS_PER_CLIENT, ShardedClient


def _run(requests: int, connections: int):
    seen = []

    async def main():
        release = asyncio.Event()

        async def handler(request):
            await release.wait()
            return httpx.Response(200, json={"n": int(request.url.params["k"])})

        async with ShardedClient(connections, transport=httpx.MockTransport(handler)) as client:
            tasks = [asyncio.ensure_future(client.post(f"http://w/generate?k={k}", json={})) for k in range(requests)]
            await asyncio.sleep(0.05)
            seen.append(list(client.in_flight))
            release.set()
            answers = await asyncio.gather(*tasks)
            seen.append(list(client.in_flight))
        return [a.json()["n"] for a in answers]

    return asyncio.run(main()), seen


def test_requests_spread_over_small_shards_opened_as_needed():
    answers, (during, after) = _run(100, 2 * 512 + 8)
    assert answers == list(range(100))
    assert len(during) == -(-100 // CONNECTIONS_PER_CLIENT) and max(during) <= CONNECTIONS_PER_CLIENT
    assert sum(during) == 100 and after == [0] * len(during)
    _, (during, _) = _run(100, 40)  # at most 3 shards for 40 connections: they share them
    assert len(during) == 3 and sum(during) == 100
