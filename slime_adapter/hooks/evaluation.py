"""slime's evaluation through the buffer: `generate_rollout(args, rollout_id, data_buffer, evaluation=True)`.

slime calls the rollout function with `evaluation=True` whenever evaluation is configured (its
`--eval-function-path` defaults to `--rollout-function-path`). The eval datasets are slime's
`args.eval_datasets` (`EvalDatasetConfig`s with per-dataset overrides, newer slime) or else the flat
`args.eval_prompt_data` (`[name, path, name, path, ...]`; a lone path is named "aime", as slime does).
Each dataset's settings fall back as slime's `eval_config` resolves them: `n_samples_per_eval_prompt`,
`max_response_len` (`eval_max_response_len`, then `rollout_max_response_len`), `temperature`
(`eval_temperature`, then `rollout_temperature`), `top_p`, `top_k` likewise, `stop` / `stop_token_ids`
(`rollout_stop...`), `min_new_tokens` (`eval_min_new_tokens`), and the dataset keys (`eval_input_key`,
`eval_label_key`, `eval_tool_key`, then `input_key`, ...; `metadata_key`).

Each dataset becomes its own buffer run per call: run id `eval-<name>-<rollout_id>-<nonce>`, one epoch,
`n` repeats per line, started with `"activate": false`, so it never becomes the buffer's active run;
every read is pinned to its run id, so training data and training prompts are never touched. The task
is `rollout_task_type` (or `agent_eval_task_type`). The datasets run side by side; each is collected
until its run has ended and nothing is left to read.

Returned: slime's eval shape `{name: {"rewards": [...], "truncated": [...], "samples": [...]}}` with
raw (never group-normalised) rewards, one entry per record, groups ordered by instance id (natural
order, so lines without ids come in file order) and each group's members by repeat; wrapped in slime's
`RolloutFnEvalOutput` when slime has it. Groups whose every member failed are dropped by the buffer's
default validity hook: they are not in `rewards` (so pass@k keeps whole groups), and are counted in
`eval/<name>/filtered_groups` and `eval/<name>/failed_samples`. A dataset that yields no sample at all
raises `RunFailedError`.

Metrics (logged like `rollout/`, with `eval/step`): `eval/<name>` (mean raw reward),
`eval/<name>-truncated_ratio` (slime's names), `eval/<name>/samples`, `/groups`, `/filtered_groups`,
`/failed_samples`, `/unbuilt_samples` (records whose tokens could not be rebuilt; kept with their reward).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from slime_adapter.hooks.metrics import rollout_step
from slime_adapter.hooks.outputs import eval_output, slime_outputs_available
from slime_adapter.reading.buffer_client import (
    BufferUnavailableError,
    build_start_payload,
    fetch_rollout_data,
    long_poll_wait_s,
    post_start_rollout,
    with_start_options,
)
from slime_adapter.reading.run_health import RunFailedError, describe_run, get_run_detail
from slime_adapter.samples.build import build_samples
from slime_adapter.samples.sample import make_sample, status_from_record
from slime_adapter.samples.tokenizers import get_tokenizer
from slime_adapter.settings import INPUT_KEY_NAMES, AgentRolloutSettings, input_keys_of

__all__ = ["EvalDataset", "eval_datasets", "eval_metrics", "evaluate", "log_eval_info"]

log = logging.getLogger(__name__)
_NONCE = uuid.uuid4().hex[:6]
_CALLS = itertools.count()
# Longest wait of one eval read: a run is over only when its last task has finished, a moment after its
# last group became readable, so a read that waited longer could outlast the run for nothing.
POLL_WAIT_S = 2.0


@dataclass(frozen=True)
class EvalDataset:
    """One eval dataset with every setting resolved (see the module docstring for the fallbacks)."""

    name: str
    path: str
    n_samples: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_response_len: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_new_tokens: int | None = None
    input_keys: dict[str, str | None] = dataclasses.field(default_factory=dict)


def _field(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)


def _first(config: Any, name: str, args: Any, attrs: tuple[str, ...], default: Any = None) -> Any:
    """The dataset's own value, else the first of `attrs` set on `args`, else `default`."""
    value = _field(config, name)
    for attr in attrs:
        if value is not None:
            break
        value = getattr(args, attr, None)
    return default if value is None else value


