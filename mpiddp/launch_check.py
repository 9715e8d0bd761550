"""Catch a launch that started N tasks which each see an MPI job of one.

``srun`` without a PMI the MPI library understands (``--mpi=none``, often the site's
``MpiDefault``), or the ``mpiexec`` of another MPI than the one mpi4py was built against,
starts N processes that each initialise MPI as a singleton. Nothing fails: N independent
trainings each believe they are the whole job, overwrite each other's checkpoint, and the
mistake shows only in the results. So ``init()`` compares the launcher's task count with
MPI's before anything else and refuses, naming the fix.

``check_launch`` is a pure function of (MPI size, environment), tested with fake environments.
"""
from __future__ import annotations

from .config import read_setting
from .errors import LaunchError

_SRUN_FIX = ("Launch with `srun --mpi=pmi2` (the bundled MPICH wheel works with pmi2), "
             "`srun --mpi=pmix` for a site MPI built with PMIx (`srun --mpi=list` shows what "
             "this Slurm offers), or start the ranks with your MPI's `mpiexec`")
_MPIEXEC_FIX = ("Start the ranks with the mpiexec of the MPI library mpi4py uses "
                "(`python -c \"from mpi4py import MPI; print(MPI.Get_library_version())\"` "
                "names it), or rebuild mpi4py against the launcher's MPI (README.md)")


def _count(environ, name: str) -> int | None:
    value = environ.get(name, "").strip()
    return int(value) if value.isdigit() else None


def launcher_tasks(environ) -> tuple[int, str, str] | None:
    """(tasks, who started them, why and how to fix a singleton launch), from the variables of
    the launcher that started this process; None when none is recognised.

    The innermost launcher wins: mpirun or mpiexec (even one run inside an srun step, which
    then holds its proxies, not the ranks) before Slurm."""
    tasks = _count(environ, "OMPI_COMM_WORLD_SIZE")     # Open MPI's mpirun / prterun
    if tasks is not None:
        return tasks, f"Open MPI's mpirun started {tasks} processes", _MPIEXEC_FIX
    in_step = "SLURM_STEP_ID" in environ
    pmi_size = _count(environ, "PMI_SIZE")     # MPICH/Intel MPI hydra, srun --mpi=pmi2
    if pmi_size is not None and not in_step:
        who = "Intel MPI's mpiexec" if "I_MPI_HYDRA_UUID" in environ else "mpiexec"
        return pmi_size, f"{who} started {pmi_size} processes (PMI_SIZE={pmi_size})", \
            _MPIEXEC_FIX
    # Only a job step started by srun counts: the batch script has SLURM_NTASKS of the whole
    # job (and SLURM_PROCID=0) but is one process, and has no SLURM_STEP_ID.
    tasks = pmi_size if pmi_size is not None else _count(environ, "SLURM_STEP_NUM_TASKS")
    if in_step and tasks is not None:
        plugin = environ.get("SLURM_MPI_TYPE", "none")     # srun sets it unless it is none
        why = ("srun gave them no PMI (--mpi=none, or a site default of none), so MPI could "
               "not find the other tasks" if plugin == "none" else
               f"srun offered --mpi={plugin}, which this MPI library does not use")
        return tasks, f"srun started {tasks} tasks", f"{why}. {_SRUN_FIX}"
    return None


def _slurm_tasks_per_node(value: str) -> list[int]:
    """Expand Slurm's compressed per-node task counts: '4(x2),3' -> [4, 4, 3]."""
    counts = []
    for part in value.split(","):
        count, _, repeat = part.partition("(x")
        if not count.isdigit() or (repeat and not repeat.rstrip(")").isdigit()):
            return []
        counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    return counts


def ranks_on_this_node(environ) -> int | None:
    """How many ranks the launcher started on this node (None when it does not say):
    hydra's MPI_LOCALNRANKS, Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE, or, in an srun step,
    SLURM_STEP_TASKS_PER_NODE at this node's index SLURM_NODEID."""
    for name in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        count = _count(environ, name)
        if count is not None:
            return count
    counts = _slurm_tasks_per_node(environ.get("SLURM_STEP_TASKS_PER_NODE", ""))
    node = _count(environ, "SLURM_NODEID") or 0
    return counts[node] if node < len(counts) else None


def check_launch(mpi_size: int, environ) -> None:
    """Raise ``LaunchError`` when the launcher started several tasks but MPI sees one."""
    if mpi_size != 1 or not read_setting("launch_check", environ):
        return
    found = launcher_tasks(environ)
    if found is None or found[0] <= 1:
        return
    _, what, why_and_fix = found
    raise LaunchError(
        f"{what} but MPI sees 1 process per task: each would train alone. {why_and_fix}. "
        "Set MPIDDP_LAUNCH_CHECK=0 if independent one-process runs are what you want.")
