"""Rank 0 keeps enqueueing all-reduces while rank 1 raises; launched by ``tests/jobs/test_failures.py``.

``python enqueue_during_shutdown.py MODE`` under ``mpirun -np 2`` or ``horovodrun -np 2 --gloo``:

* ``dcredit``: rank 0 enqueues through ``dcredit_hvd.transports.horovod.submit``, the path every block takes;
* ``horovod``: rank 0 calls ``hvd.allreduce_async_`` itself.  Not run by the tests: it is the
  reproduction of the Horovod 0.28.1 deadlock that ``comm._HorovodReferences`` avoids (it hung
  6 runs out of 6 under ``mpirun``, with rank 0's background thread in ``FinalizeTensorQueue``
  waiting for the GIL and its main thread in ``ProcessSetTable::Contains`` holding it).

Rank 1 raises two seconds after ``hvd.init()``; Horovod's exit handler shuts it down, which
shuts Horovod down on rank 0 while rank 0 is inside an enqueue.  Rank 0 must then fail with
Horovod's "has been shut down" error, never hang.  Pids go to ``$FAILURE_PID_DIR``.
"""
import os
import sys
import time

import horovod.torch as hvd
import torch

from dcredit_hvd.transports import horovod as comm

MODE = sys.argv[1]
LIMIT_S = 20.0

hvd.init()
rank = hvd.rank()
pid_dir = os.environ["FAILURE_PID_DIR"]
with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as fh:
    fh.write(str(os.getpid()))

if rank == 1:
    time.sleep(2.0)
    with open(os.path.join(pid_dir, "failed_at"), "w") as fh:
        fh.write(repr(time.time()))
    raise RuntimeError("injected failure on rank 1")

handles = []
started = time.time()
while time.time() - started < LIMIT_S:
    tensor, name = torch.zeros(16), f"enqueue.{len(handles)}"
    if MODE == "horovod":
        handles.append(hvd.allreduce_async_(tensor, name=name))
    else:
        handles.append(comm.submit(tensor, name, comm.SUM, 1.0, 1.0, hvd.global_process_set))
    if len(handles) > 2000:
        time.sleep(0.001)
print(f"rank 0 still enqueueing after {LIMIT_S:.0f} s", flush=True)
