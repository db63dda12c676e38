"""Tests of `rollout_buffer/metrics/`."""
