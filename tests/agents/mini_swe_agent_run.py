"""Runs mini-swe-agent's own agent loop (its documented Python API: `DefaultAgent`, `LitellmModel`,
`LocalEnvironment`) on one task, in mini-swe-agent's environment; the model is reached through litellm's
OpenAI provider at `OPENAI_BASE_URL` with `OPENAI_API_KEY`. Prints the exit status and the submission."""

from __future__ import annotations

import json
import sys

from minisweagent.agents.default import DefaultAgent
from minisweagent.environments.local import LocalEnvironment
from minisweagent.models.litellm_model import LitellmModel


def main() -> None:
    task = sys.argv[1]
    model = LitellmModel(model_name="openai/policy", cost_tracking="ignore_errors")
    agent = DefaultAgent(model, LocalEnvironment(), system_template="You are a helpful assistant with a shell.",
                         instance_template="{{task}}", step_limit=6)
    result = agent.run(task)
    print(json.dumps({"result": result, "messages": len(agent.messages)}, default=str))


if __name__ == "__main__":
    main()
