"""``dcredit_hvd.bench.sidebyside`` without a launch: policy names (``-sync``, ``-td``), the simulator check
of the rows on each transport, and the table's layout (scripts and tests read it)."""
from __future__ import annotations

import types

import pytest

from dcredit_hvd.bench import sidebyside as bench
from dcredit_hvd.planning import simulator
from dcredit_hvd.planning.costmodel import CostModel
from dcredit_hvd.planning.profile import Profile

PROFILE = Profile.from_lists([f"t{i}" for i in range(4)], [4_000_000, 1_000_000, 200_000, 50_000],
                             [4] * 4, [0.002, 0.003, 0.001, 0.001], [0.004, 0.006, 0.002, 0.002])
HOROVOD_COST = CostModel(a=0.004, b=8e-9)     # Horovod's live fit: its cycle in the startup
GLOO_COST = CostModel(a=0.0005, b=9e-9)       # a -td row's own fit


@pytest.mark.parametrize("name, base, overlap, transport", [
    ("dcredit", "dcredit", True, None),
    ("dcredit-sync", "dcredit", False, None),
    ("dcredit-td", "dcredit", True, "torch.distributed"),
    ("wfbp-sync-td", "wfbp", False, "torch.distributed"),
    ("bytescheduler-td-sync", "bytescheduler", False, "torch.distributed"),
    ("ddp", "ddp", True, None)])
def test_policy_names_give_the_base_the_overlap_and_the_transport(name, base, overlap, transport):
    policy = bench.PolicyName.parse(name)
    assert (policy.base, policy.overlap, policy.transport) == (base, overlap, transport)
    assert policy.baseline == (base in ("horovod", "ddp"))


