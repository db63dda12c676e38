"""The write benchmarks' load generator: `clients` keep-alive HTTP/1.1 connections posting pre-encoded
requests, each connection one request at a time, every answer read whole and its status checked.

It speaks HTTP/1.1 on asyncio streams itself rather than through aiohttp: on a 2-core machine the load
generator shares the cores with the server it measures, and aiohttp's client costs ~0.1 ms of CPU per
~48 KB request (request building, header handling, response objects), a quarter of a fast server's own
cost per write. Every side of every write row (ours, the parse-only and read-only baselines, slime's buffer)
is driven by this same generator, so the ratios compare servers, not clients.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

CLIENTS = 64


def requests(url: str, bodies: list[bytes], content_type: str = "application/json") -> list[bytes]:
    """Each body as a whole HTTP/1.1 POST to `url` (request line, headers, body)."""
    parts = urlsplit(url)
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    head = (f"POST {target} HTTP/1.1\r\nhost: {parts.netloc}\r\ncontent-type: {content_type}\r\n"
            "content-length: ").encode()
    return [b"".join([head, str(len(body)).encode(), b"\r\n\r\n", body]) for body in bodies]


async def _answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One response: its status and body (servers here always send content-length)."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = None
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if length is None:
        raise RuntimeError(f"answer without content-length: {head[:200]!r}")
    return status, await reader.readexactly(length)


async def drive(url: str, bodies: list[bytes], clients: int = CLIENTS, content_type: str = "application/json") -> float:
    """Posts every body with `clients` concurrent connections; returns the seconds it took (connections
    are opened before the clock starts). Any answer but 200 fails the run, naming it."""
    parts = urlsplit(url)
    queue = requests(url, bodies, content_type)
    queue.reverse()
    connections = [await asyncio.open_connection(parts.hostname, parts.port) for _ in range(min(clients, len(queue)))]

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while queue:
            writer.write(queue.pop())
            status, body = await _answer(reader)
            if status != 200:
                raise RuntimeError(f"{url}: {status} {body[:500]!r}")

    try:
        started = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(client(r, w) for r, w in connections)), timeout=300)
        return time.perf_counter() - started
    finally:
        for _, writer in connections:
            writer.close()
