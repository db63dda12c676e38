"""Prometheus counters of remote rollouts' response masks, exported on the API's `/metrics`.

Per API process, like the other counters there: calls that carried a counted mask by drift region
(`none` when the render reproduced the trainer's tokens exactly), the tokens that differed, and the calls
refused because no count exists (`negative_count`, `no_token_ids`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from rollout_buffer.remote.drift import Drift

MASK_REFUSALS = ("negative_count", "no_token_ids")
DRIFT_REGIONS = ("none", "assistant", "context")


class RemoteMetrics:
    """The counters, registered on one registry (the API's, or a private one)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        registry = registry if registry is not None else CollectorRegistry()
        self.masks = Counter("rollout_buffer_remote_masks", "Remote calls sent with a counted response_mask, by "
                             "drift region of the re-rendered history", ["drift"], registry=registry)
        self.drift_tokens = Counter("rollout_buffer_remote_mask_drift_tokens", "Tokens where the re-rendered "
                                    "history differs from what the trainer holds", registry=registry)
        self.refused = Counter("rollout_buffer_remote_mask_refused", "Remote calls not sent because no "
                               "response_mask count exists, by reason", ["reason"], registry=registry)
        for region in DRIFT_REGIONS:  # present at 0 from the start, so rates work
            self.masks.labels(region)
        for reason in MASK_REFUSALS:
            self.refused.labels(reason)

    def counted(self, drift: Drift | None) -> None:
        self.masks.labels(drift.region if drift is not None else "none").inc()
        if drift is not None:
            self.drift_tokens.inc(drift.tokens)

    def refusal(self, reason: str) -> None:
        self.refused.labels(reason).inc()
