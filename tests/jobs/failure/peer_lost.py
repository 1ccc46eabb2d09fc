"""Rank 1 of a 2-rank job dies, or only stalls, while the launcher does not notice; launched by
``tests/jobs/test_failures.py`` (``mpirun --mca orte_abort_on_non_zero_status 0``, or
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
of the start of the stall (the files, the model and the step: ``failure_worker.py``).
"""
import os
import sys
import time

import horovod.torch as hvd
import torch

import dcredit_hvd

from failure_worker import fail, record_pid, record_raises, small_model, train_step

FAIL_AT = 3
STEPS = 8
STALL_S = float(os.environ.get("PEER_STALL_SECONDS", "8"))
MODE = sys.argv[1]

hvd.init()
torch.set_num_threads(1)
rank = hvd.rank()
record_pid(rank)
record_raises(f"raised_at{rank}")
model = small_model()
opt = dcredit_hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(),
                                       model=None if MODE == "stall" else model,
                                       policy="bytescheduler", partition_bytes=1024)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
gen = torch.Generator().manual_seed(rank)
started = time.time()
for step in range(STEPS if MODE == "stall" else 1_000_000):
    if rank == 1 and step == FAIL_AT:
        fail(MODE, step)                       # exit, kill, stop: never returns
        end = time.monotonic() + STALL_S       # stall: alive, busy, late (a long evaluation)
        while time.monotonic() < end:
            sum(range(1000))
    train_step(model, opt, gen)
    if time.time() - started > 150:   # never reached when the peer's death is handled
        print(f"rank {rank} still training after 150 s", flush=True)
        break
opt.apply_pending_updates()
print(f"rank {rank} finished {STEPS} steps", flush=True)
