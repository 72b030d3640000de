"""Processes and collectives.

* :mod:`~hvd_lm.dist.launcher`: what a launcher (horovodrun, mpirun, srun, PBS) tells a process
  (rank, world size, local rank), the one :class:`~hvd_lm.dist.launcher.RankContext`, and the
  environment for launching local ranks.
* :mod:`~hvd_lm.dist.horovod`: every Horovod call of the project.
* :mod:`~hvd_lm.dist.mpi`: every mpi4py call outside the raw-MPI benchmark baseline.
* :mod:`~hvd_lm.dist.stack`: ``horovodrun --check-build``, parsed and checked.
"""
