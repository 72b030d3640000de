"""Sentiment transfer from a trained LM: labelled datasets, LM features (+ cache), the classifier
fit (scikit-learn, :mod:`~hvd_lm.transfer.fit`), the saved classifier, and the commands
``hvd-lm transfer`` (:mod:`hvd_lm.transfer.run`), ``classify`` (:mod:`~hvd_lm.transfer.classify`),
``generate`` and ``visualize`` (:mod:`~hvd_lm.transfer.generate`).

``python -m hvd_lm.transfer ...`` runs the transfer command (e.g. under ``horovodrun``).
"""
