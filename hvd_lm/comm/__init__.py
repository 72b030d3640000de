"""Processes and collectives.

* :mod:`~hvd_lm.comm.launcher`: what a launcher (horovodrun, mpirun, srun, PBS) tells a process
  (rank, world size, local rank), the one :class:`~hvd_lm.comm.launcher.RankContext`, and the
  environment for launching local ranks.
* :mod:`~hvd_lm.comm.horovod`: every Horovod call of the project.
* :mod:`~hvd_lm.comm.mpi`: every mpi4py call outside the raw-MPI benchmark baseline.
* :mod:`~hvd_lm.comm.stack`: ``horovodrun --check-build``, parsed and checked.
"""
