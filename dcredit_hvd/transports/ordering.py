"""One issue order for every rank, without a coordinator (the ``torch.distributed`` transport).

Horovod's coordinator starts a named all-reduce once every rank has submitted the name, so each
rank may submit in its own order.  ``torch.distributed`` has no such thing: collectives on a
group are matched by the order in which they are issued, so every rank must issue the same
sequence, or the job sums the wrong tensors or hangs.

The rule (``docs/design.md``, "One order without a coordinator"): rank 0 of the group, the gate
rank, issues each collective the moment its scheduler releases it and publishes the entry (name,
element count, dtype) on a side channel.  Every other rank (a follower) issues a collective only
when it is the next entry of rank 0's published sequence AND this rank has submitted it; a
submission that is not next waits.  So every rank's issue log is rank 0's, entry for entry.

``IssueOrder`` is that rule on one rank, apart from any wire: ``submit`` is called by the
scheduler, ``follow`` with each published batch (followers), and ``issue`` (given at
construction) starts one collective.  It also detects divergence instead of hanging:

* an entry whose count or dtype differs from this rank's submission of the same name raises at
  once (``OrderMismatchError``), before anything is summed;
* rank 0's next entry not submitted here, while this rank holds submissions rank 0 has not
  issued, for ``timeout`` seconds: the ranks took different paths; the error names the first
  divergence (the position, rank 0's name and this rank's names).
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..errors import OrderMismatchError


@dataclass(frozen=True)
class Entry:
    """What rank 0 publishes for one collective: enough to match it and to name it."""

    name: str
    numel: int
    dtype: str
    #: Which collective: ``all_reduce`` (``submit``), ``reduce_scatter`` or ``all_gather``.
    #: Part of the match: one name may be reduce-scattered and all-gathered, each in its turn.
    kind: str = "all_reduce"

    def encode(self) -> str:
        return f"{self.name}\t{self.numel}\t{self.dtype}\t{self.kind}"

    @staticmethod
    def decode(line: str) -> Entry:
        name, numel, dtype, kind = line.rsplit("\t", 3)
        return Entry(name, int(numel), dtype, kind)

    @property
    def key(self) -> tuple[str, str]:
        """What a follower's submission is matched to rank 0's entry by."""
        return self.name, self.kind


@dataclass
class Submission:
    """One collective as this rank submitted it; the transport's handle."""

    entry: Entry
    payload: Any = None                    # what ``issue`` needs (tensor, op, scaling)
    work: Any = None                       # set once issued
    error: Optional[BaseException] = None
    submitted_at: float = field(default_factory=time.monotonic)

    @property
    def issued(self) -> bool:
        return self.work is not None


#: How a mismatch names what rank 0 does with an entry.
_VERBS = {"all_reduce": "reduces", "reduce_scatter": "reduce-scatters",
          "all_gather": "all-gathers"}

#: The most entries kept in each rank's issue log (tests compare logs across ranks).
LOG_ENTRIES = 100_000


