"""Chaos tests: faults of every kind at random, at once, while a real trainer works (`bench.chaos`)."""
