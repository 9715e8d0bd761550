"""What a rank asks the engine for (Request), what the ranks agreed (Response), and the
local bookkeeping of one submitted request (Entry)."""
from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple, Optional

from ..errors import (InvalidInputError, InvalidInputTypeError, MpiddpError,
                      TensorMismatchError)
from .handle import Handle

ALLREDUCE = "allreduce"
ALLGATHER = "allgather"
BROADCAST = "broadcast"
REDUCESCATTER = "reducescatter"
ALLTOALL = "alltoall"
BARRIER = "barrier"
KINDS = (ALLREDUCE, ALLGATHER, BROADCAST, REDUCESCATTER, ALLTOALL, BARRIER)

# Kinds whose agreed response depends only on the request, so it can live in the cache.
CACHEABLE = (ALLREDUCE, BROADCAST, REDUCESCATTER, BARRIER)

# Why a response is an error (Response.error_kind): the ranks sent different requests; some
# rank rejected its own input; the request cannot run now (join in progress).
MISMATCH, INVALID, REFUSED = "mismatch", "invalid", "refused"


class Request(NamedTuple):
    """The metadata of one rank's collective; it travels to rank 0 the first time a name is
    seen. Everything here except ``splits`` and, for gathers, the first dimension must agree.
    (A NamedTuple: cheap to build and compare on the hot path.)"""

    name: str
    kind: str
    dtype: str
    shape: tuple
    device: str = "cpu"
    op: int = 1
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    splits: Optional[tuple] = None   # alltoall: rows sent to each rank
    # This rank rejected its own input (the reason): the request only tells the other ranks,
    # so that the collective fails on every rank instead of leaving them waiting.
    invalid: Optional[str] = None
    # > 0: an all-reduce (or a ring_order half) the engine may schedule by urgency (1 = most
    # urgent): in a cycle, ready prioritized requests run most urgent first, up to
    # Settings.priority_cycle_bytes, and the rest wait one cycle so that more urgent ones
    # submitted meanwhile overtake them (forward overlap: the next forward needs the first
    # layers' gradients, or a sharded optimizer's first layers' bucket, first).
    priority: int = 0
    # Prioritized all-reduces: the most bytes of them one cycle runs, carried by the request
    # (forward overlap's pieces, sized for its gradients: torch/gradients/cycle_budget.py); 0: the
    # engine's Settings.priority_cycle_bytes. The agreed request's value counts, so every
    # rank cuts a cycle at the same place.
    cycle_bytes: int = 0
    # The all-reduce's halves for a sharded optimizer (torch/sharding/), its buffer cut as
    # collectives/shard_grid.py says: 1 (RING_FLAT) the ring's chunks over all the ranks, rank
    # r keeping chunk ``(r + 1) % size``; 2 (RING_BY_NODE) a chunk of its node's chunk, reduced
    # within the node first. Reduce-scatter: summed in the all-reduce's order, in the caller's
    # buffer, which it hands over (0: rank r keeps chunk r, the input untouched). All-gather:
    # rank r's input is its piece, circulated back; its shape is the whole output's, the same
    # on every rank (so the agreement can be cached), which ends in bucket order (0:
    # MPI_Allgatherv, in rank order). engine/ring_halves.py runs them.
    ring_order: int = 0
    # > 0: a library call every rank must make (``Checkpoint.save``: a barrier named after
    # it). Once it has waited this long (at most ``MPIDDP_STALL_CHECK_TIME``) for ranks that
    # wait in other collectives instead, the ranks stop with an error naming the call and
    # the ranks that skipped it (stall.find_skipped), not after the stall rules' minutes.
    deadline: float = 0.0

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def error_for(response: "Response", rejected: Optional[BaseException] = None) -> Exception:
    """The exception a rank raises for an agreed error ``response``; ``rejected`` is this
    rank's own reason to reject its input, if it had one (a TypeError stays a TypeError)."""
    if isinstance(rejected, TypeError):
        return InvalidInputTypeError(response.error)
    kind = {MISMATCH: TensorMismatchError, INVALID: InvalidInputError}.get(
        response.error_kind, MpiddpError)
    return kind(response.error)


class Response(NamedTuple):
    """The ranks' agreement on one name: the request every rank executes, or an error.
    ``sizes`` carries per-rank data: gathered first dimensions (allgather) or the full
    send-splits matrix (alltoall)."""

    request: Request
    error: Optional[str] = None
    sizes: Optional[tuple] = None
    error_kind: str = MISMATCH          # with ``error``: MISMATCH, INVALID or REFUSED

    @property
    def name(self) -> str:
        return self.request.name


class Entry:
    """One locally submitted request with its buffers and handle (never leaves the rank).

    ``input`` and ``output`` are flat arrays (NumPy on the host). ``allocate(shape)`` makes the
    output once its shape is known (allgather, alltoall, reducescatter) and returns a flat view.
    ``ready_event`` is device work the engine must wait for before reading ``input``.
    """

    __slots__ = ("request", "input", "output", "handle", "allocate", "ready_event",
                 "submitted", "sent", "action", "rejected")

    def __init__(self, request: Request, input: Any, output: Any, handle: Handle,
                 allocate: Optional[Callable[[tuple], Any]] = None, ready_event: Any = None,
                 action: Optional[Callable[[], None]] = None):
        self.request = request
        self.input = input
        self.output = output
        self.handle = handle
        self.allocate = allocate
        self.ready_event = ready_event
        self.submitted = time.perf_counter()
        self.sent = False               # its Request has gone to rank 0
        # A barrier's action runs on the coordinator at the barrier's agreed place in the
        # execution order, i.e. at the same point on every rank (engine reconfiguration).
        self.action = action
        self.rejected: Optional[BaseException] = None   # this rank's reason (request.invalid)
