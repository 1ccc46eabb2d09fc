"""``comm``'s bookkeeping that needs no second rank: the C++ references it keeps to every tensor
Horovod holds (so Horovod's shutdown never needs the GIL; see ``comm._HorovodReferences``), and
the pickled-object encoding its object collectives sum.

torch takes the GIL when a tensor's C++ use count falls to 1, so these tests read the use count
(``Tensor._use_count``) around each step.
"""
import gc
import pickle

import pytest
import torch

from dcredit_hvd.transports import horovod as comm


def _count(tensor: torch.Tensor) -> int:
    gc.collect()
    return tensor._use_count()


def test_the_reference_is_taken_before_horovod_sees_the_tensor():
    refs, block = comm._HorovodReferences(), torch.zeros(8)[2:6]
    alone = _count(block)
    seen = []
    refs.enqueue([block], lambda: seen.append(_count(block)) or 1)
    assert seen == [alone + 1]


def test_a_finished_collective_releases_its_reference():
    refs, block = comm._HorovodReferences(), torch.zeros(4)
    alone = _count(block)
    handle = refs.enqueue([block], lambda: 7)
    assert _count(block) == alone + 1 and len(refs) == 1
    refs.finished(handle)
    assert _count(block) == alone and len(refs) == 0


def test_a_failed_collective_keeps_its_reference_while_horovod_may_still_finalize_it():
    refs = comm._HorovodReferences()
    ok, failed = torch.zeros(4), torch.zeros(4)
    alone = _count(failed)
    refs.enqueue([ok], lambda: 1)
    refs.enqueue([failed], lambda: 2)
    refs.finished(1)                     # handle 2 raised in hvd.synchronize: never finished
    assert _count(failed) == alone + 1 and len(refs) == 1


def test_restarted_handle_numbers_release_the_references_of_the_old_horovod():
    refs = comm._HorovodReferences()
    old = [torch.zeros(4) for _ in range(3)]
    alone = _count(old[0])
    for handle, tensor in enumerate(old, start=1):
        refs.enqueue([tensor], lambda handle=handle: handle)
    new = torch.zeros(4)
    refs.enqueue([new], lambda: 1)       # hvd.shutdown(); hvd.init(): handles start at 1 again
    assert [_count(t) for t in old] == [alone] * 3
    assert _count(new) == alone + 1 and len(refs) == 1


def test_a_rejected_enqueue_holds_nothing():
    refs, block = comm._HorovodReferences(), torch.zeros(4)
    alone = _count(block)

    def rejected() -> int:
        raise ValueError("Horovod has been shut down")

    with pytest.raises(ValueError):
        refs.enqueue([block], rejected)
    assert _count(block) == alone and len(refs) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32, torch.float64])
def test_any_reducible_dtype_can_be_held(dtype):
    refs, block = comm._HorovodReferences(), torch.zeros(4, dtype=dtype)
    alone = _count(block)
    refs.enqueue([block], lambda: 1)
    assert _count(block) == alone + 1


@pytest.mark.parametrize("obj", [b"", "a", {"plan": [1, 2, 3]}, list(range(1000)), (None, 2.5)])
def test_an_object_survives_a_sum_with_the_zeros_other_ranks_send(obj):
    words = comm._as_words(obj)
    assert words.dtype == torch.int32
    total = words + torch.zeros_like(words)
    assert comm._from_words(total) == obj
    assert len(pickle.dumps(obj)) <= 4 * words.numel() < len(pickle.dumps(obj)) + 4


def test_the_simulator_is_told_horovods_cycle_and_fusion_as_horovod_reads_them(monkeypatch):
    monkeypatch.delenv("HOROVOD_CYCLE_TIME", raising=False)
    monkeypatch.delenv("HOROVOD_FUSION_THRESHOLD", raising=False)
    assert comm.execution() == comm.Execution(cycle_s=0.001, fusion_bytes=128 << 20)
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "8.5")
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "0")
    assert comm.execution() == comm.Execution(cycle_s=0.0085, fusion_bytes=0)
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "lots")      # unreadable: the default
    assert comm.execution().fusion_bytes == 128 << 20
