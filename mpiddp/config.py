"""Settings read once from ``MPIDDP_*`` environment variables at ``init()``.

Every setting is listed, with its default and meaning, in ``docs/configuration.md``.
A bad value raises ``ValueError`` naming the variable, the value and what is allowed.
An unknown ``MPIDDP_*`` name is not an error (``unknown_settings`` words a warning for it):
a job must not die of a variable meant for a script, or of one a newer version knows.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, fields

ALGORITHMS = ("auto", "ring", "native")
TRI_STATE = ("auto", "0", "1")
# MPIDDP_* variables that belong to the project's scripts and tests, not to the engine:
# MPIDDP_VENV picks the virtual environment (scripts/ensure_env.sh, the job scripts) and
# MPIDDP_SYSTEM_TESTS runs the tests that change the machine (tests/conftest.py). Job
# environments carry them into every rank, so they pass without a warning.
SCRIPT_VARIABLES = ("MPIDDP_VENV", "MPIDDP_SYSTEM_TESTS")


@dataclass(frozen=True)
class Settings:
    """Validated engine settings. Field names map to ``MPIDDP_<FIELD NAME UPPERCASE>``."""

    # Longest time (ms) an idle coordinator waits before it joins a heartbeat cycle.
    # Work starts a cycle at once; this only bounds how late an idle rank notices others.
    cycle_time: float = 50.0
    # Fusion buffer size in bytes: ready tensors are packed together up to this size.
    fusion_threshold: int = 1024 * 1024
    # Number of tensor names the response cache remembers (bit-vector negotiation).
    cache_capacity: int = 1024
    # Seconds before rank 0 warns about tensors submitted by some ranks but not others.
    stall_check_time: float = 60.0
    # Seconds after which a stall shuts the engine down on every rank (0 = never). Finite by
    # default, like NCCL's 10-minute watchdog, so that a hung job does not burn its allocation.
    stall_shutdown_time: float = 600.0
    # Reduction algorithm for fused buffers: auto (by size), ring or native MPI_Allreduce.
    allreduce_algorithm: str = "auto"
    # auto: messages of at most this many bytes use native MPI_Allreduce, larger ones the ring.
    ring_threshold: int = 2 * 1024 * 1024
    # Abort the whole MPI job when a rank dies of an uncaught exception.
    abort_on_exception: bool = True
    # Record a timeline of engine events (negotiation and execution times) in memory.
    timeline: bool = False
    # Log level of the 'mpiddp' logger (DEBUG, INFO, WARNING, ERROR).
    log_level: str = "WARNING"
    # Whether MPI can read device memory directly: auto (probe), 0 or 1.
    cuda_aware: str = "auto"
    # Refuse to start when the launcher started N > 1 tasks but MPI sees one process in each
    # (srun without PMI, or another MPI's mpiexec): see mpiddp/launch_check.py.
    launch_check: bool = True


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean: use 1/0, true/false, yes/no or on/off")


def _parse_number(name: str, raw: str, kind: type, minimum: float):
    try:
        value = kind(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a valid {kind.__name__}") from None
    if value < minimum:
        raise ValueError(f"{name}={raw!r} must be at least {minimum}")
    return value


def _parse_choice(name: str, raw: str, choices: tuple[str, ...]) -> str:
    value = raw.strip().lower()
    if value not in choices:
        raise ValueError(f"{name}={raw!r} is not one of: {', '.join(choices)}")
    return value


def env_name(field_name: str) -> str:
    return "MPIDDP_" + field_name.upper()


def unknown_settings(environ=None) -> list[str]:
    """One message per ``MPIDDP_*`` variable that is neither a setting nor a script's own,
    with the closest known name when it looks like a typo. ``init()`` logs them on rank 0."""
    environ = os.environ if environ is None else environ
    known = [env_name(f.name) for f in fields(Settings)] + list(SCRIPT_VARIABLES)
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
    """Read and validate every ``MPIDDP_*`` setting from ``environ`` (default ``os.environ``).
    Unknown ``MPIDDP_*`` names are ignored here (see ``unknown_settings``)."""
    environ = os.environ if environ is None else environ
    values = {}
    for f in fields(Settings):
        name = env_name(f.name)
        if name not in environ:
            continue
        raw = environ[name]
        if f.type == "bool":
            values[f.name] = _parse_bool(name, raw)
        elif f.type == "int":
            values[f.name] = _parse_number(name, raw, int, 0)
        elif f.type == "float":
            values[f.name] = _parse_number(name, raw, float, 0.0)
        elif f.name == "allreduce_algorithm":
            values[f.name] = _parse_choice(name, raw, ALGORITHMS)
        elif f.name == "cuda_aware":
            values[f.name] = _parse_choice(name, raw, TRI_STATE)
        elif f.name == "log_level":
            values[f.name] = _parse_choice(name, raw, ("debug", "info", "warning", "error")).upper()
    settings = Settings(**values)
    if settings.cycle_time <= 0:
        raise ValueError(f"MPIDDP_CYCLE_TIME={settings.cycle_time} must be greater than 0")
    if settings.cache_capacity < 1:
        raise ValueError("MPIDDP_CACHE_CAPACITY must be at least 1")
    if settings.stall_check_time <= 0:
        raise ValueError("MPIDDP_STALL_CHECK_TIME must be greater than 0")
    return settings
