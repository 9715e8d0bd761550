"""Is the MPI library CUDA-aware? A run-time probe through ctypes, a decision table over its
answers, and the decision in force.

mpi4py has no query for this, but the libraries do, as extensions, and not every answer means
what it says. ``interpret`` is the table (a pure function of the library's version string, the
answers of its query functions and the environment); ``probe`` gathers those inputs from the
loaded library. Anything the table is unsure of is staged through host memory, with the reason
logged: a wrong "yes" crashes or corrupts data, a wrong "no" only costs copies.

* MPICH 4.0+ (and derivatives without a rule of their own): ``MPIX_GPU_query_support(
  MPIX_GPU_SUPPORT_CUDA, &flag)`` is true when MPICH was built with CUDA *and* GPU support
  is on at run time (``MPIR_CVAR_ENABLE_GPU``): its answer.
* Cray MPICH: GPU support only with ``MPICH_GPU_SUPPORT_ENABLED=1`` set before ``MPI_Init``:
  no unless it is set; then the query's answer (yes without a query).
* Open MPI 4.1+ and 5.0 releases: ``MPIX_Query_cuda_support()`` is run-time support: its
  answer.
* Open MPI up to 4.0: ``MPIX_Query_cuda_support()`` returns the *build* flag: 1 is unsure
  (built with CUDA, not necessarily usable), so stage; 0 is no.
* Open MPI 5 release candidates answer 0 even with CUDA support: 0 is unsure (stage), 1 yes.
* MVAPICH2 (-GDR) has no query function: yes with ``MV2_USE_CUDA=1``, else no.
* Intel MPI (2021.14 and later take NVIDIA device pointers): its switches decide
  (``intel_mpi.py``). No without ``I_MPI_OFFLOAD=1``, and with ``I_MPI_OFFLOAD_MODE=level_zero``
  (Intel GPUs); yes with ``I_MPI_OFFLOAD_MODE=cuda``; in the ``auto`` mode (the default), which
  may have chosen Level Zero, yes only when a query says yes, else unsure. Its query functions
  answer 0 without offload; what they answer with it on a GPU has not been seen, so they are
  not needed for a yes.
* Any other library: the answer of whichever query it has; none: no.

The functions are looked up in the MPI library this process has loaded (the one mpi4py uses,
found in ``/proc/self/maps``, or through mpi4py's extension module, whose dependencies
``dlsym`` searches).

``MPIDDP_CUDA_AWARE`` overrides the probe: ``1`` (trust that device pointers may go to MPI),
``0`` (always stage through host memory) or ``auto`` (the default: probe).
"""
from __future__ import annotations

import ctypes
import logging
import os
import re
from dataclasses import dataclass, replace
from typing import Optional

from mpi4py import MPI

from ..intel_mpi import offload

log = logging.getLogger("mpiddp")

MPIX_GPU_SUPPORT_CUDA = 0
_MPI_LIBRARY = re.compile(r"^lib(mpi|mpich|mpi_abi|msmpi|impi)(\.|-|_)?[\w.\-]*\.so")
_NOT_MPI = ("libmpi_cxx", "libmpi_mpifh", "libmpi_usempi", "libmpifort", "libmpicxx")


@dataclass(frozen=True)
class Probe:
    """What the MPI library says, as ``interpret`` reads it. ``supported`` is None when the
    answer cannot be trusted or there is none (then device buffers are staged); ``reason``
    says why, for the log."""

    supported: Optional[bool]
    library: Optional[str]     # path of the library that answered (or was searched)
    query: Optional[str]       # the function that answered
    reason: str = ""           # why this answer (the decision table's row)

    def describe(self) -> str:
        where = os.path.basename(self.library) if self.library else "the MPI library"
        if self.query is None and self.supported is None and not self.reason:
            return f"{where} has no MPIX_GPU_query_support/MPIX_Query_cuda_support"
        if self.query is not None:
            answer = {True: "yes", False: "no", None: "unsure"}[self.supported]
            text = f"{self.query} in {where} says {answer}"
        else:
            text = where
        return f"{text}: {self.reason}" if self.reason else text


@dataclass(frozen=True)
class Decision:
    """Whether the engine hands device pointers to MPI, and why."""

    cuda_aware: bool
    setting: str
    probe: Optional[Probe]

    def describe(self) -> str:
        answer = "yes" if self.cuda_aware else "no"
        if self.setting == "auto":
            return f"{answer} ({self.probe.describe()})"
        text = f"{answer} (MPIDDP_CUDA_AWARE={self.setting}"
        if self.probe is not None:
            text += f"; the probe: {self.probe.describe()}"
        return text + ")"


def loaded_mpi_libraries(maps_path: str = "/proc/self/maps") -> list[str]:
    """Paths of MPI libraries mapped into this process (Linux); empty elsewhere."""
    try:
        with open(maps_path) as maps:
            lines = maps.read().splitlines()
    except OSError:
        return []
    found: list[str] = []
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue
        path = parts[5].strip()
        name = os.path.basename(path)
        if _MPI_LIBRARY.match(name) and not name.startswith(_NOT_MPI) and path not in found:
            found.append(path)
    return found


