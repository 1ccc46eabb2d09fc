"""The priority queue and the gate between gradient hooks and Horovod.

Hooks ``enqueue`` the blocks of a ready gradient; the gate asks the policy, after every event,
whether the head of the priority queue may go (``Policy.admit``) and submits it through
``comm``.  A completion thread polls in-flight all-reduces, writes results back (for compressed
blocks), tells the policy (``on_complete``) and pumps the gate again.

Only the gate rank (rank 0 of the process set) gates with the configured policy; the others run
``Immediate`` and submit each block as soon as it is ready.  Horovod starts an all-reduce only when
every rank has submitted its name, so the gate rank's order is the global order and no rank waits
on another's window: see ``docs/design.md`` ("Why the gate cannot deadlock").

Errors raised in the completion thread are kept and re-raised in the training thread at its next
call (``enqueue``, ``wait_all``, ``check``); so is the loss of a peer reported by the liveness
channel (``liveness.py``), which also wakes a training thread waiting here.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..errors import OrderMismatchError, PeerLostError, SchedulerError, StallError
from ..liveness.heartbeat import Liveness, PeerEvent
from ..planning.blocks import Block
from ..policies.base import Policy
from .weak import weakly

log = logging.getLogger("dcredit_hvd")


@dataclass(order=True)
class Item:
    """A queued or in-flight block and the tensor Horovod reduces in place."""

    key: tuple[int, int]
    seq: int
    block: Block = field(compare=False)
    payload: torch.Tensor = field(compare=False)
    #: Called with Horovod's output once the all-reduce finished (write-back of compressed data).
    finish: Optional[Callable[[torch.Tensor], None]] = field(compare=False, default=None)
    handle: Optional[int] = field(compare=False, default=None)
    #: Whatever the submit callback needs besides the payload (a CUDA ``device.Ticket``).
    context: Any = field(compare=False, default=None)
    submitted_at: float = field(compare=False, default=0.0)
    ready_at: float = field(compare=False, default=0.0)


#: Seconds the completion thread waits with nothing in flight, inside an iteration, before it
#: ends (it ends at once when the iteration does: ``wait_all``).
IDLE_EXIT_SECONDS = 2.0

#: Seconds ``wait_all`` waits for the completion thread to end once the iteration has (it wakes
#: at once and has nothing left to collect: a longer wait means it is stuck in the transport).
JOIN_SECONDS = 2.0


#: What a stall means and what to check, shared by both StallError messages.
_STALL_ADVICE = ("Another rank stopped submitting gradients: check for uneven batches per rank, "
                 "rank-dependent control flow, or a failed peer")


def _missing_ranks_hint() -> str:
    """Horovod's public API does not say which ranks a tensor waits for, but its own stall
    check logs them (on the coordinator, rank 0): point there, or say it is switched off."""
    if os.environ.get("HOROVOD_STALL_CHECK_DISABLE", "0") not in ("", "0"):
        return ("Horovod's stall check, which names the missing ranks, is off "
                "(HOROVOD_STALL_CHECK_DISABLE): unset it to see them.")
    limit = os.environ.get("HOROVOD_STALL_CHECK_TIME_SECONDS", "60")
    return (f"Horovod's stall check logs the ranks that have not submitted each block on rank 0 "
            f"after {limit} s (HOROVOD_STALL_CHECK_TIME_SECONDS).")


#: Seconds a Horovod error waits for the liveness channel to name the peer behind it (a dead
#: peer's connection closes at once; Horovod's error may come a moment earlier).
PEER_NAME_WAIT_SECONDS = 2.0


def _join(thread: Optional[threading.Thread], timeout: float) -> None:
    """Wait for the completion thread to end (not from inside it)."""
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=timeout)


class BlockScheduler:
    """Queue + gate + completion thread for one optimizer.

    ``submit(item) -> handle``, ``poll(handle) -> bool`` and ``collect(handle) -> tensor`` are the
    transport (``comm`` in production; tests may pass their own).
    """

    def __init__(self, policy: Policy, *, submit: Callable[[Item], int],
                 poll: Callable[[int], bool], collect: Callable[[int], torch.Tensor],
                 poll_seconds: float = 0.0005, stall_seconds: float = 60.0,
                 stall_abort_seconds: float = 0.0, timeline: Any = None,
                 passthrough: tuple[type[BaseException], ...] = (),
                 liveness: Optional[Liveness] = None) -> None:
        self.policy = policy
        self._submit = submit
        self._poll = poll
        self._collect = collect
        self._poll_seconds = poll_seconds
        self._stall_seconds = stall_seconds
        self._stall_abort_seconds = stall_abort_seconds
        self.timeline = timeline               # timeline.Timeline or None (DCREDIT_TIMELINE)
        #: Errors re-raised as they are (Horovod's HorovodInternalError, which hvd.elastic.run
        #: recovers from) rather than wrapped in SchedulerError.
        self._passthrough = passthrough
        self._cond = threading.Condition(threading.Lock())
        self._queue: list[Item] = []
        self._inflight: list[Item] = []
        self._outstanding = 0          # queued + in flight
        self._seq = itertools.count()
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._iteration_open = False
        self.submitted_names: list[str] = []   # this iteration, in submission order (for tests/timeline)
        #: Link statistics since the last ``link_sample()``: bytes completed, and seconds during
        #: which at least one block was in flight (``drift.py``: measured from the blocks sent).
        self._bytes_done = 0
        self._busy_s = 0.0
        self._busy_since = 0.0
        #: The peers' liveness channel (``comm.watch_peers``); a loss is stored like a
        #: completion-thread error, so every wait here wakes and raises ``PeerLostError``.
        self._liveness = liveness
        if liveness is not None:
            liveness.subscribe(weakly(self._peer_lost))     # the channel outlives schedulers

    # -- training-thread side -------------------------------------------------------------
    def start_iteration(self) -> None:
        with self._cond:
            self._raise_if_failed()
            assert self._outstanding == 0, "start_iteration with blocks outstanding"
            self.policy.start_iteration()
            self.submitted_names = []
            self._iteration_open = True

    @property
    def iteration_open(self) -> bool:
        return self._iteration_open

    def enqueue(self, tensor: int, items: list[Item]) -> None:
        """Gradient ``tensor`` is ready: queue its blocks, tell the policy, release what it allows."""
        with self._cond:
            self._raise_if_failed()
            if not self._iteration_open:
                raise AssertionError("enqueue outside an iteration")
            now = time.perf_counter()
            for item in items:
                item.seq = next(self._seq)
                item.ready_at = now
                heapq.heappush(self._queue, item)
            self._outstanding += len(items)
            self.policy.on_ready(tensor)
            self._pump(f"ready tensor {tensor}")

    def end_backward(self) -> None:
        with self._cond:
            self._raise_if_failed()
            self.policy.on_backward_end()
            self._pump("backward end")

    def wait_all(self) -> None:
        """Block until every queued block has completed; re-raise completion-thread errors.

        After ``stall_seconds`` without completing, log which blocks wait; after
        ``stall_abort_seconds`` (when > 0) raise ``StallError`` instead of waiting for ever.
        """
        with self._cond:
            started = time.perf_counter()
            warned = False
            while self._outstanding and self._error is None:
                self._cond.wait(timeout=min(1.0, self._stall_seconds))
                waited = time.perf_counter() - started
                if not warned and waited > self._stall_seconds:
                    warned = True
                    log.warning("dcredit_hvd: %d block(s) still outstanding after %.0f s; waiting "
                                "for: %s. %s. %s", self._outstanding, waited,
                                self._describe_waiting(), _STALL_ADVICE, _missing_ranks_hint())
                if self._stall_abort_seconds and waited > self._stall_abort_seconds:
                    raise StallError(
                        f"dcredit_hvd: {self._outstanding} block(s) did not complete within "
                        f"{self._stall_abort_seconds:.0f} s (DCREDIT_STALL_ABORT_SECONDS); waiting "
                        f"for {self._describe_waiting()}. {_STALL_ADVICE}; raise the limit if a "
                        "step can take this long.")
            self._raise_if_failed()
            self._iteration_open = False
            self._cond.notify_all()         # the completion thread ends with the iteration
            thread = self._thread
        # Joined: no thread outlives the step that ended the iteration (a framework's test
        # harness checks for threads right after the last step).
        _join(thread, JOIN_SECONDS)

    def check(self) -> None:
        """Re-raise a completion-thread error; raise ``StallError`` if a released block has been
        in flight longer than ``stall_abort_seconds`` (callers that wait elsewhere poll this)."""
        with self._cond:
            self._raise_if_failed()
            # _inflight keeps submission order (appended on release, removed in place), so its
            # head is the oldest block: O(1) on every gradient hook.
            if self._stall_abort_seconds and self._inflight:
                if time.perf_counter() - self._inflight[0].submitted_at > self._stall_abort_seconds:
                    raise StallError(
                        f"dcredit_hvd: a block has been in flight for more than "
                        f"{self._stall_abort_seconds:.0f} s (DCREDIT_STALL_ABORT_SECONDS); waiting "
                        f"for {self._describe_waiting()}. {_STALL_ADVICE}.")

    def link_sample(self) -> tuple[int, float]:
        """``(bytes, busy seconds)`` completed since the last call: the link's effective seconds
        per byte is their ratio (startups and Horovod's cycles included)."""
        with self._cond:
            sample = (self._bytes_done, self._busy_s)
            self._bytes_done, self._busy_s = 0, 0.0
            return sample

    @property
    def outstanding(self) -> int:
        return self._outstanding

    @property
    def in_flight(self) -> int:
        """Blocks handed to the transport and not yet finished (``outstanding`` less the queue)."""
        return len(self._inflight)

    @property
    def liveness(self) -> Optional[Liveness]:
        """The peers' liveness channel this scheduler's waits wake on (shared: ``gathers``)."""
        return self._liveness

    def settle(self, timeout: float, patience: float) -> int:
        """Wait for the blocks in flight to finish: at most ``timeout`` seconds, and no longer
        than ``patience`` seconds without one finishing (a peer that will never issue them);
        the number still in flight."""
        now = time.monotonic()
        deadline, progress = now + timeout, now
        with self._cond:
            left = len(self._inflight)
            while left and self._error is None and not self._closed:
                now = time.monotonic()
                if now >= deadline or now - progress >= patience:
                    break
                self._cond.wait(timeout=0.1)
                if len(self._inflight) < left:
                    left, progress = len(self._inflight), time.monotonic()
            return len(self._inflight)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        _join(self._thread, 5.0)

    # -- gate ---------------------------------------------------------------------------
    def _pump(self, reason: str) -> None:
        """Release the head of the queue while the policy admits it (lock held)."""
        released = 0
        while self._queue and self.policy.admit(self._queue[0].block):
            item = heapq.heappop(self._queue)
            try:
                item.handle = self._submit(item)
            except BaseException as exc:  # a Horovod error on submission
                self._fail(exc)
                raise
            item.submitted_at = time.perf_counter()
            self.submitted_names.append(item.block.name)
            if not self._inflight:
                self._busy_since = item.submitted_at
            self._inflight.append(item)
            released += 1
        if released and self.timeline is not None:
            self.timeline.release(released, reason)
        if released:
            self._ensure_thread()
            self._cond.notify_all()

    # -- completion thread --------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="dcredit-completion", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._inflight and not self._closed:
                        # Nothing in flight and the iteration over (``wait_all``), or idle
                        # for long (an iteration abandoned): end; the next release starts
                        # another, so an optimizer no longer used leaves no thread behind.
                        if not self._iteration_open and not self._queue:
                            self._thread = None
                            return
                        if not self._cond.wait(timeout=IDLE_EXIT_SECONDS) and not self._inflight:
                            self._thread = None
                            return
                    if self._closed:
                        return
                if not self._complete_finished():
                    time.sleep(self._poll_seconds)
        except BaseException as exc:  # surfaced in the training thread
            with self._cond:
                self._fail(exc)

    def _complete_finished(self) -> bool:
        """Collect and finish every in-flight block Horovod is done with; False if none was.
        A method of its own so that the finished items (whose callbacks reference the
        optimizer) are not kept alive by the idle thread's frame."""
        with self._cond:
            inflight = list(self._inflight)
        done = [item for item in inflight if self._poll(item.handle)]
        if not done:
            return False
        for item in done:
            output = self._collect(item.handle)
            finish, item.finish = item.finish, None
            if finish is not None:
                finish(output)
        if self.timeline is not None:
            self._trace(done)
        with self._cond:
            for item in done:
                self._inflight.remove(item)
                self._outstanding -= 1
                self._bytes_done += item.block.nbytes
                self.policy.on_complete(item.block)
            if not self._inflight:
                self._busy_s += time.perf_counter() - self._busy_since
            self._pump("completion")
            self._cond.notify_all()
        return True

    def _trace(self, done: list[Item]) -> None:
        now = time.perf_counter()
        layouts = self.policy.layouts
        for item in done:
            block = item.block
            tensor_name = layouts[block.tensor].name if block.tensor < len(layouts) else ""
            self.timeline.block(block.tensor, tensor_name, block.name, item.ready_at,
                                item.submitted_at, now, block.nbytes)

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self._cond.notify_all()

    def _peer_lost(self, events: list[PeerEvent]) -> None:
        """Liveness callback (its own thread): fail every wait, now and later."""
        with self._cond:
            self._fail(PeerLostError.from_events(events))

    def reset(self) -> None:
        """Forget everything in flight or queued and any stored error (elastic ``restore()``
        after Horovod was re-initialised: the old handles are invalid)."""
        with self._cond:
            self._queue.clear()
            self._inflight.clear()
            self._outstanding = 0
            self._error = None
            self._iteration_open = False
            self._cond.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            exc = self._error
            if isinstance(exc, PeerLostError):
                raise PeerLostError(str(exc), exc.events)
            if isinstance(exc, OrderMismatchError):      # a diagnosis of the job, as it is
                raise OrderMismatchError(str(exc)) from exc
            if self._liveness is not None and isinstance(exc, self._passthrough):
                # Horovod's error says a peer failed, not which: the channel may know.
                lost = self._liveness.wait_lost(PEER_NAME_WAIT_SECONDS)
                if lost:
                    raise PeerLostError.from_events(lost) from exc
            if isinstance(exc, self._passthrough):
                raise type(exc)(f"dcredit_hvd: the communication thread failed: {exc}") from exc
            raise SchedulerError(f"dcredit_hvd: the communication thread failed: "
                                 f"{type(exc).__name__}: {exc}") from exc

    def _describe_waiting(self) -> str:
        names = [i.block.name for i in self._inflight[:5]]
        queued = [i.block.name for i in sorted(self._queue)[:5]]
        return f"in flight {names}{'...' if len(self._inflight) > 5 else ''}, " \
               f"queued {queued}{'...' if len(self._queue) > 5 else ''}"