def test_suffixes_on_a_baseline_are_refused_with_the_fix(capsys):
    for name in ("ddp-td", "horovod-sync"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--policy", f"dcredit,{name}"])
        err = capsys.readouterr().err
        assert f"--policy {name}: the -sync and -td suffixes apply to dcredit_hvd's" in err
        assert "dcredit-td" in err
    assert bench.parse_args(["--policy", "horovod, ddp,dcredit,dcredit-td"]).policies == [
        "horovod", "ddp", "dcredit", "dcredit-td"]


def test_a_bad_base_policy_fails_before_any_work():
    with pytest.raises(ValueError, match="not a known policy"):
        bench.check_policies(["horovod", "dcredti-td"])
    bench.check_policies(["horovod", "ddp", "wfbp-td", "dcredit-sync-td"])


def kept(policy: str, measured: CostModel | None = None) -> types.SimpleNamespace:
    """What ``bench.kept_of`` keeps of a wfbp/bytescheduler optimizer."""
    config = types.SimpleNamespace(policy=policy, partition_bytes=1_000_000,
                                   credit_bytes=4_000_000)
    return types.SimpleNamespace(scheduler_config=config, plan=None,
                                 measured=None if measured is None else (PROFILE, measured))


def results_of(names: list[str], link: dict | None = None) -> dict:
    return {"policies": {n: {"seconds_per_iteration": 0.05} for n in names}, "link": link}


def test_td_rows_are_simulated_without_horovods_cycle_and_fusion_on_their_own_cost():
    optimizers = {"horovod": types.SimpleNamespace(), "ddp": types.SimpleNamespace(),
                  "wfbp": kept("wfbp", HOROVOD_COST), "wfbp-td": kept("wfbp", GLOO_COST),
                  "bytescheduler-td": kept("bytescheduler")}
    out = bench.simulator_check(results_of(list(optimizers)), optimizers, None)
    sizes = {"partition_bytes": 1_000_000, "credit_bytes": 4_000_000, "overlap_forward": True}
    horovod_rows = simulator.simulate(PROFILE, HOROVOD_COST, "wfbp", fusion_bytes=128 << 20,
                                      **sizes).iteration_s
    assert out["wfbp"]["predicted"] == pytest.approx(horovod_rows)
    # the -td row: its own live fit, each block its own all-reduce at once
    assert out["wfbp-td"]["predicted"] == pytest.approx(simulator.simulate(
        PROFILE, GLOO_COST, "wfbp", cycle_s=0.0, fusion_bytes=0, **sizes).iteration_s)
    # a -td row without a fit of its own: the shared (Horovod-measured) cost, still no cycle
    assert out["bytescheduler-td"]["predicted"] == pytest.approx(simulator.simulate(
        PROFILE, HOROVOD_COST, "bytescheduler", cycle_s=0.0, fusion_bytes=0,
        **sizes).iteration_s)
    assert "ddp" not in out and out["wfbp-td"]["measured"] == 0.05
    assert out["wfbp-td"]["error_percent"] == pytest.approx(
        100 * (out["wfbp-td"]["predicted"] - 0.05) / 0.05)


def test_the_shared_profile_is_a_horovod_rows_when_there_is_one():
    """The profile and cost every row without its own fit uses: one measured with model= over
    Horovod, even when a -td row is listed first."""
    optimizers = {"wfbp-td": kept("wfbp", GLOO_COST), "wfbp-sync": kept("wfbp", CostModel(1, 1)),
                  "wfbp": kept("wfbp", HOROVOD_COST)}
    out = bench.simulator_check(results_of(list(optimizers)), optimizers, None)
    assert out["wfbp"]["predicted"] == pytest.approx(simulator.simulate(
        PROFILE, HOROVOD_COST, "wfbp", fusion_bytes=128 << 20, partition_bytes=1_000_000,
        credit_bytes=4_000_000, overlap_forward=True).iteration_s)


def test_the_link_model_of_td_rows_is_gloos_ring():
    """On 4 hosts under recursive doubling the links need log2(4) = 2 exchanges for Horovod's
    rows; Gloo's ring (the -td rows) needs 2 (P-1)/P = 1.5."""
    link = {"rate": "1gbit", "bytes": 10_000_000, "seconds": 0.16,
            "bandwidth_optimal_seconds": 0.12}
    assert bench.network_model(HOROVOD_COST, link).b == pytest.approx(0.16 / 1e7)
    ring = bench.network_model(GLOO_COST, link, bandwidth_optimal=True)
    assert (ring.a, ring.b) == (GLOO_COST.a, pytest.approx(0.12 / 1e7))
    optimizers = {"wfbp": kept("wfbp", HOROVOD_COST), "wfbp-td": kept("wfbp", GLOO_COST)}
    out = bench.simulator_check(results_of(list(optimizers), link), optimizers, None)
    assert out["wfbp-td"]["predicted_link"] == pytest.approx(simulator.simulate(
        PROFILE, ring, "wfbp", cycle_s=0.0, fusion_bytes=0, partition_bytes=1_000_000,
        credit_bytes=4_000_000, overlap_forward=True).iteration_s)


def table_of(names: list[str], capsys) -> list[str]:
    runs = {n: {"seconds_per_iteration": 0.1, "img_sec_mean": 160.0, "energy_j_per_iter": None}
            for n in names}
    bench.print_table({"policies": runs, "energy": None, "ranks": 2, "hosts": ["h0", "h1"],
                       "allreduce": "Gloo", "flush_denormal": True})
    return capsys.readouterr().out.splitlines()


def test_the_table_keeps_its_columns_and_widens_for_long_names(capsys):
    lines = table_of(["horovod", "ddp", "bytescheduler", "dcredit-sync"], capsys)
    head = next(line for line in lines if line.startswith("policy"))
    assert head.index("ms/iter") == 15 + 10 - len("ms/iter")       # the layout scripts know
    assert "(ddp: Gloo's)" in lines[1]
    lines = table_of(["ddp", "dcredit-td", "bytescheduler-sync-td"], capsys)
    assert "(ddp and the -td rows: Gloo's)" in lines[1]
    rows = [line for line in lines if line.startswith(("ddp", "dcredit-td", "bytescheduler"))]
    assert len({row.index(" 100.0") for row in rows}) == 1, rows      # ms/iter aligned
    assert all(row.split()[1] == "100.0" for row in rows), rows
