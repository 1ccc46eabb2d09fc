"""``dcredit_hvd.frameworks.hf.DCreditTrainer`` against the Hugging Face ``Trainer`` on DDP, in real
2-rank ``torchrun`` jobs (Gloo, CPU): no mocks.

An ordinary single-process pytest: it launches ``hf_cases.py`` twice (module-scoped fixtures),
``torchrun --standalone --nproc-per-node 2`` each time, and each test reads one case of the JSON
the job wrote:

* ``main``: tiny GPT-2, tiny BERT and a small CNN, every policy, with and without overlapped
  updates, accumulation, clipping, bf16, evaluation, LR schedulers (the Trainer's and one passed
  in ``optimizers=``): final weights (every rank's, against the same rank of the DDP run) and the
  logged losses within Horovod's tolerance of ``transformers.Trainer``; refused setups; full
  runs that save a checkpoint at step 4, then the job ends.
* ``resume``: a NEW job resumes those checkpoints (``resume_from_checkpoint``) and must end
  where the runs that never stopped ended; then rank 1 is SIGKILLed mid-training, hidden from
  torchrun (``tests/jobs/failure/unnoticed.sh``), and rank 0 must raise ``PeerLostError`` naming
  rank 1 and exit within seconds.

Every launch runs in its own session and is killed on timeout; no process may be left
(``tests/jobs/launched_jobs.py``).
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jobs"))
from launched_jobs import BIN, job_env, launch  # noqa: E402

HERE = Path(__file__).resolve().parent
TORCHRUN = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
UNNOTICED = HERE.parent / "jobs" / "failure" / "unnoticed.sh"
LAUNCH_TIMEOUT_S = 240.0
RTOL, ATOL = 1e-5, 1e-6
#: The survivor must be gone this long after its peer died (as for plain scripts).
LIVENESS_LIMIT_S = 30.0

POLICIES = ("dcredit", "bytescheduler", "wfbp")
PARITY = ([f"{m}-{p}{o}" for m in ("gpt2", "bert") for p in POLICIES for o in ("", "-overlap")]
          + ["gpt2-wfbp-nomodel", "cnn-dcredit", "cnn-wfbp-overlap", "gpt2-clip",
             "gpt2-accum-clip-eval-cosine-dcredit", "gpt2-accum-clip-eval-cosine-wfbp",
             "gpt2-bf16", "gpt2-bf16-overlap", "bert-user-optimizer-steplr", "cnn-shard-clip",
             "gpt2-shard-dcredit", "gpt2-sync-each-batch-accum-clip-dcredit"])
RESUMED = ["resume-accum-clip-eval", "resume-overlap", "resume-shard"]
REFUSED = {
    "overlap-with-clipping": ("ValueError", "needs max_grad_norm=0"),
    "torch-compile": ("ValueError", "does not support torch_compile"),
    "transport-horovod": ("ValueError", "transport must be 'torch.distributed'"),
    "dcredit-sets-model": ("ValueError", "dcredit= cannot set model"),
    "unknown-keyword": ("TypeError", "unknown dcredit= keyword(s) partition"),
    "already-distributed": ("ValueError", "already a distributed optimizer"),
    "shard-sync-each-batch": ("ValueError", "shard=True with accelerator_config's"),
}

pytestmark = pytest.mark.skipif(not (BIN / "torchrun").exists(), reason="torchrun not installed")


def _job(out: Path, phase: str, pid_dir: Path, prefix: tuple[str, ...] = (),
         extra: dict | None = None, args: tuple[str, ...] = ()) -> tuple[dict, str, int]:
    """Launch ``hf_cases.py OUT PHASE``; returns the JSON, the output and the exit code
    (whatever the job recorded in ``pid_dir`` is killed afterwards if still alive)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    started = time.time()
    python = [sys.executable] if prefix else []          # torchrun adds it without a prefix
    command = (TORCHRUN + list(prefix) + python + [str(HERE / "hf_cases.py"), str(out), phase]
               + list(args))
    code, output, _, _ = launch(command, job_env(pid_dir, extra=extra), pid_dir,
                                LAUNCH_TIMEOUT_S)
    tail = output[-6000:]
    print(f"HF {phase} job: {time.time() - started:.1f} s, exit {code}")
    assert code is not None, f"the {phase} job hung for {LAUNCH_TIMEOUT_S:.0f} s:\n{tail}"
    found = out / f"{phase}.json"
    assert found.exists(), f"the {phase} job wrote no results (exit {code}):\n{tail}"
    return json.loads(found.read_text())["cases"], output, code