def _candidates() -> list[str]:
    paths = loaded_mpi_libraries()
    module = getattr(MPI, "__file__", None)
    if module:
        paths.append(module)      # dlsym on its handle searches its dependencies (libmpi)
    return paths


@dataclass(frozen=True)
class Answers:
    """What one library offers: its version string and the raw answers of its query
    functions (None: the function is absent, or failed)."""

    version: str = ""
    gpu_query: Optional[int] = None       # MPIX_GPU_query_support(CUDA) flag
    cuda_query: Optional[int] = None      # MPIX_Query_cuda_support() result


GPU_QUERY = "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA)"
CUDA_QUERY = "MPIX_Query_cuda_support()"
_OPEN_MPI = re.compile(r"Open MPI v(\d+)\.(\d+)(?:\.\d+)?(\S*)")


def interpret(answers: Answers, environ=os.environ, library: Optional[str] = None) -> Probe:
    """The decision table of the module docstring: what the library's answers mean."""
    if "INTEL(R) MPI" in (answers.version or "").upper():
        return _intel(answers, environ, library)
    found = _interpret_others(answers, environ, library)
    if found.supported is False and offload(environ).requested:
        note = "I_MPI_OFFLOAD=1 is Intel MPI's switch, and this MPI is not Intel MPI"
        found = replace(found, reason=f"{found.reason}; {note}" if found.reason else note)
    return found


def _interpret_others(answers: Answers, environ, library: Optional[str]) -> Probe:
    version = answers.version or ""
    gpu, cuda = answers.gpu_query, answers.cuda_query
    if "CRAY MPICH" in version.upper():
        setting = environ.get("MPICH_GPU_SUPPORT_ENABLED", "")
        if setting != "1":
            return Probe(False, library, None,
                         "Cray MPICH supports device buffers only with "
                         "MPICH_GPU_SUPPORT_ENABLED=1 set before MPI starts (it is "
                         f"{setting or 'not set'})")
        if gpu is not None:
            return Probe(bool(gpu), library, GPU_QUERY,
                         "Cray MPICH, MPICH_GPU_SUPPORT_ENABLED=1")
        return Probe(True, library, None, "Cray MPICH with MPICH_GPU_SUPPORT_ENABLED=1")
    if "MVAPICH" in version.upper():
        if environ.get("MV2_USE_CUDA", "") == "1":
            return Probe(True, library, None,
                         "MVAPICH2 has no query function; MV2_USE_CUDA=1 is set")
        return Probe(False, library, None,
                     "MVAPICH2 has no query function and MV2_USE_CUDA=1 is not set")
    match = _OPEN_MPI.search(version)
    if match is not None and cuda is not None:
        major, minor, suffix = int(match.group(1)), int(match.group(2)), match.group(3)
        if (major, minor) <= (4, 0):
            if cuda:
                return Probe(None, library, CUDA_QUERY,
                             f"Open MPI {major}.{minor} answers with its build flag (built "
                             "with CUDA, not necessarily usable): staging to be safe")
            return Probe(False, library, CUDA_QUERY,
                         f"Open MPI {major}.{minor} built without CUDA")
        if "rc" in suffix.lower() and not cuda:
            return Probe(None, library, CUDA_QUERY,
                         f"Open MPI {major}.{minor}{suffix} (a release candidate) answers 0 "
                         "even with CUDA support: staging to be safe")
        return Probe(bool(cuda), library, CUDA_QUERY)
    if gpu is not None:
        return Probe(bool(gpu), library, GPU_QUERY)
    if cuda is not None:
        return Probe(bool(cuda), library, CUDA_QUERY)
    return Probe(None, library, None)


def _intel(answers: Answers, environ, library: Optional[str]) -> Probe:
    """Intel MPI's rows of the table: its offload switches decide."""
    switches = offload(environ)
    if not switches.requested:
        return Probe(False, library, None,
                     "Intel MPI takes device buffers only with I_MPI_OFFLOAD=1 set before MPI "
                     f"starts (it is {switches.setting or 'not set'})")
    if switches.mode == "cuda":
        return Probe(True, library, None,
                     f"Intel MPI, I_MPI_OFFLOAD={switches.setting} and I_MPI_OFFLOAD_MODE=cuda")
    if switches.mode == "level_zero":
        return Probe(False, library, None,
                     "Intel MPI with I_MPI_OFFLOAD_MODE=level_zero takes Intel GPUs' buffers, "
                     "not CUDA's: set I_MPI_OFFLOAD_MODE=cuda")
    for query, answer in ((GPU_QUERY, answers.gpu_query), (CUDA_QUERY, answers.cuda_query)):
        if answer:
            return Probe(True, library, query,
                         f"Intel MPI, I_MPI_OFFLOAD={switches.setting}, "
                         f"I_MPI_OFFLOAD_MODE={switches.mode}")
    return Probe(None, library, None,
                 f"Intel MPI with I_MPI_OFFLOAD={switches.setting} and I_MPI_OFFLOAD_MODE="
                 f"{switches.mode} may have chosen Level Zero rather than CUDA, and its queries "
                 "do not say yes: set I_MPI_OFFLOAD_MODE=cuda")


