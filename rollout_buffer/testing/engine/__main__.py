"""`python -m rollout_buffer.testing.engine`: the test engine's command line."""

from rollout_buffer.testing.engine.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