@pytest.fixture(scope="module")
def jobs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf_jobs")


@pytest.fixture(scope="module")
def main_job(jobs_dir: Path) -> dict:
    cases, output, code = _job(jobs_dir, "main", jobs_dir)
    assert code == 0, output[-6000:]
    assert not (jobs_dir / "leftovers").read_text(), "processes left behind"
    return cases


@pytest.fixture(scope="module")
def resume_job(main_job: dict, jobs_dir: Path) -> tuple[dict, str, int]:
    """The second launch: resume the main job's checkpoints, then rank 1 dies (SIGKILL)."""
    pid_dir = jobs_dir / "death"
    pid_dir.mkdir()
    return _job(jobs_dir, "resume", pid_dir, prefix=("--no-python", "sh", str(UNNOTICED)),
                extra={"UNNOTICED_HIDE": "1"}, args=("kill",))


def _close(mine: list[float], ref: list[float]) -> bool:
    return len(mine) == len(ref) and all(
        math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL) for a, b in zip(mine, ref))


def _check_parity(name: str, case: dict[str, Any]) -> None:
    assert "error" not in case, case.get("error")
    series = case["series"]
    print(f"HF PARITY {name}: max |w - w_ref| = {case['max_abs']:.3g}, "
          f"loss max diff = {max([abs(a - b) for a, b in zip(*series['loss'])] or [0]):.3g}")
    assert case["within_tolerance"], (
        f"weights off by {case['max_abs']:.3g} (worst: {case['worst_tensor']})")
    mine, ref = series["loss"]
    assert len(ref) >= 4 and _close(mine, ref), f"logged losses differ: {mine} vs {ref}"
    assert _close(*series["eval_loss"]), f"eval losses differ: {series['eval_loss']}"
    assert _close(*series["learning_rate"]), f"learning rates differ: {series['learning_rate']}"


@pytest.mark.parametrize("name", PARITY)
def test_dcredit_trainer_matches_trainer_on_ddp(main_job: dict, name: str) -> None:
    """The same fit with ``DCreditTrainer`` and with ``transformers.Trainer`` (DDP): final
    weights on every rank and the logged losses, eval losses and learning rates agree within
    Horovod's tolerance; the DCredit run's model is not wrapped in DDP, the reference's is."""
    case = main_job[name]
    _check_parity(name, case)
    assert case["reference_wrapped"] == "DistributedDataParallel"
    assert case["wrapped"] != "DistributedDataParallel"
    grad_norm, ref_grad_norm = case["series"]["grad_norm"]
    if name.endswith("-overlap"):
        assert case["wrapped"] == "_UpdatesInFlight" and grad_norm == []
    elif "-shard" in name:
        pass      # the logged grad_norm is this rank's part (docs/frameworks-hf.md)
    else:
        assert _close(grad_norm, ref_grad_norm), f"grad norms differ: {grad_norm} vs {ref_grad_norm}"
    mine, ref = case["series"]["substep_grad_norm"]
    assert _close(mine, ref), f"gradients after a micro-batch that does not step: {mine} vs {ref}"
    if "sync-each-batch" in name:
        assert mine, "no micro-batch without a step: nothing checked"
    if "dcredit" in name.split("-")[1:2]:
        assert case["plan"], "dcredit never installed its plan"


