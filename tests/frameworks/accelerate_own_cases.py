"""Accelerate's OWN multi-process tests (``accelerate.test_utils.scripts``, shipped in its
wheel), in a 2-rank job with the plain ``accelerate.Accelerator`` (``plain``) or with
``DCreditAccelerator`` in its place (``dcredit``), a job each (Accelerate's state is one per
process, and its scripts leave settings in it), issue 40 item 7:

    ACCELERATE_USE_CPU=1 torchrun --standalone --nproc-per-node 2 \
        tests/frameworks/accelerate_own_cases.py OUT dcredit

(``ACCELERATE_USE_CPU=1`` is what ``accelerate launch --cpu`` sets: without it Accelerate runs
one process per rank on a machine without GPUs.)  The scripts write files into the working
directory (``check_main_process_first.txt``): the job runs in ``OUT``.

Accelerate's scripts build their accelerators by the name ``Accelerator`` in their own module;
this runner binds that name, in those test modules only, to the class under test (Accelerate
itself is not touched).  Each test function runs on its own, with the arguments Accelerate's
``main()`` passes on a multi-CPU job, plus the accumulation grid that its ``main()`` keeps for
GPUs (it runs on CPU too); a failure is recorded and the next function runs.  Every rank
writes ``OUT/own-{plain|dcredit}-rank{R}.json``: each test's verdict and the last lines of its
error.
"""
from __future__ import annotations

import itertools
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import accelerate
import torch.distributed as dist
from accelerate.state import AcceleratorState, GradientState
from accelerate.test_utils.scripts import test_script, test_sync

from dcredit_hvd.frameworks.accelerate import DCreditAccelerator

MODULES = (test_script, test_sync)


def _grid() -> list[tuple[bool, bool, bool]]:
    return list(itertools.product((True, False), repeat=3))


def _name(module: str, fn: Callable) -> str:
    return f"{module}.{fn.__name__.removeprefix('test_')}"


def cases() -> list[tuple[str, Callable[[], Any]]]:
    """(name, call) in the order of Accelerate's ``main()``s, named after the function (less
    ``test_``); ``test_sync``'s functions that take an accelerator get a fresh one of the
    class under test."""
    s, y = test_script, test_sync
    out: list[tuple[str, Callable[[], Any]]] = [(_name("script", fn), fn) for fn in (
        s.init_state_check, s.process_execution_check, s.test_split_between_processes_list,
        s.test_split_between_processes_nested_dict, s.test_split_between_processes_tensor,
        s.test_split_between_processes_evenly, s.rng_sync_check, s.dl_preparation_check,
        s.central_dl_preparation_check, s.custom_sampler_check, s.check_seedable_sampler,
        s.check_seedable_sampler_with_data_seed, s.check_seedable_sampler_in_batch_sampler_shard)]
    out += [("script.training_check", lambda: s.training_check(use_seedable_sampler=False)),
            ("script.training_check[seedable]", lambda: s.training_check(use_seedable_sampler=True)),
            (_name("script", s.test_trigger), s.test_trigger),
            (_name("sync", y.test_dataloader_break), y.test_dataloader_break)]
    out += [(_name("sync", fn), lambda fn=fn: fn(y.Accelerator()))
            for fn in (y.test_distributed_sync, y.test_distributed_sync_multiple_fwd)]
    accumulate, with_scheduler = (y.test_gradient_accumulation,
                                  y.test_gradient_accumulation_with_opt_and_scheduler)
    out.append((_name("sync", with_scheduler), with_scheduler))
    for flags in _grid():
        tag = "[split={},dispatch={},sync_each_batch={}]".format(*flags)
        out.append((_name("sync", accumulate) + tag, lambda a=flags: accumulate(*a)))
        if any(flags):
            out.append((_name("sync", with_scheduler) + tag, lambda a=flags: with_scheduler(*a)))
    return out


def run_all(accelerator_class: type) -> dict[str, dict]:
    """Every case with ``accelerator_class`` bound in Accelerate's test modules."""
    for module in MODULES:
        module.Accelerator = accelerator_class
    accelerator_class()                  # as Accelerate's main()s begin: the state, the group
    verdicts: dict[str, dict] = {}
    for name, call in cases():
        # Which case a rank was in when it died (a C++ abort leaves no Python traceback).
        print(f"[accelerate-own] rank {dist.get_rank()}: {name}", file=sys.stderr, flush=True)
        try:
            call()
            verdicts[name] = {"passed": True}
        except Exception as exc:  # noqa: BLE001 - each test's failure is the datum
            lines = traceback.format_exception_only(type(exc), exc)
            verdicts[name] = {"passed": False, "error": "".join(lines)[-600:]}
        finally:
            # As Accelerate's scripts do between their tests: a test that failed half-way
            # (DCreditAccelerator refuses the fp16 part of training_check) must not leave its
            # settings to the next, so the state is rebuilt with the class's defaults.
            GradientState._reset_state()
            if not verdicts[name]["passed"]:
                AcceleratorState._reset_state()
                accelerator_class()
        dist.barrier()                          # a rank that failed early waits for the other
    return verdicts


if __name__ == "__main__":
    OUT, WHICH = Path(sys.argv[1]).resolve(), sys.argv[2]
    os.chdir(OUT)
    verdicts = run_all({"plain": accelerate.Accelerator, "dcredit": DCreditAccelerator}[WHICH])
    state = AcceleratorState()
    (OUT / f"own-{WHICH}-rank{dist.get_rank()}.json").write_text(json.dumps(
        {"accelerate": accelerate.__version__, "processes": state.num_processes,
         "verdicts": verdicts}, indent=1))
    state.destroy_process_group()
