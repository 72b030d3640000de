"""Training: configuration, TBPTT data streams, LR schedule, precision/device runtime,
checkpoints, the metrics log, evaluation (bits per character) and the loop itself
(:mod:`hvd_lm.train.loop`)."""
