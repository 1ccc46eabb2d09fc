"""``strategy="dcredit_spawn"`` and ``"dcredit_fork"``: the scheduler under the processes
Lightning starts itself (``ddp_spawn``'s launcher: a script, a notebook), on both Lightning
packages, against Lightning's own ``"ddp_spawn"`` (``lightning_spawn_cases.py``).

Every rank ends each fit with DDP's parameters and buffers (Horovod's float32 tolerance), and
the process that called ``fit`` gets them back, as it does from ``ddp_spawn``.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

CASES = Path(__file__).resolve().parent / "lightning_spawn_cases.py"
TIMEOUT_S = 240


@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_spawned_and_forked_fits_match_ddp_spawn_on_every_rank_and_in_the_caller(
        package: str, tmp_path: Path) -> None:
    pytest.importorskip(package)
    done = subprocess.run([sys.executable, str(CASES), package, str(tmp_path)],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    for strategy in ("dcredit_spawn", "dcredit_fork"):
        for where in ("rank0", "rank1", "main"):
            # Each rank against DDP's same rank: DDP's buffers differ by rank after the last
            # forward (it broadcasts rank 0's before each forward, then each rank updates).
            reference = torch.load(tmp_path / f"ddp_spawn.{where}.pt")
            got = torch.load(tmp_path / f"{strategy}.{where}.pt")
            assert got.keys() == reference.keys()
            for key, want in reference.items():
                torch.testing.assert_close(got[key], want, rtol=1e-5, atol=1e-6,
                                           msg=f"{strategy} {where} {key}")
    init, moved = torch.load(tmp_path / "init.pt"), torch.load(tmp_path / "ddp_spawn.main.pt")
    assert any(not torch.equal(moved[k], v) for k, v in init.items()), \
        "the fit did not train: the comparison would prove nothing"


@pytest.mark.parametrize("name", ["dcredit_spawn", "dcredit_fork", "dcredit_notebook"])
def test_a_start_method_on_horovod_is_refused_naming_the_launcher(name: str) -> None:
    pytest.importorskip("lightning")
    from lightning.pytorch.strategies import StrategyRegistry

    import dcredit_hvd.frameworks.lightning  # noqa: F401  (registers the names)
    entry = StrategyRegistry[name]
    with pytest.raises(ValueError, match="horovodrun or mpirun.*strategy='dcredit'"):
        entry["strategy"](transport="horovod", **entry["init_params"])
