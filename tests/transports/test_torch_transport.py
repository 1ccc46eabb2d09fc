"""``transports/torch_distributed.py`` and the transport choice, in one process.

Each check runs in a fresh interpreter (``torch.distributed`` is initialised once per process,
and Horovod must be absent for some): a one-rank Gloo group over a ``HashStore``.  The
multi-rank behaviour (the published order, parity with DDP) is proven under ``torchrun`` in
``tests/torchrun``.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SETUP = """
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
"""
NO_HOROVOD = "import sys; sys.modules['horovod'] = None; sys.modules['horovod.torch'] = None\n"


def run(body: str, *, horovod: bool = True, env: dict | None = None) -> str:
    code = ("" if horovod else NO_HOROVOD) + SETUP + textwrap.dedent(body)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_dcredit_hvd_trains_on_torch_distributed_without_horovod() -> None:
    out = run("""
        import dcredit_hvd
        from dcredit_hvd.transports import torch_distributed
        model = torch.nn.Linear(3, 2)
        opt = dcredit_hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                               named_parameters=model.named_parameters())
        assert isinstance(opt._state.transport, torch_distributed.TorchTransport)
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        assert "horovod" not in {m.split('.')[0] for m in sys.modules if sys.modules[m]}
        print("ok", type(opt).__name__, type(opt).__module__)
    """, horovod=False)
    assert "ok SGD dcredit_hvd.optimizer" in out


def test_submit_averages_like_ddp_and_sums_with_horovods_scaling() -> None:
    run("""
        from dcredit_hvd.transports.torch_distributed import TorchTransport, AVERAGE, SUM
        link = TorchTransport()
        t = torch.tensor([2.0, 4.0])
        assert link.wait(link.submit(t, "a", AVERAGE, 0.5, 2.0)).tolist() == [2.0, 4.0]
        s = torch.tensor([1.0, 3.0])
        out = link.wait(link.submit(s, "s", SUM))
        assert out is s and s.tolist() == [1.0, 3.0]
        assert link.broadcast_object({"k": 1}, "b") == {"k": 1}
        assert link.allgather_object(7, "g") == [7]
        assert link.issue_log() == ["a", "s"]
        assert (link.rank(), link.size(), link.job_rank(), link.job_size()) == (0, 1, 0, 1)
        assert link.is_up() and not link.gpu_operations() and link.included()
        # Each collective starts at once, alone: the simulator is told no cycle, no fusion.
        assert (link.execution().cycle_s, link.execution().fusion_bytes) == (0.0, 0)
    """)


def test_the_halves_on_one_rank_are_the_vector_itself_and_follow_the_order() -> None:
    run("""
        from dcredit_hvd.transports.base import Transport
        from dcredit_hvd.transports.torch_distributed import TorchTransport, AVERAGE, SUM
        link = TorchTransport()
        assert isinstance(link, Transport)
        for n in (0, 1, 5):
            flat = torch.arange(float(n))
            shard = link.wait(link.reduce_scatter(flat, f"b{n}", AVERAGE))
            assert torch.equal(shard, flat) and shard is not flat
            assert torch.equal(link.wait(link.all_gather(shard, f"b{n}", n)), flat)
        half = link.wait(link.reduce_scatter(torch.ones(3, dtype=torch.bfloat16), "h", SUM))
        assert half.dtype == torch.bfloat16 and half.tolist() == [1.0, 1.0, 1.0]
        assert link.issue_log() == ["b0", "b0", "b1", "b1", "b5", "b5", "h"]
    """)


def test_unsupported_op_and_names_are_refused_with_the_fix() -> None:
    run("""
        from dcredit_hvd.transports.torch_distributed import TorchTransport
        link = TorchTransport()
        for op, name, words in ((dist.ReduceOp.MAX, "x", "op=None or torch.distributed"),
                                (dist.ReduceOp.SUM, "x\\ny", "tab or newline")):
            try:
                link.submit(torch.zeros(1), name, op)
            except ValueError as exc:
                assert words in str(exc), exc
            else:
                raise AssertionError(op)
    """)


@pytest.mark.parametrize("setting, words", [
    ("transport='horovod'", "horovod.torch is not installed"),
    ("transport='nccl'", "is not a transport; choose 'horovod' or 'torch.distributed'"),
    ("op=dist.ReduceOp.MAX", "is not supported on torch.distributed"),
    ("process_set=object()", "process_set must be a group of one of the transports (horovod, "
                             "torch.distributed), got object: a Horovod process set"),
])
def test_bad_transport_choices_name_the_fix(setting: str, words: str) -> None:
    out = run(f"""
        import dcredit_hvd
        model = torch.nn.Linear(3, 2)
        try:
            opt = dcredit_hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                   named_parameters=model.named_parameters(),
                                                   {setting})
            model(torch.ones(1, 3)).sum().backward()
            opt.step()
        except (ValueError, TypeError, RuntimeError) as exc:
            print("refused:", exc)
    """, horovod=False)
    assert "refused:" in out and words in out, out


def test_nothing_initialised_says_how_to_initialise_either_library() -> None:
    code = NO_HOROVOD + textwrap.dedent("""
        import torch, dcredit_hvd
        model = torch.nn.Linear(3, 2)
        try:
            dcredit_hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        except RuntimeError as exc:
            print(exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120).stdout
    assert "call hvd.init() first" in out and "init_process_group('gloo')" in out, out


