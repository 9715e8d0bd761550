"""What the asynchronous calls return, and how to wait for it."""
from __future__ import annotations

from typing import Any, Callable

from ...engine.handle import Handle
from ..core.streams import wait_done

__all__ = ["TensorHandle", "synchronize", "poll"]


class TensorHandle:
    """What the ``*_async`` calls return; pass it to ``synchronize`` or ``poll``.

    Made by mpiddp, not by users. One handle may cover several engine requests (a grouped
    all-reduce); it is done when all of them are.
    """

    __slots__ = ("_handles", "_finalize", "_value", "_finished")

    def __init__(self, handles: list[Handle], finalize: Callable[[], object]):
        self._handles = handles
        self._finalize = finalize
        self._finished = False
        self._value = None

    def done(self) -> bool:
        """Whether every request of this handle has finished (successfully or not).

        Returns:
            True when ``wait()`` would return or raise without blocking.
        """
        return all(h.done() for h in self._handles)

    def wait(self) -> Any:
        """Block until every request has finished, then return the result (``synchronize``
        is the public spelling). Later calls return the same result (or raise the same
        error).

        Returns:
            The result of the collective (see the ``*_async`` call that made the handle).

        Raises:
            MpiddpError: the first error of this handle's requests (``TensorMismatchError``,
                ``EngineShutdownError``, ...), raised once all of them have finished.
        """
        if not self._finished:
            error = None
            for handle in self._handles:    # wait for all: none may still write afterwards
                try:
                    handle.wait()
                except BaseException as exc:
                    error = error or exc
            if error is not None:
                raise error
            # Device results: the caller's current stream waits for the engine's done event.
            wait_done(list({id(h.done_event): h.done_event for h in self._handles
                            if h.done_event is not None}.values()))
            self._value = self._finalize()
            self._finished = True
        return self._value

    @property
    def names(self) -> list[str]:
        """The engine names of this handle's requests, in submission order."""
        return [h.name for h in self._handles]

    def __repr__(self) -> str:
        return f"<mpiddp.TensorHandle {self.names} {'done' if self.done() else 'pending'}>"


def combined(parts: list[TensorHandle]) -> TensorHandle:
    """One handle for several (pieces of one tensor reduced apart); its result is None."""
    return TensorHandle([h for part in parts for h in part._handles], lambda: None)


def synchronize(handle: TensorHandle) -> Any:
    """Wait for an asynchronous collective and return its output.

    Waits for every request of the handle, also after one failed, so that no reduction
    still writes into a tensor afterwards. Calling it again on the same handle returns the
    same output (or raises the same error).

    Args:
        handle: what an ``*_async`` call (or ``submit_together``) returned.

    Returns:
        The collective's output: a tensor (in-place calls: the input tensor itself), a list
        of tensors for grouped all-reduces, ``(output, received_splits)`` for ``alltoall``
        with ``splits``, None for handles of ``submit_together``.

    Raises:
        TypeError: ``handle`` is not a ``TensorHandle``.
        TensorMismatchError: the ranks disagreed on the request (shape, dtype, op, root,
            scale factors, device type or collective kind); raised on every rank.
        MpiddpError: a collective other than allreduce while some ranks have called
            ``join()``.
        EngineShutdownError: the engine stopped before the request finished (``shutdown()``
            on some rank, a stall timeout or a failure); the message gives the cause.
    """
    if not isinstance(handle, TensorHandle):
        raise TypeError(f"synchronize() takes a handle returned by an *_async call, "
                        f"not {type(handle).__name__}")
    return handle.wait()


def poll(handle: TensorHandle) -> bool:
    """Whether an asynchronous collective has finished, without waiting.

    Args:
        handle: what an ``*_async`` call (or ``submit_together``) returned.

    Returns:
        True when ``synchronize(handle)`` would return (or raise) without waiting.

    Raises:
        TypeError: ``handle`` is not a ``TensorHandle``.
    """
    if not isinstance(handle, TensorHandle):
        raise TypeError(f"poll() takes a handle returned by an *_async call, "
                        f"not {type(handle).__name__}")
    return handle.done()
