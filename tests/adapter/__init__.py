"""Tests of the trainer side, `slime_adapter`."""
