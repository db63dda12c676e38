"""The chaos run's trainer: slime's rollout loop on `slime_adapter`, checkpointing after every step.

Run as its own process (`python -m bench.chaos.trainer WORKDIR CONFIG_JSON`) so the harness can SIGKILL it
mid-step. Each step calls `generate_rollout` (leased reads, acks, background lease renewal where the adapter
has it) through the chaos proxy, checks every Sample it got, appends the step to `steps.jsonl` (what this
life trained, fsynced), then saves the checkpoint atomically: the data source's resume metadata, the next
step and the lineage of trained groups. Like slime with a `--save-interval`, it skips some checkpoints (a
seeded `skip_checkpoint_p` of the steps). A restarted trainer starts from the checkpoint, as slime does, so
groups trained after the last checkpoint are lost with the killed life: the batch it was training comes
back from the same run; groups already acknowledged (a step after a skipped checkpoint) need a new
generation of the run.
"""

from __future__ import annotations

import copy
import json
import os
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from slime_adapter.agent_rollout import generate_rollout
from tests.support.helpers import SlimeLikeDataBuffer

CHECKPOINT = "checkpoint.json"
STEPS = "steps.jsonl"
IN_STEP = "in_step"  # "{pid} {step} {first step of that life}": the harness kills trainers mid-step


def load_checkpoint(workdir: Path) -> dict[str, Any]:
    path = workdir / CHECKPOINT
    if not path.exists():
        return {"step": 0, "metadata": {}, "lineage": []}
    return json.loads(path.read_text())


def save_checkpoint(workdir: Path, checkpoint: dict[str, Any]) -> None:
    tmp = workdir / (CHECKPOINT + ".tmp")
    with open(tmp, "w") as out:
        json.dump(checkpoint, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, workdir / CHECKPOINT)


def sample_problems(sample: Any) -> list[str]:
    """Why a Sample is not token-exact: a rollout that generated tokens must reach the trainer with the
    engine's own tokens (the token path, not the re-tokenizing fallback, which only a failed rollout without
    engine turns takes), one loss-mask bit per response token and, on the token path, one rollout logprob
    per response token."""
    problems = []
    meta = sample.metadata
    uid, length = meta.get("uid"), sample.response_length
    retokenized = meta.get("mask_source") == "retokenized"
    if retokenized and meta.get("record_status") != "failed":
        problems.append(f"{uid}: a {meta.get('record_status')} rollout re-tokenized instead of its engine tokens")
    if not 0 < length <= len(sample.tokens):
        problems.append(f"{uid}: response_length {length} of {len(sample.tokens)} tokens")
    if len(sample.loss_mask or []) != length:
        problems.append(f"{uid}: {len(sample.loss_mask or [])} loss-mask bits for response_length {length}")
    if not retokenized and len(sample.rollout_log_probs or []) != length:
        problems.append(f"{uid}: {len(sample.rollout_log_probs or [])} logprobs for response_length {length}")
    if meta.get("record_status") == "failed" and any(sample.loss_mask or []):
        problems.append(f"{uid}: a failed rollout trains tokens")
    return problems


def train(workdir: Path, config: dict[str, Any]) -> None:
    args = SimpleNamespace(**config["args"])
    checkpoint = load_checkpoint(workdir)
    buffer = SlimeLikeDataBuffer(copy.deepcopy(checkpoint["metadata"]))
    life, life_began = os.getpid(), time.time()
    first = checkpoint["step"]
    lineage = list(checkpoint["lineage"])
    for step in range(first, config["steps"]):
        (workdir / IN_STEP).write_text(f"{life} {step} {first}")  # a kill from now on lands mid-step
        began, began_at = time.monotonic(), time.time()
        output = generate_rollout(args, step, buffer)
        groups = getattr(output, "samples", output)
        time.sleep(config.get("train_s", 0.0))  # the training itself (the batch leased, renewed meanwhile)
        trained, problems = [], []
        for group in groups:
            keys = {(s.metadata["epoch"], s.metadata["instance_id"]) for s in group}
            if len(keys) != 1:
                problems.append(f"a group mixes {sorted(keys)}")
            epoch, instance = next(iter(keys))
            trained.append([epoch, instance, sorted(s.metadata["uid"] for s in group)])
            for sample in group:
                problems += sample_problems(sample)
        with open(workdir / STEPS, "a") as log:
            log.write(json.dumps({"life": life, "step": step, "groups": trained, "problems": problems,
                                  "took_s": round(time.monotonic() - began, 2), "began": round(began_at, 3),
                                  "life_began": round(life_began, 3)}) + "\n")
            log.flush()
            os.fsync(log.fileno())
        lineage += [[e, i] for e, i, _ in trained]
        last = step + 1 == config["steps"]
        if not last and random.Random(f"{config.get('seed', 0)}/{step}").random() < config.get("skip_checkpoint_p", 0):
            continue
        save_checkpoint(workdir, {"step": step + 1, "metadata": copy.deepcopy(buffer.get_metadata()),
                                  "lineage": lineage})
    (workdir / "done").write_text("ok")


if __name__ == "__main__":
    train(Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()))
