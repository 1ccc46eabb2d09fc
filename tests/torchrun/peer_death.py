"""Rank 1 of a 2-rank torchrun job dies mid-training; launched by ``tests/jobs/test_torchrun_jobs.py``
through ``unnoticed.sh`` (so that torchrun does not stop the survivor first).

``python peer_death.py MODE``: at step ``FAIL_AT`` rank 1 calls ``os._exit(1)`` (``exit``),
sends itself SIGKILL (``kill``) or SIGSTOP (``stop``: alive for the launcher, silent for its
peers).  Rank 0 trains (``model=``, so it waits in the forward pass for its updates) far longer
than the test allows, and ends only because the liveness channel told it its peer is gone.  An
excepthook writes ``raised_at0`` (time and exception type) when the training thread raises.

Each rank writes its pid to ``$FAILURE_PID_DIR``; ``failed_at`` holds the time of the death.
The files, the model and the step are ``tests/jobs/failure/failure_worker.py``'s, as in
``peer_lost.py`` (the Horovod job).
"""
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jobs" / "failure"))
import dcredit_hvd  # noqa: E402

from failure_worker import fail, record_pid, record_raises, small_model, train_step  # noqa: E402

FAIL_AT = 3
MODE = sys.argv[1]

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank = dist.get_rank()
record_pid(rank)
record_raises(f"raised_at{rank}")
model = small_model()
opt = dcredit_hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(), model=model,
                                       policy="bytescheduler", partition_bytes=1024)
gen = torch.Generator().manual_seed(rank)
started = time.time()
for step in range(1_000_000):
    if rank == 1 and step == FAIL_AT:
        fail(MODE, step)
    train_step(model, opt, gen)
    if time.time() - started > 150:   # never reached when the peer's death is handled
        print(f"rank {rank} still training after 150 s", flush=True)
        break
