"""Handles: what an asynchronous call returns, completed by the coordinator thread."""
from __future__ import annotations

import _thread
from time import perf_counter


class Handle:
    """The future of one collective. ``wait()`` blocks (without spinning) and returns
    ``result``, or raises the error the engine recorded for this request.

    A plain lock, created held and released on completion, is the cheapest wake-up Python
    offers (a ``threading.Event`` costs several times more per handle).

    ``stats`` (set by the engine that takes the handle): where the time a caller spends
    blocked in ``wait`` adds up (``EngineStats.add_wait``)."""

    __slots__ = ("name", "result", "info", "done_event", "stats", "_lock", "_done", "_error")

    def __init__(self, name: str, result=None):
        self.name = name
        self.result = result
        self.info = None            # extra agreed data, e.g. alltoall's received splits
        self.done_event = None      # device results: the event recorded after writing them
        self.stats = None
        self._error: BaseException | None = None
        self._done = False
        self._lock = _thread.allocate_lock()
        self._lock.acquire()

    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None):
        if not self._done:
            start = perf_counter()
            acquired = self._lock.acquire(timeout=-1 if timeout is None else timeout)
            if self.stats is not None:
                self.stats.add_wait(perf_counter() - start)
            if not acquired:
                raise TimeoutError(f"collective '{self.name}' did not finish within {timeout} s")
            self._lock.release()    # let any other waiter through too
        if self._error is not None:
            raise self._error
        return self.result

    def complete(self, result=None) -> None:
        if result is not None:
            self.result = result
        self._done = True
        self._lock.release()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self.complete()

    def __repr__(self) -> str:
        state = "failed" if self._error else ("done" if self._done else "pending")
        return f"<mpiddp.Handle {self.name!r} {state}>"
