"""``Runtime``: everything ``init()`` starts on this rank and ``shutdown()`` stops.

It owns the agreed settings, the communicator and its topology, the global engine, the
process-set table (every other engine) and the abort hooks. The process holds at most one,
the current runtime (``current.py``).
"""
from __future__ import annotations

import logging
import os
import sys

from mpi4py import MPI

from .. import gpu
from ..collectives.topology import Topology, node_layout
from ..config import Settings, read_settings, unknown_settings
from ..engine.coordinator import Engine, start_engine
from ..errors import EngineShutdownError, LaunchError
from ..horovod_env import horovod_messages
from ..launch_check import check_launch
from .abort import ABORT_HOOKS, AbortHooks
from .mpi_environment import child_process_error, mark_mpi_process, mpi_kept_out
from .process_set_table import ProcessSetTable

log = logging.getLogger("mpiddp")

# Settings every rank must share: they decide message sizes, fusion plans and algorithms.
PROTOCOL_SETTINGS = ("fusion_threshold", "cache_capacity", "allreduce_algorithm",
                     "ring_threshold", "hierarchical_allreduce", "priority_cycle_bytes",
                     "speculation_bytes")


def check_mpi_here(what: str) -> None:
    """Raise ``LaunchError`` for ``what`` in a process where MPI was kept out (one a rank
    started, such as a DataLoader worker: ``mpi_environment.py``), where an MPI call would
    end the process ("Attempting to use an MPI routine before initializing")."""
    if mpi_kept_out() and not MPI.Is_initialized():
        raise LaunchError(child_process_error(what))


