"""Settings read once from ``MPIDDP_*`` environment variables at ``init()``.

Every setting is listed, with its default and meaning, in ``docs/configuration.md``.
A bad value raises ``ValueError`` naming the variable, the value and what is allowed.
An unknown ``MPIDDP_*`` name is not an error (``unknown_settings`` words a warning for it):
a job must not die of a variable meant for a script, or of one a newer version knows.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field, fields
from typing import Optional

from .horovod_env import settings_from_horovod

ALGORITHMS = ("auto", "ring", "halving_doubling", "recursive_doubling", "native",
              "hierarchical")
TRI_STATE = ("auto", "0", "1")
LOG_LEVELS = ("debug", "info", "warning", "error")
# MPIDDP_* variables that belong to the project's scripts and tests, not to the engine:
# MPIDDP_VENV picks the virtual environment (scripts/ensure_env.sh, the job scripts),
# MPIDDP_NO_INSTALL, MPIDDP_OPENMPI_VENV and MPIDDP_INTELMPI_VENV belong to the setup
# scripts, MPIDDP_SYSTEM_TESTS, MPIDDP_TEST_WORKERS, MPIDDP_TESTS_ALONE and
# MPIDDP_TEST_COUNTS to the test runner. Job environments carry them into every rank, so
# they pass without a warning. The elastic launcher (mpiddp/run.py) sets
# MPIDDP_LOST_NODES_DIR (where the lost-peer watchdog names the lost nodes),
# MPIDDP_ELASTIC_RESTART (0 at the first launch, then 1, 2, ...) and MPIDDP_LAUNCH_HOSTS
# (each rank's host as launched).
SCRIPT_VARIABLES = ("MPIDDP_VENV", "MPIDDP_SYSTEM_TESTS", "MPIDDP_LOST_NODES_DIR",
                    "MPIDDP_ELASTIC_RESTART", "MPIDDP_LAUNCH_HOSTS", "MPIDDP_NO_INSTALL",
                    "MPIDDP_OPENMPI_VENV", "MPIDDP_INTELMPI_VENV", "MPIDDP_TEST_WORKERS",
                    "MPIDDP_TESTS_ALONE", "MPIDDP_TEST_COUNTS")


# ---- parsers: each setting names its own (no guessing from type annotations) ------------
@dataclass(frozen=True)
class Boolean:
    def __call__(self, name: str, raw: str) -> bool:
        value = raw.strip().lower()
        if value in ("1", "true", "yes", "on"):
            return True
        if value in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}={raw!r} is not a boolean: use 1/0, true/false, yes/no or "
                         "on/off")


@dataclass(frozen=True)
class BooleanOrAuto:
    """A boolean, or 'auto' (mpiddp measures and decides)."""

    def __call__(self, name: str, raw: str):
        if raw.strip().lower() == "auto":
            return "auto"
        try:
            return Boolean()(name, raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not a boolean or 'auto': use 1/0, true/false, "
                             "yes/no, on/off or auto") from None


@dataclass(frozen=True)
class Number:
    kind: type                      # int or float
    minimum: float = 0              # smallest allowed value
    positive: bool = False          # the minimum itself is not allowed

    def __call__(self, name: str, raw: str):
        try:
            value = self.kind(raw.strip())
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not a valid {self.kind.__name__}") from None
        if self.positive and value <= self.minimum:
            raise ValueError(f"{name}={raw!r} must be greater than {self.minimum}")
        if value < self.minimum:
            raise ValueError(f"{name}={raw!r} must be at least {self.minimum}")
        return value


@dataclass(frozen=True)
class Choice:
    choices: tuple
    upper: bool = False             # the value is kept in upper case (log levels)

    def __call__(self, name: str, raw: str) -> str:
        value = raw.strip().lower()
        if value not in self.choices:
            raise ValueError(f"{name}={raw!r} is not one of: {', '.join(self.choices)}")
        return value.upper() if self.upper else value


@dataclass(frozen=True)
class SwitchOrPath:
    """A boolean switch, or a file path meaning "on, and write the result there"
    (``MPIDDP_TIMELINE=1`` or ``MPIDDP_TIMELINE=/tmp/timeline.json``, as Horovod's
    ``HOROVOD_TIMELINE``): '' when off, '1' when on, else the path."""

    def __call__(self, name: str, raw: str) -> str:
        value = raw.strip()
        if value.lower() in ("", "0", "false", "no", "off"):
            return ""
        if value.lower() in ("1", "true", "yes", "on"):
            return "1"
        return value


@dataclass(frozen=True)
class Text:
    """Any text (a file path); surrounding blanks removed, '' when unset."""

    def __call__(self, name: str, raw: str) -> str:
        return raw.strip()


def setting(default, parser):
    """A field of ``Settings`` read from its environment variable with ``parser``."""
    return field(default=default, metadata={"parser": parser})


@dataclass(frozen=True)
class Settings:
    """Validated engine settings. Field names map to ``MPIDDP_<FIELD NAME UPPERCASE>``."""

    # Longest time (ms) an idle coordinator waits before it joins a heartbeat cycle.
    # Work starts a cycle at once; this only bounds how late an idle rank notices others.
    cycle_time: float = setting(50.0, Number(float, 0, positive=True))
    # Fusion buffer size in bytes: ready tensors are packed together up to this size.
    fusion_threshold: int = setting(1024 * 1024, Number(int))
    # Number of tensor names the response cache remembers (bit-vector negotiation).
    cache_capacity: int = setting(1024, Number(int, 1))
    # Seconds before rank 0 warns about tensors submitted by some ranks but not others.
    stall_check_time: float = setting(60.0, Number(float, 0, positive=True))
    # Seconds a coordinator may stay inside one MPI call before the lost-peer watchdog holds a
    # roll call (engine/liveness.py). Short, because a roll call that everyone answers costs
    # nothing and the job just waits on, while a lost node is found this plus 10 s after its
    # loss: 30 s with the default, so an elastic job trains again within a minute.
    peer_check_time: float = setting(20.0, Number(float, 0, positive=True))
    # Seconds after which a stall shuts the engine down on every rank (0 = never). Finite by
    # default, like NCCL's 10-minute watchdog, so that a hung job does not burn its allocation.
    stall_shutdown_time: float = setting(600.0, Number(float))
    # Reduction algorithm for fused buffers: auto (by size), ring, halving_doubling,
    # recursive_doubling (over mpiddp's TCP connections across nodes) or native MPI_Allreduce.
    allreduce_algorithm: str = setting("auto", Choice(ALGORITHMS))
    # auto: messages of at most this many bytes use native MPI_Allreduce, larger ones ours (the
    # ring, or halving-doubling). Unset (None): 2 MiB where all ranks share a node; across
    # nodes from the links measured at start (collectives/algorithms.py, docs/dev/scaling-model.md).
    ring_threshold: Optional[int] = setting(None, Number(int))
    # Hierarchical all-reduce (node-local reduce-scatter, cross-node all-reduce, node-local
    # all-gather) where several nodes have the same number (> 1) of ranks: auto = for the
    # messages that take the ring (above ring_threshold), 1 = for every fused buffer, 0 = never.
    hierarchical_allreduce: str = setting("auto", Choice(TRI_STATE))
    # Bytes of prioritized all-reduces (forward overlap's gradients) a cycle runs at most;
    # the less urgent rest waits one cycle, so an urgent gradient never queues behind more
    # than this much on the wire (0 = no limit: a cycle runs everything that is ready).
    # Unset: sized from the links measured at start so that a cycle's fixed cost (the
    # negotiation and the engine's own work) is 3% of its transfer, rounded down to a power
    # of two, 1-64 MiB (collectives/cost_model.py: 1 MiB at 2 nodes on 1 Gbit/s or
    # slower, 4-8 MiB at 16 emulated nodes on 1 Gbit/s, 8-16 MiB at 2 nodes on ~12 Gbit/s);
    # 1 MiB where nothing was measured.
    priority_cycle_bytes: Optional[int] = setting(None, Number(int))
    # Small all-reduces carried beside every cycle's negotiation (engine/speculation.py): a
    # cached Sum or Average of host memory up to this many bytes (and this many in all) is
    # summed together with the cycle's bit vector, so where it is ready on every rank it is
    # over in one synchronization instead of two. Unset: where the bit vector travels over
    # mpiddp's TCP connections across nodes, the bytes the measured links move in one
    # latency, a power of two, 4-64 KiB (4 KiB at 1 Gbit/s); elsewhere 0 (off).
    speculation_bytes: Optional[int] = setting(None, Number(int))
    # Forward overlap for DistributedOptimizer(overlap_forward=None) (docs/training.md):
    # step() returns before the gradients are averaged; each parameter is updated just before
    # the next forward uses it. 'auto': try both in the first steps, keep the faster. An
    # explicit overlap_forward argument wins.
    overlap_forward: object = setting(False, BooleanOrAuto())
    # Longest sleep (us) between tests of a transfer across nodes (transport/pacing.py).
    # Unset: the wire time of 6 x what one MPI call moves over TCP (24 KiB) on the links
    # measured at start, each wake testing 8 times (about 1200 at 1 Gbit/s, at most 2000; on
    # links too fast for sleeps, transfers block in MPI); 200 where nothing was measured.
    # 0: always block. Longer sleeps cost less CPU but stall transports
    # that move a bounded amount per call (UCX over TCP with UCX_TCP_TX_SEG_SIZE /
    # UCX_TCP_RX_SEG_SIZE=1m: 1000 measured at gloo's CPU per byte at 1 Gbit/s).
    transfer_sleep_us: Optional[float] = setting(None, Number(float))
    # The engine's exchanges with partners on other nodes (the ring, halving-doubling) over
    # TCP sockets of mpiddp's own rather than MPI (transport/sockets.py: no polling, less
    # CPU per byte than MPI over TCP): auto: where the sockets move a probe no slower than
    # MPI does (MPI's RDMA stays), 1: always (an error if they cannot connect), 0: never.
    socket_transport: str = setting("auto", Choice(TRI_STATE))
    # Interfaces whose addresses those sockets use, comma-separated, in order (as
    # GLOO_SOCKET_IFNAME); unset: every interface with an IPv4 address, loopback last.
    socket_ifname: str = setting("", Text())
    # Abort the whole MPI job when a rank dies of an uncaught exception.
    abort_on_exception: bool = setting(True, Boolean())
    # Record a timeline of engine events (negotiation and execution times) from init() on:
    # '' off, '1' in memory, or a path: written as a Chrome trace at shutdown().
    timeline: str = setting("", SwitchOrPath())
    # At shutdown() every rank prints one line of its traffic per engine (the global set's
    # and each process set's it is in) to stderr: engine_stats()'s traffic counters.
    traffic_summary: bool = setting(False, Boolean())
    # Log level of the 'mpiddp' logger (DEBUG, INFO, WARNING, ERROR).
    log_level: str = setting("WARNING", Choice(LOG_LEVELS, upper=True))
    # Whether MPI can read device memory directly: auto (probe), 0 or 1.
    cuda_aware: str = setting("auto", Choice(TRI_STATE))
    # Refuse to start when the launcher started N > 1 tasks but MPI sees one process in each
    # (srun without PMI, or another MPI's mpiexec): see mpiddp/launch_check.py.
    launch_check: bool = setting(True, Boolean())
    # Autotune (engine/autotune.py, docs/tuning.md): while the job trains,
    # rank 0 searches the fusion threshold, cycle time, ring threshold and hierarchical
    # all-reduce (those not set explicitly) and every rank applies each choice at the same
    # cycle; at the end the best values stay for the rest of the run.
    autotune: bool = setting(False, Boolean())
    # A CSV file rank 0 writes every scored sample to (settings, score), then the best.
    autotune_log: str = setting("", Text())
    # Windows discarded after each change of settings (the engine settles: buffers grow).
    autotune_warmup_windows: int = setting(1, Number(int))
    # Steps per measuring window: the window closes when some all-reduce name has been
    # reduced this many times in it (a name repeats once per training step).
    autotune_steps_per_window: int = setting(3, Number(int, 1))
    # Windows measured per sample; the sample's score is their median (bytes per us).
    autotune_windows: int = setting(3, Number(int, 1))
    # Samples (settings tried, the first being the starting settings) before the search ends.
    autotune_max_samples: int = setting(20, Number(int, 1))

    # Which of the fields above were set in the environment (filled by read_settings, not
    # a variable of its own): autotune leaves an explicitly set value alone.
    # Not compared: two runs with the same values have the same settings.
    explicit: frozenset = field(default=frozenset(), compare=False,
                                metadata={"derived": True})


def setting_fields() -> list:
    """The fields read from ``MPIDDP_*`` variables (not the derived ``explicit``)."""
    return [f for f in fields(Settings) if not f.metadata.get("derived")]


def env_name(field_name: str) -> str:
    return "MPIDDP_" + field_name.upper()


def read_setting(field_name: str, environ=None):
    """One setting from ``environ`` (default ``os.environ``), parsed, or its default."""
    environ = os.environ if environ is None else environ
    f = next(f for f in setting_fields() if f.name == field_name)
    name = env_name(field_name)
    return f.metadata["parser"](name, environ[name]) if name in environ else f.default


def unknown_settings(environ=None) -> list[str]:
    """One message per ``MPIDDP_*`` variable that is neither a setting nor a script's own,
    with the closest known name when it looks like a typo. ``init()`` logs them on rank 0."""
    environ = os.environ if environ is None else environ
    known = [env_name(f.name) for f in setting_fields()] + list(SCRIPT_VARIABLES)
    # Compare what follows the prefix: the shared "MPIDDP_" would make every name look close.
    suffixes = {name[len("MPIDDP_"):]: name for name in known}
    messages = []
    for name in sorted(k for k in environ if k.startswith("MPIDDP_") and k not in known):
        close = difflib.get_close_matches(name[len("MPIDDP_"):].upper(), suffixes, n=1)
        hint = f"; did you mean {suffixes[close[0]]}?" if close else \
            " (settings are listed in docs/configuration.md)"
        messages.append(f"unknown setting {name} (ignored){hint}")
    return messages


def read_settings(environ=None) -> Settings:
    """Read and validate every ``MPIDDP_*`` setting from ``environ`` (default ``os.environ``),
    with the ``HOROVOD_*`` variables that have an ``MPIDDP_*`` meaning read as it
    (``horovod_env.py``; an ``MPIDDP_*`` variable set too wins). Unknown ``MPIDDP_*`` names
    are ignored here (see ``unknown_settings``)."""
    environ = os.environ if environ is None else environ
    environ = {**settings_from_horovod(environ), **environ}
    names = [f.name for f in setting_fields()]
    return Settings(**{name: read_setting(name, environ) for name in names},
                    explicit=frozenset(n for n in names if env_name(n) in environ))
