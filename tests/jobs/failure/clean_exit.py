"""A finished training ends promptly with status 0; ``hvd.shutdown()`` after use works.

Launched by ``tests/jobs/test_failures.py`` under ``mpirun -np 2``.  Trains with plain Horovod for the
expected parameters, then with ``dcredit_hvd`` (``model=``, so the last ``step()`` returns before
its updates are applied) and calls ``hvd.shutdown()``: straight after the last ``step()`` as many
Horovod scripts do (``python clean_exit.py direct``: updates still in flight then are lost and
reading the model says so; each rank leaves its outcome in ``outcome<rank>``), or after
``opt.apply_pending_updates()`` (``apply``); or without
``model=`` (``sync``: ``step()`` waits, so a direct ``hvd.shutdown()`` loses nothing).
Prints ``CLEAN rank R params_ok=... non_daemon_threads=[...]`` and writes ``done_at`` just
before the interpreter starts to exit.
"""
import os
import sys
import threading
import time

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F

import dcredit_hvd

hvd.init()
torch.set_num_threads(1)
with open(os.path.join(os.environ["FAILURE_PID_DIR"], f"rank{hvd.rank()}.pid"), "w") as fh:
    fh.write(str(os.getpid()))


def run(wrap):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = wrap(torch.optim.Adam(model.parameters(), lr=0.01), model)
    gen = torch.Generator().manual_seed(hvd.rank())
    for _ in range(6):
        opt.zero_grad()
        x, y = torch.randn(8, 32, generator=gen), torch.randint(0, 10, (8,), generator=gen)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


expected = run(lambda opt, model: hvd.DistributedOptimizer(
    opt, named_parameters=[(f"ref.{n}", p) for n, p in model.named_parameters()]))
expected = [p.detach().clone() for p in expected[0].parameters()]
mode = sys.argv[1]
rank, hvd_size = hvd.rank(), hvd.size()
pid_dir = os.environ["FAILURE_PID_DIR"]


def leave_outcome(text: str) -> None:
    """The launcher kills the other rank as soon as one exits non-zero: each rank leaves its
    outcome in ``outcome<rank>`` too, and a rank about to raise waits briefly for its peer's."""
    print(text, flush=True)
    with open(os.path.join(pid_dir, f"outcome{rank}"), "w") as fh:
        fh.write(text)


def raise_after_peer(where: str, exc: Exception):
    leave_outcome(f"CLEAN rank {rank} {where} raised {type(exc).__name__}: {exc}")
    deadline = time.time() + 20.0
    while (time.time() < deadline and sum(os.path.exists(os.path.join(pid_dir, f"outcome{r}"))
                                          for r in range(hvd_size)) < hvd_size):
        time.sleep(0.05)
    raise exc


try:
    model, opt = run(lambda opt, model: dcredit_hvd.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(), model=None if mode == "sync" else model,
        policy="bytescheduler", partition_bytes=1024))
except Exception as exc:
    raise_after_peer("training", exc)
if mode == "apply":
    opt.apply_pending_updates()
if mode == "direct":
    # Both ranks have returned from their last step() (every block handed to Horovod) before
    # either shuts Horovod down: a shutdown while the peer is still inside allreduce_async_ can
    # deadlock inside Horovod 0.28.1 (seen about 1 run in 8), which is not what this checks.
    with open(os.path.join(pid_dir, f"stepped{rank}"), "w") as fh:
        fh.write("1")
    deadline = time.time() + 30.0
    while (time.time() < deadline and sum(os.path.exists(os.path.join(pid_dir, f"stepped{r}"))
                                          for r in range(hvd_size)) < hvd_size):
        time.sleep(0.01)
hvd.shutdown()
try:
    got = [v.detach().clone() for k, v in model.state_dict().items()]
except Exception as exc:
    raise_after_peer("state_dict", exc)
same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(got, expected))
leave_outcome(f"CLEAN rank {rank} state_dict params_ok={same}")
others = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
print(f"CLEAN rank {rank} params_ok={same} non_daemon_threads={others}", flush=True)
with open(os.path.join(os.environ["FAILURE_PID_DIR"], f"done_at{rank}"), "w") as fh:
    fh.write(repr(time.time()))
