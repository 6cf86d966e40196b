"""Benchmarks: every script a registration on ``benchmarks/harness.py`` (see ``benchmarks/README.md``);
``make bench`` runs the pytest-benchmark suites, ``python -m benchmarks.kernels report RESULTS.json`` renders them."""
