"""Small utilities every layer uses, building on nothing of the project.

* :mod:`~hvd_lm.util.atomic`: the one atomic-write implementation (temp file, fsync, rename).
* :mod:`~hvd_lm.util.files`: how a path a command was given is opened (regular files within
  a size budget, outputs that replace no input, nothing written through a link out of the
  run's folder) and shown in an error line.
* :mod:`~hvd_lm.util.lock`: folder locks that name their holder and die with it.
* :mod:`~hvd_lm.util.digest`: streaming sha256 of files.
* :mod:`~hvd_lm.util.units`: byte and rate units shared by the benchmarks and the scaling model.
"""
