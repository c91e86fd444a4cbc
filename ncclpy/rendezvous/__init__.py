"""Who am I and where do the ranks meet: the environment-based rendezvous
(:mod:`ncclpy.rendezvous.environment`: rank, world size, local rank, the store's address, from
``ncclpy run``, torchrun, Open MPI, MPICH or SLURM) and a communicator over an existing
torch.distributed group (:mod:`ncclpy.rendezvous.torch_group`, loaded on first use).

The uid exchange itself is :mod:`ncclpy.bootstrap`; the store, :mod:`ncclpy.store`.
"""
from __future__ import annotations

from .environment import (ENV_VARS, MPI_PORT_BASE, SLURM_PORT_BASE, SOURCES, RendezvousInfo,
                      expand_hostlist, first_host, free_port, mpi_job_port, resolve)

__all__ = ["RendezvousInfo", "resolve", "expand_hostlist", "first_host", "free_port", "SOURCES",
           "ENV_VARS", "mpi_job_port", "SLURM_PORT_BASE", "MPI_PORT_BASE"]