def _call_version(library: ctypes.CDLL) -> str:
    get = getattr(library, "MPI_Get_library_version", None)
    if get is None:
        return ""
    get.restype = ctypes.c_int
    get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)]
    text = ctypes.create_string_buffer(8192)     # MPI_MAX_LIBRARY_VERSION_STRING or more
    length = ctypes.c_int(0)
    if get(text, ctypes.byref(length)) != 0:
        return ""
    return text.value.decode("utf-8", "replace")


def ask(library: ctypes.CDLL) -> Answers:
    """Call the version and query functions ``library`` exports."""
    gpu_answer = cuda_answer = None
    gpu_query = getattr(library, "MPIX_GPU_query_support", None)
    if gpu_query is not None:
        gpu_query.restype = ctypes.c_int
        gpu_query.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        supported = ctypes.c_int(0)
        if gpu_query(MPIX_GPU_SUPPORT_CUDA, ctypes.byref(supported)) == 0:
            gpu_answer = int(supported.value)
    cuda_query = getattr(library, "MPIX_Query_cuda_support", None)
    if cuda_query is not None:
        cuda_query.restype = ctypes.c_int
        cuda_query.argtypes = []
        cuda_answer = int(cuda_query())
    return Answers(_call_version(library), gpu_answer, cuda_answer)


def probe(libraries: Optional[list[str]] = None, environ=os.environ) -> Probe:
    """Ask the loaded MPI library whether it can read and write CUDA device memory, and read
    the answer with ``interpret``. Call it after MPI is initialised (importing
    ``mpi4py.MPI`` does that)."""
    searched = None
    for path in (_candidates() if libraries is None else libraries):
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        searched = searched or path
        answers = ask(library)
        if answers.version or answers.gpu_query is not None or answers.cuda_query is not None:
            return interpret(answers, environ, path)
    return Probe(None, searched, None)


def decide(setting: str, found: Optional[Probe]) -> Decision:
    """Apply the ``MPIDDP_CUDA_AWARE`` setting ('auto', '0' or '1') to a probe result."""
    if setting not in ("auto", "0", "1"):
        raise ValueError(f"MPIDDP_CUDA_AWARE={setting!r} is not one of: auto, 0, 1")
    if setting == "auto":
        if found is None:
            raise ValueError("MPIDDP_CUDA_AWARE=auto needs a probe result")
        return Decision(bool(found.supported), setting, found)
    return Decision(setting == "1", setting, found)


_decision: Optional[Decision] = None


def configure(setting: str) -> Decision:
    """Decide at ``init()`` (probing unless overridden) and keep the decision for the run."""
    global _decision
    _decision = decide(setting, probe())
    if setting == "1" and _decision.probe is not None and _decision.probe.supported is False:
        log.warning("MPIDDP_CUDA_AWARE=1 although %s: device pointers will be passed to MPI, "
                    "which crashes or corrupts data if MPI cannot read device memory",
                    _decision.probe.describe())
    elif setting == "auto" and _decision.probe.supported is None and _decision.probe.reason:
        # The library may well be CUDA-aware, but its answer cannot be trusted.
        log.warning("CUDA-aware MPI: unsure (%s); device buffers are staged through host "
                    "memory. Set MPIDDP_CUDA_AWARE=1 if this MPI can read device memory.",
                    _decision.probe.describe())
    elif setting == "auto" and not _decision.cuda_aware and offload().requested:
        # Asked for, and not to be had: say so rather than stage in silence.
        log.warning("I_MPI_OFFLOAD=%s asks Intel MPI to take device buffers, but %s; device "
                    "buffers are staged through host memory", offload().setting,
                    _decision.probe.describe())
    return _decision


def current_decision() -> Decision:
    """The decision of the running job, or (before ``init()``) one made now from the
    environment and a fresh probe."""
    if _decision is not None:
        return _decision
    from ..config import read_settings

    return decide(read_settings().cuda_aware, probe())


def reset() -> None:
    global _decision
    _decision = None


def mpi_cuda_aware() -> bool:
    """Whether mpiddp hands CUDA device buffers to MPI directly.

    Decided at ``init()`` from ``MPIDDP_CUDA_AWARE`` (default ``auto``: ask the loaded MPI
    library through ``MPIX_GPU_query_support`` or ``MPIX_Query_cuda_support``, or for
    MVAPICH2, Cray MPICH and Intel MPI their environment switches; an answer that cannot be
    trusted, or none, counts as not CUDA-aware). Before ``init()`` the answer is worked out now,
    from the environment and a fresh probe.

    Returns:
        True when device buffers go to MPI as they are; False when they are staged through
        pinned host memory.

    Raises:
        ValueError: before ``init()`` only: an ``MPIDDP_*`` environment variable has an
            invalid value.
    """
    return current_decision().cuda_aware
