"""Processes and collectives: the one place the project calls Horovod and MPI.

* :mod:`~hvd_lm.comm.world`: what a launcher (horovodrun, mpirun, srun, PBS) tells a process
  (rank, world size, local rank), the one :class:`~hvd_lm.comm.world.RankContext`, and the
  environment for launching local ranks.
* :mod:`~hvd_lm.comm.horovod`: every Horovod call of the project.
* :mod:`~hvd_lm.comm.mpi`: every mpi4py call outside the raw-MPI benchmark baseline.
* :mod:`~hvd_lm.comm.hosts`: ``host:slots`` lists and the interfaces hosts share (preflight).
* :mod:`~hvd_lm.comm.peers`: which peer a failed collective lost, and on which host.
* :mod:`~hvd_lm.comm.onebit_compression`: the math of the 1-bit compressed allreduce (error
  feedback).
"""
