"""Every command that takes a policy name lists, in its ``--help``, every name it accepts with its
one-line description, taken from the one source of each (``policies.DESCRIBE`` for the runtime's
policies, ``bench.report`` for the bench's rows and suffixes, ``SIMULATOR_ONLY`` and
``STATIC`` for the simulator's and the drift bench's own).  A new name without a description,
or a command that stops listing one, fails here."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dcredit_hvd.__main__ import SIMULATOR_ONLY, simulator_policies
from dcredit_hvd.bench import report
from dcredit_hvd.planning import simulator
from dcredit_hvd.policies import DESCRIBE, POLICIES

ROOT = Path(__file__).resolve().parents[2]


def _runtime() -> dict[str, str]:
    return {name: DESCRIBE[name] for name in POLICIES}


def _bench_rows() -> dict[str, str]:
    """The side-by-side and emulated benches' names: policies, baselines, suffixes."""
    return {**_runtime(), **report.BASELINE_DESCRIPTIONS, **report.SUFFIX_DESCRIPTIONS}


def _drift_rows() -> dict[str, str]:
    spec = importlib.util.spec_from_file_location("bench_drift", ROOT / "scripts" / "bench_drift.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert set(module.POLICIES) <= set(POLICIES) | set(module.STATIC) | {"horovod"}
    return {**_runtime(), **module.STATIC, "horovod": report.BASELINE_DESCRIPTIONS["horovod"]}


#: (command line after the interpreter, the rows its --help must list).
COMMANDS = {
    "dcredit_hvd": (["-m", "dcredit_hvd"], lambda: {**_runtime(), **simulator_policies()}),
    "dcredit_hvd simulate": (["-m", "dcredit_hvd", "simulate"], simulator_policies),
    "dcredit_hvd.bench": (["-m", "dcredit_hvd.bench"], _bench_rows),
    "dcredit_hvd.emulate": (["-m", "dcredit_hvd.emulate"], _bench_rows),
    "bench_all.py": (["scripts/bench_all.py"], _bench_rows),
    "bench_emulated.py": (["scripts/bench_emulated.py"], _bench_rows),
    "bench_drift.py": (["scripts/bench_drift.py"], _drift_rows),
    "gpu_profile_zoo.py": (["scripts/gpu_profile_zoo.py"], simulator_policies),
    "soak.py": (["scripts/soak.py"], _runtime),
}


def test_every_accepted_name_has_one_description():
    """The descriptions cover exactly what each parser accepts."""
    assert tuple(DESCRIBE) == POLICIES                          # config.py validates these
    assert tuple(report.BASELINE_DESCRIPTIONS) == report.BASELINES
    assert set(report.SUFFIX_DESCRIPTIONS) == {report.SYNC, report.TORCH_DISTRIBUTED, report.SHARD}
    assert tuple(simulator_policies()) == simulator.POLICY_NAMES
    assert set(SIMULATOR_ONLY) <= set(simulator.POLICY_NAMES)
    for text in [*DESCRIBE.values(), *report.BASELINE_DESCRIPTIONS.values(),
                 *report.SUFFIX_DESCRIPTIONS.values(), *SIMULATOR_ONLY.values()]:
        assert text and "\n" not in text, text


def test_a_suffix_described_is_one_the_bench_parses():
    for suffix in report.SUFFIX_DESCRIPTIONS:
        parsed = report.PolicyName.parse("dcredit" + suffix)
        assert parsed.base == "dcredit" and parsed.name != parsed.base, suffix


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_lists_every_accepted_policy_name_with_its_line(command: str):
    argv, rows = COMMANDS[command]
    done = subprocess.run([sys.executable, *argv, "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    missing = [name for name, text in rows().items()
               if not any(re.fullmatch(rf"\s+{re.escape(name)}\s{{2,}}{re.escape(text)}", line)
                          for line in lines)]
    assert not missing, f"{command} --help does not list {missing} with their descriptions:\n" \
                        f"{done.stdout[-3000:]}"
