"""``lightning.Fabric(strategy="dcredit")`` against Fabric's own ``strategy="ddp"``, on two ranks
(``dcredit_hvd/frameworks/fabric.py``, ``docs/frameworks-fabric.md``).

A single-process pytest: ``torchrun --standalone --nproc-per-node 2 fabric_cases.py main`` runs
once (module-scoped fixture), every rank writes a JSON of its cases, each test asserts one case;
then ``python fabric_cases.py launch`` lets Fabric's own ``launch()`` start rank 1.  Launches
run in their own session and are killed on timeout, so a hang is a failed test.

Tolerance: Horovod's for float32 (``rtol=1e-5, atol=1e-6``) on every parameter and buffer of
each rank, on every loss and on every norm ``fabric.clip_gradients`` returned.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jobs"))
from launched_jobs import job_env, launch  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
BIN = Path(sys.executable).parent
DRIVER = str(HERE / "fabric_cases.py")
TORCHRUN = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
LAUNCH_TIMEOUT_S = 180.0

PLAIN = ["plain-dcredit", "plain-bytescheduler", "plain-sync", "separate-setup", "gpt2-dcredit",
         "gpt2-bf16"]
ACCUMULATION = ["accumulate", "gpt2-accumulate", "accumulate-clip-norm"]
CLIPPING = ["clip-norm", "clip-value", "gpt2-bytescheduler-clip-norm", "bf16-clip-norm"]
SHARDED = ["shard-clip-norm", "shard-gpt2-accumulate-clip-norm"]
REFUSALS = {
    "refuse-wrapped-optimizer": "pass the plain torch optimizer",
    "refuse-unknown-argument": "find_unused_parameters",
    "refuse-horovod-transport": "torch.distributed only",
    "refuse-accumulation-without-passes": "DCreditFabricStrategy(backward_passes_per_step=N)",
    "refuse-clip-value-with-shard": "clips by norm only",
}


@dataclass
class Job:
    code: Optional[int]
    output: str
    ranks: list[dict]
    folder: Path

    def case(self, name: str) -> list[dict]:
        """``name`` on every rank; a case that raised fails with its traceback."""
        assert len(self.ranks) == 2, f"a rank wrote no results (exit {self.code}):\n" \
            f"{self.output[-4000:]}"
        found = [rank.get(name) for rank in self.ranks]
        assert all(found), f"case {name} did not run (exit {self.code}):\n{self.output[-4000:]}"
        for rank, result in enumerate(found):
            assert "error" not in result, f"rank {rank}: {result['error']}\n{result['trace']}"
        return found


def _run(command: list[str], folder: Path, group: str) -> Job:
    """``command`` in a session of its own, as a user who sets no ``DCREDIT_*`` variable
    (``launched_jobs``), with no rank variable of this process's launcher left over."""
    pids = folder / f"pids-{group}"
    pids.mkdir(parents=True, exist_ok=True)
    env = job_env(pids)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    code, output, seconds, _ = launch(command, env, pids, LAUNCH_TIMEOUT_S)
    print(f"FABRIC {group}: {seconds:.1f} s, exit {code}")
    ranks = [json.loads(p.read_text()) for p in sorted(folder.glob(f"{group}.rank*.json"))]
    return Job(code, output, ranks, folder)


@pytest.fixture(scope="module")
def main_job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    if not (BIN / "torchrun").exists():
        pytest.skip("torchrun not installed")
    folder = tmp_path_factory.mktemp("fabric")
    job = _run(TORCHRUN + [DRIVER, "main", str(folder)], folder, "main")
    assert job.code == 0, f"the torchrun launch exited {job.code}:\n{job.output[-4000:]}"
    return job


@pytest.fixture(scope="module")
def launch_job(main_job: Job) -> Job:
    job = _run([sys.executable, DRIVER, "launch", str(main_job.folder)], main_job.folder,
               "launch")
    assert job.code == 0, f"the fabric.launch() run exited {job.code}:\n{job.output[-4000:]}"
    return job


def _assert_parity(results: list[dict], what: str) -> None:
    for rank, result in enumerate(results):
        assert result["wrapped"], f"{what}: the optimizer was not a dcredit_hvd wrapper"
        print(f"PARITY {what} rank {rank}: weights max |diff| {result['max_abs_diff']:.3g}, "
              f"optimizer state {result['optimizer_state_diff']:.3g}")
        assert result["names_match"], f"{what}: other parameters or buffers than DDP's"
        assert result["weights_close"], \
            f"{what} rank {rank}: weights differ from DDP's by {result['max_abs_diff']}"
        assert result["optimizer_state_close"], (
            f"{what} rank {rank}: the optimizer state to save differs from DDP's by "
            f"{result['optimizer_state_diff']}")
        assert result["series_close"], (
            f"{what} rank {rank}: losses {result['losses']} norms {result['norms']}, DDP's "
            f"{result['ref_losses']} {result['ref_norms']}")


