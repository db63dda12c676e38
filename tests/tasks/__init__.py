"""Tests of `rollout_buffer/tasks/`."""
