"""Tests of `rollout_buffer/security/`."""
