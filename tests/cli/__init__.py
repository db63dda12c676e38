"""Tests of the entry points as a user runs them: the CLI commands, scripts/ and tools/."""
