"""Which process of a pre-fork server accepted a loopback connection, read from /proc: the server's end of
the connection in /proc/net/tcp gives the socket's inode, and the process holding that inode among its file
descriptors is the one serving it. Lets a test send each request to the API process it chooses."""

from __future__ import annotations

import http.client
import os
import time


def _server_inode(server_port: int, client_port: int) -> int:
    """The inode of the server's end of 127.0.0.1:client_port -> :server_port (0 while not yet accepted)."""
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            local, remote = fields[1], fields[2]
            if int(local.split(":")[1], 16) == server_port and int(remote.split(":")[1], 16) == client_port:
                return int(fields[9])
    return 0


def _holder(inode: int, pids: list[int]) -> int | None:
    target = f"socket:[{inode}]"
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                        return pid
                except OSError:
                    continue
        except OSError:
            continue
    return None


def accepted_by(conn: http.client.HTTPConnection, pids: list[int], timeout_s: float = 30.0) -> int:
    """The pid among `pids` that accepted this (connected) connection."""
    assert conn.sock is not None, "connect first"
    client_port = conn.sock.getsockname()[1]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        inode = _server_inode(conn.port, client_port)
        if inode:
            pid = _holder(inode, pids)
            if pid is not None:
                return pid
        time.sleep(0.01)
    raise AssertionError(f"no process of {pids} accepted the connection from port {client_port} in {timeout_s:g}s")


def connection_to(port: int, pid: int, pids: list[int], timeout_s: float = 60.0) -> http.client.HTTPConnection:
    """A keep-alive connection to 127.0.0.1:port that process `pid` accepted (others are opened and closed
    until one lands there)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.connect()
        if accepted_by(conn, pids, timeout_s) == pid:
            return conn
        conn.close()
    raise AssertionError(f"no connection to port {port} landed on pid {pid} in {timeout_s:g}s")