@pytest.mark.parametrize("case", PLAIN)
def test_a_fabric_loop_under_dcredit_ends_on_ddps_weights_on_every_rank(
        main_job: Job, case: str) -> None:
    """5 steps of ``setup``/``backward``/``step`` (a CNN with batch norm and SGD, a tiny GPT-2
    with tied embeddings and AdamW, also in bf16-mixed): ranks start from different weights
    and see different data, so rank 0's weights and buffers must have been broadcast, and
    every gradient averaged, for each rank to end on DDP's.  Policy ``dcredit`` ran with its
    plan in force."""
    results = main_job.case(case)
    _assert_parity(results, case)
    assert all(r["planned"] == (r["policy"] == "dcredit") for r in results), results[0]


@pytest.mark.parametrize("case", ACCUMULATION)
def test_accumulating_two_micro_batches_matches_ddps_no_backward_sync(
        main_job: Job, case: str) -> None:
    """``fabric.no_backward_sync`` around the first of 2 micro-batches under DDP;
    ``backward_passes_per_step=2`` under dcredit (where ``no_backward_sync`` is a no-op)."""
    results = main_job.case(case)
    _assert_parity(results, case)
    _assert_clipped_every_step(results, case)
    assert all(len(r["losses"]) == 10 and r["passes"] == 2 for r in results)


@pytest.mark.parametrize("case", CLIPPING)
def test_clip_gradients_sees_the_reduced_gradients(main_job: Job, case: str) -> None:
    """``fabric.clip_gradients`` (by value, and by a norm below every step's, so every step
    clips) returns DDP's global norm each step and ends on DDP's weights."""
    results = main_job.case(case)
    _assert_parity(results, case)
    _assert_clipped_every_step(results, case)


def _assert_clipped_every_step(results: list[dict], case: str) -> None:
    if "norm" in case:
        for r in results:
            assert len(r["norms"]) == 5 and min(r["norms"]) > r["max_norm"], r["norms"]


@pytest.mark.parametrize("case", SHARDED)
def test_shard_true_clips_by_the_global_norm_and_matches_ddp(main_job: Job, case: str) -> None:
    """``DCreditFabricStrategy(shard=True)``: each rank updates its slices; the norm is over
    every rank's slices (the same on each rank, DDP's within float tolerance), and the state
    ``fabric.save`` would write is the whole state (every rank's slices), DDP's."""
    results = main_job.case(case)
    _assert_parity(results, case)
    _assert_clipped_every_step(results, case)
    assert results[0]["norms"] == results[1]["norms"]


@pytest.mark.parametrize("case", ["resume-shard", "resume-shard-into-plain"])
def test_a_sharded_checkpoint_resumes_where_the_uninterrupted_run_ends(
        main_job: Job, case: str) -> None:
    """``fabric.save`` at step 3 of a ``shard=True`` run writes every rank's slices of the
    optimizer state (rank 0 writes the file); ``fabric.load`` into a new sharded (or unsharded)
    run, 2 more steps: DDP's 5-step weights, momentum and losses of steps 4-5."""
    results = main_job.case(case)
    _assert_parity(results, case)
    assert all(len(r["losses"]) == 2 for r in results)


def test_an_unsupported_lightning_version_is_refused_at_import() -> None:
    code = ("import lightning; lightning.__version__ = '2.7.0'\n"
            "try:\n    import dcredit_hvd.frameworks.fabric\n"
            "except ImportError as exc:\n    print('REFUSED', exc)")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120).stdout
    assert "REFUSED" in out and "lightning 2.7.0 is not supported" in out, out


def test_fabrics_collectives_under_dcredit_give_ddps_results(main_job: Job) -> None:
    for result in main_job.case("collectives"):
        assert result["dcredit"] == result["ddp"], result
        assert result["dcredit"]["mean"] == [1.5, 1.5] and result["dcredit"]["any"]


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_what_cannot_work_is_refused_with_what_to_do(main_job: Job, case: str) -> None:
    for result in main_job.case(case):
        assert result["raised"] and REFUSALS[case] in result["raised"], result


def test_fabric_launch_starts_the_other_rank_and_matches_ddp(launch_job: Job) -> None:
    """``python script.py`` with ``Fabric(strategy="dcredit", devices=2).launch()``: the
    strategy's launcher starts rank 1; both ranks end on the torchrun DDP run's weights."""
    _assert_parity(launch_job.case("fabric-launch"), "fabric-launch")


@pytest.mark.parametrize("nodes", [1, 2])
def test_num_nodes_and_the_distributed_sampler_are_ddps_before_launch(nodes: int) -> None:
    """``Fabric(num_nodes=...)`` reaches the strategy, and ``setup_dataloaders`` samples the
    world DDP samples, also before ``launch()`` (Lightning's own sampler tests rely on it)."""
    import lightning

    import dcredit_hvd.frameworks.fabric  # noqa: F401  (registers the name)
    made = {name: lightning.Fabric(accelerator="cpu", strategy=name, devices=2, num_nodes=nodes)
            for name in ("ddp", "dcredit")}
    assert made["dcredit"].strategy.num_nodes == nodes
    assert (made["dcredit"].strategy.distributed_sampler_kwargs
            == made["ddp"].strategy.distributed_sampler_kwargs
            == {"num_replicas": 2 * nodes, "rank": 0})
