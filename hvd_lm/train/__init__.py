"""Training: the loop (:mod:`hvd_lm.train.loop`) around the one training step
(:mod:`hvd_lm.train.step`), its settings, TBPTT data streams, LR schedule, optimizers (1-bit
included), resuming, the divergence guard, the metrics log, evaluation (bits per character) and
the preflight checks."""
