"""The scaling study: the alpha-beta model of data-parallel training (:mod:`.scaling_model`), its
calibration from ``hvd-lm bench allreduce`` (:mod:`.calibration`), the ``hvd-lm scaling-model``
study (:mod:`.scaling_study`), the ``hvd-lm scaling-report`` of a sweep (:mod:`.scaling_report`)
and ``hvd-lm bench multinode`` (:mod:`.bench_multinode`), the model against measured links.
"""
