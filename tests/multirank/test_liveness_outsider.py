"""Under a real launcher the liveness channel lets no outsider in (issue 22).

Rank 0 runs ``tests/liveness/liveness_outsider.py``, another process that knows the whole address table
(every rank's host, pid, address and port, as ``comm.watch_peers`` all-gathers it) but not the
secret rank 0 broadcast over Horovod: forged hellos, a forged ``bye``, 1,000 idle connections to
every rank.  Every rank then checks that it lost no peer, is still connected, and kept its file
descriptors within the channel's limit; and the job goes on training.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import horovod.torch as hvd
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dcredit_hvd
from dcredit_hvd.transports import horovod as comm

from conftest import assert_all_ranks

OUTSIDER = Path(__file__).resolve().parents[1] / "liveness" / "liveness_outsider.py"


def _channel():
    lease = comm.watch_peers()         # held for the rest of the job: the channel lives on
    if lease is None:
        pytest.skip("the liveness channel is off (DCREDIT_LIVENESS=0)")
    channel = lease.channel
    assert_all_ranks(channel.wait_connected(30.0), f"not connected: {channel.connected()}")
    return channel


def _on_rank_0(table: list[dict], *args: str) -> list[dict]:
    """The outsider's results, run by rank 0 and broadcast (the others wait in Horovod)."""
    results: list[dict] = []
    if hvd.rank() == 0:
        done = subprocess.run([sys.executable, str(OUTSIDER), *args], capture_output=True,
                              input=json.dumps(table) + "\n", text=True, timeout=180)
        results = ([json.loads(line) for line in done.stdout.splitlines()]
                   if done.returncode == 0 else [{"error": done.stderr[-2000:]}])
    return hvd.broadcast_object(results, root_rank=0, name=f"outsider.{args[0]}")


def _still_watching(channel) -> None:
    time.sleep(2.5 * channel.config.interval)
    others = [r for r in range(hvd.size()) if r != hvd.rank()]
    assert_all_ranks(channel.lost == [], f"lost {channel.lost}")
    assert_all_ranks(channel.connected() == others, f"connected to {channel.connected()}")


def test_the_channel_listens_on_loopback_when_every_rank_is_on_one_host():
    channel = _channel()
    addrs = channel.address()["addrs"]
    single = hvd.local_size() == hvd.size()
    assert_all_ranks(not single or addrs == ["127.0.0.1"], f"listening on {addrs}")


def test_an_outsider_with_the_address_table_is_refused_and_its_bye_ends_nothing():
    channel = _channel()
    table = hvd.allgather_object(channel.address(), name="outsider.table")
    for action in ("token", "bye"):
        results = _on_rank_0(table, action)
        assert_all_ranks(len(results) == hvd.size() and all(r.get("refused") for r in results),
                         f"{action}: {results}")
    _still_watching(channel)


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="counts /proc/self/fd")
def test_a_thousand_idle_connections_per_rank_leave_descriptors_bounded_and_the_job_on():
    channel = _channel()
    table = hvd.allgather_object(channel.address(), name="outsider.flood.table")
    before, peak, stop = _open_files(), [0], threading.Event()

    def sample() -> None:
        while not stop.wait(0.01):
            peak[0] = max(peak[0], _open_files())
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        results = _on_rank_0(table, "flood", "1000", "2")
    finally:
        stop.set()
        sampler.join()
    limit = channel._pending_limit
    assert_all_ranks(len(results) == hvd.size() and all(r.get("opened", 0) > 2 * limit
                                                        for r in results), f"{results}")
    # 8 more: the outsider's pipes on rank 0, Horovod's own sockets coming and going
    assert_all_ranks(peak[0] - before <= limit + 8, f"{before} open files, peak {peak[0]}")
    _still_watching(channel)
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = dcredit_hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(),
                                           policy="bytescheduler")
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 0, 1])
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    weights = hvd.allgather_object(model.weight.detach().clone(), name="outsider.weights")
    assert_all_ranks(all(torch.equal(w, weights[0]) for w in weights), "ranks disagree")
