"""Tests of `rollout_buffer/runtime/`."""
