"""Processes and collectives.

* :mod:`~hvd_lm.comm.launcher`: what a launcher (horovodrun, mpirun, srun, PBS) tells a process
  (rank, world size, local rank), the one :class:`~hvd_lm.comm.launcher.RankContext`, and the
  environment for launching local ranks.
* :mod:`~hvd_lm.comm.horovod`: every Horovod call of the project.
* :mod:`~hvd_lm.comm.mpi`: every mpi4py call outside the raw-MPI benchmark baseline.
* :mod:`~hvd_lm.comm.stack`: ``horovodrun --check-build``, parsed and checked.
* :mod:`~hvd_lm.comm.build`: building Horovod from source for this torch (the NCCL wheel found).
* :mod:`~hvd_lm.comm.hosts`: ``host:slots`` lists and the interfaces hosts share (preflight).
* :mod:`~hvd_lm.comm.peers`: which peer a failed collective lost, and on which host.
* :mod:`~hvd_lm.comm.onebit`: the math of the 1-bit compressed allreduce (error feedback).
"""
