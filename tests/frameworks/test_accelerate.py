"""``dcredit_hvd.frameworks.accelerate.DCreditAccelerator`` against the plain
``accelerate.Accelerator`` (DDP), in real 2-rank jobs (Gloo, CPU): no mocks.

An ordinary single-process pytest: it launches ``accelerate_cases.py`` twice (module-scoped
fixtures), and each test reads the per-rank JSON the jobs wrote:

* ``first``: ``torchrun --standalone --nproc-per-node 2``: a tiny GPT-2 (tied embeddings, each
  rank its own initial weights) trained by the same user loop with both accelerators: plain,
  accumulation over 2 (a partial window at each epoch's end), ``clip_grad_norm_`` with AdamW
  and an LR scheduler, AdamW and the scheduler with overlapped updates (no clipping), a
  batch-norm model (DDP's ``broadcast_buffers``), ``shard=True``, policies ``dcredit`` and
  ``bytescheduler``; resume runs ``save_state`` after step 2 of 4 and go on; ``prepare``
  refusals.
* ``second``: ``accelerate launch --cpu --num_processes 2`` (Accelerate's multi-CPU launch, via
  mpirun): a NEW job ``load_state``s those checkpoints, trains steps 3-4, and must end where the
  runs that never stopped ended; then the parity cases again under this launcher.

* ``bf16``: ``torchrun`` again, a few parity cases under bf16 autocast (Accelerate fixes the
  mixed precision per process).

Construction refusals run in single processes (``accelerate_cases.py refuse``).
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jobs"))
from launched_jobs import BIN, job_env, launch  # noqa: E402

HERE = Path(__file__).resolve().parent
CASES = HERE / "accelerate_cases.py"
LAUNCH_TIMEOUT_S = 240.0
RTOL, ATOL = 1e-5, 1e-6
PARITY = [f"{kind}-{policy}" for kind in ("plain", "accumulate", "clip")
          for policy in ("dcredit", "bytescheduler")] + [
              "adam-scheduler-overlap-dcredit", "batchnorm-accumulate-dcredit", "clip-noaccum-dcredit",
              "shard-clip-dcredit", "sync-each-batch-clip-dcredit"]
RESUMED = ["resume-dcredit", "resume-shard-bytescheduler"]
BF16 = ["plain-dcredit", "accumulate-clip-bytescheduler", "shard-adam-dcredit"]
LAUNCHERS = ("torchrun", "accelerate")
REFUSED = {
    "fp16": ("ValueError", "does not support fp16 loss scaling"),
    "dynamo": ("ValueError", "does not support dynamo_backend"),
    "horovodrun": ("RuntimeError", "Accelerate has no Horovod backend"),
    "transport-horovod": ("ValueError", "transport must be 'torch.distributed'"),
    "unknown-keyword": ("TypeError", "unknown dcredit= keyword(s) partition"),
    "sets-model": ("ValueError", "dcredit= cannot set model"),
    "shard-sync-each-batch": ("ValueError", "does not support shard=True with "
                              "GradientAccumulationPlugin(sync_each_batch=True)"),
}
PREPARE_REFUSED = {
    "already-distributed": ("ValueError", "already a distributed optimizer"),
    "optimizer-without-model": ("ValueError", "no prepared model holds every parameter"),
}

pytestmark = pytest.mark.skipif(
    not (BIN / "torchrun").exists() or not (BIN / "accelerate").exists()
    or shutil.which("mpirun") is None, reason="torchrun, accelerate or mpirun not installed")


def _job(out: Path, phase: str, launcher: list[str]) -> list[dict]:
    """Launch ``accelerate_cases.py OUT PHASE``; each rank's JSON (rank 0, rank 1)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    started = time.time()
    pid_dir = out / f"pids-{phase}"
    pid_dir.mkdir()
    code, output, _, _ = launch(launcher + [str(CASES), str(out), phase],
                                job_env(pid_dir, extra={"OMPI_ALLOW_RUN_AS_ROOT": "1",
                                                        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}),
                                pid_dir, LAUNCH_TIMEOUT_S)
    tail = output[-6000:]
    print(f"ACCELERATE {phase} job: {time.time() - started:.1f} s, exit {code}")
    assert code == 0, f"the {phase} job failed or hung (exit {code}):\n{tail}"
    found = [out / f"{phase}.rank{r}.json" for r in (0, 1)]
    assert all(f.exists() for f in found), f"the {phase} job wrote no results:\n{tail}"
    return [json.loads(f.read_text()) for f in found]


@pytest.fixture(scope="module")
def jobs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("accelerate_jobs")


@pytest.fixture(scope="module")
def first_job(jobs_dir: Path) -> list[dict]:
    return _job(jobs_dir, "first", [str(BIN / "torchrun"), "--standalone",
                                    "--nproc-per-node", "2"])


