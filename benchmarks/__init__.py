"""Benchmarks that print JSON (speed targets live here, not in timed unit tests)."""
