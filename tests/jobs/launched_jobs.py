"""Launching a 2-rank job from a single-process test, as ``tests/jobs/test_failures.py`` (mpirun,
horovodrun) and ``tests/jobs/test_torchrun_jobs.py`` (torchrun) do.

Each launch runs in its own session and is killed on timeout, and every rank the job recorded
in its pid directory (``failure_worker.record_pid``) is killed afterwards if still alive, so
that a regression shows as a failed test, never as a hung CI job or a process left behind.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def job_env(pid_dir: Path, defaults: bool = True, extra: Optional[dict] = None) -> dict:
    """The caller's environment plus the pid directory, this venv first on ``PATH``, the
    checkout on ``PYTHONPATH``, warnings only, and ``extra``.  ``defaults``: no ``DCREDIT_*``
    setting from the caller's environment (the Makefile exports a shorter stall limit), as a
    user who sets nothing runs."""
    env = {k: v for k, v in os.environ.items() if not (defaults and k.startswith("DCREDIT_"))}
    env.update(FAILURE_PID_DIR=str(pid_dir), PYTHONUNBUFFERED="1", DCREDIT_LOG_LEVEL="WARNING",
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    env.update(extra or {})
    return env


def launch(command: list[str], env: dict, pid_dir: Path, timeout: float,
           meanwhile: Optional[Callable[[threading.Event], None]] = None,
           ) -> tuple[Optional[int], str, float, float]:
    """Run ``command`` in its own session; kill the whole session on timeout.  ``meanwhile``
    runs in a thread until the command ended (its event is set then).  Returns
    ``(returncode or None on timeout, output, seconds, end time)``."""
    started = time.time()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True, text=True)
    ended = threading.Event()
    helper = threading.Thread(target=meanwhile, args=(ended,), daemon=True) if meanwhile else None
    if helper is not None:
        helper.start()
    try:
        output, _ = proc.communicate(timeout=timeout)
        code: Optional[int] = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        code = None
    finally:
        ended.set()
        kill_leftovers(pid_dir)
    return code, output, time.time() - started, time.time()


def alive(pid: int) -> bool:
    """Running (a zombie left to a non-reaping init does not count: it holds no resources)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return fields[0] not in ("Z", "X")


def rank_pids(pid_dir: Path) -> list[int]:
    """The processes the job's scripts recorded."""
    return [int(f.read_text()) for f in pid_dir.glob("*.pid") if f.read_text().strip()]


def kill_leftovers(pid_dir: Path, grace: float = 5.0) -> None:
    """Leave nothing behind even when the test fails: what is still alive ``grace`` seconds
    on is killed, and noted in ``leftovers`` (empty when nothing was) for the test to check."""
    deadline = time.time() + grace
    while True:
        left = [pid for pid in rank_pids(pid_dir) if alive(pid)]
        if not left or time.time() > deadline:
            break
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    pid_dir.joinpath("leftovers").write_text(" ".join(map(str, left)))


def reap_frozen_rank_1(pid_dir: Path, done: threading.Event) -> None:
    """Once rank 0 has ended (``status0``, written by ``unnoticed.sh``), kill the frozen rank 1,
    as whoever froze it would: horovodrun and torchrun end their workers with SIGTERM, which a
    stopped process never receives, so they would wait for ever (mpirun sends SIGCONT first)."""
    while not done.wait(0.2):
        if (pid_dir / "status0").exists():
            done.wait(10.0)                      # the launcher's own chance first
            for pid in rank_pids(pid_dir):
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
            return
