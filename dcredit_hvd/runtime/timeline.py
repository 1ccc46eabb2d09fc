"""A per-rank Chrome-trace timeline of the schedule: layers, gradient blocks and window releases.

Set ``DCREDIT_TIMELINE=/path/trace.json`` (``from_env``) and every rank writes its own file,
``/path/trace.rank0.json`` and so on (or put ``{rank}`` in the path to place the rank yourself);
every optimizer of a process writes into that one file.
The file is a JSON array of Chrome trace events, the format of Horovod's ``HOROVOD_TIMELINE``,
so it opens in Perfetto (ui.perfetto.dev) or ``chrome://tracing``; ``scripts/plot_timeline.py``
draws it as a PNG Gantt chart.

Tracks (one trace "process" each, ``pid``):

* ``forward`` and ``backward``: one complete event per layer.
* ``gate``: an instant per window release (how many blocks, and why) and free-form marks.
* one per gradient tensor, named after the tensor and sorted by its priority index (0 first):
  each block is two back-to-back complete events named exactly as the block is named to
  Horovod, category ``QUEUED`` (ready to released) then ``INFLIGHT`` (released to done), so the
  rows line up with the ones in ``HOROVOD_TIMELINE``.  Blocks of one tensor that overlap in time
  go to separate lanes (``tid``) of the tensor's track.

Times passed in are ``time.perf_counter()`` seconds; the trace holds microseconds since the
timeline was created.  The wall-clock time of that instant (``time.time()``, microseconds) is in
every track's metadata as ``epoch_unix_us``, so traces of different ranks can be aligned.

Events are serialised under a lock (the training thread and the completion thread both write)
and buffered; the buffer goes to disk every ``flush_every`` events and on ``close()``.  The file
starts with ``[`` and every event after the first is preceded by a comma, so a file cut short
is a valid array once ``]`` is appended (Perfetto does that itself); ``close()`` writes the
``]`` and also runs at interpreter exit.
"""
from __future__ import annotations

import atexit
import json
import os
import threading
import time
from collections.abc import Mapping
from typing import Any, Optional

#: ``pid`` of the fixed tracks; tensor ``i`` gets ``TENSOR_PID_BASE + i``.
FORWARD_PID = 1
BACKWARD_PID = 2
GATE_PID = 3
TENSOR_PID_BASE = 100

#: Environment variable holding the trace path (``from_env``).
ENV_VAR = "DCREDIT_TIMELINE"

QUEUED = "QUEUED"
INFLIGHT = "INFLIGHT"

_FIXED_TRACKS = {"forward": FORWARD_PID, "backward": BACKWARD_PID, "gate": GATE_PID}


