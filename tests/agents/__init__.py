"""Tests of `rollout_buffer/agents/`: the agent_command task, its sandboxes and verifiers, Claude Code."""