def test_clipping_actually_clipped(main_job: dict) -> None:
    """``max_grad_norm=0.05`` is below every step's gradient norm: the clipping cases clip."""
    for name in ("gpt2-clip", "gpt2-accum-clip-eval-cosine-dcredit"):
        norms = main_job[name]["series"]["grad_norm"][1]
        assert norms and min(norms) > 0.05, (name, norms)


def test_accumulation_and_evaluation_ran(main_job: dict) -> None:
    """Accumulation over 2 with 5 micro-batches per epoch (a partial window at each epoch's
    end), evaluation every 2 steps: 3 evaluations in 6 steps, each matching DDP's."""
    case = main_job["gpt2-accum-clip-eval-cosine-dcredit"]
    assert len(case["series"]["eval_loss"][0]) == 3


def test_a_scheduler_passed_in_optimizers_drives_the_wrapper(main_job: dict) -> None:
    """``optimizers=(SGD, StepLR)``: the scheduler built on the user's optimizer sets the
    wrapped optimizer's learning rate (halved every 2 steps: 0.05 -> 0.00625 after 6)."""
    case = main_job["bert-user-optimizer-steplr"]
    assert case["lr_seen"] == [pytest.approx(0.00625)]


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_setups_are_refused_with_a_clear_error(main_job: dict, name: str) -> None:
    kind, text = REFUSED[name]
    found = main_job["refusals"][name]
    assert found["raised"] == kind and text in found["message"], found


def test_every_case_ran(main_job: dict) -> None:
    expected = set(PARITY) | {f"{n}-full" for n in RESUMED} | {"refusals"}
    assert set(main_job) == expected


@pytest.mark.parametrize("name", RESUMED)
def test_resume_in_a_new_job_matches_the_run_that_never_stopped(
        main_job: dict, resume_job: tuple[dict, str, int], name: str) -> None:
    """Checkpoint at step 4 of 8 (the main job ended), ``resume_from_checkpoint`` in a new
    job: the weights after step 8 and the losses of steps 5-8 match the uninterrupted run (no
    update lost or applied twice; Adam state, LR schedule, data order restored)."""
    assert main_job[f"{name}-full"].get("checkpoint"), main_job[f"{name}-full"]
    cases, _, _ = resume_job
    _check_parity(name, cases[name])


def test_a_dead_worker_ends_the_job_within_seconds_naming_the_rank(
        resume_job: tuple[dict, str, int], jobs_dir: Path) -> None:
    """Rank 1 is SIGKILLed at step 3 of a long fit, hidden from torchrun: rank 0 raises
    ``PeerLostError`` naming rank 1 out of ``trainer.train()`` and exits non-zero well within
    30 s; nothing is left running."""
    _, output, code = resume_job
    tail = output[-5000:]
    pid_dir = jobs_dir / "death"
    died = pid_dir / "failed_at"
    assert died.exists(), f"rank 1 never reached the failure point:\n{tail}"
    raised = pid_dir / "raised_at0"
    assert raised.exists(), f"rank 0 raised nothing:\n{tail}"
    at, kind, message = raised.read_text().split(" ", 2)
    status = pid_dir / "status0"
    assert status.exists() and int(status.read_text()) != 0, tail
    assert code != 0, f"torchrun reported success:\n{tail}"
    detected = float(at) - float(died.read_text())
    exited = status.stat().st_mtime - float(died.read_text())
    print(f"HF LIVENESS: PeerLostError {detected:.2f} s, rank 0 exited {exited:.2f} s "
          "after rank 1 died")
    assert kind == "PeerLostError", raised.read_text()
    assert "rank 1 " in message, message
    assert exited < LIVENESS_LIMIT_S, f"the survivor took {exited:.0f} s to exit"
    assert "still training after its peer died" not in output, tail
    assert not (pid_dir / "leftovers").read_text(), "processes left behind"
