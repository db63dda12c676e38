"""The embedded Redis taken over by a new owner while the old server still shuts down.

Found by the chaos run (`python -m bench.chaos --seed 1`, the API restarted from a fork server within
milliseconds of its SIGKILL): Redis deletes its pidfile early in its shutdown and its socket file last, so a
new owner that looked only at the pidfile started its server at once, and the old one then deleted the new
server's socket file: the new API's start-up failed with "No such file or directory". The owner now records
the server's pid in a file of its own and waits for that process to exit.
"""

from __future__ import annotations

import os
from pathlib import Path

import redis

from rollout_buffer.store.embedded import SERVER_PID_FILE, EmbeddedRedis


def test_a_new_owner_waits_for_the_old_server_even_once_its_pidfile_is_gone(tmp_path: Path) -> None:
    old = EmbeddedRedis(tmp_path)
    old.start()
    assert old.process is not None and (tmp_path / SERVER_PID_FILE).read_text() == str(old.process.pid)
    # the old owner dies (its lock goes with it) while its server is still up, past deleting its pidfile
    assert old._lock_fd is not None
    os.close(old._lock_fd)
    old._lock_fd = None
    (tmp_path / "redis.pid").unlink()
    new = EmbeddedRedis(tmp_path)
    try:
        new.start()
        assert new.owner, "the lock was free: the new process owns the server"
        assert old.process.poll() is not None, "the old server was stopped before the new one started"
        assert new.process is not None and new.process.pid != old.process.pid
        assert (tmp_path / SERVER_PID_FILE).read_text() == str(new.process.pid)
        with redis.Redis(unix_socket_path=str(new.socket_path), socket_timeout=5) as client:
            assert client.ping(), "the new server's socket is there and answers"
    finally:
        new.stop()
        if old.process.poll() is None:
            old.process.kill()
        old.process.wait(timeout=10)
