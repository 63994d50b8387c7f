"""The generation client's HTTP side (rollout/servers/call_http.py) against raw TCP servers that
misbehave on purpose: the pool's bound, answers matched to their requests, and every way of not
answering mapped to what the client does with it (gone: probe and resend; no answer in time: the
generate timeout's error)."""

import asyncio
import contextlib
import json

import pytest

from megatron_klear.platform.process import free_port
from megatron_klear.rollout.servers.call_http import CallHTTP, HTTPFailure, NoAnswerInTime


async def _serve(behaviour):
    """A TCP server on 127.0.0.1 running ``behaviour(body, writer)`` for each request; returns
    (server, url)."""

    async def handle(reader, writer):
        # a client that closes its connection (or a request cut short) ends this connection's loop
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lengths = [
                    int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length")
                ]
                length = lengths[0] if lengths else 0
                body = json.loads(await reader.readexactly(length)) if length else None
                if not await behaviour(body, writer):
                    break
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def _answer(writer, status: int, payload) -> None:
    data = json.dumps(payload).encode()
    writer.write(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % (status, len(data)))
    writer.write(data)


def _http(**kw) -> CallHTTP:
    return CallHTTP(kw.pop("connections", 8), read_timeout=kw.pop("read_timeout", 30), connect_timeout=5, headers={})


def test_requests_share_a_bounded_pool_and_get_their_own_answers():
    async def main():
        open_now, most, release = [0], [0], asyncio.Event()

        async def echo(body, writer):
            open_now[0] += 1
            most[0] = max(most[0], open_now[0])
            await release.wait()
            open_now[0] -= 1
            _answer(writer, 200, {"k": body["k"]})
            await writer.drain()
            return True

        server, url = await _serve(echo)
        async with server, _http(connections=4) as http:
            tasks = [asyncio.ensure_future(http.post(url + "/generate", {"k": k})) for k in range(10)]
            await asyncio.sleep(0.3)
            during = most[0]
            release.set()
            answers = await asyncio.gather(*tasks)
        return during, most[0], [(a.status_code, a.json()["k"]) for a in answers]

    during, most, answers = asyncio.run(main())
    assert during == 4 and most == 4  # never more connections than the pool allows
    assert answers == [(200, k) for k in range(10)]


def test_an_error_status_is_an_answer_with_its_text():
    async def main():
        async def refuse(body, writer):
            _answer(writer, 503, {"error": {"message": "busy"}})
            return True

        server, url = await _serve(refuse)
        async with server, _http() as http:
            return await http.post(url + "/generate", {})

    a = asyncio.run(main())
    assert a.status_code == 503 and a.json() == {"error": {"message": "busy"}}


@pytest.mark.parametrize("how", ["closed", "cut"])
def test_no_answer_at_all_is_gone(how):
    async def main():
        async def hang_up(body, writer):
            if how == "cut":  # half an answer, then the connection closes
                writer.write(b'HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{"text":')
                await writer.drain()
            return False

        server, url = await _serve(hang_up)
        async with server, _http() as http:
            await http.post(url + "/generate", {})

    with pytest.raises(HTTPFailure) as e:
        asyncio.run(main())
    assert e.value.gone


def test_a_refused_connection_is_gone():
    port = free_port()  # a port nobody listens on

    async def main():
        async with _http() as http:
            await http.post(f"http://127.0.0.1:{port}/generate", {})

    with pytest.raises(HTTPFailure) as e:
        asyncio.run(main())
    assert e.value.gone and "Connect" in str(e.value)


def test_silence_past_the_read_timeout_and_a_probe_past_its_own():
    async def main():
        async def silent(body, writer):
            await asyncio.sleep(30)
            return False

        server, url = await _serve(silent)
        loop = asyncio.get_running_loop()
        async with server, _http(read_timeout=0.3) as http:
            t = loop.time()
            with pytest.raises(NoAnswerInTime):
                await http.post(url + "/generate", {})
            read = loop.time() - t
            t = loop.time()
            with pytest.raises(NoAnswerInTime):
                await http.aside("GET", url + "/health", 0.2)
            probe = loop.time() - t
        return read, probe

    read, probe = asyncio.run(main())
    assert 0.25 < read < 5 and 0.15 < probe < 5