def _dataset(args: Any, config: Any) -> EvalDataset:
    name, path = _field(config, "name"), _field(config, "path")
    if not name or not path:
        raise ValueError(f"an eval dataset needs a name and a path, got {config!r}")
    keys = input_keys_of(args, prefix="eval_")
    for key in INPUT_KEY_NAMES:  # a dataset's own keys win (slime's EvalDatasetConfig has them resolved)
        if _field(config, key) is not None:
            keys[key] = _field(config, key)
    top_k = _first(config, "top_k", args, ("eval_top_k", "rollout_top_k"))
    stop = _first(config, "stop", args, ("rollout_stop",))
    stop_ids = _first(config, "stop_token_ids", args, ("rollout_stop_token_ids",))
    min_new = _first(config, "min_new_tokens", args, ("eval_min_new_tokens",))
    max_len = _first(config, "max_response_len", args, ("eval_max_response_len", "rollout_max_response_len"))
    return EvalDataset(
        name=str(name), path=str(path),
        n_samples=int(_first(config, "n_samples_per_eval_prompt", args,
                             ("n_samples_per_eval_prompt", "n_samples_per_prompt"), 1)),
        temperature=float(_first(config, "temperature", args, ("eval_temperature", "rollout_temperature"), 1.0)),
        top_p=float(_first(config, "top_p", args, ("eval_top_p", "rollout_top_p"), 1.0)),
        top_k=None if top_k is None or int(top_k) == -1 else int(top_k),
        max_response_len=None if max_len is None else int(max_len),
        stop=None if stop is None else [str(s) for s in ([stop] if isinstance(stop, str) else stop)],
        stop_token_ids=None if stop_ids is None else [int(i) for i in stop_ids],
        min_new_tokens=None if min_new is None else int(min_new),
        input_keys=keys,
    )


def eval_datasets(args: Any) -> list[EvalDataset]:
    """slime's eval datasets, resolved; [] when evaluation is not configured."""
    configs = list(getattr(args, "eval_datasets", None) or [])
    if not configs:
        flat = getattr(args, "eval_prompt_data", None)
        values = [flat] if isinstance(flat, str) else list(flat or [])
        if len(values) == 1:
            values = ["aime", values[0]]
        if len(values) % 2:
            raise ValueError(f"eval_prompt_data must be name/path pairs, got {values!r}")
        configs = [{"name": values[i], "path": values[i + 1]} for i in range(0, len(values), 2)]
    return [_dataset(args, config) for config in configs]


def eval_run_id(name: str, rollout_id: int) -> str:
    """A fresh run id per dataset and call: letters, digits, '_', '.', '-' only."""
    safe = re.sub(r"[^A-Za-z0-9_.\-]", "_", name)[:48]
    return f"eval-{safe}-{rollout_id}-{_NONCE}{next(_CALLS)}"


def start_payload(settings: AgentRolloutSettings, dataset: EvalDataset, run_id: str, task_type: str) -> dict[str, Any]:
    """The `/start_rollout` body of one eval run: the training body's shape with the dataset's settings."""
    resolved = dataclasses.replace(
        settings, prompt_data=dataset.path, n_samples_per_prompt=dataset.n_samples, num_epoch=1, run_id=run_id,
        temperature=dataset.temperature, top_p=dataset.top_p, top_k=dataset.top_k, stop=dataset.stop,
        stop_token_ids=dataset.stop_token_ids, max_response_len=dataset.max_response_len,
        input_keys=dict(dataset.input_keys), task_type=task_type)
    payload = build_start_payload(resolved, None)
    payload["activate"] = False  # never the buffer's active run: unqualified reads and writes stay training's
    if dataset.min_new_tokens is not None:
        payload["sampling_params"]["min_new_tokens"] = dataset.min_new_tokens
    return with_start_options(payload, resolved)


