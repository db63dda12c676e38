"""Tests of `rollout_buffer/runs/`."""
