"""Benchmark and diagnostic scripts behind the measurements in docs/results.md, each run as
``python -m ldqa.eval.bench.<name>``. They use the product (`ldqa.app`, `ldqa.eval`); the product never
imports them (tests/test_layering.py)."""
