"""The coordinator's inbox: what user threads hand the coordinator thread, and its wait for it.

Items travel in a ``queue.SimpleQueue`` (C, cheap to put and drain); the wait for the first
one is ``Lock.acquire(timeout=...)`` on a doorbell lock that every put releases, never
``SimpleQueue.get(timeout=...)``. In CPython 3.11 and 3.12 that call can wait without a
deadline: when the queue's lock is free (its last ``get`` returned an item) and the thread is
descheduled past the deadline between its first try of the lock and its second, it waits for
the next ``put``, however long (3.13 rewrote the queue). On a busy node (DataLoader workers
on every core, more ranks than cores) a coordinator with pending work and no more
submissions coming then never began its next cycle, and every rank hung (found with 33 ranks
on 2 cores; the engine start worker's third check). ``Lock.acquire`` treats a passed
deadline as a timeout (checked under the same load: no hang in ~10^5 waits of 1 us, where
the queue hung within ~10^4). A plain lock rather than a ``threading.Event``: the Event's
Python-level condition cost ~3 us per synchronous all-reduce.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Iterable, Optional


class Inbox:
    """Many producers (user threads), one consumer (the coordinator)."""

    def __init__(self):
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        # Held: nothing new since the consumer last looked; released by a put (a release of a
        # released lock raises: a wake-up is pending already).
        self._doorbell = threading.Lock()
        self._doorbell.acquire()

    def put(self, item: Any) -> None:
        self._items.put(item)
        self._ring()

    def put_many(self, items: Iterable[Any]) -> None:
        for item in items:
            self._items.put(item)
        self._ring()

    def _ring(self) -> None:
        try:
            self._doorbell.release()
        except RuntimeError:
            pass

    def take(self, timeout: Optional[float]) -> list:
        """Everything queued, after waiting up to ``timeout`` seconds for a first item if there
        is none (None: no wait)."""
        self._doorbell.acquire(False)   # before looking: a put after this rings again
        if timeout is not None and self._items.empty():
            # Rung: held again, so the next take starts clean; timed out: still held.
            self._doorbell.acquire(timeout=max(timeout, 0.0))   # -1 would mean forever
        return self.drain()

    def drain(self) -> list:
        """Everything queued now, without waiting."""
        items = []
        while not self._items.empty():   # the coordinator is the only consumer
            items.append(self._items.get_nowait())
        return items
