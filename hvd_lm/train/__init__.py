"""Training: the loop (:mod:`hvd_lm.train.loop`) around the one training step
(:mod:`hvd_lm.train.step`), holding its components (the run built at startup, metrics,
checkpointer, step counting, elastic state); its settings, TBPTT data streams, LR schedule,
optimizers (1-bit included), resuming, the divergence guard, evaluation (bits per character) and
the preflight checks."""
