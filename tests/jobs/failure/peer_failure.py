"""A 2-rank training in which rank 1 fails mid-training; launched by ``tests/jobs/test_failures.py``.

``python peer_failure.py MODE`` under ``mpirun -np 2`` or ``horovodrun -np 2 --gloo``:

* ``raise``: rank 1 raises ``RuntimeError`` from its training loop at step ``FAIL_AT``;
* ``kill``: rank 1 sends itself ``SIGKILL`` at step ``FAIL_AT``.

Rank 0 keeps training (far longer than the test waits), so it ends only because the runtime or
the launcher noticed that its peer is gone.  Each rank writes its pid to ``$FAILURE_PID_DIR`` so
the driver can check that no process is left behind, and prints ``rank R step S`` markers.
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

FAIL_AT = 5
MODE = sys.argv[1]

hvd.init()
torch.set_num_threads(1)
rank = hvd.rank()
with open(os.path.join(os.environ["FAILURE_PID_DIR"], f"rank{rank}.pid"), "w") as fh:
    fh.write(str(os.getpid()))

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
opt = dcredit_hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(), model=model,
                                       policy=os.environ.get("FAILURE_POLICY", "bytescheduler"),
                                       partition_bytes=1024)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
gen = torch.Generator().manual_seed(rank)
started = time.time()
for step in range(1_000_000):
    if rank == 1 and step == FAIL_AT:
        print(f"rank 1 failing ({MODE}) at step {step}", flush=True)
        with open(os.path.join(os.environ["FAILURE_PID_DIR"], "failed_at"), "w") as fh:
            fh.write(repr(time.time()))
        if MODE == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("injected failure on rank 1")
    opt.zero_grad()
    x, y = torch.randn(8, 32, generator=gen), torch.randint(0, 10, (8,), generator=gen)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    if step % 50 == 0 or step == FAIL_AT:
        print(f"rank {rank} step {step}", flush=True)
    if time.time() - started > 240:   # never reached when failures are handled
        print(f"rank {rank} still training after 240 s", flush=True)
        break
