"""Tests of `rollout_buffer/store/`."""
