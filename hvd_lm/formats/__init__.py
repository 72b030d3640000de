"""What hvd_lm keeps on disk, each format with one owner.

* :mod:`~hvd_lm.formats.tokenizer`: UTF-8 bytes are the tokens (0..255), byte 0 ends a document.
* :mod:`~hvd_lm.formats.shards`: HDF5 shards (tokens + document offsets, checksummed).
* :mod:`~hvd_lm.formats.manifest`: ``manifest.json``, the index of a prepared corpus.
* :mod:`~hvd_lm.formats.checkpoint`: checkpoint files and what a run's ``checkpoints/`` folder
  holds (which file is newest, which are complete, what is pruned).
"""
