"""Benchmarks and studies run from a checkout (``python -m benchmarks.NAME``), not installed with
the package, as Horovod keeps ``examples/pytorch/pytorch_synthetic_benchmark.py`` and PyTorch its
``benchmarks/`` outside their packages. Each prints ratios measured side by side in one run and
can write its figures as JSON (docs/performance.md, docs/launch.md)."""
