"""torchrun jobs that cannot share the multi-rank suite's job (``make test-torchrun``): ranks
whose collectives diverge (the group is left desynchronised), a rank that dies, and the user's
own collectives on the optimizer's group (a mismatch aborts the process in Gloo).

Single-process pytest that launches ``torchrun --standalone --nproc-per-node 2`` itself on the
scripts in ``tests/torchrun/`` (as ``tests/jobs/test_failures.py`` does with mpirun and horovodrun).
Each launch runs in its own session and is killed on timeout, so a regression shows as a failed
test, never as a hung CI job; no process may be left behind (``launched_jobs.py``, shared with
``tests/jobs/test_failures.py``).
"""
from __future__ import annotations

import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import pytest

from launched_jobs import BIN, job_env, launch, reap_frozen_rank_1

HERE = Path(__file__).resolve().parents[1] / "torchrun"
TORCHRUN = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
#: Hard limit on any launch: start-up on a loaded 2-core machine included.
LAUNCH_TIMEOUT_S = 180.0
#: ``DCREDIT_ORDER_TIMEOUT`` in the diverging jobs: how long a follower waits for evidence.
ORDER_TIMEOUT_S = 2.0
#: A diverging rank must have raised this long after it left the common path (order timeout
#: included; a 2-core machine shared with other jobs is slow).
MISMATCH_LIMIT_S = ORDER_TIMEOUT_S + 10.0
#: The issue's limit for a dead peer: the survivor gone this long after the death.
LIVENESS_LIMIT_S = 30.0
LOST = "PeerLostError: dcredit_hvd: lost 1 peer process(es) of this job: rank 1 (host "
CLOSED = "closed its connection without saying goodbye: the process exited abruptly or was killed"
SILENT = "s: its host is unreachable or the process is frozen"

pytestmark = pytest.mark.skipif(not (BIN / "torchrun").exists(), reason="torchrun not installed")


def _launch(command: list[str], pid_dir: Path, extra: Optional[dict] = None,
            meanwhile: Optional[Callable[[threading.Event], None]] = None,
            ) -> tuple[Optional[int], str, float]:
    """``launch`` as a user who sets no ``DCREDIT_*`` variable (the Makefile exports a shorter
    stall limit), plus ``extra``.  Returns ``(returncode or None on timeout, output, end
    time)``."""
    code, output, _, ended = launch(command, job_env(pid_dir, extra=extra), pid_dir,
                                    LAUNCH_TIMEOUT_S, meanwhile)
    return code, output, ended


def _record(pid_dir: Path, name: str) -> Optional[str]:
    path = pid_dir / name
    return path.read_text() if path.exists() else None


# -- diverged collectives -----------------------------------------------------------------------
@dataclass(frozen=True)
class Diverged:
    """What rank 1 of a ``diverge.py`` job raised: the exception's type and message, and the
    seconds from its divergence to the raise."""

    kind: str
    message: str
    after: float
    tail: str


def _diverge(pid_dir: Path, mode: str) -> Diverged:
    """Run ``diverge.py MODE`` and check that it ended, non-zero, with nothing left."""
    code, output, ended = _launch(TORCHRUN + [str(HERE / "diverge.py"), mode], pid_dir,
                                  extra={"DCREDIT_ORDER_TIMEOUT": str(ORDER_TIMEOUT_S)})
    tail = output[-5000:]
    assert code is not None, f"the diverged job hung for {LAUNCH_TIMEOUT_S:.0f} s:\n{tail}"
    assert code != 0, f"a job whose ranks diverged exited 0:\n{tail}"
    diverged = _record(pid_dir, "diverged_at")
    assert diverged is not None, f"rank 1 never left the common path:\n{tail}"
    raised = _record(pid_dir, "raised1")
    assert raised is not None, f"rank 1 raised nothing:\n{tail}"
    at, kind, message = raised.split(" ", 2)
    assert "still running after the divergence" not in output, tail
    assert not (pid_dir / "leftovers").read_text(), "processes left behind"
    return Diverged(kind, message, float(at) - float(diverged), tail)


@pytest.fixture(scope="module")
def diverged_paths(tmp_path_factory: pytest.TempPathFactory) -> Diverged:
    """One ``diverge.py path`` job for the tests that read it."""
    found = _diverge(tmp_path_factory.mktemp("diverged_paths"), "path")
    print(f"ORDER MISMATCH path: rank 1 raised {found.kind} {found.after:.2f} s after it "
          "diverged")
    return found


def test_ranks_on_diverged_paths_are_told_the_first_divergence_instead_of_hanging(
        diverged_paths: Diverged) -> None:
    """Rank 1 steps an optimizer rank 0 never steps (its gradients are submitted on rank 1
    only): after ``DCREDIT_ORDER_TIMEOUT`` (2 s) rank 1 raises, naming the first divergence:
    the collective's position, rank 0's next name (the main model's) and what rank 1
    submitted instead (the auxiliary model's)."""
    found = diverged_paths
    text = found.message
    assert "OrderMismatchError: " in f"{found.kind}: {text}", found.tail
    assert re.search(r"diverged at collective #\d+ of this group", text), text
    issued = re.search(r"rank 0 issued '([^']+)'", text)
    mine = re.search(r"while this rank submitted \[([^\]]+)\]", text)
    assert issued and ".main." in issued.group(1), text
    assert mine and ".aux." in mine.group(1) and ".main." not in mine.group(1), text
    assert ORDER_TIMEOUT_S - 0.5 <= found.after < MISMATCH_LIMIT_S, \
        f"raised after {found.after:.1f} s"


