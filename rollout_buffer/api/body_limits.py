"""Body-size limits per route family: records are large by nature (token ids of long rollouts), a model
request is a conversation, and the control routes (`/start_rollout`, reads, acks, sessions, `/init`) carry
little. Each family has its own limit and flag; `--max-body-mb` caps them all. A refusal (413) names the
family and the flag that set its limit."""

from __future__ import annotations

from dataclasses import dataclass

from rollout_buffer.settings import Settings

MB = 1024 * 1024


@dataclass(frozen=True)
class Limit:
    family: str
    max_bytes: int
    flag: str

    def message(self) -> str:
        return f"request body exceeds the limit of {self.max_bytes} bytes of the {self.family} routes (set {self.flag})"


def family_of(path: str) -> str:
    if path.startswith("/v1/"):
        return "gateway"
    if path.startswith("/buffer/") or (path.startswith("/runs/") and path.endswith("/buffer/write")):
        return "write"
    return "control"


@dataclass(frozen=True)
class BodyLimits:
    """The limit of each family: its own flag's value, or `--max-body-mb` where that is smaller."""

    overall: int
    gateway: int
    control: int

    @classmethod
    def from_settings(cls, settings: Settings) -> BodyLimits:
        return cls(overall=settings.max_body_bytes, gateway=int(settings.max_gateway_body_mb * MB),
                   control=int(settings.max_control_body_mb * MB))

    def for_path(self, path: str) -> Limit:
        family = family_of(path)
        own = {"gateway": (self.gateway, "--max-gateway-body-mb"),
               "control": (self.control, "--max-control-body-mb")}.get(family)
        if own is None or own[0] >= self.overall:
            return Limit(family, self.overall, "--max-body-mb")
        return Limit(family, own[0], own[1])