class Runtime:
    """The running mpiddp of this rank (see the module docstring); made by ``start``."""

    def __init__(self, comm: MPI.Comm, settings: Settings, topology: Topology, engine: Engine,
                 abort_hooks: AbortHooks):
        self.comm = comm
        self.settings = settings
        self.topology = topology
        self.engine = engine
        self.abort_hooks = abort_hooks
        self.process_sets = ProcessSetTable(comm, engine, settings, start_engine)
        # Where the trace goes at the end: start_timeline(file_path), or MPIDDP_TIMELINE=path.
        self.timeline_file = None
        if settings.timeline not in ("", "1"):
            self.set_timeline_file(settings.timeline, "MPIDDP_TIMELINE")

    def set_timeline_file(self, path, what: str) -> None:
        """Write the timeline to ``path`` at the end; its directory is made now, so that a
        missing one fails here, naming ``what`` (not at the end, with the trace lost)."""
        if path:
            directory = os.path.dirname(os.path.abspath(path))
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as exc:
                raise ValueError(f"{what}={path!r}: cannot make its directory {directory}: "
                                 f"{exc.strerror}") from None
        self.timeline_file = path

    @classmethod
    def start(cls, comm: MPI.Comm) -> "Runtime":
        """The body of ``init()`` (a collective of ``comm``): check the launch and MPI's
        thread level, agree on the settings, learn the topology, pick the GPU, start the
        engine. Raises as ``init()`` documents."""
        check_mpi_here("init()")
        mark_mpi_process(MPI.COMM_WORLD.Get_size())   # MPI may have started after the import
        # Installed first, so that an error on one rank during start-up (a bad setting, say)
        # ends the job instead of leaving the others waiting in the collectives below.
        ABORT_HOOKS.install()
        check_launch(MPI.COMM_WORLD.Get_size(), os.environ)   # N singletons (srun, no PMI)?
        provided = MPI.Query_thread()
        if provided < MPI.THREAD_SERIALIZED:
            raise RuntimeError(
                "mpiddp needs MPI initialised with at least MPI_THREAD_SERIALIZED (its "
                f"coordinator thread calls MPI), but the MPI library provides level {provided}. "
                "Let mpi4py initialise MPI (its default asks for MPI_THREAD_MULTIPLE).")
        settings = agreed_settings(comm)
        _configure_logging(settings)
        if comm.Get_rank() == 0:                             # once per job, not once per rank
            _log_setting_messages()
        if provided < MPI.THREAD_MULTIPLE:
            log.warning("MPI provides only MPI_THREAD_SERIALIZED: do not make MPI calls of "
                        "your own while mpiddp collectives are in flight")
        layout = node_layout(comm)
        layout.local.Free()             # the numbers are all the runtime needs
        layout.cross.Free()
        topology = layout.topology
        gpu.setup(settings, topology.local_rank)   # device selection before any CUDA call
        gpu.warn_about_shared_devices(comm, MPI.Get_processor_name())
        runtime = cls(comm, settings, topology, start_engine(comm, settings), ABORT_HOOKS)
        if not settings.abort_on_exception:
            ABORT_HOOKS.remove()
        log.info("mpiddp initialised: rank %d of %d, local rank %d of %d", topology.rank,
                 topology.size, topology.local_rank, topology.local_size)
        return runtime

    def check_running(self) -> None:
        """Raise when the engine stopped on its own (stall, failure) since ``init()``."""
        if not self.engine.running:
            raise EngineShutdownError(
                f"mpiddp's engine has stopped ({self.engine.stopped_reason}); call "
                "mpiddp.shutdown() on every rank before calling mpiddp.init() again")

    def stop(self) -> None:
        """Stop every engine (agreed with the other ranks in their next cycle), then write the
        timeline file if ``MPIDDP_TIMELINE`` names one, and the traffic summary if
        ``MPIDDP_TRAFFIC_SUMMARY`` asks for it."""
        engines = self.process_sets.engines()
        self.process_sets.close("shutdown() was called")
        self.engine.shutdown("shutdown() was called")
        if self.timeline_file:
            self.write_timeline_file(self.timeline_file)
        if self.settings.traffic_summary:
            rank = self.topology.rank
            lines = [f"mpiddp traffic: rank {rank} process_set {set_id}: "
                     f"{engine.stats.summary()}\n" for set_id, engine in engines]
            sys.stderr.write("".join(lines))     # one write: the ranks' lines stay whole
            sys.stderr.flush()

    def write_timeline_file(self, path: str) -> None:
        """Every rank writes its events as a Chrome trace (``MPIDDP_TIMELINE=path`` at
        shutdown, ``start_timeline(file_path)`` at ``stop_timeline()``), rank r to
        ``<path stem>.rank<r><suffix>`` (one file when there is one rank)."""
        rank, size = self.topology.rank, self.topology.size
        if size > 1:
            stem, dot, suffix = path.rpartition(".")
            path = f"{stem}.rank{rank}.{suffix}" if dot and "/" not in suffix else \
                f"{path}.rank{rank}"
        self.engine.timeline.write_chrome_trace(path, rank)


def agreed_settings(comm: MPI.Comm) -> Settings:
    """Read the settings on every rank and check that the ranks agree; every rank raises the
    same error otherwise (a collective: no rank is left waiting)."""
    try:
        settings, error = read_settings(), None
    except ValueError as exc:
        settings, error = None, str(exc)
    everyone = comm.allgather((settings, error))
    errors = [f"rank {r}: {e}" for r, (_, e) in enumerate(everyone) if e]
    if errors:
        raise ValueError("invalid mpiddp settings: " + "; ".join(errors))
    for field in PROTOCOL_SETTINGS:
        values = {r: getattr(s, field) for r, (s, _) in enumerate(everyone)}
        if len(set(values.values())) > 1:
            listing = ", ".join(f"rank {r} has {v!r}" for r, v in values.items())
            raise ValueError(f"MPIDDP_{field.upper()} must be the same on every rank, but "
                             f"{listing}")
    return settings


def _log_setting_messages() -> None:
    """Unknown ``MPIDDP_*`` names, and the ``HOROVOD_*`` variables read as mpiddp settings
    (INFO) or not (a warning naming what to use instead)."""
    honoured, ignored = horovod_messages(os.environ)
    for line in honoured:
        log.info(line)
    warnings = unknown_settings() + ignored
    if warnings:
        log.warning("\n".join(warnings))


def _configure_logging(settings: Settings) -> None:
    log.setLevel(settings.log_level)
    if not logging.getLogger().handlers and not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[mpiddp %(levelname)s] %(message)s"))
        log.addHandler(handler)
