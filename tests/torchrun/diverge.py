"""Ranks whose collectives really diverge, on the torch.distributed transport; launched by
``tests/jobs/test_torchrun_jobs.py`` under ``torchrun --nproc-per-node 2`` (a job of its own: the
group is left desynchronised).

``python diverge.py MODE``, after two iterations trained together:

* ``path``: rank 1 also steps an auxiliary optimizer (without ``model=``) that rank 0 never
  steps, so rank 1 submits gradients rank 0 never issues while rank 0 issues its next
  iteration's; rank 1 must raise ``OrderMismatchError`` naming both after
  ``DCREDIT_ORDER_TIMEOUT`` seconds, not hang.
* ``count``: both ranks submit a collective under one name, 4 elements on rank 0 and 5 on
  rank 1; rank 1 must raise at once, before anything is summed.

Each rank writes its pid to ``$FAILURE_PID_DIR``; rank 1 writes ``diverged_at`` (the time it
left the common path); an excepthook writes ``raised<rank>`` (time, type, message) when the
training thread raises, which is then left to end the process (non-zero).  The files, the
model and the step are ``tests/jobs/failure/failure_worker.py``'s, as in the other failure jobs.
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jobs" / "failure"))
import dcredit_hvd  # noqa: E402

from failure_worker import record_pid, record_raises, record_time, small_model, train_step  # noqa: E402

MODE = sys.argv[1]

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank = dist.get_rank()
record_pid(rank)
record_raises(f"raised{rank}", with_message=True)


def optimizer(model: nn.Module, prefix: str) -> torch.optim.Optimizer:
    return dcredit_hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        named_parameters=[(f"{prefix}.{n}", p) for n, p in model.named_parameters()],
        policy="bytescheduler", partition_bytes=1024)


main = small_model()
aux = nn.Sequential(nn.Linear(32, 10))
main_opt, aux_opt = optimizer(main, "main"), optimizer(aux, "aux")
gen = torch.Generator().manual_seed(rank)
for _ in range(2):
    train_step(main, main_opt, gen)
print(f"rank {rank}: two iterations trained together", flush=True)
if MODE == "path":
    for _ in range(3):
        train_step(main, main_opt, gen)
        if rank == 1:
            record_time("diverged_at")
            train_step(aux, aux_opt, gen)          # rank 0 never steps it
elif MODE == "count":
    transport = main_opt._state.transport
    if rank == 1:
        record_time("diverged_at")
    handle = transport.submit(torch.ones(4 if rank == 0 else 5), "probe", transport.sum)
    transport.wait(handle)
print(f"rank {rank}: still running after the divergence", flush=True)
