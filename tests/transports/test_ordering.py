"""``ordering.IssueOrder``: every rank issues in rank 0's published order, and divergence raises.

Pure logic, no wire: ``issue`` records what was started, ``follow`` is fed rank 0's entries by
hand (or by a thread, to check the rule under arbitrary interleavings).
"""
from __future__ import annotations

import random
import threading
import time

import pytest

from dcredit_hvd.transports.ordering import Entry, IssueOrder, OrderMismatchError, Submission


def entry(name: str, numel: int = 4, dtype: str = "float32") -> Entry:
    return Entry(name, numel, dtype)


def recorder() -> tuple[list[str], callable]:
    started: list[str] = []

    def issue(sub: Submission) -> str:
        started.append(sub.entry.name)
        return f"work:{sub.entry.name}"
    return started, issue


def test_entries_round_trip_through_their_line_format() -> None:
    for original in (entry("dcredit.ab12.block.3"), entry("a\tb", 7, "bfloat16")):
        assert Entry.decode(original.encode()) == original


def test_gate_issues_at_once_and_publishes_in_issue_order() -> None:
    started, issue = recorder()
    published: list[Entry] = []
    order = IssueOrder(True, issue, published.append)
    for name in ("b", "a", "c"):
        sub = order.submit(Submission(entry(name)))
        assert sub.issued and sub.work == f"work:{name}"
    assert started == ["b", "a", "c"] == [e.name for e in published] == list(order.log)
    assert order.issued == 3


def test_follower_issues_only_in_rank_0_order_whatever_its_own_order() -> None:
    started, issue = recorder()
    order = IssueOrder(False, issue)
    subs = {name: order.submit(Submission(entry(name))) for name in ("c", "a")}
    assert started == [] and not subs["a"].issued          # nothing published yet
    order.follow([entry("a")])
    assert started == ["a"] and subs["a"].issued and not subs["c"].issued
    order.follow([entry("b"), entry("c")])                  # b is next: c waits behind it
    assert started == ["a"]
    subs["b"] = order.submit(Submission(entry("b")))
    assert started == ["a", "b", "c"] and all(s.issued for s in subs.values())


def test_a_name_submitted_twice_is_matched_oldest_first() -> None:
    started, issue = recorder()
    order = IssueOrder(False, issue)
    first, second = (order.submit(Submission(entry("ctl"), payload=k)) for k in (1, 2))
    order.follow([entry("ctl")])
    assert first.issued and not second.issued
    order.follow([entry("ctl")])
    assert second.issued and started == ["ctl", "ctl"]


def test_the_kind_of_collective_round_trips_and_defaults_to_the_all_reduce() -> None:
    assert entry("a").kind == "all_reduce"
    for kind in ("reduce_scatter", "all_gather"):
        original = Entry("a\tb", 1001, "float16", kind)
        assert Entry.decode(original.encode()) == original


def test_one_name_reduce_scattered_and_all_gathered_follows_rank_0_kind_by_kind() -> None:
    """A bucket's two halves may share its name: the follower matches name and kind, so its
    all-gather submitted first waits for rank 0's, behind the reduce-scatter rank 0 issued."""
    started: list[tuple[str, str]] = []
    order = IssueOrder(False, lambda s: started.append(s.entry.key) or True)
    gather = order.submit(Submission(Entry("bucket", 10, "float32", "all_gather")))
    order.follow([Entry("bucket", 10, "float32", "reduce_scatter")])
    assert started == [] and not gather.issued
    scatter = order.submit(Submission(Entry("bucket", 10, "float32", "reduce_scatter")))
    assert scatter.issued and not gather.issued
    order.follow([Entry("bucket", 10, "float32", "all_gather")])
    assert gather.issued
    assert started == [("bucket", "reduce_scatter"), ("bucket", "all_gather")]


def test_a_different_length_of_a_half_raises_naming_the_half() -> None:
    order = IssueOrder(False, lambda s: True)
    sub = order.submit(Submission(Entry("bucket", 10, "float32", "reduce_scatter")))
    order.follow([Entry("bucket", 11, "float32", "reduce_scatter")])
    assert isinstance(sub.error, OrderMismatchError)
    assert "rank 0 reduce-scatters 'bucket' as 11 float32, this rank as 10" in str(sub.error)


