"""The errors a training script may catch, in one place (``from dcredit_hvd.errors import ...``).

Each is raised in the training thread: an error found in a background thread (the completion
thread, the liveness channel) is carried over and raised there, never lost.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .liveness.heartbeat import PeerEvent


class SchedulerError(RuntimeError):
    """An error raised in the completion thread, re-raised in the training thread."""


class StallError(TimeoutError):
    """Blocks did not complete within ``DCREDIT_STALL_ABORT_SECONDS``."""


class PeerLostError(RuntimeError):
    """A peer process is gone (liveness channel): the job cannot continue without it.

    Not a ``SchedulerError``: nothing in this process failed, and no retry can help.
    """

    def __init__(self, message: str, events: tuple[PeerEvent, ...] = ()) -> None:
        super().__init__(message)
        self.events = events

    @property
    def ranks(self) -> list[int]:
        return [e.rank for e in self.events]

    @property
    def hosts(self) -> list[str]:
        return [e.host for e in self.events]

    @classmethod
    def from_events(cls, events: list[PeerEvent]) -> PeerLostError:
        what = "; ".join(e.describe() for e in events)
        ranks = ", ".join(str(e.rank) for e in events)
        return cls(
            f"dcredit_hvd: lost {len(events)} peer process(es) of this job: {what}. This rank "
            f"stops now: the collective library cannot continue without rank(s) {ranks}, and "
            "it would wait for them for ever. Find the cause in that rank's own log or on its "
            "host (a traceback, the kernel's out-of-memory killer in dmesg, a node or network "
            "failure), then restart from the last checkpoint; to survive lost workers, train "
            "with hvd.elastic.run (Horovod) or let torchrun restart the workers "
            "(--max-restarts).", tuple(events))


class OrderMismatchError(RuntimeError):
    """The ranks' collectives diverged: rank 0 published an entry this rank cannot match."""


class LayoutMismatchError(ValueError):
    """Ranks were about to send different blocks: raised on every rank, before anything is sent."""


__all__ = ["LayoutMismatchError", "OrderMismatchError", "PeerLostError", "SchedulerError",
           "StallError"]
