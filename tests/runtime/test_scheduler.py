"""The gate and completion thread, driven by a fake transport (no Horovod)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from dcredit_hvd.planning.blocks import build_layout
from dcredit_hvd.policies import WFBP, ByteScheduler, Immediate
from dcredit_hvd.runtime.scheduler import BlockScheduler, Item, SchedulerError


class FakeLink:
    """Submitted blocks complete when the test says so (or at once with ``auto``)."""

    def __init__(self, auto: bool = False, fail_on: str | None = None) -> None:
        self.auto = auto
        self.fail_on = fail_on
        self.lock = threading.Lock()
        self.submitted: list[Item] = []
        self.done: set[int] = set()
        self.max_inflight_bytes = 0

    def submit(self, item: Item) -> int:
        with self.lock:
            self.submitted.append(item)
            handle = len(self.submitted) - 1
            inflight = sum(i.block.nbytes for h, i in enumerate(self.submitted) if h not in self.done)
            self.max_inflight_bytes = max(self.max_inflight_bytes, inflight)
            if self.auto:
                self.done.add(handle)
            return handle

    def poll(self, handle: int) -> bool:
        with self.lock:
            return handle in self.done

    def collect(self, handle: int) -> torch.Tensor:
        item = self.submitted[handle]
        if self.fail_on is not None and item.block.name == self.fail_on:
            raise RuntimeError("simulated Horovod failure")
        return item.payload

    def complete_all(self) -> None:
        with self.lock:
            self.done.update(range(len(self.submitted)))


def make(policy, link, names=("a", "b", "c"), numels=(100, 100, 100), part=100):
    layouts = build_layout(list(names), list(numels), [4] * len(names), policy.partition_bytes(part))
    policy.bind(layouts)
    sched = BlockScheduler(policy, submit=link.submit, poll=link.poll, collect=link.collect,
                           poll_seconds=0.0001)
    return sched, layouts


def items_for(layout):
    return [Item(b.key, 0, b, torch.zeros(b.numel)) for b in layout.blocks]


def wait_until(predicate, timeout=5.0):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.001)


def step_until(link, sched, count):
    """Complete everything in flight until ``count`` blocks have been submitted."""
    while len(link.submitted) < count:
        seen = len(link.submitted)
        link.complete_all()
        wait_until(lambda seen=seen: len(link.submitted) > seen)


def test_bytescheduler_keeps_bytes_in_flight_within_the_credit():
    link = FakeLink()
    # three tensors of two 100-byte blocks; the credit holds two blocks
    sched, layouts = make(ByteScheduler(credit_bytes=200), link, numels=(50, 50, 50))
    sched.start_iteration()
    sched.enqueue(2, items_for(layouts[2]))
    assert len(link.submitted) == 2
    sched.enqueue(1, items_for(layouts[1]))
    assert len(link.submitted) == 2, "credit exhausted: nothing more may go"
    step_until(link, sched, 4)
    sched.enqueue(0, items_for(layouts[0]))
    sched.end_backward()
    step_until(link, sched, 6)
    link.complete_all()
    sched.wait_all()
    assert link.max_inflight_bytes <= 200
    sched.close()


def test_urgent_block_overtakes_queued_less_urgent_blocks():
    link = FakeLink()
    sched, layouts = make(ByteScheduler(credit_bytes=100), link, numels=(50, 50, 50))
    sched.start_iteration()
    sched.enqueue(2, items_for(layouts[2]))          # (2,0) goes, (2,1) waits for credit
    sched.enqueue(0, items_for(layouts[0]))          # tensor 0 becomes ready meanwhile
    sched.end_backward()
    step_until(link, sched, 4)
    link.complete_all()
    sched.wait_all()
    order = [i.block.key for i in link.submitted]
    assert order == [(2, 0), (0, 0), (0, 1), (2, 1)]
    sched.close()


def test_wfbp_sends_each_tensor_whole_as_soon_as_ready():
    link = FakeLink(auto=True)
    sched, layouts = make(WFBP(), link)
    assert all(len(t.blocks) == 1 for t in layouts)
    sched.start_iteration()
    for l in (2, 1, 0):
        sched.enqueue(l, items_for(layouts[l]))
    assert [i.block.tensor for i in link.submitted] == [2, 1, 0]
    sched.end_backward()
    sched.wait_all()
    sched.close()


def test_compressed_blocks_are_written_back_on_completion():
    link = FakeLink(auto=True)
    sched, layouts = make(Immediate(), link, names=("a",), numels=(4,))
    target = torch.zeros(4)
    block = layouts[0].blocks[0]
    item = Item(block.key, 0, block, torch.full((4,), 3.0),
                finish=lambda out: target.copy_(out * 2))
    sched.start_iteration()
    sched.enqueue(0, [item])
    sched.end_backward()
    sched.wait_all()
    assert torch.equal(target, torch.full((4,), 6.0))
    sched.close()


def test_error_in_completion_thread_surfaces_in_the_training_thread():
    link = FakeLink(auto=True, fail_on="dcredit.b.0of1")
    sched, layouts = make(Immediate(), link, part=None)
    sched.start_iteration()
    sched.enqueue(1, items_for(layouts[1]))
    with pytest.raises(SchedulerError, match="simulated Horovod failure"):
        sched.wait_all()
    with pytest.raises(SchedulerError):
        sched.enqueue(0, items_for(layouts[0]))
    sched.close()


def test_close_stops_the_completion_thread():
    link = FakeLink()                          # in flight until the test completes them
    sched, layouts = make(Immediate(), link)
    sched.start_iteration()
    sched.enqueue(0, items_for(layouts[0]))
    thread = sched._thread
    sched.close()
    assert thread is not None and not thread.is_alive()


def test_the_completion_thread_ends_when_wait_all_ends_the_iteration_and_the_next_starts_one():
    """A framework's harness (Lightning's, Fabric's) fails a test that leaves a thread behind
    right after its last step: the thread must be gone when ``wait_all`` returns."""
    link = FakeLink()
    sched, layouts = make(Immediate(), link)
    for _ in range(2):
        sched.start_iteration()
        sched.enqueue(0, items_for(layouts[0]))
        thread = sched._thread
        assert thread is not None and thread.is_alive()
        link.complete_all()
        sched.wait_all()
        assert not thread.is_alive()
        assert sched._thread is None
    assert len(link.submitted) == 2 * len(layouts[0].blocks)
    sched.close()


def test_blocks_that_never_complete_raise_a_stall_error_naming_them():
    from dcredit_hvd.runtime.scheduler import StallError

    link = FakeLink()                          # nothing ever completes: a peer stopped submitting
    sched, layouts = make(Immediate(), link)
    sched._stall_seconds, sched._stall_abort_seconds = 0.05, 0.2
    sched.start_iteration()
    sched.enqueue(0, items_for(layouts[0]))
    with pytest.raises(StallError, match=r"did not complete within .*dcredit\.a\.0of4"):
        sched.wait_all()
    sched.close()


def test_a_block_in_flight_too_long_makes_check_raise_for_waiting_forward_passes():
    from dcredit_hvd.runtime.scheduler import StallError

    link = FakeLink()
    sched, layouts = make(Immediate(), link)
    sched._stall_abort_seconds = 0.1
    sched.start_iteration()
    sched.enqueue(0, items_for(layouts[0]))
    sched.check()                                 # young: fine
    time.sleep(0.15)
    with pytest.raises(StallError, match="in flight for more than"):
        sched.check()
    sched.close()


def _liveness_pair():
    from dcredit_hvd.liveness.heartbeat import Liveness, Settings

    config = Settings(interval=0.1, timeout=1.5, exit_seconds=0.0)
    pair = [Liveness(r, 2, config, advertise=["127.0.0.1"]) for r in range(2)]
    table = [c.address() for c in pair]
    for c in pair:
        c.start(table)
    assert all(c.wait_connected(10.0) for c in pair)
    return pair


def test_a_lost_peer_wakes_a_training_thread_blocked_in_wait_all_with_peer_lost_error():
    from dcredit_hvd.runtime.scheduler import PeerLostError

    pair = _liveness_pair()
    link = FakeLink()                          # nothing completes: the peer is gone
    policy = Immediate()
    layouts = build_layout(["a"], [100], [4], None)
    policy.bind(layouts)
    sched = BlockScheduler(policy, submit=link.submit, poll=link.poll, collect=link.collect,
                           poll_seconds=0.0001, liveness=pair[0])
    sched.start_iteration()
    sched.enqueue(0, items_for(layouts[0]))
    raised: list[BaseException] = []

    def train() -> None:
        try:
            sched.wait_all()
        except BaseException as exc:  # noqa: BLE001 (the test inspects it)
            raised.append(exc)
    thread = threading.Thread(target=train)
    thread.start()
    time.sleep(0.2)
    assert thread.is_alive()                     # waiting, as for a slow peer
    pair[1].close()                              # the peer dies
    thread.join(timeout=10.0)
    assert not thread.is_alive(), "wait_all did not wake up"
    assert isinstance(raised[0], PeerLostError) and raised[0].ranks == [1], raised
    assert "rank 1 (host " in str(raised[0])
    with pytest.raises(PeerLostError):          # and every later call
        sched.check()
    sched.close()
    pair[0].close()


@pytest.mark.parametrize("peer_dies", [True, False])
def test_horovods_error_becomes_peer_lost_error_when_the_channel_names_the_peer(peer_dies):
    """Horovod's error comes first; the channel's report of the closed connection a moment
    later (0.3 s here, within PEER_NAME_WAIT_SECONDS) turns it into PeerLostError.  With no
    loss, Horovod's own error type comes through as before (elastic recovers from it)."""
    from dcredit_hvd.runtime.scheduler import PeerLostError

    class Internal(RuntimeError):
        pass

    pair = _liveness_pair()
    link = FakeLink(auto=True)

    def collect(handle):
        if peer_dies:
            threading.Timer(0.3, pair[1].close).start()
        raise Internal("Horovod has been shut down")
    policy = Immediate()
    layouts = build_layout(["a"], [100], [4], None)
    policy.bind(layouts)
    sched = BlockScheduler(policy, submit=link.submit, poll=link.poll, collect=collect,
                           poll_seconds=0.0001, passthrough=(Internal,), liveness=pair[0])
    sched.start_iteration()
    sched.enqueue(0, items_for(layouts[0]))
    if peer_dies:
        with pytest.raises(PeerLostError, match="rank 1 .*closed its connection") as info:
            sched.wait_all()
        assert isinstance(info.value.__cause__, Internal)
    else:
        with pytest.raises(Internal, match="Horovod has been shut down"):
            sched.wait_all()
    sched.close()
    for c in pair:
        c.close()
