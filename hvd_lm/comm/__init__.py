"""Processes and collectives: the one place the project calls Horovod, torch.distributed and MPI.

* :mod:`~hvd_lm.comm.world`: what a launcher (horovodrun, mpirun, srun, PBS, torchrun) tells a
  process (rank, world size, local rank, the torch engine's rendezvous), the one
  :class:`~hvd_lm.comm.world.RankContext`, and the environment for launching local ranks.
* :mod:`~hvd_lm.comm.engine`: every collective of the project, on the engine ``--backend``
  picks once per process: Horovod (every Horovod call of the project) or the torch engine
  (also one process without Horovod installed). A caller imports it by name
  (``from hvd_lm.comm import engine``, then ``engine.allreduce_sum(...)``): a plain module
  attribute, no lookup hook in the step.
* :mod:`~hvd_lm.comm.torch_engine`: the torch engine, ``horovod.torch``'s API on
  ``torch.distributed`` (NCCL/Gloo; its one caller besides the benchmarks' baselines), its
  gradients through ``DistributedDataParallel`` (fp16/bf16 on the wire by torch's comm hooks).
* :mod:`~hvd_lm.comm.mpi`: every mpi4py call outside the raw-MPI benchmark baseline.
* :mod:`~hvd_lm.comm.hosts`: ``host:slots`` lists and the interfaces hosts share (preflight).
* :mod:`~hvd_lm.comm.peers`: which peer a failed collective lost, and on which host.
* :mod:`~hvd_lm.comm.onebit_compression`: the 1-bit compressed allreduce (its math, error
  feedback).

A ``# collective:`` comment marks every line that runs a collective, whatever the engine under it
(Horovod or torch.distributed): every rank must reach that line at the same step. ``# Horovod:``
marks the calls into ``horovod.torch`` itself and what only Horovod runs (elastic training).
"""

