"""``HOROVOD_*`` variables in a Horovod job's environment (docs/horovod.md, "Environment
variables").

Those whose meaning mpiddp has are read as the ``MPIDDP_*`` setting they name (an ``MPIDDP_*``
variable set too wins); ``init()`` says so on rank 0 at INFO level. Every other one is named in
a warning on rank 0, once per job, with what to use instead: a job script moved from Horovod
must not lose a setting silently.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

PREFIX = "HOROVOD_"


def _same(raw: str) -> str:
    return raw


def _log_level(raw: str) -> str:
    """Horovod's levels: trace, debug, info, warning, error, fatal."""
    value = raw.strip().lower()
    return {"trace": "debug", "fatal": "error"}.get(value, value)


def _switch(raw: str) -> str:
    """Horovod reads a switch as an integer: 0 off, anything else on."""
    try:
        return "1" if int(raw.strip()) else "0"
    except ValueError:
        return raw


@dataclass(frozen=True)
class Honoured:
    """A Horovod variable with the meaning of an mpiddp setting."""
    setting: str                                # the MPIDDP_* variable
    convert: Callable[[str], str] = _same       # Horovod's value -> mpiddp's
    note: str = ""                              # what the user should know, if anything
    # A value with another meaning in Horovod (not honoured; warned of with this advice).
    unless: Optional[Callable[[str], Optional[str]]] = None


def _timeline_dynamic(raw: str) -> Optional[str]:
    if raw.strip().upper() == "DYNAMIC":
        return ("HOROVOD_TIMELINE=DYNAMIC (record only between start_timeline() and "
                "stop_timeline()) is what mpiddp does without a variable: call "
                "mpiddp.start_timeline() and mpiddp.stop_timeline(path)")
    return None


def _cache_off(raw: str) -> Optional[str]:
    if raw.strip() == "0":
        return ("HOROVOD_CACHE_CAPACITY=0 turns Horovod's response cache off; mpiddp's cannot "
                "be turned off (it only saves work): leave MPIDDP_CACHE_CAPACITY unset")
    return None


HONOURED: dict[str, Honoured] = {
    "HOROVOD_FUSION_THRESHOLD": Honoured("MPIDDP_FUSION_THRESHOLD"),
    "HOROVOD_CACHE_CAPACITY": Honoured("MPIDDP_CACHE_CAPACITY", unless=_cache_off),
    "HOROVOD_TIMELINE": Honoured(
        "MPIDDP_TIMELINE", unless=_timeline_dynamic,
        note="every rank writes its own trace at shutdown(), rank r to <name>.rank<r>.json"),
    "HOROVOD_AUTOTUNE": Honoured("MPIDDP_AUTOTUNE", _switch),
    "HOROVOD_AUTOTUNE_LOG": Honoured("MPIDDP_AUTOTUNE_LOG"),
    "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": Honoured("MPIDDP_AUTOTUNE_MAX_SAMPLES"),
    "HOROVOD_HIERARCHICAL_ALLREDUCE": Honoured("MPIDDP_HIERARCHICAL_ALLREDUCE", _switch),
    "HOROVOD_STALL_CHECK_TIME_SECONDS": Honoured("MPIDDP_STALL_CHECK_TIME"),
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": Honoured("MPIDDP_STALL_SHUTDOWN_TIME"),
    "HOROVOD_LOG_LEVEL": Honoured("MPIDDP_LOG_LEVEL", _log_level),
    "HOROVOD_GLOO_IFACE": Honoured(
        "MPIDDP_SOCKET_IFNAME",
        note="the interfaces of mpiddp's own TCP connections across nodes"),
}

_BUILD = ("a Horovod build variable: mpiddp has nothing to build (pure Python over mpi4py); "
          "GPU tensors go to CUDA-aware MPI or are staged through host memory "
          "(MPIDDP_CUDA_AWARE)")
_HOROVODRUN = ("set by horovodrun's Gloo launch: mpiddp takes ranks from MPI; launch with "
               "mpiexec or srun (docs/running.md)")
