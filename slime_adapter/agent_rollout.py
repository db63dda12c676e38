"""The documented path of slime's rollout function: `--rollout-function-path
slime_adapter.agent_rollout.generate_rollout`. The code lives in `slime_adapter.hooks.agent_rollout`; this
module keeps the path that run scripts and checkpoints' command lines name working.
"""

from slime_adapter.hooks.agent_rollout import (
    AgentRolloutState,
    BufferUnavailableError,
    GroupSizeMismatchError,
    RolloutDataUnavailable,
    RunFailedError,
    RunSuperseded,
    StartRolloutRejected,
    generate_rollout,
    reset_state,
)

__all__ = [
    "AgentRolloutState",
    "BufferUnavailableError",
    "GroupSizeMismatchError",
    "RolloutDataUnavailable",
    "RunFailedError",
    "RunSuperseded",
    "StartRolloutRejected",
    "generate_rollout",
    "reset_state",
]
