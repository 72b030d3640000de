"""Performance: benchmarks (training step, allreduce, fusion), their results and alpha-beta
fit, the scaling model to 128 GPUs and the scaling report of finished sweeps."""
