"""Benchmarks: ``python -m bench.engine``, ``bench.transfer``, ``bench.serve`` and ``bench.soak``
(see docs/benchmarks.md)."""
