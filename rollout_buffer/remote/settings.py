"""Knobs of the remote-rollout protocol, settable as `ROLLOUT_BUFFER_REMOTE_<NAME>` environment variables.

They live apart from the server's `Settings` because only `/init` rollouts use them; the per-rollout time
limit is the server's `--rollout-timeout-s` unless an `/init` body gives its own `timeout_s`.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class RemoteSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ROLLOUT_BUFFER_REMOTE_", extra="ignore")

    # How long an API process's ownership key lives unrenewed: after it lapses (process killed), another
    # process or the restarted one takes over its unfinished rollouts. Shorter = faster recovery, more
    # heartbeat writes.
    owner_ttl_s: float = Field(default=15.0, gt=0)
    # Rollouts driven at once by one API process; the rest wait in state "queued".
    max_concurrency: int = Field(default=512, ge=1)
    # Calls to the trainer's /v1/chat/completions.
    engine_timeout_s: float = Field(default=600.0, gt=0)
    engine_retries: int = Field(default=4, ge=0)
    engine_backoff_s: float = Field(default=0.5, ge=0)
    # The completion callback: retried with exponential backoff until delivered or the deadline passes.
    callback_timeout_s: float = Field(default=30.0, gt=0)
    callback_backoff_s: float = Field(default=0.5, ge=0)
    callback_max_backoff_s: float = Field(default=30.0, ge=0)
    callback_deadline_s: float = Field(default=3600.0, gt=0)
    # On a clean shutdown, time allowed for ERROR callbacks of the rollouts it interrupts.
    shutdown_grace_s: float = Field(default=5.0, ge=0)
    # How long a settled rollout's state (callback delivered, or refused/given up) stays readable at
    # GET /init/{rollout_id} and keeps /init idempotent; then it expires and the rollout_id is unknown again.
    settled_ttl_s: float = Field(default=86400.0, gt=0)
