"""Benchmarks run from a checkout (`python -m benchmarks.bench`); not part of the shipped package."""