def test_a_different_count_or_dtype_under_one_name_raises_before_issue() -> None:
    for theirs in (entry("w", 8), entry("w", 4, "float16")):
        started, issue = recorder()
        order = IssueOrder(False, issue)
        sub = order.submit(Submission(entry("w", 4)))
        order.follow([theirs])
        assert started == [] and isinstance(sub.error, OrderMismatchError)
        assert "'w'" in str(sub.error) and "collective #0" in str(sub.error)
        later = order.submit(Submission(entry("x")))          # the order is broken for good
        assert later.error is sub.error


def test_diverged_paths_raise_after_the_timeout_naming_both_sides() -> None:
    started, issue = recorder()
    order = IssueOrder(False, issue, timeout=0.2)
    order.follow([entry("shared"), entry("only_on_rank_0")])
    shared = order.submit(Submission(entry("shared")))
    mine = order.submit(Submission(entry("only_here")))
    assert shared.issued and started == ["shared"]
    order.check(mine)
    assert mine.error is None                                  # not yet: evidence is fresh
    time.sleep(0.25)
    order.check(mine)
    error = mine.error
    assert isinstance(error, OrderMismatchError)
    text = str(error)
    assert "collective #1" in text and "'only_on_rank_0'" in text and "'only_here'" in text


def test_a_follower_that_is_only_behind_is_not_a_divergence() -> None:
    """Rank 0 waits for nothing of this rank's: no entry published, no error however long."""
    _, issue = recorder()
    order = IssueOrder(False, issue, timeout=0.05)
    sub = order.submit(Submission(entry("late")))
    time.sleep(0.1)
    order.check(sub)
    assert sub.error is None and not sub.issued


def test_a_broken_channel_fails_every_waiting_and_later_submission() -> None:
    _, issue = recorder()
    order = IssueOrder(False, issue)
    waiting = order.submit(Submission(entry("a")))
    broken = ConnectionError("side channel closed")
    order.fail(broken)
    assert waiting.error is broken
    assert order.submit(Submission(entry("b"))).error is broken


def test_an_issue_that_raises_fails_the_order() -> None:
    def issue(sub: Submission) -> None:
        raise RuntimeError("library refused")
    order = IssueOrder(True, issue, lambda e: None)
    sub = order.submit(Submission(entry("a")))
    assert isinstance(sub.error, RuntimeError) and not sub.issued
    assert order.submit(Submission(entry("b"))).error is sub.error


@pytest.mark.parametrize("seed", range(5))
def test_followers_log_equals_the_gates_under_random_interleavings(seed: int) -> None:
    """Three submitting threads per rank in random order and a publisher thread with random
    delays: each follower's issue log is the gate's, entry for entry."""
    rng = random.Random(seed)
    names = [f"block.{i}" for i in range(60)] + ["control"] * 3
    published: list[Entry] = []
    lock = threading.Lock()

    def publish(e: Entry) -> None:
        with lock:
            published.append(e)
    gate = IssueOrder(True, lambda s: True, publish)
    followers = [IssueOrder(False, lambda s: True) for _ in range(2)]

    def submit_all(order: IssueOrder, own: list[str], r: random.Random) -> None:
        for name in own:
            time.sleep(r.random() * 1e-4)
            order.submit(Submission(entry(name)))
    threads = []
    for k, order in enumerate([gate, *followers]):
        own = names[:]
        rng.shuffle(own)
        chunks = [own[i::3] for i in range(3)]
        threads += [threading.Thread(target=submit_all, args=(order, c, random.Random(seed * 10 + k * 3 + j)))
                    for j, c in enumerate(chunks)]
    for t in threads:
        t.start()

    def relay(order: IssueOrder) -> None:
        sent = 0
        while sent < len(names):
            with lock:
                batch = published[sent:sent + rng.randint(1, 5)]
            if batch:
                order.follow(batch)
                sent += len(batch)
            time.sleep(rng.random() * 1e-4)
    relays = [threading.Thread(target=relay, args=(f,)) for f in followers]
    for t in relays:
        t.start()
    for t in threads + relays:
        t.join(timeout=30)
    assert len(gate.log) == len(names)
    for follower in followers:
        assert list(follower.log) == list(gate.log)


def test_the_gate_publishes_an_entry_before_it_issues_it() -> None:
    """An issue may block until the followers issue too (NCCL's first collective initialises
    its communicator): they must have the entry by then."""
    published: list[str] = []
    seen_at_issue: list[list[str]] = []

    def issue(sub: Submission) -> bool:
        seen_at_issue.append(list(published))
        return True
    order = IssueOrder(True, issue, lambda e: published.append(e.name))
    order.submit(Submission(entry("first")))
    assert seen_at_issue == [["first"]]
