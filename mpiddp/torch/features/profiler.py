"""``mpiddp.profile``: ``torch.profiler.profile`` whose Chrome trace also shows mpiddp's
collectives, beside the script's own operators, as torch's shows DDP's.

torch's profiler records only the threads it is started on, and the collectives run on each
engine's coordinator thread. So the engines' timelines (``engine/timeline.py``) record while
the profile runs, and ``export_chrome_trace`` adds them to the file torch writes: per engine,
one row of the collectives as they ran (fused tensors in one span, with their names and
bytes), each tensor's span from hand-over to completion (async slices: they overlap) and one
row of each optimizer's waits and steps. Timeline times are
``time.perf_counter()``; torch's trace counts microseconds from ``baseTimeNanoseconds`` on
the Unix clock, so the two are aligned through the Unix time now.
"""
from __future__ import annotations

import gzip
import json
import os
import threading
import time
from typing import Any
import torch.profiler

from ... import runtime

__all__ = ["profile"]

# A row per engine and kind, after the thread ids torch uses (the process's own).
_ENGINE_ROW, _OPTIMIZER_ROW = 1_000_000, 1_000_001
_TENSOR_SPAN = 2          # (_spans' rows: 0 collectives, 1 optimizers, 2 each tensor's span)
# Timeline phases -> (the phase that opens the span, its name) for the optimizer row.
_OPTIMIZER_SPANS = {"synchronized": ("backward_end", "mpiddp: wait for reductions"),
                    "step_end": ("step_begin", "mpiddp: optimizer step")}


class profile(torch.profiler.profile):
    """``torch.profiler.profile`` (the same arguments), whose ``export_chrome_trace`` (and so
    ``torch.profiler.tensorboard_trace_handler``) also writes mpiddp's collectives and
    optimizer waits, each engine's on rows of their own: ``mpiddp engine (collectives)``,
    one span per collective pass (its tensors' names and bytes in ``args``), and ``mpiddp
    optimizer``, the waits for the last reductions and the steps; and each tensor's span
    from its hand-over to the end of its collective (``mpiddp tensor: <name>``, async
    slices, as they overlap), with its bytes. Needs ``mpiddp.init()``
    before it starts. A timeline the script started itself (``start_timeline``) keeps
    recording; otherwise the engines record only while the profile runs."""

    def start(self) -> None:
        """Start profiling (``with`` calls it): torch's profiler, and every engine's
        timeline that is not recording already.

        Raises:
            RuntimeError: as ``torch.profiler.profile.start``.
        """
        self._mpiddp_started = []
        for _, engine in _engines():
            if not engine.timeline.enabled:
                engine.timeline.start()
                self._mpiddp_started.append(engine)
        super().start()

    def stop(self) -> None:
        """Stop profiling (the end of ``with`` calls it); the engines' timelines stop where
        this profile started them.

        Raises:
            RuntimeError: as ``torch.profiler.profile.stop``.
        """
        super().stop()
        self._mpiddp_events = _recorded()
        for engine in getattr(self, "_mpiddp_started", []):
            engine.timeline.stop()
        self._mpiddp_started = []

    def export_chrome_trace(self, path: str, *args: Any, **kwargs: Any) -> Any:
        """Write torch's Chrome trace to ``path``, with mpiddp's rows added.

        Args:
            path: the trace file (``.gz``: gzipped), as torch's.
            *args: passed on to ``torch.profiler.profile.export_chrome_trace``.
            **kwargs: passed on likewise.

        Returns:
            What torch's ``export_chrome_trace`` returns.

        Raises:
            OSError: the file cannot be read back or written.
        """
        result = super().export_chrome_trace(path, *args, **kwargs)
        events = getattr(self, "_mpiddp_events", None)
        if events is None:        # (exported while running: from on_trace_ready)
            events = _recorded()
        add_to_chrome_trace(path, events)
        return result


def _engines() -> list:
    if not runtime.is_initialized():
        return []
    return runtime.require("mpiddp.profile").process_sets.engines()


def _recorded() -> list:
    """(set id, events, bytes by tensor) of every engine's timeline."""
    return [(set_id, engine.timeline.events(), engine.timeline.sizes())
            for set_id, engine in _engines()]