def test_the_environment_variable_chooses_the_transport() -> None:
    import os
    env = dict(os.environ, DCREDIT_TRANSPORT="torch.distributed")
    out = run("""
        import horovod.torch as hvd, dcredit_hvd
        hvd.init()                   # initialised too: without the variable Horovod would win
        model = torch.nn.Linear(3, 2)
        opt = dcredit_hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                               named_parameters=model.named_parameters())
        print(type(opt._state.transport).__name__, opt.scheduler_config.sources["transport"])
    """, env=env)
    assert "TorchTransport environment" in out, out


SUBGROUP_JOB = """
import sys
from datetime import timedelta
import torch, torch.distributed as dist
import dcredit_hvd
dist.init_process_group("gloo")
rank = dist.get_rank()
pair = dist.new_group([0, 1])                    # every rank calls new_group, as required
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = dcredit_hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       model=model, process_group=pair)
for step in range(4):
    opt.zero_grad()
    model(torch.full((2, 4), float(rank + step))).sum().backward()
    opt.step()
    loss = torch.ones(1)
    dist.all_reduce(loss)                        # the user's own collective, every step
    assert loss.item() == 3.0, loss
other = dist.new_group([1, 2], timeout=timedelta(seconds=20))   # counters still agree
if rank > 0:
    t = torch.ones(1)
    dist.all_reduce(t, group=other)
    assert t.item() == 2.0
opt.apply_pending_updates()
weights = [None] * 3
dist.all_gather_object(weights, model.weight.detach().clone())
if rank == 0:
    assert torch.equal(weights[0], weights[1]), weights
    assert not torch.equal(weights[0], weights[2]), "rank 2 is outside: its own local steps"
    print("subgroup OK")
dist.destroy_process_group()
"""


def test_a_subgroup_needs_nothing_of_the_ranks_outside_and_user_collectives_never_interleave(
        tmp_path) -> None:
    """Ranks outside ``process_group`` build the optimizer as a pass-through and make no group;
    the user's own all-reduce on the default group, each step, meets no collective of ours
    (they run on groups of their own), and later ``new_group`` calls still match."""
    import os
    import shutil
    script = tmp_path / "job.py"
    script.write_text(SUBGROUP_JOB)
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    result = subprocess.run([torchrun, "--nproc-per-node", "3", "--master-port", "29561",
                             str(script)], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "subgroup OK" in result.stdout


def test_a_collective_that_fails_in_gloo_raises_the_transports_failure_type() -> None:
    """Gloo raises a plain RuntimeError ("Connection reset by peer") when a peer dies; as the
    transport's ``failure`` (``DistError``) the scheduler waits for the liveness channel to
    name the dead rank (``PeerLostError``) instead of reporting its own thread's failure."""
    run("""
        from dcredit_hvd.transports.ordering import Entry, Submission
        from dcredit_hvd.transports.torch_distributed import TorchTransport
        class Broken:
            def is_completed(self): return True
            def wait(self): raise RuntimeError("[pair.cc:537] Read error: Connection reset by peer")
        link = TorchTransport()
        sub = Submission(Entry("g", 1, "float32"), {"wire": torch.zeros(1), "out": torch.zeros(1),
                                                  "scale": 1.0}, work=Broken())
        try:
            link.collect(sub)
        except link.failure as exc:
            assert "'g' failed" in str(exc) and "Connection reset" in str(exc), exc
            assert isinstance(exc.__cause__, RuntimeError)
        else:
            raise AssertionError("no failure raised")
    """)
