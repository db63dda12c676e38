"""The verify policy and the verdict's bounds, without a container: `agent.verify` parsed (a bad one named at
/start_rollout), rewards outside the range, non-finite or unreadable are typed kept failures, reward.json's
extra keys are capped, and the verifier's environment drops the agent's places from PATH and turns off
Python's unsafe path."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rollout_buffer.agents.config import AgentConfigError, parse
from rollout_buffer.agents.verify.environment import SYSTEM_PATH, env_argv, system_path, verifier_env
from rollout_buffer.agents.verify.policy import PolicyError, VerifyPolicy, parse_policy
from rollout_buffer.agents.verify.reward import (MAX_EXTRA_BYTES, MAX_EXTRA_KEYS, AmbiguousReward, KeptFailure, cap_extra,
                                               parse_reward)
from rollout_buffer.tasks.contract import ServerFacts
from rollout_buffer.tasks.harbor import HarborTaskError, read_task

SERVER = ServerFacts(agent_sandboxes=("docker",))


def test_the_policy_defaults_to_clean_and_names_bad_fields() -> None:
    assert parse_policy(None) == VerifyPolicy(mode="clean") and parse_policy("same").mode == "same"
    policy = parse_policy({"mode": "snapshot", "tasks": {"db": "same"}, "failure_reward": -1,
                           "reward_range": [-1, 1], "outputs": ["/srv/out/"]})
    assert (policy.mode_for("db"), policy.mode_for("other")) == ("same", "snapshot")
    assert policy.failure_reward == -1.0 and policy.reward_range == (-1.0, 1.0) and policy.outputs == ("/srv/out",)
    for raw, field in (("fresh", "agent.verify.mode"), ({"mode": "clean", "x": 1}, "agent.verify"),
                       ({"failure_reward": math.nan}, "agent.verify.failure_reward"),
                       ({"failure_reward": "0"}, "agent.verify.failure_reward"),
                       ({"reward_range": [1, 0]}, "agent.verify.reward_range"),
                       ({"reward_range": [0, math.inf]}, "agent.verify.reward_range"),
                       ({"reward_range": [0, 1], "failure_reward": -1}, "agent.verify.failure_reward"),
                       ({"outputs": ["relative"]}, "agent.verify.outputs"), ({"outputs": ["/"]}, "agent.verify.outputs"),
                       ({"tasks": {"a": "dirty"}}, "agent.verify.tasks"), (7, "agent.verify"),
                       ({"keep_work": "yes"}, "agent.verify.keep_work")):
        with pytest.raises(AgentConfigError) as caught:
            parse({"agent": {"command": "true", "verify": raw}}, SERVER)
        assert caught.value.field == field, (raw, caught.value)
    assert parse({"agent": {"command": "true"}}, SERVER).verify.mode == "clean"
    assert parse_policy({"keep_work": True}).keep_work and not parse_policy(None).keep_work


def test_rewards_are_bounded_and_typed() -> None:
    assert parse_reward("txt", "0.5\n", (0, 1)) == {"reward": 0.5}
    assert parse_reward("txt", "7", (0, 10))["reward"] == 7.0
    cases = [("txt", "1e308", "reward_invalid"), ("txt", "nan", "reward_invalid"), ("txt", "-inf", "reward_invalid"),
             ("txt", "1.5", "reward_invalid"), ("txt", "-0.1", "reward_invalid"), ("txt", "yes", "reward_invalid"),
             ("json", '{"reward": true}', "reward_invalid"), ("json", '{"reward": NaN}', "reward_invalid"),
             ("json", "[1]", "reward_invalid"), ("json", '{"reward": 1', "reward_invalid"),
             ("none", "", "reward_missing")]
    for kind, text, error_type in cases:
        with pytest.raises(KeptFailure) as caught:
            parse_reward(kind, text, (0.0, 1.0))
        assert caught.value.error_type == error_type, (kind, text)


def test_reward_json_extra_keys_are_capped() -> None:
    extra = {"passed": 3, "pad": "x" * 60_000, "k" * 100: 1, **{f"m{i}": i for i in range(40)}}
    verdict = parse_reward("json", json.dumps({"reward": 1, **extra}), (0, 1))
    kept = {k: v for k, v in verdict.items() if k not in ("reward", "dropped_keys")}
    assert verdict["reward"] == 1.0 and kept["passed"] == 3 and "pad" not in kept and len(kept) == MAX_EXTRA_KEYS
    assert len(json.dumps(kept)) <= MAX_EXTRA_BYTES + 2 * MAX_EXTRA_KEYS
    assert verdict["dropped_keys"][:2] == ["pad", "k" * 64] and len(verdict["dropped_keys"]) <= MAX_EXTRA_KEYS
    assert cap_extra({"a": float("nan")}) == {"dropped_keys": ["a"]}  # not JSON: never stored


def test_the_verifiers_environment() -> None:
    image = ["PATH=/app/bin:/opt/venv/bin:/usr/bin:/tmp/x:/home/agent/.local/bin:relative", "LANG=C.UTF-8",
             "PYTHONPATH=/opt/lib"]
    env = verifier_env(image, work="/app", task_env={"GREETING": "hi"})
    assert env["PATH"] == "/opt/venv/bin:/usr/bin" and env["HOME"] == "/root" and env["LANG"] == "C.UTF-8"
    assert env["PYTHONSAFEPATH"] == "1" and env["PYTHONNOUSERSITE"] == "1" and env["GREETING"] == "hi"
    assert env["PYTHONPATH"] == "/opt/lib"  # the image author's, kept
    assert system_path(None, "/app") == SYSTEM_PATH and system_path("/app:/tmp", "/app") == SYSTEM_PATH
    assert verifier_env([], work="/srv/w", task_env={"PYTHONSAFEPATH": ""})["PYTHONSAFEPATH"] == ""  # the author's
    assert env_argv({"A": "1"}) == ["env", "-i", "A=1"]
    # agent.verify.python_safe_path off for a task: Harbor's sys.path (no PYTHONSAFEPATH unless the image sets it)
    assert "PYTHONSAFEPATH" not in verifier_env(image, work="/app", safe_path=False)
    assert verifier_env(["PYTHONSAFEPATH=1"], work="/app", safe_path=False)["PYTHONSAFEPATH"] == "1"
    policy = parse_policy({"python_safe_path": {"cancel-async-tasks": False}})
    assert not policy.safe_path_for("cancel-async-tasks") and policy.safe_path_for("regex-log")
    assert not parse_policy({"python_safe_path": False}).safe_path_for("regex-log")
    assert parse_policy(None).safe_path_for("any")
    for bad in ("no", {"t": "false"}, [1]):
        with pytest.raises(PolicyError, match="agent.verify.python_safe_path: must be true, false or an object"):
            parse_policy({"python_safe_path": bad})


def test_task_toml_declares_its_range_and_outputs(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test.sh").write_text("true\n")
    (tmp_path / "instruction.md").write_text("do it\n")
    base = '[environment]\ndocker_image = "img"\n[verifier]\n'
    (tmp_path / "task.toml").write_text(base + 'reward_range = [0, 10]\noutputs = ["/srv/out/"]\n')
    harbor = read_task(tmp_path)["harbor"]
    assert harbor["reward_range"] == [0.0, 10.0] and harbor["outputs"] == ["/srv/out"]
    for bad, field in (("reward_range = [1, 1]", "reward_range"), ("reward_range = [0, nan]", "reward_range"),
                       ('outputs = ["out"]', "outputs"), ('outputs = "/srv"', "outputs")):
        (tmp_path / "task.toml").write_text(base + bad + "\n")
        with pytest.raises(HarborTaskError, match=f"\\[verifier\\] {field}"):
            read_task(tmp_path)


def test_a_kept_failure_stays_in_its_group_and_an_infrastructure_failure_drops_it() -> None:
    from rollout_buffer.agents.task import _failed
    from rollout_buffer.runs.reads import _apply_hooks
    from rollout_buffer.store.handover import ReadBatch, ReadGroup

    sample = {"instance_id": "fifo", "prompt": "answer"}
    hung = _failed(sample, "verifier_timeout", "test.sh ran past its timeout_sec 4", {"verifier": {"mode": "clean"}},
                   reward=-1.0)
    honest = {"status": "completed", "reward": 1.0, "messages": [], "extra_info": {}}
    infra = _failed(sample, "sandbox_error", "the sandbox failed twice", {"infrastructure": True})
    batch = ReadBatch(kind="handed", groups=[ReadGroup("r", 0, "fifo", [hung, honest]),
                                             ReadGroup("r", 0, "broken", [infra, dict(honest)])])
    records, info, _ = _apply_hooks(batch, None, "agent_command", 1)
    assert [(r["status"], r["reward"]) for r in records] == [("failed", -1.0), ("completed", 1.0)]
    assert info["dynamic_filter"] == {"sandbox_error": 1} and info["filtered_groups"] == ["broken"]


def test_several_named_rewards_need_the_runs_choice_and_are_all_kept() -> None:
    """Harbor's multi-metric reward.json: every key is kept; the scalar is the run's reward_key or weights, the
    only numeric key, or a loud refusal naming the keys (never a silent pick)."""
    many = json.dumps({"accuracy": 0.5, "style": 1.0, "note": "ok"})
    with pytest.raises(AmbiguousReward, match=r"\['accuracy', 'style'\].*reward_key") as caught:
        parse_reward("json", many, (0.0, 1.0))
    assert caught.value.error_type == "reward_ambiguous" and caught.value.infrastructure
    chosen = parse_reward("json", many, (0.0, 1.0), key="accuracy")
    assert chosen["reward"] == 0.5 and chosen["style"] == 1.0 and chosen["accuracy"] == 0.5
    assert parse_reward("json", many, (0.0, 1.0), weights={"accuracy": 0.5, "style": 0.5})["reward"] == 0.75
    assert parse_reward("json", json.dumps({"score": 0.25}), (0.0, 1.0))["reward"] == 0.25
    for key, weights in (("missing", None), (None, {"accuracy": 1.0, "absent": 1.0})):
        with pytest.raises(KeptFailure) as kept:
            parse_reward("json", many, (0.0, 1.0), key=key, weights=weights)
        assert kept.value.error_type == "reward_invalid"
    policy = parse_policy({"reward_weights": {"accuracy": 2, "style": 1}})
    assert policy.reward_weights == {"accuracy": 2.0, "style": 1.0} and policy.reward_key is None
    for bad, field in (({"reward_key": ""}, "agent.verify.reward_key"),
                       ({"reward_weights": {"a": float("inf")}}, "agent.verify.reward_weights"),
                       ({"reward_key": "a", "reward_weights": {"a": 1}}, "agent.verify.reward_key")):
        with pytest.raises(PolicyError) as refused:
            parse_policy(bad)
        assert refused.value.field == field
