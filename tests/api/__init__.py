"""Tests of `rollout_buffer/api/`."""
