"""A stand-in for slime's `train.py` (slime needs torch, Megatron and GPUs), for the README's
`scripts/run_agent.sh -- python train.py ...` walkthrough.

It does with the rollout function what slime's training loop does: parses the flags (unknown ones are an
error, so a README typo fails), builds slime's `args` (slime's defaults for the rest, tests/support/slime_namespace.py),
imports `--rollout-function-path`, and calls it once per rollout id with a data buffer whose metadata is
saved to `--save` after every step and loaded from `--load` at start, as slime's checkpoints do. The SGLang
router slime would start is the test engine at `$STANDIN_ENGINE_URL`. `$STANDIN_STOP_AFTER=N` ends the run
after N steps (a crash after a checkpoint). Prints one JSON line: each step's samples, checked.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tests.support.helpers import SlimeLikeDataBuffer
from tests.support.slime_namespace import slime_namespace

STATE_FILE = "rollout_state.json"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="train.py")
    for flag in ("--hf-checkpoint", "--prompt-data", "--input-key", "--label-key", "--metadata-key", "--tool-key",
                 "--rollout-task-type", "--rollout-function-path", "--rollout-buffer-url", "--loss-mask-type",
                 "--save", "--load"):
        parser.add_argument(flag)
    for flag in ("--num-rollout", "--rollout-batch-size", "--n-samples-per-prompt", "--global-batch-size",
                 "--rollout-max-response-len"):
        parser.add_argument(flag, type=int)
    parser.add_argument("--rollout-temperature", type=float)
    return parser.parse_args(argv)


def check_sample(sample: Any) -> None:
    """What slime's trainer relies on."""
    assert len(sample.loss_mask) == sample.response_length == len(sample.rollout_log_probs), sample
    assert sample.response_length <= len(sample.tokens) and sum(sample.loss_mask) > 0, sample
    assert isinstance(sample.reward, float), sample


def main(argv: list[str]) -> int:
    flags = parse(argv)
    given = {k: v for k, v in vars(flags).items() if v is not None}
    args = slime_namespace(engine_url=os.environ["STANDIN_ENGINE_URL"], **given)
    module, name = args.rollout_function_path.rsplit(".", 1)
    generate_rollout = getattr(importlib.import_module(module), name)

    data_buffer, first = SlimeLikeDataBuffer(), 0
    load, save = getattr(args, "load", None), getattr(args, "save", None)
    loaded = Path(load or ".") / STATE_FILE
    if load and loaded.is_file():
        state = json.loads(loaded.read_text())
        data_buffer.metadata, first = state["metadata"], state["rollout_id"] + 1
    stop_after = int(os.environ.get("STANDIN_STOP_AFTER", "0")) or None
    steps: list[dict[str, Any]] = []
    for rollout_id in range(first, args.num_rollout):
        if stop_after is not None and len(steps) >= stop_after:
            break
        out = generate_rollout(args, rollout_id, data_buffer, evaluation=False)
        groups = getattr(out, "samples", out)
        assert len(groups) == args.rollout_batch_size, len(groups)
        for group in groups:
            assert len(group) == args.n_samples_per_prompt
            for sample in group:
                check_sample(sample)
        steps.append({"rollout_id": rollout_id, "groups": len(groups),
                      "samples": sum(len(group) for group in groups)})
        if save:  # slime saves the data buffer's metadata with every checkpoint
            Path(save).mkdir(parents=True, exist_ok=True)
            (Path(save) / STATE_FILE).write_text(json.dumps({"rollout_id": rollout_id,
                                                                  "metadata": data_buffer.metadata}))
    print(json.dumps({"first_rollout_id": first, "steps": steps, "metadata": data_buffer.metadata,
                      "buffer_url": urlparse(args.rollout_buffer_url).geturl(),
                      "loss_mask_type": args.loss_mask_type}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
