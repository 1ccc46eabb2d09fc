"""Elastic training with ``hvd.elastic.TorchState(model, dcredit optimizer)``; launched by
``tests/jobs/test_failures.py`` under ``horovodrun --gloo`` with a host discovery script that lists two
local "hosts" (``localhost`` and ``127.0.0.1``, one slot each).

The worker on ``127.0.0.1`` kills itself (SIGKILL; ``os._exit(1)`` with ``ELASTIC_DEATH=exit``)
once, at batch ``KILL_AT``, writing the time into ``killed-once``; Horovod blacklists
that host for a short cool-down, the survivor restores the last commit and goes on alone (reset 1),
then a new worker joins (reset 2), receives the state, and both train ``JOINT`` more batches.
At the end the ranks compare their parameters: every rank prints ``ELASTIC RESULT`` with the
number of resets this process saw, the world size and whether its parameters equal rank 0's
bit for bit.  The first reset of a process writes its time into ``first-reset``.
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

TOTAL = int(os.environ.get("ELASTIC_TOTAL", "60"))
KILL_AT = int(os.environ.get("ELASTIC_KILL_AT", "15"))
MARKER = os.path.join(os.environ["FAILURE_PID_DIR"], "killed-once")
FIRST_RESET = os.path.join(os.environ["FAILURE_PID_DIR"], "first-reset")
DEATH = os.environ.get("ELASTIC_DEATH", "kill")

hvd.init()
torch.set_num_threads(1)
with open(os.path.join(os.environ["FAILURE_PID_DIR"], f"pid{os.getpid()}.pid"), "w") as fh:
    fh.write(str(os.getpid()))

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
# The policy comes from DCREDIT_POLICY (the test runs the default, dcredit, which profiles and
# plans with collectives, and must start that over in step on every rank after each reset).
opt = dcredit_hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=model.named_parameters(), model=model,
                                       partition_bytes=256)
state = hvd.elastic.TorchState(model, opt, batch=0, shrunk=False, joint=0)
resets = [0]                   # this process's own count (not part of the synced state)
#: Give up waiting for the replacement worker after this many batches (the test then fails).
CAP = int(os.environ.get("ELASTIC_CAP", "4000"))
#: Batches both workers train together after the replacement joined.
JOINT = int(os.environ.get("ELASTIC_JOINT", "10"))


def on_reset():
    resets[0] += 1
    if not os.path.exists(FIRST_RESET):
        with open(FIRST_RESET, "w") as fh:
            fh.write(repr(time.time()))
    print(f"worker {os.getpid()}: reset, size now {hvd.size()}", flush=True)


state.register_reset_callbacks([on_reset])


@hvd.elastic.run
def train(state):
    # Every rank sees the same batch, joint and size, so all leave the loop together:
    # after TOTAL batches, once the replacement has trained JOINT batches with the survivor.
    while (state.batch < TOTAL or state.joint < JOINT) and state.batch < CAP:
        gen = torch.Generator().manual_seed(state.batch * 100 + hvd.rank())
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        state.batch += 1
        # (elastic's sync() restores the last commit, so these are counted in the state itself)
        state.shrunk = state.shrunk or hvd.size() < 2
        if state.shrunk and hvd.size() == 2:
            state.joint += 1
        if state.batch % 5 == 0:
            state.commit()
        if (state.batch == KILL_AT and os.environ.get("HOROVOD_HOSTNAME") == "127.0.0.1"
                and not os.path.exists(MARKER)):
            with open(MARKER, "w") as fh:
                fh.write(repr(time.time()))
            print(f"worker {os.getpid()}: {DEATH} at batch {state.batch}", flush=True)
            sys.stdout.flush()
            if DEATH == "exit":
                os._exit(1)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.05)       # leaves time for the replacement to join before the end


train(state)
flat = torch.cat([p.detach().reshape(-1) for p in model.state_dict().values()])
everyone = hvd.allgather_object(flat)
same = all(torch.equal(t, everyone[0]) for t in everyone)
print(f"ELASTIC RESULT rank={hvd.rank()} size={hvd.size()} batch={state.batch} "
      f"resets={resets[0]} shrunk={state.shrunk} joint={state.joint} identical={same}", flush=True)
