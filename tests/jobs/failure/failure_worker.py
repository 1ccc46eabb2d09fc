"""What a failure job's worker writes for the test that launched it, and the small model and
training step it runs, without Horovod: shared by ``peer_lost.py`` (Horovod, launched by
``tests/jobs/test_failures.py``) and ``tests/torchrun/peer_death.py`` / ``diverge.py``
(torch.distributed, launched by ``tests/jobs/test_torchrun_jobs.py``), so that both launchers' jobs
record the same files the same way.

Every file goes to ``$FAILURE_PID_DIR``: the test reads them after the job, and kills whatever
``*.pid`` it finds still alive.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from types import TracebackType
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

PID_DIR = os.environ["FAILURE_PID_DIR"]


def record_pid(rank: int) -> None:
    """``rank<rank>.pid``: this process, for the test to kill if it outlives the job."""
    with open(os.path.join(PID_DIR, f"rank{rank}.pid"), "w") as fh:
        fh.write(str(os.getpid()))


def record_time(name: str) -> None:
    """``name``: the time now (when rank 1 died, stalled or left the common path)."""
    with open(os.path.join(PID_DIR, name), "w") as fh:
        fh.write(repr(time.time()))


def fail(mode: str, step: int) -> None:
    """Rank 1's failure at ``step``, its time in ``failed_at``: ``exit`` (``os._exit(1)``),
    ``kill`` (SIGKILL) or ``stop`` (SIGSTOP: alive for the launcher, silent for its peers);
    any other mode returns, for the caller to fail its own way."""
    print(f"rank 1 {mode} at step {step}", flush=True)
    record_time("failed_at")
    if mode == "exit":
        os._exit(1)
    if mode in ("kill", "stop"):
        os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)


def record_raises(path: str, with_message: bool = False) -> None:
    """When the training thread raises, write ``path`` (time and exception type, then the
    message if ``with_message``) before the previous hook reports it: the test times the
    raise against the failure and checks what was raised."""
    previous = sys.excepthook

    def note_raise(kind: type[BaseException], value: BaseException,
                   tb: Optional[TracebackType]) -> None:
        with open(os.path.join(PID_DIR, path), "w") as fh:
            fh.write(f"{time.time()!r} {kind.__name__}" + (f" {value}" if with_message else ""))
        previous(kind, value, tb)

    sys.excepthook = note_raise


def small_model() -> nn.Module:
    """The same network on every rank (seed 0)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def train_step(model: nn.Module, opt: Any, gen: torch.Generator) -> None:
    """One step on a batch of ``gen``'s (a generator per rank: other data on each)."""
    opt.zero_grad()
    x, y = torch.randn(8, 32, generator=gen), torch.randint(0, 10, (8,), generator=gen)
    F.cross_entropy(model(x), y).backward()
    opt.step()
