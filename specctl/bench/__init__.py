"""Benchmarks: commands that print tables and write JSON, with baselines from the same run."""
