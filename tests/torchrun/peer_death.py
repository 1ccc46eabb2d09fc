"""Rank 1 of a 2-rank torchrun job dies mid-training; launched by ``tests/test_torchrun_jobs.py``
through ``unnoticed.sh`` (so that torchrun does not stop the survivor first).

``python peer_death.py MODE``: at step ``FAIL_AT`` rank 1 calls ``os._exit(1)`` (``exit``),
sends itself SIGKILL (``kill``) or SIGSTOP (``stop``: alive for the launcher, silent for its
peers).  Rank 0 trains (``model=``, so it waits in the forward pass for its updates) far longer
than the test allows, and ends only because the liveness channel told it its peer is gone.  An
excepthook writes ``raised_at0`` (time and exception type) when the training thread raises.

Each rank writes its pid to ``$FAILURE_PID_DIR``; ``failed_at`` holds the time of the death.
"""
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import dcredit_hvd

FAIL_AT = 3
MODE = sys.argv[1]
PID_DIR = os.environ["FAILURE_PID_DIR"]

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank = dist.get_rank()
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
                                       named_parameters=model.named_parameters(), model=model,
                                       policy="bytescheduler", partition_bytes=1024)
gen = torch.Generator().manual_seed(rank)
started = time.time()
for step in range(1_000_000):
    if rank == 1 and step == FAIL_AT:
        print(f"rank 1 {MODE} at step {step}", flush=True)
        with open(os.path.join(PID_DIR, "failed_at"), "w") as fh:
            fh.write(repr(time.time()))
        if MODE == "exit":
            os._exit(1)
        os.kill(os.getpid(), signal.SIGKILL if MODE == "kill" else signal.SIGSTOP)
    opt.zero_grad()
    x, y = torch.randn(8, 32, generator=gen), torch.randint(0, 10, (8,), generator=gen)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    if time.time() - started > 150:   # never reached when the peer's death is handled
        print(f"rank {rank} still training after 150 s", flush=True)
        break
