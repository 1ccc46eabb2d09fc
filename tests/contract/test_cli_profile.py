"""``plan --profile`` and ``simulate --profile``: re-plan a profile measured by the runtime."""
from __future__ import annotations

import json

import pytest

from dcredit_hvd.__main__ import main


def write_measured(path) -> str:
    """A small ``DCREDIT_PROFILE_OUT`` file in the runtime's format (three tensors)."""
    record = {
        "cost": {"a": 1e-3, "b": 1e-9, "residual": 0.02, "r2": 0.999},
        "samples": [[4096, 0.0011], [1 << 20, 0.002]],
        "profile": {"names": ["conv.weight", "conv.bias", "fc.weight"],
                    "nbytes": [400_000, 64, 4_000_000], "element_size": [4, 4, 4],
                    "t_f": [0.004, 0.0, 0.002], "t_b": [0.008, 0.0, 0.004],
                    "t_u": [0.0001, 0.0, 0.0002]},
        "plan": {"partition_bytes": 1 << 20, "windows": [4, 0, 1, 1, 0]},
        "search": [[1 << 20, 0.021], [1 << 22, 0.022]],
    }
    file = path / "measured.json"
    file.write_text(json.dumps(record))
    return str(file)


@pytest.mark.parametrize("overlap", ["--overlap", "--no-overlap"])
def test_cli_plan_replans_a_measured_profile_and_prints_search_and_windows(tmp_path, capsys,
                                                                           overlap):
    path = write_measured(tmp_path)
    assert main(["plan", "--profile", path, overlap, "--cycle", "1ms",
                 "--candidates", "256KiB,1MiB"]) == 0
    out = capsys.readouterr().out
    assert "measured profile" in out and "fitted cost model" in out
    assert "dcredit search" in out and "chosen partition S_p" in out
    assert "phase 1 (backward)" in out and "phase 2 (next forward)" in out
    assert "conv.weight" in out                    # tensor 0 is always left for phase 2
    assert "the runtime's recorded plan" in out and "recorded search" in out


def test_cli_simulate_runs_every_policy_on_a_measured_profile(tmp_path, capsys):
    path = write_measured(tmp_path)
    assert main(["simulate", "--profile", path, "--overlap", "--candidates", "256KiB,1MiB"]) == 0
    out = capsys.readouterr().out
    for word in ("measured profile", "horovod", "wfbp", "bytescheduler", "dcredit", "lower_bound"):
        assert word in out


def test_cli_wants_exactly_one_of_model_and_profile(tmp_path, capsys):
    path = write_measured(tmp_path)
    for argv in (["plan"], ["plan", "--model", "vgg16", "--profile", path], ["simulate"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "either --model" in capsys.readouterr().err


def test_cli_reports_a_profile_file_without_the_needed_fields(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"cost": {"a": 1e-3}}))
    with pytest.raises(SystemExit):
        main(["plan", "--profile", str(bad)])
    assert "lacks a field" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--profile", str(tmp_path / "missing.json")])
    assert "cannot read profile" in capsys.readouterr().err
