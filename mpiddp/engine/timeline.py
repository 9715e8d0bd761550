"""Timeline: when each tensor was submitted, agreed and reduced, for overlap analysis and
Chrome's trace viewer (chrome://tracing, Perfetto)."""
from __future__ import annotations

import json
import os
import threading
import time


class Timeline:
    """In-memory event log, off unless started. Times are ``time.perf_counter()`` seconds."""

    def __init__(self, enabled: bool = False):
        self._lock = threading.Lock()
        self._events: list[tuple[str, str, float]] = []
        self._bytes: dict[str, int] = {}     # tensor name -> bytes handed over (last seen)
        self.enabled = enabled

    def record(self, name: str, phase: str, when: float | None = None) -> None:
        if self.enabled:
            with self._lock:
                self._events.append((name, phase, time.perf_counter() if when is None else when))

    def record_bytes(self, name: str, nbytes: int) -> None:
        """The bytes of the tensor ``name`` this rank handed over (its spans carry them)."""
        if self.enabled:
            self._bytes[name] = nbytes

    def start(self) -> None:
        with self._lock:
            self._events.clear()
            self._bytes.clear()
        self.enabled = True

    def stop(self) -> list[tuple[str, str, float]]:
        self.enabled = False
        return self.events()

    def sizes(self) -> dict[str, int]:
        """Tensor name -> the bytes this rank handed over (the last time it was seen)."""
        with self._lock:
            return dict(self._bytes)

    def events(self) -> list[tuple[str, str, float]]:
        """(name, phase, time). Tensors: submit, agreed, start, end. A DistributedOptimizer
        (named by its prefix, e.g. ``opt0``): backward_end and synchronized (the wait for the
        last reductions at the end of backward), step_begin and step_end."""
        with self._lock:
            return list(self._events)

    def write_chrome_trace(self, path: str, rank: int) -> None:
        """Write the events as a Chrome trace: one row per tensor, spans from submission to
        agreement (NEGOTIATE), from agreement to the start of its reduction (QUEUE: waiting
        for the engine, e.g. behind other fusion buffers) and from start to end of its
        reduction (REDUCE); one row per optimizer, spans of forward and backward (COMPUTE: from
        the previous step's end to the end of backward), of the wait for the last reductions
        (WAIT) and of the step (STEP). A tensor's spans carry its bytes, as this rank handed
        them over, in ``args.bytes``."""
        spans = []
        sizes = dict(self._bytes)
        times: dict[str, dict[str, float]] = {}
        pairs = {"agreed": ("submit", "NEGOTIATE"), "start": ("agreed", "QUEUE"),
                 "end": ("start", "REDUCE"),
                 "backward_end": ("step_end", "COMPUTE"), "synchronized": ("backward_end", "WAIT"),
                 "step_end": ("step_begin", "STEP")}
        for name, phase, when in self.events():
            slot = times.setdefault(name, {})
            slot[phase] = when
            if phase in pairs and pairs[phase][0] in slot:
                begin = slot[pairs[phase][0]]
                span = {"name": pairs[phase][1], "ph": "X", "pid": rank, "tid": name,
                        "ts": begin * 1e6, "dur": (when - begin) * 1e6}
                if name in sizes:
                    span["args"] = {"bytes": sizes[name]}
                spans.append(span)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": spans}, f)
        os.replace(tmp, path)
