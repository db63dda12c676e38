"""Input roots and outbound URLs: `/start_rollout` reads no file outside `--input-root` (default: the
directory the server started in) and says the same thing for a file outside the roots, a symlink out of
them, a `../` escape and a missing file; tokenizer paths follow the same rule and hub names are read from
the local cache only; `--allow-url` restricts the URLs the server calls."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest

from rollout_buffer.security.access import AccessDenied, AccessPolicy, url_allowed
from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir
from tests.support.helpers import REPO, ServerSpec, write_jsonl
from tests.support.runtime_helpers import LEGACY_TASKS

ALLOWED = "http://127.0.0.1:9/ok"


# started in the root folder with no --input-root: the default root is that folder
SERVER = ServerSpec(args=("--task-dir", LEGACY_TASKS, "--allow-url", ALLOWED), cwd_fixture="layout",
                    data_dir=".rb-data", env={"ROLLOUT_BUFFER_INPUT_ROOT": "", "PYTHONPATH": str(REPO)})


def refusal(path: str, root: Path) -> str:
    """The refusal of a loopback server (these tests' server): one text for every reason, naming the roots."""
    return (f"input_file: {path!r} is not a readable file under the server's input roots ({root.resolve()}; add a "
            "folder with --input-root)")


def tokenizer_refusal(name: str) -> str:
    return (f"tokenizer_path: {name!r}: no tokenizer folder under the server's input roots (--input-root) and no "
            "hub model of that name in its local cache (downloads: --allow-hub-downloads)")


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A root folder (the server's working directory) with a good file, a symlink out and a folder; an
    outside folder with a readable JSONL file."""
    base = tmp_path_factory.mktemp("access")
    root, outside = base / "root", base / "outside"
    root.mkdir()
    outside.mkdir()
    rows = [{"instance_id": f"a{i}", "prompt": f"What is {i} + 1?", "label": str(i + 1)} for i in range(3)]
    write_jsonl(root / "data.jsonl", rows)
    write_jsonl(outside / "secret.jsonl", rows)
    (root / "to_passwd").symlink_to("/etc/passwd")
    (root / "to_secret").symlink_to(outside / "secret.jsonl")
    (root / "to_tokenizer").symlink_to(qwen_tokenizer_dir("qwen2.5"))
    (root / "folder").mkdir()
    return {"base": base, "root": root, "outside": outside}


def start(client: httpx.Client, **body: object) -> httpx.Response:
    payload = {"task_type": "slime_style", "num_repeat_per_sample": "2", "num_epoch": "1", "num_process": "2",
               **body}
    return client.post("/start_rollout", json=payload)


@pytest.mark.parametrize("task_type", ["slime_style", "math"])
def test_files_outside_the_roots_and_missing_files_get_one_refusal(client: httpx.Client, layout: dict[str, Path],
                                                                   task_type: str) -> None:
    root, outside = layout["root"], layout["outside"]
    names = ["/etc/passwd", str(root / "to_passwd"), "to_passwd", str(root / "to_secret"),
             str(outside / "secret.jsonl"), "../outside/secret.jsonl", str(root / ".." / "outside" / "secret.jsonl"),
             str(root / "missing.jsonl"), "missing.jsonl", "/no/such/dir/x.jsonl", str(root / "folder"),
             "folder/../../outside/secret.jsonl", "/etc", "~/.bashrc"]
    for name in names:
        answer = start(client, task_type=task_type, input_file=name, remote_engine_url=ALLOWED,
                       tokenizer_path=str(root / "to_tokenizer"))
        assert answer.status_code == 403, (name, answer.text)
        body = answer.json()
        assert body["message"] == refusal(name, root), "one text, whatever the reason"
        assert body["errors"] == [{"field": "input_file", "message": refusal(name, root)}]
    assert client.get("/runs").json() == {"runs": [], "active_run": None}, "nothing stored"


def test_a_file_under_the_default_root_is_read(client: httpx.Client, layout: dict[str, Path]) -> None:
    answer = start(client, input_file="data.jsonl", run_id="inside-root")
    assert answer.status_code == 200, answer.text
    config = client.get("/runs/inside-root").json()["config"]
    assert config["input_file"] == str((layout["root"] / "data.jsonl").resolve()), "the real path is what is read"
    assert client.delete("/runs/inside-root").status_code == 200


def test_tokenizer_paths_follow_the_roots_and_hub_names_stay_offline(client: httpx.Client,
                                                                     layout: dict[str, Path]) -> None:
    root = layout["root"]
    outside_tokenizer = str(qwen_tokenizer_dir("qwen2.5"))
    for name in (outside_tokenizer, str(root / "to_tokenizer"), "to_tokenizer", "/etc", str(root / "nothing"),
                 "./nothing", "Qwen/Not-A-Cached-Model-xyz", "not/a/hub/name", "../outside"):
        answer = start(client, task_type="math", input_file="data.jsonl", remote_engine_url=ALLOWED,
                       tokenizer_path=name)
        assert answer.status_code == 403, (name, answer.text)
        assert answer.json()["message"] == tokenizer_refusal(name)
    assert client.get("/runs").json()["runs"] == []


def test_outbound_urls_outside_allow_url_are_refused(client: httpx.Client, layout: dict[str, Path]) -> None:
    for url in ("http://127.0.0.1:9/other", "http://127.0.0.1:10/ok", "http://localhost:9/ok",
                "http://127.0.0.1:9/ok2", "http://127.0.0.1:9@evil.example/ok", "https://127.0.0.1:9/ok",
                "http://127.0.0.1:9/ok/../admin"):
        answer = start(client, task_type="math", input_file="data.jsonl", remote_engine_url=url,
                       tokenizer_path="to_tokenizer")
        assert answer.status_code == 403, (url, answer.text)
        assert answer.json()["errors"][0]["field"] == "remote_engine_url"
        assert "--allow-url" in answer.json()["message"]
    init = {"rollout_id": "r-not-allowed", "server_url": "http://127.0.0.1:9/elsewhere",
            "messages": [{"role": "user", "content": "hi"}], "tokenizer_name": "Qwen/Qwen2.5-7B-Instruct",
            "task_type": "math"}
    answer = client.post("/init", json=init)
    assert answer.status_code == 403 and answer.json()["errors"][0]["field"] == "server_url", answer.text
    answer = client.post("/init", json={**init, "server_url": ALLOWED, "tokenizer_name": "/etc"})
    assert answer.status_code == 403 and answer.json()["errors"][0]["field"] == "tokenizer_name", answer.text
    assert client.get("/init/r-not-allowed").status_code == 404, "nothing started, nothing stored"
    assert client.get("/runs").json()["runs"] == []


def test_url_prefix_rules() -> None:
    assert url_allowed("http://10.0.0.5:30000", "http://10.0.0.5:30000")
    assert url_allowed("http://10.0.0.5:30000/generate", "http://10.0.0.5:30000/")
    assert url_allowed("http://Node-1:80/v1/x", "http://node-1/v1")
    assert url_allowed("https://h/v1", "https://h:443/v1")
    for url in ("http://10.0.0.5:300001", "http://10.0.0.5:30000@evil:1", "http://user:pw@10.0.0.5:30000",
                "ftp://10.0.0.5:30000", "http://10.0.0.5:3000", "http://10.0.0.50:30000", "not a url",
                "http://10.0.0.5:notaport"):
        assert not url_allowed(url, "http://10.0.0.5:30000"), url
    assert not url_allowed("http://h/v10", "http://h/v1") and not url_allowed("http://h/", "http://h/v1")
    assert not url_allowed("http://h/v1/../admin", "http://h/v1")
    policy = AccessPolicy(roots=(Path("/"),), allowed_urls=())
    policy.url("remote_engine_url", "http://anything:1")  # no prefix: any URL
    with pytest.raises(ValueError, match="--allow-url"):
        AccessPolicy.from_settings(type("S", (), {"input_root": [], "allow_url": ["10.0.0.5:30000"],
                                                 "allow_hub_downloads": False})())


def test_policy_units(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "f.jsonl").write_text("{}\n")
    (root / "tok").mkdir()
    policy = AccessPolicy(roots=(root.resolve(),))
    assert policy.input_file(str(root / "sub" / ".." / "sub" / "f.jsonl")) == str((root / "sub" / "f.jsonl").resolve())
    for bad in ("", "x\x00y", str(root), str(tmp_path)):
        with pytest.raises(AccessDenied):
            policy.input_file(bad)
    with pytest.raises(AccessDenied, match=r"input roots \(--input-root\)$"):
        policy.input_file(str(root / "missing.jsonl"))  # a server on a network does not list its folders
    shown = AccessPolicy(roots=(root.resolve(),), show_roots=True)
    with pytest.raises(AccessDenied, match=f"input roots \\({re.escape(str(root.resolve()))}; add a folder with"):
        shown.input_file(str(root / "missing.jsonl"))
    assert policy.tokenizer(str(root / "tok")).local
    hub = policy.tokenizer("Qwen/Qwen2.5-7B-Instruct")
    assert (hub.local, hub.allow_download, hub.name) == (False, False, "Qwen/Qwen2.5-7B-Instruct")
    assert AccessPolicy(roots=(root,), allow_hub_downloads=True).tokenizer("gpt2").allow_download
    (tmp_path / "elsewhere").mkdir()
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)  # a relative name that exists is a local folder, so it must be under a root
        with pytest.raises(AccessDenied):
            policy.tokenizer("elsewhere")
        assert policy.tokenizer("root/tok").local
    finally:
        os.chdir(cwd)


def test_environment_forms_of_the_network_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollout_buffer.cli import build_parser, settings_from
    from rollout_buffer.settings import Settings

    monkeypatch.setenv("ROLLOUT_BUFFER_ALLOW_URL", "http://a:1/v1, http://b:2  http://c:3")
    monkeypatch.setenv("ROLLOUT_BUFFER_INPUT_ROOT", f"/data/a{os.pathsep}/data/b")
    monkeypatch.setenv("ROLLOUT_BUFFER_ALLOW_HUB_DOWNLOADS", "1")
    settings = Settings()
    assert settings.allow_url == ["http://a:1/v1", "http://b:2", "http://c:3"]
    assert settings.input_root == [Path("/data/a"), Path("/data/b")] and settings.allow_hub_downloads
    monkeypatch.delenv("ROLLOUT_BUFFER_ALLOW_HUB_DOWNLOADS")
    assert settings_from(build_parser().parse_args(["worker", "--allow-hub-downloads"])).allow_hub_downloads
    assert not settings_from(build_parser().parse_args(["worker"])).allow_hub_downloads
    flags = settings_from(build_parser().parse_args(["serve", "--allow-url", "http://x:1", "--input-root", "/r"]))
    assert flags.allow_url == ["http://x:1"] and flags.input_root == [Path("/r")], "a flag wins over the environment"