def add_to_chrome_trace(path: str, engine_events: list) -> None:
    """Add the timelines ``engine_events`` (``_recorded()``) to the Chrome trace torch wrote
    at ``path``: only what falls within the trace's time span."""
    opener = gzip.open if path.endswith(".gz") else open      # (tensorboard's use_gzip)
    with opener(path, "rt") as f:
        trace = json.load(f)
    base_us = trace.get("baseTimeNanoseconds", 0) / 1e3
    # perf_counter seconds -> the trace's microseconds
    offset_us = (time.time() - time.perf_counter()) * 1e6 - base_us
    own = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "ts" in e]
    if not own:
        return
    first = min(e["ts"] for e in own)
    last = max(e["ts"] + e.get("dur", 0) for e in own)
    pid = os.getpid()
    added = []
    for set_id, events, sizes in engine_events:
        rows = (_ENGINE_ROW + 2 * set_id, _OPTIMIZER_ROW + 2 * set_id)
        where = "" if set_id == 0 else f" (process set {set_id})"
        added += [_thread_name(pid, rows[0], f"mpiddp engine{where} (collectives)"),
                  _thread_name(pid, rows[1], f"mpiddp optimizer{where}")]
        for span in _spans(events, sizes):
            span["ts"] += offset_us
            if span["ts"] + span["dur"] < first or span["ts"] > last:
                continue
            row = span.pop("row")
            if row == _TENSOR_SPAN:    # they overlap: async slices (a track each in Perfetto)
                begin = dict(span, ph="b", cat="mpiddp", id=len(added), pid=pid, tid=rows[0])
                end = begin.pop("dur") + begin["ts"]
                added += [begin, {"ph": "e", "cat": "mpiddp", "id": begin["id"],
                                  "name": begin["name"], "pid": pid, "tid": rows[0],
                                  "ts": end}]
            else:
                span.update(pid=pid, tid=rows[row])
                added.append(span)
    trace["traceEvents"].extend(added)
    tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
    with opener(tmp, "wt") as f:
        json.dump(trace, f)
    os.replace(tmp, path)


def _thread_name(pid: int, tid: int, name: str) -> dict:
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}


def _spans(events: list, sizes: dict) -> list:
    """The timeline's collectives as one span per pass (the tensors of one pass end at one
    time), each tensor's span from its hand-over to the end of its collective, and the
    optimizers' waits and steps; times in microseconds of ``perf_counter``, ``row`` 0
    (collectives), 1 (optimizers) or ``_TENSOR_SPAN``."""
    started: dict = {}
    passes: dict = {}                 # end -> [first start, tensor names]
    opened: dict = {}
    spans = []
    for name, phase, when in events:
        if phase == "start":
            started[name] = when
        elif phase == "end" and name in started:
            submitted = opened.pop((name, "submit"), None)
            if submitted is not None:         # the tensor's span: hand-over to completion
                spans.append({"name": f"mpiddp tensor: {name}", "ts": submitted * 1e6,
                              "dur": (when - submitted) * 1e6, "row": _TENSOR_SPAN,
                              "args": {"bytes": sizes.get(name, 0)}})
            begin = started.pop(name)
            found = passes.setdefault(when, [begin, []])
            found[0] = min(found[0], begin)
            found[1].append(name)
        elif phase in _OPTIMIZER_SPANS:
            opener, label = _OPTIMIZER_SPANS[phase]
            begin = opened.pop((name, opener), None)
            if begin is not None:
                spans.append({"name": label, "ph": "X", "ts": begin * 1e6,
                              "dur": (when - begin) * 1e6, "row": 1,
                              "args": {"optimizer": name}})
        else:
            opened[(name, phase)] = when
    for end, (begin, names) in passes.items():
        label = names[0] if len(names) == 1 else f"{names[0]} + {len(names) - 1} more"
        spans.append({"name": f"mpiddp: {label}", "ph": "X", "ts": begin * 1e6,
                      "dur": (end - begin) * 1e6, "row": 0,
                      "args": {"tensors": names,
                               "bytes": sum(sizes.get(name, 0) for name in names)}})
    return spans

