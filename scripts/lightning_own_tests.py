"""Lightning's own multi-process CPU tests with ``strategy="dcredit"`` swapped in for DDP, beside
the same tests as Lightning ships them (issue 40, item 7; ``docs/frameworks-lightning.md``).

Lightning's tests are not in its wheels or sdists, only in its repository, so this is a script
(``make test`` runs where only the package registries are reachable).  Give it the ``tests``
folder of the Lightning release that is installed::

    git -C pytorch-lightning archive 2.6.5 tests | tar x -C /tmp/lt
    pip install --target /tmp/lt-deps requests jsonargparse      # two tests' own needs
    PYTHONPATH=/tmp/lt-deps python scripts/lightning_own_tests.py --tests /tmp/lt/tests \
        --out /tmp/lt-own

Each test in ``CASES`` (every test of ``tests_pytorch`` and ``tests_fabric`` that trains or
checkpoints on two CPU processes under ``ddp`` or ``ddp_spawn``; the connector tests, which
check what the name ``"ddp"`` resolves to, are left out) runs twice, each in its own
``python -m pytest``, with ``PL_RUN_STANDALONE_TESTS=1`` for those Lightning runs standalone:
once as shipped, once from a copy of its file in which ``"ddp"`` is ``"dcredit"`` and
``"ddp_spawn"`` is ``"dcredit_spawn"`` (Fabric's strategy has no spawn launcher, so there
``"ddp_spawn"`` is ``"dcredit"``, launched by Fabric's script launcher).  It prints one line per
test and the pass counts, and writes ``OUT/verdicts.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

CASES = [
    "tests_pytorch/strategies/test_ddp_integration.py::test_ddp_cpu",
    "tests_pytorch/callbacks/test_pruning.py::test_pruning_callback_ddp_cpu",
    "tests_pytorch/callbacks/test_stochastic_weight_avg.py::test_swa_callback_ddp_cpu",
    "tests_pytorch/callbacks/test_weight_averaging.py::test_ema_ddp_spawn_cpu",
    "tests_pytorch/callbacks/test_weight_averaging.py::test_ema_resume_ddp",
    "tests_pytorch/checkpointing/test_model_checkpoint.py::"
    "test_model_checkpoint_no_extraneous_invocations",
    "tests_pytorch/checkpointing/test_torch_saving.py::test_model_torch_save_ddp_cpu",
    "tests_pytorch/overrides/test_distributed.py::test_params_synced_during_nonfit",
    "tests_pytorch/profilers/test_profiler.py::test_simple_profiler_distributed_files",
    "tests_pytorch/serve/test_servable_module_validator.py::"
    "test_servable_module_validator_with_trainer",
    "tests_pytorch/strategies/launchers/test_multiprocessing.py::test_memory_sharing_disabled",
    "tests_pytorch/trainer/connectors/test_data_connector.py::test_dataloader_reinit_for_subclass",
    "tests_pytorch/trainer/connectors/test_data_connector.py::"
    "test_eval_shuffle_with_distributed_sampler_replacement",
    "tests_pytorch/trainer/flags/test_overfit_batches.py::"
    "test_distributed_sampler_with_overfit_batches",
    "tests_pytorch/trainer/logging_/test_distributed_logging.py::test_all_rank_logging_ddp_cpu",
    "tests_pytorch/trainer/properties/test_get_model.py::test_get_model_ddp_cpu",
    "tests_pytorch/trainer/test_dataloaders.py::test_distributed_sampler_without_global_seed",
    "tests_pytorch/trainer/test_trainer.py::test_trainer_predict_ddp_spawn",
    "tests_pytorch/trainer/test_trainer.py::test_spawn_predict_return_predictions",
    "tests_pytorch/trainer/test_trainer.py::test_fit_test_synchronization",
    "tests_pytorch/tuner/test_scale_batch_size.py::"
    "test_batch_size_finder_with_distributed_strategies",
    "tests_pytorch/tuner/test_tuning.py::test_tuner_with_distributed_strategies",
    "tests_pytorch/utilities/test_combined_loader.py::test_combined_data_loader_validation_test",
    "tests_pytorch/utilities/test_combined_loader.py::"
    "test_combined_data_loader_with_max_size_cycle_and_ddp",
    "tests_fabric/plugins/precision/test_amp_integration.py::test_amp",
    "tests_fabric/strategies/test_ddp_integration.py::test_ddp_save_load",
    "tests_fabric/strategies/test_ddp_integration.py::test_clip_gradients",
    "tests_fabric/strategies/launchers/test_multiprocessing_integration.py::"
    "test_memory_sharing_disabled",
    "tests_fabric/test_fabric.py::test_setup_dataloaders_distributed_sampler_shuffle",
    "tests_fabric/test_fabric.py::test_setup_dataloaders_distributed_sampler_parity",
]
TIMEOUT_S = 300
#: pytest's counts in its summary line ("2 passed, 1 error in 3.1s"; "errors" counts as "error").
COUNTED = re.compile(r"(\d+) (passed|failed|skipped|error)")
REGISTERS = {"tests_pytorch": "import dcredit_hvd.frameworks.lightning  # noqa\n",
             "tests_fabric": "import dcredit_hvd.frameworks.fabric  # noqa\n"}


def swapped(text: str, suite: str) -> str:
    """The file with DDP's strategy names replaced by ours (and our registration imported)."""
    spawn = "dcredit_spawn" if suite == "tests_pytorch" else "dcredit"
    text = re.sub(r"""(["'])ddp_spawn\1""", f'"{spawn}"', text)
    text = re.sub(r"""(["'])ddp\1""", '"dcredit"', text)
    return REGISTERS[suite] + text