def test_ranks_on_diverged_paths_raise_order_mismatch_error_itself(
        diverged_paths: Diverged) -> None:
    """Through the optimizer (its completion thread met the divergence) the training thread
    gets ``OrderMismatchError`` itself, not a ``SchedulerError`` around it: users catch it."""
    assert diverged_paths.kind == "OrderMismatchError", diverged_paths.kind


def test_a_name_reduced_with_another_element_count_raises_at_once(tmp_path: Path) -> None:
    """Both ranks submit ``probe`` through the transport, 4 elements on rank 0 and 5 on rank
    1: rank 1 raises ``OrderMismatchError`` as soon as rank 0's entry arrives, before
    anything is summed."""
    found = _diverge(tmp_path, "count")
    print(f"ORDER MISMATCH count: rank 1 raised {found.after:.2f} s after it diverged")
    assert found.kind == "OrderMismatchError", found.tail
    assert "rank 0 reduces 'probe' as 4 float32, this rank as 5 float32" in found.message, \
        found.message
    assert found.after < ORDER_TIMEOUT_S, \
        f"waited {found.after:.1f} s for a mismatch it could see at once"


# -- a dead peer --------------------------------------------------------------------------------
# A frozen peer (stop) is the same liveness channel as under Horovod (test_failures.py, mpi stop):
# make test-full's.
@pytest.mark.parametrize("mode", ["exit", "kill", pytest.param("stop", marks=pytest.mark.full)])
def test_a_dead_peer_raises_peer_lost_on_the_survivor_within_seconds(tmp_path: Path,
                                                                     mode: str) -> None:
    """Rank 1 ``os._exit``s, is SIGKILLed or frozen (SIGSTOP) at step 3, hidden from torchrun
    (``unnoticed.sh``).  Rank 0, waiting in its forward pass, raises ``PeerLostError`` naming
    rank 1 (at once for a closed connection, after the liveness timeout, 3 s here, for a silent
    one) and exits non-zero well within 30 s; no process is left."""
    command = (TORCHRUN + ["--no-python", "sh", str(HERE / "unnoticed.sh"), sys.executable,
                           str(HERE / "peer_death.py"), mode])
    extra = {"UNNOTICED_HIDE": "1"}
    if mode == "stop":
        extra["DCREDIT_LIVENESS_TIMEOUT"] = "3"
    code, output, ended = _launch(
        command, tmp_path, extra=extra,
        meanwhile=(lambda done: reap_frozen_rank_1(tmp_path, done)) if mode == "stop" else None)
    tail = output[-5000:]
    assert code is not None, f"the job hung for {LAUNCH_TIMEOUT_S:.0f} s after its peer died:\n{tail}"
    died = _record(tmp_path, "failed_at")
    assert died is not None, f"rank 1 never reached the failure point:\n{tail}"
    status = _record(tmp_path, "status0")
    assert status is not None, f"rank 0 never ended:\n{tail}"
    assert int(status) != 0, f"the survivor exited {status}:\n{tail}"
    assert code != 0, f"torchrun reported success:\n{tail}"
    raised = _record(tmp_path, "raised_at0")
    assert raised is not None, f"rank 0 raised nothing:\n{tail}"
    raised_at, kind = raised.split()
    rank0_ended = (tmp_path / "status0").stat().st_mtime
    detected, exited = float(raised_at) - float(died), rank0_ended - float(died)
    print(f"LIVENESS torchrun {mode}: raised {detected:.2f} s, rank 0 exited {exited:.2f} s, "
          f"job ended {ended - float(died):.2f} s after the death")
    assert kind == "PeerLostError", tail
    assert exited < LIVENESS_LIMIT_S, f"the survivor took {exited:.0f} s to exit:\n{tail}"
    assert LOST in output and (SILENT if mode == "stop" else CLOSED) in output, \
        f"no message names the dead peer:\n{tail}"
    assert "still training" not in output and "StallError" not in output, tail
    left = (tmp_path / "leftovers").read_text()
    assert not left, f"processes left behind: {left}"


# -- the user's own collectives -----------------------------------------------------------------
def test_the_users_own_collectives_on_the_default_group_still_sum_what_they_should(
        tmp_path: Path) -> None:
    """A loss all-reduce on the default group between ``backward()`` and ``step()``, and
    after an overlapped ``step()``, while the optimizer's all-reduces are issued from its
    threads: each sums what it should (the optimizer reduces on groups of its own; over the
    user's group, rank 0's order thread and the user's thread paired collectives crosswise
    and Gloo aborted the process, 3 runs out of 3 before that)."""
    code, output, _ = _launch(TORCHRUN + [str(HERE / "user_collectives.py")], tmp_path)
    tail = output[-3000:]
    assert code == 0 and output.count("USER COLLECTIVES OK") == 2, f"exited {code}:\n{tail}"
