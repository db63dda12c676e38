"""Tests of `rollout_buffer/remote/`."""
