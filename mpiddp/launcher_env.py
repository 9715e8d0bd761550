"""What the launcher tells each process through its environment, read without MPI (device
selection reads it before ``MPI_Init``; the node layout after).

The launchers' local-rank variables, innermost first (an ``mpirun`` inside an ``srun`` step
sees both): ``OMPI_COMM_WORLD_LOCAL_RANK`` (Open MPI), ``MPI_LOCALRANKID`` (MPICH and Intel
MPI's hydra), ``MV2_COMM_WORLD_LOCAL_RANK`` (MVAPICH2), ``PMI_LOCAL_RANK`` (PMIx, Cray PALS),
``SLURM_LOCALID`` (srun).
"""
from __future__ import annotations

import os
from typing import Optional

LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                        "MV2_COMM_WORLD_LOCAL_RANK", "PMI_LOCAL_RANK", "SLURM_LOCALID")


def launcher_local_rank(environ=os.environ) -> Optional[tuple[int, str]]:
    """(local rank, variable) from the first launcher variable set to a number."""
    for name in LOCAL_RANK_VARIABLES:
        value = environ.get(name, "").strip()
        if value.isdigit():
            return int(value), name
    return None
