"""The disk bound of a container whose root is writable (Harbor tasks: `image_root`): `limits.disk_mb`.

The Engine's own quota (`StorageOpt size`) is used where its storage driver has one (overlay2 on xfs with
`pquota`, devicemapper, btrfs, zfs): the first such container on an Engine asks for it, and a refusal that
names the option is remembered for that Engine, whose containers then go without it. Without the quota the
agent's command is watched instead: every `CHECK_S` the Engine reports the container's writable layer
(`SizeRw`), and past the bound the command is stopped (`stopped_by: "disk_mb"`): a fast writer overshoots by
what it writes in that time. The bound counts from what the layer held when the command started (the work
folder handed to the agent user is copied up into it), as the bwrap backend's does. The tmpfs folders (home,
/tmp, /dev/shm) are bounded by the kernel, each to `disk_mb`, either way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiodocker.exceptions import DockerError

CHECK_S = 2.0
_supported: dict[str, bool] = {}  # Engine URL -> whether it takes StorageOpt size


def with_quota(spec: dict[str, Any], disk_mb: int) -> dict[str, Any]:
    """The create body with the Engine's quota on the container's writable layer."""
    return {**spec, "HostConfig": {**spec["HostConfig"], "StorageOpt": {"size": f"{disk_mb}m"}}}


def is_quota_refusal(exc: Exception) -> bool:
    """Whether a create failed because the storage driver has no quota (then it is retried without one)."""
    text = str(exc).lower()
    return "storage-opt" in text or "storageopt" in text or "storage opt" in text or "quota" in text


async def create(docker: Any, spec: dict[str, Any], name: str, disk_mb: int, url: str) -> tuple[Any, bool]:
    """Create a container with a writable root: (the container, whether it must be watched: no quota)."""
    if _supported.get(url, True):
        try:
            container = await docker.containers.create(with_quota(spec, disk_mb), name=name)
            _supported[url] = True
            return container, False
        except DockerError as exc:
            if not is_quota_refusal(exc):
                raise
            _supported[url] = False
    return await docker.containers.create(spec, name=name), True


async def writable_bytes(container: Any) -> int:
    """The bytes in the container's writable layer, as the Engine counts them (`SizeRw`)."""
    info = await container.show(size=1)
    return int(info.get("SizeRw") or 0)


async def watch(pump: asyncio.Future[Any], timeout_s: float, size: Callable[[], Awaitable[int]] | None,
                disk_mb: int | None) -> str | None:
    """Wait for a command's output to end: None when it did, "deadline" at `timeout_s`, "disk_mb" once the
    writable layer (`size`, when given) grew past `disk_mb` (counted from its size now, if that is more)."""
    deadline = time.monotonic() + timeout_s
    cap = max(disk_mb << 20, await size()) if size is not None and disk_mb else 0
    while not pump.done():
        left = deadline - time.monotonic()
        if left <= 0:
            return "deadline"
        await asyncio.wait([pump], timeout=min(left, CHECK_S) if cap else left)
        if cap and not pump.done() and await size() > cap:  # type: ignore[misc]
            return "disk_mb"
    pump.result()  # the output's own failure, if any
    return None