@pytest.fixture(scope="module")
def second_job(first_job: list[dict], jobs_dir: Path) -> list[dict]:
    """``accelerate launch``'s multi-CPU mode starts its processes with mpirun."""
    hostfile = jobs_dir / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    return _job(jobs_dir, "second", [
        str(BIN / "accelerate"), "launch", "--cpu", "--num_processes", "2", "--num_machines",
        "1", "--mpirun_hostfile", str(hostfile), "--mixed_precision", "no",
        "--dynamo_backend", "no"])


@pytest.fixture(scope="module")
def bf16_job(second_job: list[dict], jobs_dir: Path) -> list[dict]:
    """Accelerate fixes the mixed precision per process: a third, short torchrun job."""
    return _job(jobs_dir, "bf16", [str(BIN / "torchrun"), "--standalone",
                                   "--nproc-per-node", "2"])


@pytest.fixture(scope="module")
def jobs(first_job: list[dict], second_job: list[dict]) -> dict[str, list[dict]]:
    return {"torchrun": first_job, "accelerate": second_job}


@pytest.fixture(scope="module")
def refusals(jobs_dir: Path) -> dict:
    """Four single processes (fp16, dynamo and the accumulation plugin each fix Accelerate's
    process-wide state)."""
    out = jobs_dir / "refused"
    out.mkdir()
    batches = ["transport-horovod,unknown-keyword,sets-model,horovodrun", "fp16", "dynamo",
               "shard-sync-each-batch"]
    env = job_env(out)
    procs = [subprocess.Popen([sys.executable, str(CASES), str(out), "refuse", names], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for names in batches]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    return {name: json.loads((out / f"refuse-{name}.json").read_text()) for name in REFUSED}


def _close(mine: list[float], ref: list[float]) -> bool:
    return len(mine) == len(ref) and all(
        math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL) for a, b in zip(mine, ref))


def test_both_launchers_ran_every_case_on_two_ranks(jobs: dict[str, list[dict]]) -> None:
    for launcher, ranks in jobs.items():
        for job in ranks:
            assert job["launcher"] == launcher and job["world"] == 2, job
            assert job["distributed_type"] == "DistributedType.MULTI_CPU"
        expected = set(PARITY) | ({f"{n}-full" for n in RESUMED} | {"refusals", "unowned"}
                                  if launcher == "torchrun" else set(RESUMED))
        assert set(ranks[0]["cases"]) == set(ranks[1]["cases"]) == expected


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("name", PARITY)
def test_dcredit_accelerator_matches_accelerator_on_ddp(jobs: dict[str, list[dict]],
                                                        launcher: str, name: str) -> None:
    """The same loop: final weights on every rank (against the same rank of the DDP run),
    each micro-batch's loss and each step's learning rate agree within Horovod's tolerance.
    The ranks started apart and end equal (rank 0's weights were broadcast); the model was
    not wrapped in DDP, the optimizer was the dcredit_hvd wrapper (and the reference's not)."""
    for rank, job in enumerate(jobs[launcher]):
        case = job["cases"][name]
        assert "error" not in case, case.get("error")
        ref = case["reference"]
        print(f"ACCELERATE PARITY {launcher} {name} rank {rank}: "
              f"max |w - w_ddp| = {case['max_abs']:.3g}")
        assert case["within_tolerance"], (
            f"rank {rank}: weights off by {case['max_abs']:.3g} (worst: {case['worst_tensor']})")
        assert _close(case["losses"], ref["losses"]) and len(ref["losses"]) >= 5
        assert _close(case["lrs"], ref["lrs"]) and case["steps"] == ref["steps"] >= 3
        assert case["initial_cross_rank"] > 1e-3
        # batch-norm statistics end apart (each rank's own last window), as DDP's do
        assert case["cross_rank"] == ref["cross_rank"] == (0.0 if "gpt2" in case["model"].lower()
                                                           else pytest.approx(0.05, abs=0.04))
        assert ref["model"] == "DistributedDataParallel" and not ref["distributed"]
        assert case["model"] in ("GPT2LMHeadModel", "BatchNormTokens") and case["distributed"]
        if "-dcredit" in name:
            assert case["plan"], "dcredit never installed its plan"


