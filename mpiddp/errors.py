"""Exceptions raised by mpiddp. All derive from ``MpiddpError``."""
from __future__ import annotations


class MpiddpError(RuntimeError):
    """Base class of every error mpiddp raises on its own account.

    Raised as such (not as a subclass) for: ``join()`` while this rank still has collectives
    in flight; a collective other than allreduce submitted while some ranks have called
    ``join()`` (on every rank that submitted it). Catch ``MpiddpError`` to catch all of
    mpiddp's own errors; bad arguments raise the built-in ``TypeError``/``ValueError``.
    """


class NotInitializedError(MpiddpError):
    """A call that needs ``mpiddp.init()`` came before it.

    The message names the call (e.g. ``mpiddp.rank() needs mpiddp.init() to be called
    first``). A call after ``mpiddp.shutdown()`` raises ``EngineShutdownError`` instead.
    """


class TensorMismatchError(MpiddpError, ValueError):
    """Ranks submitted the same tensor name with different dtype, shape, op, scale factors,
    root, device or collective kind.

    Raised on every rank by ``synchronize()`` of that tensor (the engine keeps serving other
    tensors); the message names the tensor and what each rank sent, e.g. ``Mismatched
    allreduce shapes for 'layer1.weight': rank 0 sent [4, 3], rank 2 sent [3, 4]``. Also
    raised by ``DistributedOptimizer()`` when the ranks' models or settings differ.
    """


class DuplicateNameError(MpiddpError, ValueError):
    """A tensor name was submitted while a request of the same name was still in flight on
    this rank (or twice in one grouped submission).

    Raised at submission, on the submitting rank only. Synchronize the earlier request first
    or use another name.
    """


class HorovodInternalError(MpiddpError):
    """A collective could not complete because the job's communication broke down (Horovod's
    name, kept so that Horovod scripts catching it keep working); see ``EngineShutdownError``,
    the only kind mpiddp raises."""


class EngineShutdownError(HorovodInternalError):
    """The engine stopped before the request finished, or the call came after it stopped.

    Causes: ``shutdown()`` on some rank (agreed by all ranks in the next cycle), a stall
    longer than ``MPIDDP_STALL_SHUTDOWN_TIME``, or a failure of the coordinator thread. The
    message gives the first real cause. Also raised by calls made after ``mpiddp.shutdown()``
    on this rank, and by ``init()`` while an engine that stopped on its own has not been shut
    down yet.
    """


class LaunchError(MpiddpError):
    """This process cannot be a rank as launched: the launcher started several tasks that MPI
    sees as jobs of their own, or a rank started this process (a DataLoader worker).

    Raised by ``init()`` (e.g. ``srun`` without ``--mpi=pmi2``/``pmix``); the message names
    the fix. ``MPIDDP_LAUNCH_CHECK=0`` disables the check. Also raised by ``init()`` (and the
    calls that ask MPI) in a process that a rank started, such as a DataLoader worker that
    'spawn' or 'forkserver' started: no rank of the job.
    """


class PeerLostError(MpiddpError):
    """A partner process of this rank died, or its node: a transport saw its connection close
    (``transport/sockets.py``). Raised on the engine's coordinator thread, which then gives the
    launcher a few seconds to report how that rank ended before it ends the job itself
    (``engine/coordinator.py``); the user's handles fail with ``EngineShutdownError``."""


class InvalidInputError(MpiddpError, ValueError):
    """Some rank rejected its own input to a collective (a dtype the op does not support, a
    bad root rank, splits that do not add up...).

    The rejecting rank does not simply raise on its own, which would leave the other ranks
    waiting forever for a collective it never submits: the rejection is negotiated like a
    mismatch, and every rank raises this error for that call, naming each rejecting rank and
    its reason (e.g. ``Invalid input for allreduce 'grad' on 1 of 2 ranks: rank 0: op=Average
    is not defined for integer tensor ...``). A ``ValueError`` and a ``RuntimeError``.
    """


class InvalidInputTypeError(InvalidInputError, TypeError):
    """``InvalidInputError`` as raised on a rank whose own input had the wrong type (e.g. a
    ``root_rank`` that is not an integer): also a ``TypeError``, as the local check was."""
