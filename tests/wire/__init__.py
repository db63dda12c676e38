"""Tests of `rollout_buffer/wire/`."""
