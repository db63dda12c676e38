"""The in-sandbox forwarder: `127.0.0.1:PORT` on the sandbox's own loopback -> the model socket.

An isolated sandbox has no network but its own loopback, and agents want an ordinary `http://` base URL. This
script runs inside the sandbox, listens on the sandbox's loopback and copies bytes both ways to the unix
socket the host's model relay serves (`model_relay.py`), which lets through this rollout's model endpoints
and nothing else. Standard library only: it runs on whatever Python 3 the sandbox has, never the server's.

    python3 forwarder.py PORT SOCKET_PATH                 # serve in the foreground (a long-lived container)
    python3 forwarder.py PORT SOCKET_PATH -- ARGV...      # listen, serve from a child, exec ARGV

The second form binds before it forks, so the agent's first connection never races the forwarder's start;
the child dies with the sandbox (its pid namespace or container).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            writer.close()
        except (ConnectionError, OSError):
            pass


async def _serve_one(socket_path: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        up_reader, up_writer = await asyncio.open_unix_connection(socket_path)
    except OSError:
        writer.close()
        return
    await asyncio.gather(_copy(reader, up_writer), _copy(up_reader, writer))


async def serve(listener: socket.socket, socket_path: str) -> None:
    server = await asyncio.start_server(lambda r, w: _serve_one(socket_path, r, w), sock=listener)
    async with server:
        await server.serve_forever()


def listen(port: int) -> socket.socket:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    return listener


def main(argv: list[str]) -> None:
    port, socket_path, rest = int(argv[0]), argv[1], argv[2:]
    listener = listen(port)
    if rest and rest[0] == "--" and len(rest) > 1:
        if os.fork() == 0:  # the child serves; stdio closed so it holds no pipe of the agent's open
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            asyncio.run(serve(listener, socket_path))
            os._exit(0)
        listener.close()
        os.execvp(rest[1], rest[1:])
    asyncio.run(serve(listener, socket_path))


if __name__ == "__main__":
    main(sys.argv[1:])
