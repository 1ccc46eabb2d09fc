"""The user's own collectives on the group the optimizer reduces over (the default group):
``dist.all_reduce`` of a loss for logging, between ``backward()`` and ``step()`` without
``model=``, and after ``step()`` with ``model=`` (while the overlapped updates are in flight).
Both are ordinary torchrun code and are safe with DDP; the optimizer's own all-reduces, issued
from its threads, must never be paired with them.  Launched by ``tests/jobs/test_torchrun_jobs.py``
in a job of its own (a mismatch aborts the process in Gloo).

Prints ``USER COLLECTIVES OK rank R`` once every all-reduce summed what it should.
"""
import torch
import torch.distributed as dist
import torch.nn as nn

import dcredit_hvd

STEPS = 30

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank = dist.get_rank()


def logged_sum(value: float) -> float:
    """What a training loop does to log the mean loss: an all-reduce on the default group."""
    box = torch.full((3,), value)
    dist.all_reduce(box)
    return float(box[0])


def train(with_model: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = dcredit_hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
        model=model if with_model else None, policy="bytescheduler", partition_bytes=64)
    for step in range(STEPS):
        opt.zero_grad()
        model(torch.randn(3, 8)).sum().backward()
        if not with_model:
            assert logged_sum(rank + 1.0) == 3.0, f"step {step}: the loss all-reduce was wrong"
        opt.step()
        if with_model:
            assert logged_sum(rank + 1.0) == 3.0, f"step {step}: the loss all-reduce was wrong"
    opt.apply_pending_updates()
    opt.close()


train(with_model=False)
train(with_model=True)
print(f"USER COLLECTIVES OK rank {rank}", flush=True)
