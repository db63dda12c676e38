"""What only a Redis Cluster shows: runs whose keys live on different nodes, the cluster flag and its errors,
callers queueing for the cluster client's connections, and every script's keys in one run's slot.

The rest of the Redis-facing suite (core API, hand-over, run lifecycle, runtime, remote protocol) also runs
on the same real 3-node cluster through the backend parameter of tests/support/backends.py.
"""

from __future__ import annotations

import asyncio
import importlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvloop
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError

import rollout_buffer
from rollout_buffer.api.app import create_app
from rollout_buffer.cli import main as cli_main
from rollout_buffer.settings import Settings
from rollout_buffer.store import keys
from rollout_buffer.store.redis_client import BoundedRedisCluster, ClusterUnavailableError, RedisModeError, display_url
from rollout_buffer.store.store import Store
from tests.support.helpers import ServerProcess, make_record, start_run, write_jsonl
from tests.support.process_tools import wait_for
from tests.support.redis_cluster import LocalRedis, LocalRedisCluster

TASKS = str(Path(__file__).parents[1] / "fixtures" / "tasks")


@pytest.fixture(scope="module")
def single_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    with LocalRedis(tmp_path_factory.mktemp("single-redis")) as server:
        yield server


# ----- the flag and its errors --------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["serve", "worker"])
def test_the_cluster_flag_needs_a_tcp_url_of_database_0(command: str, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli_main([command, "--redis-cluster"]) == 2
    assert "--redis-cluster needs --redis-url naming a node of the cluster" in capsys.readouterr().err
    monkeypatch.setenv("ROLLOUT_BUFFER_REDIS_CLUSTER", "1")  # the environment form says the same
    assert cli_main([command]) == 2
    assert "--redis-cluster needs --redis-url" in capsys.readouterr().err
    assert cli_main([command, "--redis-url", "unix:///tmp/redis.sock"]) == 2
    assert "needs a redis:// or rediss:// URL" in capsys.readouterr().err
    assert cli_main([command, "--redis-url", "redis://127.0.0.1:7000/3"]) == 2
    assert "a Redis Cluster has only database 0" in capsys.readouterr().err


def test_the_cluster_flag_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUT_BUFFER_REDIS_CLUSTER", "1")
    monkeypatch.setenv("ROLLOUT_BUFFER_REDIS_URL", "redis://10.0.0.5:7000")
    settings = Settings()
    assert settings.redis_cluster and settings.redis_url == "redis://10.0.0.5:7000"
    assert Settings(redis_url="redis://10.0.0.5:7000/0", redis_cluster=True).redis_cluster


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_a_server_in_the_other_mode_is_refused_naming_the_fix(command: str, single_redis: LocalRedis,
                                                              redis_cluster: LocalRedisCluster,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main([command, "--redis-url", single_redis.url, "--redis-cluster"]) == 2
    err = capsys.readouterr().err
    assert f"the Redis at {single_redis.url} is not in cluster mode" in err and "leave --redis-cluster" in err
    assert cli_main([command, "--redis-url", redis_cluster.node_url(2)]) == 2
    err = capsys.readouterr().err
    assert "is a Redis Cluster node (cluster_enabled:1): add --redis-cluster" in err


def test_error_messages_and_logs_show_urls_without_passwords(capsys: pytest.CaptureFixture[str]) -> None:
    assert display_url("redis://:s3cret@10.0.0.5:7000/0") == "redis://:***@10.0.0.5:7000/0"
    assert display_url("rediss://app:s3cret@cache.example:6380") == "rediss://app:***@cache.example:6380"
    assert display_url("redis://10.0.0.5:7000/0") == "redis://10.0.0.5:7000/0"
    assert cli_main(["worker", "--redis-url", "redis://:s3cret@127.0.0.1:1/0"]) == 2  # nothing listens on port 1
    err = capsys.readouterr().err
    assert "cannot reach the Redis at redis://:***@127.0.0.1:1/0" in err and "s3cret" not in err


async def test_the_app_refuses_a_server_in_the_other_mode_at_start_up(single_redis: LocalRedis,
                                                                      redis_cluster: LocalRedisCluster,
                                                                      tmp_path: Path) -> None:
    """`create_app` users (not the CLI) get the same refusal from the lifespan."""
    for url, cluster in ((single_redis.url, True), (redis_cluster.url, False)):
        app = create_app(Settings(redis_url=url, redis_cluster=cluster, data_dir=tmp_path, workers=0))
        with pytest.raises(RedisModeError):
            async with app.router.lifespan_context(app):
                pass


# ----- two runs on two nodes ----------------------------------------------------------------------------

def _runs_on_two_nodes(cluster: LocalRedisCluster) -> tuple[str, str]:
    """Two run ids whose keys live on different nodes (the first pair of candidates that do)."""
    first = "split-0"
    node = cluster.node_of_key(keys.run_meta(first))
    for n in range(1, 100):
        other = f"split-{n}"
        if cluster.node_of_key(keys.run_meta(other)) != node:
            return first, other
    raise AssertionError("no two candidate run ids on different nodes")


@pytest.fixture()
def cluster_server(redis_cluster: LocalRedisCluster, tmp_path: Path) -> Iterator[ServerProcess]:
    redis_cluster.flush()
    with ServerProcess(tmp_path / "data", "--task-dir", TASKS, "--redis-url", redis_cluster.url,
                       "--redis-cluster") as server:
        yield server


def _run_tags_by_node(cluster: LocalRedisCluster) -> dict[int, set[str]]:
    """For each node, the run ids (hash tags) of the keys it holds."""
    found: dict[int, set[str]] = {}
    for i in range(cluster.nodes):
        with cluster.client(i) as client:
            found[i] = {m.group(1) for k in client.keys("rb:{*") if (m := re.match(r"rb:\{([^}]*)\}", k.decode()))}
    return found


def test_two_runs_on_different_nodes_stay_apart_end_to_end(redis_cluster: LocalRedisCluster,
                                                           cluster_server: ServerProcess, tmp_path: Path) -> None:
    run_a, run_b = _runs_on_two_nodes(redis_cluster)
    node_a, node_b = (redis_cluster.node_of_key(keys.run_meta(r)) for r in (run_a, run_b))
    instances = [f"i{i}" for i in range(4)]
    input_file = write_jsonl(tmp_path / "input.jsonl", [{"instance_id": i, "prompt": i} for i in instances])
    with httpx.Client(base_url=cluster_server.url, timeout=30) as client:
        assert start_run(client, input_file, task_type="external", repeats=2, run_id=run_a) == run_a
        assert start_run(client, input_file, task_type="external", repeats=2, run_id=run_b) == run_b
        for iid in instances:  # interleaved: each write goes to its own run's node
            for run_id in (run_a, run_b, run_a, run_b):
                written = client.post("/buffer/write", json=make_record(iid, run_id=run_id)).json()
                assert written["success"], written
        leased = client.post("/get_rollout_data", json={"run_id": run_a, "lease_s": 60, "batch_id": "a-1"}).json()
        assert leased["success"] and len(leased["data"]["data"]) == 8
        assert {r["run_id"] for r in leased["data"]["data"]} == {run_a}
        plain = client.post("/get_rollout_data", json={"run_id": run_b, "num": 4}).json()
        assert [r["instance_id"] for r in plain["data"]["data"]] == ["i0", "i0", "i1", "i1"]
        assert {r["run_id"] for r in plain["data"]["data"]} == {run_b}

        by_node = _run_tags_by_node(redis_cluster)
        assert run_a in by_node[node_a] and run_b in by_node[node_b]
        assert all(run_a not in tags for i, tags in by_node.items() if i != node_a), "run A's keys on one node"
        assert all(run_b not in tags for i, tags in by_node.items() if i != node_b), "run B's keys on one node"

        acked = client.post("/ack", json={"run_id": run_a, "batch_id": "a-1"}).json()
        assert [r["outcome"] for r in acked["data"]["results"]] == ["acked"]
        assert set(client.get("/runs").json()["runs"]) == {run_a, run_b}
        detail_a = client.get(f"/runs/{run_a}").json()
        assert detail_a["groups"]["consumed"] == 4 and detail_a["records"]["written"] == 8
        assert detail_a["groups"]["leased"] == 0 and detail_a["leases"]["batches_acked"] == 1

        assert client.delete(f"/runs/{run_a}").json()["success"]
        assert run_a not in set().union(*_run_tags_by_node(redis_cluster).values()), "every key of run A is gone"
        rest = client.post("/get_rollout_data", json={"run_id": run_b}).json()
        assert [r["instance_id"] for r in rest["data"]["data"]] == ["i2", "i2", "i3", "i3"]
        assert client.get("/runs").json()["runs"] == [run_b]


async def test_a_node_that_lost_its_scripts_gets_them_again(redis_cluster: LocalRedisCluster) -> None:
    """Scripts are cached per node: a node restarted without them answers NOSCRIPT; the script is loaded
    again (on every primary) and only the refused calls are sent again, single calls and pipelines alike."""
    redis_cluster.flush()
    run_a, run_b = _runs_on_two_nodes(redis_cluster)
    store = await Store.open(redis_cluster.url, cluster=True)
    try:
        for run_id in (run_a, run_b):
            await store.create_run(run_id, {}, group_size=2, num_epoch=1, task_type="external")
            assert (await store.write_record(run_id, make_record("i0", uid=f"{run_id}-0"))).outcome == "stored"
        with redis_cluster.client(redis_cluster.node_of_key(keys.run_meta(run_b))) as node_b:
            node_b.script_flush()
            assert (await store.write_record(run_b, make_record("i0", uid=f"{run_b}-1"))).outcome == "completed"
            node_b.script_flush()
            outcomes = await store.write_records(run_b, [make_record("i1", uid=f"{run_b}-{n}") for n in (2, 3)])
            assert [o.outcome for o in outcomes] == ["stored", "completed"], "a pipeline of script calls"
        assert (await store.write_record(run_a, make_record("i0", uid=f"{run_a}-1"))).outcome == "completed"
        assert (await store.stats(run_b))["records_written"] == 4
    finally:
        await store.close()


# ----- connections --------------------------------------------------------------------------------------

async def test_callers_queue_for_cluster_connections_instead_of_failing(redis_cluster: LocalRedisCluster) -> None:
    redis_cluster.flush()
    store = Store.from_url(redis_cluster.url, max_connections=2, cluster=True)
    client = store.redis
    assert isinstance(client, BoundedRedisCluster)
    try:
        names = [f"q{n}" for n in range(60)]  # spread over every node's slots

        async def one(name: str) -> Any:
            await client.rpush(name, "x")
            async with client.pipeline(transaction=False) as pipe:
                pipe.llen(name)
                pipe.lindex(name, 0)
                return await pipe.execute()

        results = await asyncio.gather(*(one(name) for name in names))
        assert results == [[1, b"x"]] * len(names)
        opened = [len(node._connections) for node in client.get_nodes()]
        assert max(opened) <= 4, f"at most 2 permits x 2 connections per node: {opened}"
    finally:
        await store.close()


async def test_a_caller_that_waits_too_long_for_a_connection_gets_a_connection_error(
        redis_cluster: LocalRedisCluster) -> None:
    client = BoundedRedisCluster.from_url(redis_cluster.url, max_in_flight=1, wait_s=0.2)
    try:
        holder = asyncio.create_task(client.blpop(["never-filled"], timeout=1))  # holds the only permit
        await asyncio.sleep(0.3)
        with pytest.raises(RedisConnectionError, match="no Redis Cluster connection free"):
            await client.get("anything")
        assert await holder is None
        assert await client.get("anything") is None, "the permit is free again"
    finally:
        await client.aclose()


def test_a_connection_closed_under_a_command_is_a_lost_connection(redis_cluster: LocalRedisCluster) -> None:
    """On uvloop (what the server and workers run on), writing to a connection whose transport was closed
    meanwhile raises RuntimeError; callers see a ConnectionError (503 "retry"), and the next call reconnects."""

    def close_under_the_client(client: BoundedRedisCluster, key: str) -> None:
        for connection in client.get_node_from_key(key)._free:
            connection._writer.transport.abort()  # what a peer reset or a concurrent disconnect leaves

    async def scenario() -> None:
        client = BoundedRedisCluster.from_url(redis_cluster.url)
        try:
            await client.set("closed-under", "1")
            close_under_the_client(client, "closed-under")
            await asyncio.sleep(0.05)
            with pytest.raises(ClusterUnavailableError, match="handler is closed"):
                await client.get("closed-under")
            assert await client.get("closed-under") == b"1", "the next call reconnects"
            close_under_the_client(client, "closed-under")
            await asyncio.sleep(0.05)
            with pytest.raises(ClusterUnavailableError):
                async with client.pipeline(transaction=False) as pipe:
                    pipe.get("closed-under")
                    await pipe.execute()
            assert await client.get("closed-under") == b"1"
        finally:
            await client.aclose()

    redis_cluster.flush()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())


# ----- every script's keys in one run's slot --------------------------------------------------------------

@pytest.mark.parametrize("run_id", ["run-1", "a.b_c-d", "math-3f2a.r2", "x" * 128])
def test_every_key_of_a_run_is_in_one_slot(run_id: str) -> None:
    slots = {key_slot(k.encode()) for k in keys.run_keys(run_id)}
    assert slots == {key_slot(run_id.encode())}, "the run id is the hash tag of every run key"
    for global_key in (keys.RUNS, keys.ACTIVE_RUN, keys.RUN_EVENTS, keys.REMOTE_INDEX, keys.REMOTE_OPEN):
        assert "{" not in global_key


def _scripts() -> dict[str, str]:
    """Every Lua script of the package: the module-level strings that call Redis, in every module whose
    source does (so a module added later is checked too)."""
    package = Path(rollout_buffer.__file__).parent
    found: dict[str, str] = {}
    for path in sorted(package.rglob("*.py")):
        if "redis.call(" not in path.read_text():
            continue
        module = importlib.import_module(".".join(("rollout_buffer", *path.relative_to(package).with_suffix("").parts)))
        found.update({f"{module.__name__}.{name}": value for name, value in vars(module).items()
                      if isinstance(value, str) and "redis.call(" in value and "return" in value})
    return found


_KEY_ARG = re.compile(r"^(KEYS\[\d+\]|k_\w+)$")
_MULTI_KEY = {"DEL", "UNLINK", "EXISTS", "TOUCH"}


def test_every_script_touches_only_keys_it_declares() -> None:
    """What a cluster requires of a script: every key it touches comes from KEYS (so the client routes it and
    the server checks that all of them share one slot); no key name is built inside a script."""
    scripts = _scripts()
    for expected in ("rollout_buffer.store.store.WRITE_RECORD", "rollout_buffer.runtime.jobqueue._ENQUEUE",
                     "rollout_buffer.remote.state._CLAIM"):
        assert expected in scripts, sorted(scripts)
    for name, source in scripts.items():
        assert "rb:" not in source, f"{name} builds a key name"
        for command, args in re.findall(r"redis\.p?call\('([A-Z]+)'((?:, *[^,)]+)*)\)?", source):
            arguments = [a.strip() for a in args.split(",") if a.strip()]
            key_args = arguments if command in _MULTI_KEY else arguments[:1]
            for arg in key_args:
                assert _KEY_ARG.match(arg), f"{name}: {command} on {arg!r}, not a declared key"
        # helper functions take keys as k_* parameters: every call passes declared keys there
        for function, params in re.findall(r"local function (\w+)\(([^)]*)\)", source):
            positions = [i for i, p in enumerate(params.split(",")) if p.strip().startswith("k_")]
            for call in re.findall(rf"(?<!function ){function}\(([^()]*)\)", source):
                arguments = [a.strip() for a in call.split(",")]
                for i in positions:
                    assert _KEY_ARG.match(arguments[i]), f"{name}: {function}() gets {arguments[i]!r} as a key"


# ----- a node going away ----------------------------------------------------------------------------------


async def _callers_see_lost_connections(cluster: LocalRedisCluster, run_id: str) -> None:
    """CLUSTERDOWN reaches callers as a ConnectionError, from commands and from pipelines alike."""
    store = Store.from_url(cluster.node_url(2), cluster=True)
    try:
        async with store.redis.pipeline(transaction=False) as pipe:
            pipe.hget(keys.run_meta(run_id), "status")
            pipe.llen(keys.ready(run_id))
            replies = await pipe.execute(raise_on_error=False)
        assert [type(reply) for reply in replies] == [ClusterUnavailableError] * 2, replies
        assert "ClusterDownError" in str(replies[0])
        with pytest.raises(RedisConnectionError):
            await store.redis.hget(keys.run_meta(run_id), "status")
    finally:
        await store.close()


def test_a_dead_node_answers_503_retry_and_the_buffer_recovers_with_it(tmp_path: Path) -> None:
    """A node of its own cluster (the shared one stays whole) is killed: requests for its run answer 503
    "retry" (a lost node, then CLUSTERDOWN everywhere once the others mark it failed), never a 500 or a hang;
    when it comes back, so does the buffer, with everything acknowledged before."""
    instances = ["i0", "i1"]
    input_file = write_jsonl(tmp_path / "input.jsonl", [{"instance_id": i, "prompt": i} for i in instances])
    with LocalRedisCluster(tmp_path / "cluster", node_timeout_ms=1000, durable=True) as cluster, \
            ServerProcess(tmp_path / "data", "--task-dir", TASKS, "--workers", "0", "--redis-url", cluster.url,
                          "--redis-cluster") as server, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        run_id, elsewhere = (next(r for r in (f"fault-{n}" for n in range(100)) if cluster.node_of_key(keys.run_meta(r))
                                  == node) for node in (1, 2))
        for run in (elsewhere, run_id):
            assert start_run(client, input_file, task_type="external", repeats=1, run_id=run) == run
            assert client.post("/buffer/write", json=make_record("i0", run_id=run)).json()["success"]

        cluster.kill(1)
        down = client.post("/buffer/write", json=make_record("i1", run_id=run_id))
        assert down.status_code == 503 and "redis unavailable; retry" in down.json()["message"], down.text
        assert client.get("/health").status_code == 503, "a primary that does not answer makes the buffer unhealthy"
        wait_for(lambda: cluster.state(0) == cluster.state(2) == "fail", 20, "the cluster marked failed")
        answers = [client.post("/get_rollout_data", json={"run_id": elsewhere}),  # live nodes say CLUSTERDOWN
                   client.post("/buffer/write", json=make_record("i1", run_id=elsewhere))]
        for answer in answers:
            assert answer.status_code == 503 and "redis unavailable; retry" in answer.json()["message"], answer.text
        asyncio.run(_callers_see_lost_connections(cluster, elsewhere))

        cluster.restart(1)
        wait_for(lambda: client.get("/health").status_code == 200, 30, "the buffer healthy again")
        retried = client.post("/buffer/write", json=make_record("i1", run_id=run_id))
        assert retried.status_code == 200 and retried.json()["success"], retried.text
        read = client.post("/get_rollout_data", json={"run_id": run_id}).json()
        assert sorted(r["instance_id"] for r in read["data"]["data"]) == instances, "nothing acknowledged was lost"
        assert [r["instance_id"] for r in client.post("/get_rollout_data", json={"run_id": elsewhere}).json()
                ["data"]["data"]] == ["i0"]
