"""data_prep: review text -> byte-level token shards (HDF5) with a manifest.

``python -m data_prep prepare|verify`` (see docs/data_prep.md). Readers in
:mod:`data_prep.readers`, the pipeline in :mod:`data_prep.pipeline` (its phases in
:mod:`data_prep.sort` and :mod:`data_prep.plan`, settings in :mod:`data_prep.settings`, resume
and output folders in :mod:`data_prep.resume`), the shard format in :mod:`hvd_lm.formats.shards`,
the tokenizer in :mod:`hvd_lm.formats.tokenizer`.
"""
