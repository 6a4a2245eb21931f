"""The chaos client's resends, against a loopback server that drops or refuses on purpose: a
resend after a connection the server accepted and then broke is counted apart from one after a
refused connection, so that a chaos report can tell a dropped request from a closed port."""

from __future__ import annotations

import asyncio
import time

from poise.bench.client import SendOptions, client_session, send
from poise.bench.report import Record
from poise.chaos.report import outcome
from poise.launcher import free_port

EVENTS = (
    b'data: {"choices": [{"index": 0, "text": "hi"}]}\n\n'
    b'data: {"choices": [], "usage": {"completion_tokens": 1}}\n\n'
    b"data: [DONE]\n\n"
)
ANSWER = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(EVENTS), EVENTS)
)


class DropsFirst:
    """Accepts every connection; reads the request, then closes the first ``drops`` without a
    byte of answer (as a gateway that went away mid-request) and answers the rest."""

    def __init__(self, drops: int) -> None:
        self.drops = drops
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
        if self.connections > self.drops:
            writer.write(ANSWER)
            await writer.drain()
        writer.close()
        await writer.wait_closed()


async def send_to(port: int, options: SendOptions) -> Record:
    body: dict[str, object] = {"model": "m", "prompt": "x", "max_tokens": 1, "stream": True}
    async with client_session() as session:
        url = f"http://127.0.0.1:{port}/v1/completions"
        return await send(session, url, body, {}, time.perf_counter(), options)


async def test_a_resend_after_an_accepted_connection_dropped_is_counted_as_such():
    server = DropsFirst(drops=2)
    listening = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    try:
        r = await send_to(port, SendOptions(timeout_s=10, retry_connect=True))
        assert r.completed and r.failure is None and outcome(r) == "completed"
        assert (r.connect_retries, r.drop_resends, server.connections) == (2, 2, 3)
        # Without resends the same drop is a request lost: no answer, and no error said so.
        server.drops, server.connections = 1, 0
        once = await send_to(port, SendOptions(timeout_s=10))
        assert once.failure == "dropped" and outcome(once) == "lost"
        assert (once.connect_retries, once.drop_resends, server.connections) == (0, 0, 1)
    finally:
        listening.close()
        await listening.wait_closed()


async def test_a_resend_after_a_refused_connection_is_not_a_dropped_one():
    nobody = free_port()
    r = await send_to(nobody, SendOptions(timeout_s=0.5, retry_connect=True))
    assert r.failure == "refused" and outcome(r) == "failed"
    assert r.connect_retries >= 2 and r.drop_resends == 0