# Variables with no mpiddp equivalent, or another meaning: what to do instead.
ADVICE: dict[str, str] = {
    "HOROVOD_CYCLE_TIME": (
        "Horovod waits this long between cycles to batch tensors; mpiddp starts a cycle as "
        "soon as a tensor is ready and fuses whatever is ready then, so there is no batching "
        "delay to set (MPIDDP_CYCLE_TIME only bounds how long an idle rank waits to notice "
        "the others; autotune may tune it: docs/tuning.md)"),
    "HOROVOD_TIMELINE_MARK_CYCLES": (
        "mpiddp's timeline has no cycle markers: each tensor's 'agreed' event is the cycle "
        "that agreed on it (docs/timeline.md)"),
    "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": (
        "counted differently: MPIDDP_AUTOTUNE_WARMUP_WINDOWS sets the windows discarded after "
        "each change of settings"),
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": (
        "counted differently: MPIDDP_AUTOTUNE_STEPS_PER_WINDOW and MPIDDP_AUTOTUNE_WINDOWS "
        "set the steps a setting is measured for"),
    "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "mpiddp's autotune has no such parameter",
    "HOROVOD_HIERARCHICAL_ALLGATHER": (
        "mpiddp's allgather is not hierarchical; MPIDDP_HIERARCHICAL_ALLREDUCE covers the "
        "all-reduce"),
    "HOROVOD_STALL_CHECK_DISABLE": (
        "mpiddp's stall check cannot be turned off: set MPIDDP_STALL_CHECK_TIME to a long "
        "time instead"),
    "HOROVOD_MPI_THREADS_DISABLE": (
        "mpiddp needs MPI with threads (its coordinator thread calls MPI); mpi4py asks for "
        "MPI_THREAD_MULTIPLE by itself"),
    "HOROVOD_CPU_OPERATIONS": "mpiddp always uses MPI (and its own TCP connections across "
                              "nodes, MPIDDP_SOCKET_TRANSPORT)",
    "HOROVOD_CONTROLLER": "mpiddp's coordinator always talks over MPI",
    "HOROVOD_ELASTIC": "elastic jobs start with python -m mpiddp.run (docs/elastic.md)",
    "HOROVOD_DYNAMIC_PROCESS_SETS": "mpiddp.add_process_set() works without it",
    "HOROVOD_NUM_NCCL_STREAMS": "mpiddp does not use NCCL",
    "HOROVOD_BATCH_D2D_MEMCOPIES": "mpiddp has no such switch",
    "HOROVOD_ENABLE_XLA_OPS": "TensorFlow only",
    "HOROVOD_DISABLE_NVTX_RANGES": "mpiddp emits no NVTX ranges",
    "HOROVOD_THREAD_AFFINITY": "bind ranks with your launcher (srun --cpu-bind, mpiexec -bind-to)",
    "HOROVOD_DISABLE_GROUP_FUSION": "mpiddp has no such switch",
    "HOROVOD_ENABLE_ASYNC_COMPLETION": "mpiddp has no such switch",
    "HOROVOD_TORUS_ALLREDUCE": "mpiddp chooses its algorithm (MPIDDP_ALLREDUCE_ALGORITHM)",
    "HOROVOD_ADASUM_MPI_CHUNK_SIZE": "nothing to set: mpiddp's Adasum moves whole halves",
    "HOROVOD_CCL_CACHE": "mpiddp does not use oneCCL",
    "HOROVOD_LOG_HIDE_TIME": "mpiddp's log lines carry no time",
}
for _name in ("HOROVOD_GPU_OPERATIONS", "HOROVOD_GPU_ALLREDUCE", "HOROVOD_GPU_ALLGATHER",
              "HOROVOD_GPU_BROADCAST", "HOROVOD_GPU_ALLTOALL", "HOROVOD_GPU_REDUCESCATTER",
              "HOROVOD_CUDA_HOME", "HOROVOD_NCCL_HOME", "HOROVOD_NCCL_LINK",
              "HOROVOD_BUILD_ARCH_FLAGS", "HOROVOD_CMAKE"):
    ADVICE[_name] = _BUILD
for _name in ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
              "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME",
              "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT",
              "HOROVOD_GLOO_TIMEOUT_SECONDS"):
    ADVICE[_name] = _HOROVODRUN


def _advice(name: str) -> str:
    if name in ADVICE:
        return ADVICE[name]
    if name.startswith(("HOROVOD_WITH_", "HOROVOD_WITHOUT_")):
        return _BUILD
    return "mpiddp has no such setting (docs/horovod.md lists what it reads)"


def _honoured_value(name: str, raw: str) -> Optional[str]:
    """The MPIDDP_* value for Horovod's ``name=raw``; None where this value means something
    mpiddp does not do."""
    rule = HONOURED[name]
    if rule.unless is not None and rule.unless(raw) is not None:
        return None
    return rule.convert(raw)


def settings_from_horovod(environ: Mapping[str, str]) -> dict[str, str]:
    """The ``MPIDDP_*`` values that the ``HOROVOD_*`` variables of ``environ`` set, for the
    settings ``environ`` does not set itself."""
    values = {}
    for name, rule in HONOURED.items():
        if name in environ and rule.setting not in environ:
            value = _honoured_value(name, environ[name])
            if value is not None:
                values[rule.setting] = value
    return values


def horovod_messages(environ: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(info lines, warnings) about the ``HOROVOD_*`` variables of ``environ``: one line per
    variable read as an mpiddp setting, one warning per variable not read (launcher
    variables that horovodrun sets together share one warning)."""
    infos, warnings, launcher = [], [], []
    for name in sorted(k for k in environ if k.startswith(PREFIX)):
        raw = environ[name]
        rule = HONOURED.get(name)
        if rule is not None:
            value = _honoured_value(name, raw)
            if value is None:
                warnings.append(f"{name}={raw} ignored: {rule.unless(raw)}")
            elif rule.setting in environ and environ[rule.setting] != value:
                warnings.append(f"{name}={raw} ignored: {rule.setting}={environ[rule.setting]} "
                                "is set too and wins")
            elif rule.setting not in environ:
                note = f" ({rule.note})" if rule.note else ""
                infos.append(f"{name}={raw} read as {rule.setting}={value}{note}")
        elif ADVICE.get(name) == _HOROVODRUN:
            launcher.append(name)
        else:
            warnings.append(f"{name} ignored: {_advice(name)}")
    if launcher:
        warnings.append(f"{', '.join(launcher)} ignored: {_HOROVODRUN}")
    return infos, warnings
