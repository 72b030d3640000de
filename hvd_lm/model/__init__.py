"""The language model and what runs it.

* :mod:`~hvd_lm.model.lm`: the byte-level mLSTM / LSTM language model (:class:`LanguageModel`).
* :mod:`~hvd_lm.model.mlstm_fused`: the fused recurrence, one autograd Function per window.
* :mod:`~hvd_lm.model.mlstm_kernels` / :mod:`~hvd_lm.model.mlstm_triton`: its cell kernels
  (torch, compiled, Triton).
* :mod:`~hvd_lm.model.device`: the device of a rank and the precision it computes in.
* :mod:`~hvd_lm.model.load`: a trained model from a checkpoint, for every command that uses one.
"""