async def _collect_run(settings: AgentRolloutSettings, run_id: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every record the run hands over, and each read's meta_info, until it has ended and nothing is left."""
    records: list[dict[str, Any]] = []
    metas: list[dict[str, Any]] = []
    failures = 0
    while True:
        detail = await get_run_detail(settings.buffer_url, run_id)
        if detail is not None and detail.get("missing"):
            raise RunFailedError(f"evaluation run {run_id} is unknown to the buffer (deleted, or its data was lost)",
                                 run_id, detail)
        over = detail is not None and (detail.get("meta") or {}).get("status") not in (None, "running")
        try:
            wait_s = 0.0 if over else min(POLL_WAIT_S, long_poll_wait_s(settings.fetch_timeout_s))
            got, meta, _ = await fetch_rollout_data(settings.buffer_url, None, settings.fetch_timeout_s,
                                                    run_id=run_id, wait_s=wait_s, read_format=settings.read_format)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            failures += 1
            if 0 <= settings.fetch_retry_times < failures:
                raise BufferUnavailableError(f"evaluation run {run_id}: {failures} consecutive failed fetch(es) "
                                             f"from {settings.buffer_url}; last: {type(exc).__name__}: {exc}") from exc
            await asyncio.sleep(min(settings.fetch_backoff_max_s, settings.fetch_backoff_s * 2 ** (failures - 1)))
            continue
        failures = 0
        if meta:
            metas.append(meta)
        records.extend(got)
        if over and not got and not meta.get("finished_groups"):
            return records, metas


def _natural(text: str) -> tuple[Any, ...]:
    """Sort key that orders "q2" before "q10" and "9" before "10"."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", text) if part)


def _eval_sample(record: dict[str, Any], settings: AgentRolloutSettings, group_index: int, name: str,
                 ) -> tuple[Any, str | None]:
    """(sample, build error): the record's sample with its raw reward; a record whose tokens cannot be
    rebuilt still gives a sample (no tokens, `metadata["build_error"]`) so its reward counts."""
    raw = record.get("raw_reward")
    reward = float(record["reward"] if raw is None else raw)
    try:
        samples, _ = build_samples(record, lambda: _tokenizer(settings), settings.loss_mask_type,
                                   group_index=group_index, fork_policy="last", verify=settings.loss_mask_verify)
        sample, error = samples[-1], None
    except Exception as exc:  # noqa: BLE001 - an eval reward must not be lost to a rendering problem
        error = f"{type(exc).__name__}: {exc}"
        sample = make_sample(group_index=group_index, index=record.get("instance_id"), prompt=record.get("uid", ""),
                             response="", response_length=0, loss_mask=[], reward=reward,
                             status=status_from_record(record.get("status") or "completed"),
                             metadata={**(record.get("extra_info") or {}), "uid": record.get("uid"),
                                       "build_error": error}, label=None)
    sample.reward = reward
    sample.metadata["raw_reward"] = reward
    sample.metadata["eval_dataset"] = name
    return sample, error


def _tokenizer(settings: AgentRolloutSettings) -> Any:
    if not settings.hf_checkpoint:
        raise ValueError("a record without `turns` needs a tokenizer to re-render its messages; set args.hf_checkpoint")
    return get_tokenizer(settings.hf_checkpoint, trust_remote_code=True)


def dataset_result(settings: AgentRolloutSettings, name: str, records: list[dict[str, Any]],
                   metas: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, int]]:
    """slime's per-dataset entry (rewards, truncated, samples) and the counts behind the metrics."""
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault((str(record["instance_id"]), record.get("epoch")), []).append(record)
    ordered = sorted(groups.items(), key=lambda item: (_natural(item[0][0]), str(item[0][1])))
    samples: list[Any] = []
    rewards: list[float] = []
    truncated: list[bool] = []
    errors: list[str] = []
    for group_index, (_, members) in enumerate(ordered):
        members.sort(key=lambda r: (r.get("repeat") if isinstance(r.get("repeat"), int) else 0, str(r.get("uid"))))
        for record in members:
            sample, error = _eval_sample(record, settings, group_index, name)
            if error is not None:
                errors.append(error)
            samples.append(sample)
            rewards.append(sample.reward)
            truncated.append(record.get("status") == "truncated")
    if errors:  # one line per dataset, not one per record
        log.warning("eval %s: %d record(s) kept with their reward but without tokens; first: %s", name,
                    len(errors), errors[0])
    counts = {
        "samples": len(samples), "groups": len(ordered), "unbuilt_samples": len(errors),
        "filtered_groups": sum(len(m.get("filtered_groups") or []) for m in metas),
        "failed_samples": sum(int((m.get("status_counts") or {}).get("failed", 0)) for m in metas),
    }
    return {"rewards": rewards, "truncated": truncated, "samples": samples}, counts


def eval_metrics(data: dict[str, dict[str, Any]], counts: dict[str, dict[str, int]]) -> dict[str, Any]:
    """`eval/<name>` (mean raw reward), `eval/<name>-truncated_ratio` and the counts, per dataset."""
    out: dict[str, Any] = {}
    for name, entry in data.items():
        rewards, truncated = entry["rewards"], entry["truncated"]
        out[f"eval/{name}"] = sum(rewards) / len(rewards) if rewards else 0.0
        out[f"eval/{name}-truncated_ratio"] = sum(truncated) / len(truncated) if truncated else 0.0
        for key, value in counts.get(name, {}).items():
            out[f"eval/{name}/{key}"] = value
    return out


def log_eval_info(settings: AgentRolloutSettings, metrics: dict[str, Any], rollout_id: int,
                  to_wandb: bool = True) -> dict[str, Any]:
    """Log one evaluation's metrics (wandb when `use_wandb` and `to_wandb`, always the log), with `eval/step`."""
    metrics = {**metrics, "eval/step": rollout_step(settings, rollout_id)}
    if settings.use_wandb and to_wandb:
        try:
            from slime_adapter.hooks.metrics import _wandb_run

            run = _wandb_run(settings)
            run.define_metric("eval/step")
            run.define_metric("eval/*", step_metric="eval/step")
            run.log(metrics)
        except Exception:
            log.exception("logging evaluation %d to wandb failed; metrics: %s", rollout_id, metrics)
            return metrics
    log.info("eval %d: %s", rollout_id, metrics)
    return metrics


async def _evaluate_one(settings: AgentRolloutSettings, dataset: EvalDataset, rollout_id: int, task_type: str,
                        ) -> tuple[dict[str, Any], dict[str, int]]:
    if not os.path.isfile(dataset.path):
        log.warning("eval %s: %s is not a file here; the buffer will judge it", dataset.name, dataset.path)
    run_id = eval_run_id(dataset.name, rollout_id)
    payload = start_payload(settings, dataset, run_id, task_type)
    began = time.monotonic()
    answer = await asyncio.to_thread(post_start_rollout, settings.buffer_url, payload, settings)
    run_id = str(answer.get("run_id") or run_id)
    records, metas = await _collect_run(settings, run_id)
    entry, counts = dataset_result(settings, dataset.name, records, metas)
    if not entry["samples"]:
        detail = await get_run_detail(settings.buffer_url, run_id)
        raise RunFailedError(
            f"evaluation {rollout_id}: dataset {dataset.name!r} (run {run_id}, {dataset.path}) handed over no "
            f"sample ({counts['filtered_groups']} group(s) filtered, {counts['failed_samples']} failed rollout(s)); "
            f"{describe_run(detail) if detail else 'the buffer did not describe the run'}", run_id, detail)
    log.info("eval %s: %d sample(s) in %d group(s) from run %s in %.1f s", dataset.name, counts["samples"],
             counts["groups"], run_id, time.monotonic() - began)
    return entry, counts


async def evaluate(args: Any, rollout_id: int) -> Any:
    """slime's evaluation call (see the module docstring); returns its eval output."""
    settings = AgentRolloutSettings.from_args(args)
    datasets = eval_datasets(args)
    if not datasets:
        raise ValueError("evaluation was requested but no eval dataset is configured "
                         "(set --eval-prompt-data name path [name path ...] or --eval-config)")
    names = [d.name for d in datasets]
    if len(set(names)) != len(names):
        raise ValueError(f"eval dataset names must be unique, got {names}")
    task_type = str(getattr(args, "agent_eval_task_type", None) or settings.task_type)
    results = await asyncio.gather(*(_evaluate_one(settings, d, rollout_id, task_type) for d in datasets))
    data = {d.name: entry for d, (entry, _) in zip(datasets, results)}
    counts = {d.name: c for d, (_, c) in zip(datasets, results)}
    metrics = log_eval_info(settings, eval_metrics(data, counts), rollout_id, to_wandb=not slime_outputs_available())
    return eval_output(data, metrics)
