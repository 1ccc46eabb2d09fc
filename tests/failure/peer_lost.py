"""Rank 1 of a 2-rank job dies, or only stalls, while the launcher does not notice; launched by
``tests/test_failures.py`` (``mpirun --mca orte_abort_on_non_zero_status 0``, or
``horovodrun --gloo`` through ``unnoticed.sh``).

``python peer_lost.py MODE``:

* ``exit``: rank 1 calls ``os._exit(1)`` at step ``FAIL_AT``; ``kill``: it sends itself SIGKILL;
  ``stop``: SIGSTOP (frozen: alive for the launcher, silent for its peers).
  Rank 0 trains (``model=``, so it waits in the forward pass for its updates) far longer than the
  test allows, and ends only because the liveness channel told it its peer is gone.  An
  excepthook writes ``raised_at`` (time and exception type) when the training thread raises.
* ``stall``: rank 1 computes in pure Python for ``STALL_S`` seconds at step ``FAIL_AT`` (longer
  than the test's liveness timeout), without ``model=`` (rank 0 waits in ``step()``, where the
  stall warning is logged); both ranks then finish ``STEPS`` steps and exit 0.

Each rank writes its pid to ``$FAILURE_PID_DIR``; ``failed_at`` holds the time of the death or
of the start of the stall.
"""
import os
import signal
import sys
import time

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F

import dcredit_hvd

FAIL_AT = 3
STEPS = 8
STALL_S = float(os.environ.get("PEER_STALL_SECONDS", "8"))
MODE = sys.argv[1]
PID_DIR = os.environ["FAILURE_PID_DIR"]

hvd.init()
torch.set_num_threads(1)
rank = hvd.rank()
with open(os.path.join(PID_DIR, f"rank{rank}.pid"), "w") as fh:
    fh.write(str(os.getpid()))


def note_raise(kind, value, tb, _previous=sys.excepthook):
    with open(os.path.join(PID_DIR, f"raised_at{rank}"), "w") as fh:
        fh.write(f"{time.time()!r} {kind.__name__}")
    _previous(kind, value, tb)


sys.excepthook = note_raise
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
opt = dcredit_hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(),
                                       model=None if MODE == "stall" else model,
                                       policy="bytescheduler", partition_bytes=1024)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
gen = torch.Generator().manual_seed(rank)
started = time.time()
for step in range(STEPS if MODE == "stall" else 1_000_000):
    if rank == 1 and step == FAIL_AT:
        print(f"rank 1 {MODE} at step {step}", flush=True)
        with open(os.path.join(PID_DIR, "failed_at"), "w") as fh:
            fh.write(repr(time.time()))
        if MODE == "exit":
            os._exit(1)
        if MODE in ("kill", "stop"):
            os.kill(os.getpid(), signal.SIGKILL if MODE == "kill" else signal.SIGSTOP)
        end = time.monotonic() + STALL_S       # alive, busy, late: a long evaluation
        while time.monotonic() < end:
            sum(range(1000))
    opt.zero_grad()
    x, y = torch.randn(8, 32, generator=gen), torch.randint(0, 10, (8,), generator=gen)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    if time.time() - started > 150:   # never reached when the peer's death is handled
        print(f"rank {rank} still training after 150 s", flush=True)
        break
opt.apply_pending_updates()
print(f"rank {rank} finished {STEPS} steps", flush=True)
