"""A script that ends right after its last step() still ends with every update applied.

Not a pytest file: ``make test`` runs it under ``mpirun -np 2`` and ``horovodrun --gloo``.  It
trains with plain Horovod, then with dcredit_hvd (``model=``, so step() returns before updating)
and simply ends.  A check registered before the optimizer runs after dcredit_hvd's exit handler
(atexit runs handlers last-in first-out) and reads the parameters directly, bypassing every hook;
any difference exits the process with status 1.
"""
import atexit
import os
import sys

import horovod.torch as hvd
import torch

sys.path.insert(0, os.path.dirname(__file__))
import dcredit_hvd  # noqa: E402

from models import make_model, params_close, train  # noqa: E402

hvd.init()
torch.set_num_threads(1)

model = make_model()
reference = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                     named_parameters=model.named_parameters())
expected = train(model, reference, steps=4)
expected_params = [v for k, v in zip(model.state_dict(), expected)
                   if k in dict(model.named_parameters())]

model = make_model()


def check() -> None:
    got = [p.detach().clone() for p in model.parameters()]
    if not params_close(got, expected_params):
        print(f"rank {hvd.rank()}: the last step's updates were lost at exit", flush=True)
        os._exit(1)
    print(f"rank {hvd.rank()}: every update applied at exit", flush=True)


atexit.register(check)
opt = dcredit_hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(), model=model,
                                       policy="bytescheduler", partition_bytes=512)
for micro in __import__("models").batches(4):
    opt.zero_grad()
    x, y = micro[0]
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
# no synchronize(), no state_dict(): the script just ends