@pytest.mark.parametrize("name", BF16)
def test_bf16_autocast_matches_accelerator_on_ddp(bf16_job: list[dict], name: str) -> None:
    """``mixed_precision="bf16"``: the model is prepared with Accelerate's autocast and no DDP;
    weights, losses and clip norms agree with the DDP run on every rank."""
    for job in bf16_job:
        assert job["mixed_precision"] == "bf16"
        case = job["cases"][name]
        assert "error" not in case, case.get("error")
        ref = case["reference"]
        print(f"ACCELERATE BF16 {name}: max |w - w_ddp| = {case['max_abs']:.3g}")
        assert case["within_tolerance"], f"weights off by {case['max_abs']:.3g}"
        assert _close(case["losses"], ref["losses"]) and _close(case["norms"], ref["norms"])
        assert case["model"] != ref["model"] == "DistributedDataParallel"


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_clip_grad_norm_clips_by_the_global_norm_of_the_reduced_gradients(
        jobs: dict[str, list[dict]], launcher: str) -> None:
    """``clip_grad_norm_`` returns DDP's norm of the averaged gradients at every step (also
    with ``shard=True``, where each rank holds slices), and every step clipped (norm > 0.05)."""
    for job in jobs[launcher]:
        for name in [n for n in PARITY if n.startswith(("clip", "shard"))]:
            case = job["cases"][name]
            norms, ref = case["norms"], case["reference"]["norms"]
            assert len(norms) == case["steps"] and _close(norms, ref), (name, norms, ref)
            assert min(norms) > 0.05, (name, norms)


def test_accumulation_follows_accelerates_sync_gradients(jobs: dict[str, list[dict]]) -> None:
    """Accumulation over 2 with 5 micro-batches per epoch: Accelerate steps after micro-batches
    2, 4 and 5 (the dataloader's end) of each epoch, 6 steps, as the wrapper reduced."""
    for job in jobs["torchrun"] + jobs["accelerate"]:
        case = job["cases"]["accumulate-dcredit"]
        assert case["steps"] == case["reference"]["steps"] == 6
        assert len(case["losses"]) == 10


def test_a_prepared_scheduler_sets_the_wrappers_learning_rate(
        jobs: dict[str, list[dict]]) -> None:
    """A ``LambdaLR`` built on the user's AdamW: the rate the wrapper's parameter groups hold
    falls every step, as DDP's does (1/(1+s), stepped twice per step by Accelerate)."""
    for job in jobs["torchrun"]:
        case = job["cases"]["clip-dcredit"]
        lrs = case["lrs"]
        assert all(b < a for a, b in zip(lrs, lrs[1:])) and case["inner_lr"] == [lrs[-1]]
        assert lrs[-1] == pytest.approx(5e-3 / 13)


@pytest.mark.parametrize("name", RESUMED)
def test_load_state_in_a_new_job_matches_the_run_that_never_stopped(
        jobs: dict[str, list[dict]], name: str) -> None:
    """``save_state`` after step 2 of 4 (torchrun job), ``load_state`` in a new job (accelerate
    launch): the weights after step 4 and the losses of steps 3-4 match the uninterrupted run
    on every rank (AdamW state, LR schedule, data position restored; nothing applied twice);
    the uninterrupted run itself matches DDP."""
    for full_job, resumed_job in zip(jobs["torchrun"], jobs["accelerate"]):
        full = full_job["cases"][f"{name}-full"]
        assert "error" not in full, full.get("error")
        assert full["checkpoint"] and full["within_tolerance"], full["max_abs"]
        resumed = resumed_job["cases"][name]
        assert "error" not in resumed, resumed.get("error")
        print(f"ACCELERATE RESUME {name}: max |w - w_uninterrupted| = {resumed['max_abs']:.3g}")
        assert resumed["within_tolerance"], f"weights off by {resumed['max_abs']:.3g}"
        assert resumed["steps"] == full["steps"] == 4
        assert _close(resumed["losses"], full["losses"][4:])
        assert _close(resumed["norms"], full["norms"][2:])


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_setups_are_refused_at_construction(refusals: dict, name: str) -> None:
    kind, text = REFUSED[name]
    assert refusals[name]["raised"] == kind and text in refusals[name]["message"], refusals[name]


@pytest.mark.parametrize("name", sorted(PREPARE_REFUSED))
def test_optimizers_it_cannot_wrap_are_refused_at_prepare(first_job: list[dict],
                                                          name: str) -> None:
    kind, text = PREPARE_REFUSED[name]
    for job in first_job:
        found = job["cases"]["refusals"][name]
        assert found["raised"] == kind and text in found["message"], found


def test_gradients_no_optimizer_owns_are_reduced_as_ddp_reduces_them(
        first_job: list[dict]) -> None:
    """Layers outside the prepared optimizer: after a synced backward, one under ``no_sync``
    and a synced one again, every gradient equals DDP's (``find_unused_parameters``), a layer
    one rank uses included; the layer no rank uses keeps ``grad=None``, as under DDP."""
    for job in first_job:
        found = job["cases"]["unowned"]
        assert "error" not in found, found.get("error")
        assert found["max_gap"] < 1e-6, found
        assert found["none"] == found["ref_none"], found
        assert all(step[-2:] == [True, True] for step in found["none"]), found
