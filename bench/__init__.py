"""Benchmarks: ``python -m bench.engine`` and ``python -m bench.transfer`` (see bench/README.md)."""