def rank_path(path: str, rank: int) -> str:
    """The file of ``rank``: ``{rank}`` in ``path`` replaced, else ``.rank<N>`` before the extension."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"


class Timeline:
    """Writes one rank's Chrome-trace JSON file; every method is safe to call from any thread."""

    def __init__(self, path: str, rank: int, flush_every: int = 256):
        self.rank = int(rank)
        self.path = rank_path(path, self.rank)
        self.flush_every = max(1, int(flush_every))
        #: ``perf_counter()`` and ``time.time()`` at construction; trace time 0.
        self.epoch = time.perf_counter()
        self.epoch_unix_us = int(time.time() * 1e6)
        self._lock = threading.Lock()
        self._buffer: list[str] = []
        self._count = 0          # events serialised so far (decides the leading comma)
        self._tracks: set[int] = set()
        self._tensor_pids: dict[str, int] = {}
        self._lanes: dict[int, list[float]] = {}  # tensor pid -> end time (us) of each lane
        self._closed = False
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self._file = open(self.path, "w", encoding="utf-8")
        self._file.write("[\n")
        self._file.flush()
        atexit.register(self.close)

    # ------------------------------------------------------------------ helpers
    def now(self) -> float:
        """``time.perf_counter()``: the clock every method expects."""
        return time.perf_counter()

    def _us(self, t: Optional[float]) -> float:
        if t is None:
            t = time.perf_counter()
        return round((t - self.epoch) * 1e6, 3)

    def _emit(self, event: Mapping[str, Any]) -> None:
        # Caller holds the lock.
        text = json.dumps(event, separators=(",", ":"), default=str)
        self._buffer.append(text if self._count == 0 else ",\n" + text)
        self._count += 1

    def _maybe_flush(self) -> None:
        # Caller holds the lock.
        if len(self._buffer) >= self.flush_every:
            self._write_buffer()

    def _write_buffer(self) -> None:
        if self._buffer:
            self._file.write("".join(self._buffer))
            self._buffer.clear()
        self._file.flush()

    def _track(self, pid: int, name: str, sort_index: int, **args: Any) -> None:
        # Caller holds the lock; writes the track's metadata the first time it is used.
        if pid in self._tracks:
            return
        self._tracks.add(pid)
        meta = {"name": name, "rank": self.rank, "epoch_unix_us": self.epoch_unix_us, **args}
        self._emit({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": meta})
        self._emit({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                    "args": {"sort_index": sort_index}})

    def _tensor_pid(self, index: int, name: str) -> int:
        """One track per unit name: ``TENSOR_PID_BASE + index`` unless an earlier layout gave
        that index to another name (a plan that groups tensors renumbers them), then a fresh
        pid; the sort index stays the priority, so rows keep priority order."""
        pid = self._tensor_pids.get(name)
        if pid is None:
            pid = TENSOR_PID_BASE + index
            if pid in self._tensor_pids.values():
                pid = TENSOR_PID_BASE + 1_000_000 + len(self._tensor_pids)
            self._tensor_pids[name] = pid
        return pid

    def _fixed(self, kind: str) -> int:
        pid = _FIXED_TRACKS[kind]
        self._track(pid, kind, pid)
        return pid

    def _lane(self, pid: int, start_us: float, end_us: float) -> int:
        # The first lane of the tensor's track that is free at ``start_us``.
        lanes = self._lanes.setdefault(pid, [])
        for i, busy_until in enumerate(lanes):
            if busy_until <= start_us:
                lanes[i] = end_us
                return i
        lanes.append(end_us)
        return len(lanes) - 1

    # ------------------------------------------------------------------ events
    def layer(self, kind: str, name: str, start: float, end: float, **args: Any) -> None:
        """A layer's forward or backward computation: a complete event on the ``kind`` track."""
        if kind not in ("forward", "backward"):
            raise ValueError(f"layer kind must be 'forward' or 'backward', not {kind!r}")
        ts, te = self._us(start), self._us(end)
        with self._lock:
            if self._closed:
                return
            pid = self._fixed(kind)
            event: dict[str, Any] = {"name": name, "cat": kind, "ph": "X", "ts": ts,
                                     "dur": max(0.0, round(te - ts, 3)), "pid": pid, "tid": 0}
            if args:
                event["args"] = args
            self._emit(event)
            self._maybe_flush()

    def block(self, tensor_index: int, tensor_name: str, block_name: str, ready: float,
              released: float, done: float, nbytes: int, **args: Any) -> None:
        """One block's life on its tensor's track: ``QUEUED`` (ready to released), then
        ``INFLIGHT`` (released to done), both named ``block_name``."""
        tr, tl, td = self._us(ready), self._us(released), self._us(done)
        tl = max(tl, tr)
        td = max(td, tl)
        with self._lock:
            if self._closed:
                return
            pid = self._tensor_pid(int(tensor_index), tensor_name)
            self._track(pid, tensor_name, TENSOR_PID_BASE + int(tensor_index),
                        tensor_index=int(tensor_index))
            tid = self._lane(pid, tr, td)
            for phase, ts, te in ((QUEUED, tr, tl), (INFLIGHT, tl, td)):
                self._emit({"name": block_name, "cat": phase, "ph": "X", "ts": ts,
                            "dur": round(te - ts, 3), "pid": pid, "tid": tid,
                            "args": {"bytes": int(nbytes), "phase": phase, **args}})
            self._maybe_flush()

    def release(self, count: int, reason: str, at: Optional[float] = None, **args: Any) -> None:
        """The gate released ``count`` blocks into the window, because of ``reason``."""
        ts = self._us(at)
        with self._lock:
            if self._closed:
                return
            pid = self._fixed("gate")
            self._emit({"name": "release", "cat": "release", "ph": "i", "s": "p", "ts": ts,
                        "pid": pid, "tid": 0,
                        "args": {"count": int(count), "reason": reason, **args}})
            self._maybe_flush()

    def mark(self, name: str, at: Optional[float] = None, **args: Any) -> None:
        """A named instant on the gate track (e.g. ``"plan installed"``)."""
        ts = self._us(at)
        with self._lock:
            if self._closed:
                return
            pid = self._fixed("gate")
            self._emit({"name": name, "cat": "mark", "ph": "i", "s": "p", "ts": ts,
                        "pid": pid, "tid": 0, "args": args})
            self._maybe_flush()

    def flush(self) -> None:
        """Write buffered events to disk now (the file stays open, without its ``]``)."""
        with self._lock:
            if not self._closed:
                self._write_buffer()

    def close(self) -> None:
        """Flush, write the closing ``]`` and close the file; later calls and events are no-ops."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._write_buffer()
                self._file.write("\n]\n")
            finally:
                self._file.close()
        try:
            atexit.unregister(self.close)
        except Exception:  # pragma: no cover - interpreter shutting down
            pass

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Timeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: rank path -> the open timeline every optimizer of this process writes into (``from_env``)
_shared: dict[str, Timeline] = {}
_shared_lock = threading.Lock()


def from_env(rank: int, env: Optional[Mapping[str, str]] = None) -> Optional[Timeline]:
    """A ``Timeline`` writing to ``$DCREDIT_TIMELINE`` (per rank) when it is set, else ``None``.

    One per file and process: every optimizer of the process (a GAN's two, one rebuilt, the
    bench's rows) writes into the same open timeline, not a second writer of the same file
    (two would truncate and overwrite each other's events)."""
    path = (os.environ if env is None else env).get(ENV_VAR, "")
    if not path:
        return None
    with _shared_lock:
        key = os.path.abspath(rank_path(path, rank))
        timeline = _shared.get(key)
        if timeline is None or timeline.closed:
            timeline = _shared[key] = Timeline(path, rank)
        return timeline
