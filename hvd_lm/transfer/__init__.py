"""Sentiment transfer from a trained LM: labelled datasets, LM features (+ cache), the
classifier, and the ``hvd-lm transfer`` command (:mod:`hvd_lm.transfer.run`).

``python -m hvd_lm.transfer ...`` runs the command (e.g. under ``horovodrun``).
"""
