"""What must be settled in the environment before MPI starts (the first import of
``mpi4py.MPI`` initialises it): no MPI import here."""
from __future__ import annotations

import os

from ..launch_check import ranks_on_this_node


def prefer_yielding_waits(environ=os.environ) -> None:
    """MPICH's waiting ranks busy-poll; with more ranks than cores they steal the cores that
    compute needs. Only helps when mpiddp is imported before mpi4py.MPI; users of other MPIs
    are unaffected."""
    ranks_here = ranks_on_this_node(environ)
    if ranks_here is not None and ranks_here > (os.cpu_count() or 1):
        environ.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