class IssueOrder:
    """Rank 0's order on one rank of a group: issues submissions in it, detects divergence."""

    def __init__(self, gate: bool, issue: Callable[[Submission], Any],
                 publish: Optional[Callable[[Entry], None]] = None, timeout: float = 60.0) -> None:
        """``gate``: this is rank 0 (issues at once and calls ``publish``); ``issue(sub)``
        starts the collective and returns its work; ``timeout``: seconds of divergence
        evidence before ``OrderMismatchError``."""
        self.gate = gate
        self._issue = issue
        self._publish = publish
        self.timeout = timeout
        self._lock = threading.Lock()
        # submitted, not issued, by ``Entry.key``
        self._waiting: dict[tuple[str, str], collections.deque[Submission]] = {}
        self._order: collections.deque[tuple[Entry, float]] = collections.deque()  # published
        self._issued = 0
        self._failed: Optional[BaseException] = None
        self.log: collections.deque[str] = collections.deque(maxlen=LOG_ENTRIES)

    @property
    def issued(self) -> int:
        """Collectives issued on this rank so far (the next one's position)."""
        return self._issued

    def submit(self, sub: Submission) -> Submission:
        """This rank's scheduler released ``sub``: issue it now (gate) or when it is next."""
        with self._lock:
            if self._failed is not None:
                sub.error = self._failed
                return sub
            if self.gate:
                # Published before it is issued: an issue may block until every rank issued
                # it too (NCCL initialises a communicator at its first collective).
                if self._publish is not None:
                    self._publish(sub.entry)
                self._start(sub)
            else:
                self._waiting.setdefault(sub.entry.key, collections.deque()).append(sub)
                self._drain()
        return sub

    def follow(self, entries: list[Entry]) -> None:
        """Rank 0 published ``entries`` (in its order): issue what is submitted here."""
        now = time.monotonic()
        with self._lock:
            self._order.extend((entry, now) for entry in entries)
            if self._failed is None:
                self._drain()

    def fail(self, error: BaseException) -> None:
        """The order can no longer be followed (the side channel broke): every submission not
        yet issued, and every later one, fails with ``error``."""
        with self._lock:
            self._fail(error)

    def check(self, sub: Submission) -> None:
        """Called while ``sub`` waits to be issued (the scheduler polls it): raise the
        divergence into every waiting submission once its evidence lasted ``timeout``."""
        if sub.issued or sub.error is not None:
            return
        now = time.monotonic()
        with self._lock:
            if self._failed is not None or not self._order or sub.work is not None:
                return
            head, since = self._order[0]
            if now - max(since, sub.submitted_at) < self.timeout:
                return
            mine = [s.entry.name for subs in self._waiting.values() for s in subs]
            self._fail(OrderMismatchError(
                f"dcredit_hvd: the ranks' collectives diverged at collective #{self._issued} of "
                f"this group: rank 0 issued {head.name!r} ({head.kind}, {head.numel} "
                f"{head.dtype}), which "
                f"this rank has not submitted in {self.timeout:.0f} s, while this rank submitted "
                f"{mine[:5]}{'...' if len(mine) > 5 else ''}, which rank 0 has not issued. The "
                "ranks ran different code: a parameter that gets a gradient on one rank only, "
                "a collective called on some ranks only, or optimizers built in different orders. "
                "Make every rank run the same collectives (DCREDIT_ORDER_TIMEOUT sets this wait)."))

    def _drain(self) -> None:
        """Issue, in rank 0's order, every next entry this rank has submitted (lock held)."""
        while self._order:
            entry, _ = self._order[0]
            subs = self._waiting.get(entry.key)
            if not subs:
                return
            sub = subs[0]
            if (sub.entry.numel, sub.entry.dtype) != (entry.numel, entry.dtype):
                self._fail(OrderMismatchError(
                    f"dcredit_hvd: the ranks' collectives diverged at collective #{self._issued} "
                    f"of this group: rank 0 {_VERBS[entry.kind]} {entry.name!r} as {entry.numel} "
                    f"{entry.dtype}, this rank as {sub.entry.numel} {sub.entry.dtype}. The ranks "
                    "built different models or gradients of different shapes under one name."))
                return
            subs.popleft()
            if not subs:
                del self._waiting[entry.key]
            self._order.popleft()
            self._start(sub)

    def _start(self, sub: Submission) -> None:
        try:
            sub.work = self._issue(sub)
        except BaseException as exc:        # the library refused: this and all later fail
            sub.error = exc
            self._fail(exc)
            return
        self._issued += 1
        self.log.append(sub.entry.name)

    def _fail(self, error: BaseException) -> None:
        if self._failed is None:
            self._failed = error
        for subs in self._waiting.values():
            for sub in subs:
                if sub.error is None:
                    sub.error = self._failed
        self._waiting.clear()
