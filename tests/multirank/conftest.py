"""Shared set-up for tests that run on every rank under ``mpirun -np 2`` / ``horovodrun --gloo``.

Every rank runs the same tests in the same order.  Assertions go through ``assert_all_ranks`` so
that every rank reaches the same verdict: a failure on one rank fails the test on all of them
instead of leaving the others waiting in the next collective.
"""
from __future__ import annotations

import horovod.torch as hvd
import pytest
import torch

hvd.init()
torch.set_num_threads(1)


def assert_all_ranks(ok: bool, message: str = "") -> None:
    verdicts = hvd.allgather_object((hvd.rank(), bool(ok), message if not ok else ""))
    failed = [(r, m) for r, good, m in verdicts if not good]
    assert not failed, f"failed on rank(s) {[r for r, _ in failed]}: {failed[0][1]}"


@pytest.fixture(autouse=True)
def _two_ranks():
    if hvd.size() < 2:
        pytest.skip("multi-rank test: run under mpirun -np 2 or horovodrun -np 2")
    yield
    hvd.barrier()
