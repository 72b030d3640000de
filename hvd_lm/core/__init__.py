"""The ground floor: what every other part builds on and that builds on nothing of the project.

* :mod:`~hvd_lm.core.tokenizer`: UTF-8 bytes are the tokens (0..255), byte 0 ends a document.
* :mod:`~hvd_lm.core.shards`: the one owner of the on-disk format (HDF5 shards + manifest.json).
* :mod:`~hvd_lm.core.model`: the mLSTM / LSTM byte-level language model.
* :mod:`~hvd_lm.core.atomic`: the one atomic-write implementation (temp file, fsync, rename).
* :mod:`~hvd_lm.core.config`: dataclass trees -> YAML sections + generated command-line flags.
* :mod:`~hvd_lm.core.units`: byte and rate units shared by the benchmarks and the scaling model.
"""
