"""What must be settled in the environment before MPI starts (the first import of
``mpi4py.MPI`` initialises it): no MPI import here."""
from __future__ import annotations

import multiprocessing
import os
import sys
from typing import Optional

from ..errors import LaunchError
from ..intel_mpi import likely_intel_mpi, offload, offload_crash, wheel_root
from ..launch_check import launcher_tasks, ranks_on_this_node

# The pid of a rank whose mpiddp found MPI initialised, for the processes it starts.
MPI_PROCESS_VARIABLE = "_MPIDDP_MPI_PID"
_kept_out = False      # MPI's initialisation was turned off in this process (below)


def prefer_yielding_waits(environ=os.environ) -> None:
    """MPICH's waiting ranks busy-poll; with more ranks than cores they steal the cores that
    compute needs. Only helps when mpiddp is imported before mpi4py.MPI; users of other MPIs
    are unaffected."""
    ranks_here = ranks_on_this_node(environ)
    if ranks_here is not None and ranks_here > (os.cpu_count() or 1):
        environ.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")


def refuse_crashing_offload(environ=os.environ, modules=sys.modules,
                            crash=offload_crash) -> None:
    """Raise ``LaunchError`` where Intel MPI would crash in ``MPI_Init`` on its GPU switches
    (``intel_mpi.offload_crash``: ``I_MPI_OFFLOAD=1`` without a CUDA driver library it can
    load), instead of letting the rank die of a segmentation fault with no word of why. Only
    before MPI starts, and where Intel MPI is likely: other MPIs ignore Intel's switches."""
    if "mpi4py.MPI" in modules or not offload(environ).requested or \
            not likely_intel_mpi(environ):
        return
    reason = crash(environ)
    if reason:
        raise LaunchError(f"{reason} (docs/gpu.md, Intel MPI)")


def point_intel_mpi_at_its_files(environ=os.environ, root=wheel_root) -> None:
    """Set ``I_MPI_ROOT`` to the ``impi-rt`` wheel's prefix where Intel MPI would hang in
    ``MPI_Init`` without it (``intel_mpi.wheel_root``: under srun with ``I_MPI_PMI_LIBRARY``),
    as Intel's own environment scripts would have set it."""
    found = root(environ)
    if found:
        environ["I_MPI_ROOT"] = found


def reimporting_main() -> bool:
    """True while multiprocessing re-imports the parent's main module in a child it started
    with 'spawn' or 'forkserver' (the flag multiprocessing itself checks before it refuses
    to start processes from such a child)."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def parent_of(pid: int) -> Optional[int]:
    """The parent of process ``pid`` (Linux's /proc), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def started_by(pid: str) -> bool:
    """Whether process ``pid`` started this one: it is our parent, or our grandparent (a
    forkserver's workers are its children, and it the rank's)."""
    parent = os.getppid()
    return pid in (str(parent), str(parent_of(parent)))


def mark_mpi_process(world_size: int, environ=os.environ) -> None:
    """Tell the processes this one starts that it is a rank of an MPI job (read by
    ``keep_mpi_out_of_rank_children`` in them). Called once MPI is initialised; a process
    alone (no launcher, one process) is left unmarked: its children may start MPI alone too,
    as before."""
    if world_size > 1 or launcher_tasks(environ) is not None:
        environ[MPI_PROCESS_VARIABLE] = str(os.getpid())


def keep_mpi_out_of_rank_children(environ=os.environ, modules=sys.modules,
                                  started=started_by) -> bool:
    """Turn off mpi4py's initialisation at import in a process that a rank started (the mark
    of ``mark_mpi_process`` names our parent or grandparent): a DataLoader worker that
    'spawn' or 'forkserver' started, or that forkserver itself, which import the main module
    again and with it mpiddp. There ``MPI_Init`` cannot work: the child inherited the rank's
    launcher variables but not its connection to the launcher (MPICH's workers aborted the
    job with "PMI_Init returned -1", Open MPI's crashed), and it is no rank of the job
    anyway. Returns True when it turned it off; ``init()`` there then says why it cannot run
    (``child_process_error``). Left alone: forked children (MPI is imported already), and
    processes whose mark is further up (ranks of an ``mpiexec`` run by a marked process, a
    wrapper that forks the real rank: the mark passes through the launcher)."""
    global _kept_out
    owner = environ.get(MPI_PROCESS_VARIABLE)
    if "mpi4py.MPI" in modules or owner is None or not started(owner):
        return False
    import mpi4py

    mpi4py.rc.initialize = False
    _kept_out = True
    return True


def mpi_kept_out() -> bool:
    """Whether ``keep_mpi_out_of_rank_children`` turned MPI's initialisation off here."""
    return _kept_out


def child_process_error(what: str) -> str:
    """What ``what`` (``init()``, a call that asks MPI) says in a process where MPI was kept
    out (above)."""
    how = (f"MPI process {os.environ.get(MPI_PROCESS_VARIABLE)} (a rank) started it, e.g. as "
           "a DataLoader worker with 'spawn' or 'forkserver'")
    if reimporting_main():
        return (f"mpiddp.{what} was called while process {os.getpid()} was being prepared: "
                f"{how}, and such a child imports the script's main module again (and the "
                "modules of what it is given). Put the script's code under "
                "`if __name__ == \"__main__\":` so that it runs only in the rank itself.")
    return (f"mpiddp.{what} cannot run in process {os.getpid()}: {how}; it is no rank of the "
            "MPI job, and MPI is not initialised there. Call it in the rank itself.")