def prepare(source: Path, out: Path, which: str) -> Path:
    tree = out / which
    if tree.exists():
        shutil.rmtree(tree)
    shutil.copytree(source, tree)
    if which == "dcredit":
        for path in sorted({case.split("::")[0] for case in CASES}):
            file = tree / path
            file.write_text(swapped(file.read_text(), path.split("/")[0]))
    return tree


def run(tree: Path, case: str) -> dict:
    """``case`` as Lightning's standalone harness runs it; a test that is not standalone is
    deselected there (pytest's exit 5), so it runs again as Lightning's main job runs it."""
    found = run_as(tree, case, standalone=True)
    return run_as(tree, case, standalone=False) if found["exit"] == 5 else found


def run_as(tree: Path, case: str, standalone: bool) -> dict:
    env = dict(os.environ, PL_RUN_STANDALONE_TESTS="1" if standalone else "0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
    started = time.time()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "-rs", case], cwd=tree, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as timed_out:
        output, code = f"timed out after {TIMEOUT_S} s: {timed_out.stdout!r}", -1
    tail = [line for line in output.splitlines() if COUNTED.search(line)]
    summary = tail[-1] if tail else f"exit {code}"
    counts = {kind: int(n) for n, kind in COUNTED.findall(summary)}
    return {"exit": code, "summary": summary.strip("= "), "counts": counts,
            "seconds": round(time.time() - started, 1),
            "output": "" if code == 0 else output[-4000:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=Path, required=True,
                        help="the tests/ folder of the installed Lightning release")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("-k", default="", help="only the cases whose id contains this")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cases = [c for c in CASES if args.k in c]
    verdicts: dict[str, dict[str, dict]] = {}
    for which in ("plain", "dcredit"):
        tree = prepare(args.tests, args.out, which)
        verdicts[which] = {}
        for case in cases:
            verdicts[which][case] = found = run(tree, case)
            print(f"{which:8s} {found['seconds']:6.1f} s  {found['summary']:40s} {case}",
                  flush=True)
    (args.out / "verdicts.json").write_text(json.dumps(verdicts, indent=1))
    for which, found in verdicts.items():
        total = {k: sum(v["counts"].get(k, 0) for v in found.values())
                 for k in ("passed", "failed", "error", "skipped")}
        # A run killed or timed out prints no summary: its test function counts here.
        unsettled = sum(1 for v in found.values() if not v["counts"])
        print(f"LIGHTNING OWN {which}: {total['passed']} passed, {total['failed']} failed, "
              f"{total['error']} errors, {total['skipped']} skipped, {unsettled} test "
              f"function(s) ended without pytest's verdict (killed or timed out) "
              f"({len(found)} test functions)")


if __name__ == "__main__":
    main()
