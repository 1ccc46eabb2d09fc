"""Accelerate's own multi-process tests (its wheel's ``test_utils/scripts``: ``test_script``,
``test_sync``) with ``DCreditAccelerator`` in place of ``accelerate.Accelerator``, beside the
plain class, in real 2-rank torchrun jobs on CPU (``accelerate_own_cases.py``; issue 40, item 7).

Every test must pass with the plain class (else this Accelerate is not the one these lists
were made for), and with ``DCreditAccelerator`` every test passes except the documented
refusal (``docs/frameworks-accelerate.md``): ``FP16_REFUSED``, ``training_check`` ends with an
fp16 training, which the accelerator refuses at construction (its fp32 and bf16 trainings
before it pass).  The accumulation tests with ``sync_each_batch=True`` read ``param.grad`` on
micro-batches that do not step and expect it all-reduced, as DDP leaves it; they pass
(``DCreditAccelerator.backward``).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jobs"))
from launched_jobs import BIN, job_env, launch  # noqa: E402

CASES = Path(__file__).resolve().parent / "accelerate_own_cases.py"
TIMEOUT_S = 240.0
_GRID = [f"[split={a},dispatch={b},sync_each_batch={c}]"
         for a in (True, False) for b in (True, False) for c in (True, False)]
SYNC_EACH_BATCH = {f"sync.gradient_accumulation_with_opt_and_scheduler{g}" for g in _GRID
                   if g.endswith("sync_each_batch=True]")}
FP16_REFUSED = {"script.training_check", "script.training_check[seedable]"}

pytestmark = pytest.mark.skipif(not (BIN / "torchrun").exists(), reason="torchrun not installed")


def _verdicts(out: Path, which: str) -> list[dict]:
    pytest.importorskip("accelerate")
    pid_dir = out / f"pids-{which}"
    pid_dir.mkdir()
    started = time.time()
    code, output, _, _ = launch([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2",
                                 str(CASES), str(out), which],
                                job_env(pid_dir, extra={"ACCELERATE_USE_CPU": "1"}), pid_dir,
                                TIMEOUT_S)
    print(f"ACCELERATE OWN {which} job: {time.time() - started:.1f} s, exit {code}")
    # Less Accelerate's per-batch prints ("Model dtype: ..."), which would fill the message.
    told = "\n".join(line for line in output.splitlines() if "dtype:" not in line)
    assert code == 0, f"the {which} job failed or hung (exit {code}):\n{told[-6000:]}"
    return [json.loads((out / f"own-{which}-rank{r}.json").read_text())["verdicts"]
            for r in (0, 1)]


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("accelerate_own")
    found = {which: _verdicts(out, which) for which in ("plain", "dcredit")}
    for which, ranks in found.items():
        passed = sum(v["passed"] for v in ranks[0].values())
        print(f"ACCELERATE OWN {which}: {passed} of {len(ranks[0])} passed")
    return found


def test_accelerates_own_tests_all_pass_with_its_own_accelerator(verdicts):
    for rank, run in enumerate(verdicts["plain"]):
        failed = {k: v["error"] for k, v in run.items() if not v["passed"]}
        assert not failed, f"rank {rank}: Accelerate's own tests failed with its own class: {failed}"


def test_accelerates_own_tests_pass_with_dcredit_but_for_the_documented_differences(verdicts):
    expected = FP16_REFUSED
    assert expected | SYNC_EACH_BATCH <= set(verdicts["plain"][0]), \
        "the case list changed: update these sets"
    for rank, run in enumerate(verdicts["dcredit"]):
        assert set(run) == set(verdicts["plain"][rank])
        unexpected = {k: v["error"] for k, v in run.items()
                      if not v["passed"] and k not in expected}
        assert not unexpected, f"rank {rank}: {unexpected}"
        for name in FP16_REFUSED & {k for k, v in run.items() if not v["passed"]}:
            assert "does not support fp16" in run[name]["error"], (name, run[name]["error"])
    passed = [k for k, v in verdicts["dcredit"][0].items() if v["passed"]]
    # Accelerate's trainings that step (on one CPU or two, batches split or not, an LR
    # scheduler under accumulation) are among them.
    assert {"sync.gradient_accumulation_with_opt_and_scheduler", "sync.dataloader_break",
            "script.trigger"} | SYNC_EACH_BATCH <= set(passed)
