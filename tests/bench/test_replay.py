"""The replayed-compute model (``dcredit_hvd.bench.replay``): dilation and scale arithmetic, the
profile reader's refusals, the model's shapes and waits, and the round trip from what
``profile_out`` writes (``planning.write``) to a replay."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from dcredit_hvd.bench import replay, zoo
from dcredit_hvd.bench.replay import Dilation, ReplayError
from dcredit_hvd.planning import decision as planning
from dcredit_hvd.planning.costmodel import CostModel
from dcredit_hvd.planning.planner import plan
from dcredit_hvd.planning.profile import Profile


def small_profile(n: int = 6, t: float = 0.002) -> Profile:
    return Profile.from_lists([f"layer{i}.weight" for i in range(n)],
                              [4000 * (i + 1) for i in range(n)], [4] * n,
                              [t] * n, [2 * t] * n, [0.0] * n)


# ------------------------------------------------------------------ dilation arithmetic

def test_k_times_s_is_the_rate_ratio() -> None:
    d = Dilation.for_cluster("10gbit", "200mbit", byte_scale=10)
    assert d.byte_scale == 10 and d.time_factor == pytest.approx(5.0)
    d = Dilation.for_cluster(25e9, "100mbit", time_factor=4)
    assert d.byte_scale == round(250 / 4) and d.time_factor * d.byte_scale == pytest.approx(250)
    # a gradient takes K times its target time on the emulated link
    nbytes = 4 << 20
    target_s = nbytes * 8 / d.target_rate
    emulated_s = d.numel(nbytes, 4) * 4 * 8 / d.link_rate
    assert emulated_s == pytest.approx(d.time_factor * target_s, rel=1e-4)
    assert d.cluster(d.wall(0.123)) == pytest.approx(0.123)


def test_dilated_environment() -> None:
    env = Dilation.for_cluster("10gbit", "100mbit", byte_scale=25).environment()
    assert env == {"HOROVOD_CYCLE_TIME": "4", "DCREDIT_POLL_SECONDS": "0.002"}


def test_scaled_sizes() -> None:
    d = Dilation.for_cluster("10gbit", "100mbit", byte_scale=50)
    assert d.numel(4 * 1000, 4) == 20
    assert d.numel(4, 4) == 1                       # never empty
    assert d.numel(4 * 1001, 4) == 21               # rounded up
    assert d.scaled_bytes(25_000_000) == 500_000


@pytest.mark.parametrize("kwargs, message", [
    ({"byte_scale": 0}, "byte scale S=0"),
    ({"byte_scale": 2.5}, "byte scale S=2.5"),
    ({"byte_scale": 1_000_000}, "time dilation K="),      # K = 1e-4: out of range
    ({"time_factor": 0}, "time dilation K=0"),
    ({"time_factor": float("nan")}, "time dilation K=nan"),
    ({"time_factor": 5000}, "so K <= 100"),
    ({}, "exactly one of"),
    ({"byte_scale": 2, "time_factor": 50}, "exactly one of"),
])
def test_out_of_range_factors_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ReplayError, match=message.replace("(", r"\(").replace(".", r"\.")):
        Dilation.for_cluster("10gbit", "100mbit", **kwargs)


def test_k_out_of_range_names_the_range() -> None:
    with pytest.raises(ReplayError, match=r"must lie in \[1, 1000\]"):
        Dilation.for_cluster("100gbit", "1mbit", byte_scale=1)   # K = 100,000
    with pytest.raises(ReplayError, match="faster than the target"):
        Dilation.for_cluster("1gbit", "10gbit", byte_scale=1)
    with pytest.raises(ReplayError, match=r"K\*S = "):
        Dilation(10e9, 1e8, 2.0, 10)
    with pytest.raises(ReplayError, match="tc bit rate"):
        Dilation.for_cluster("10 gigabit", "100mbit", byte_scale=10)


def test_memory_budget() -> None:
    vgg, _ = replay.load(replay.shipped("vgg16"))
    ok = Dilation.for_cluster("10gbit", "100mbit", byte_scale=50)
    assert ok.check_memory(vgg, 16) < replay.MEMORY_BUDGET_BYTES
    with pytest.raises(ReplayError, match="use a byte scale S >= "):
        Dilation.for_cluster("10gbit", "10gbit", byte_scale=1).check_memory(vgg, 16)


# ------------------------------------------------------------------ profiles

def write(tmp_path, record) -> str:
    path = tmp_path / "p.json"
    path.write_text(record if isinstance(record, str) else json.dumps(record))
    return str(path)


def good_record() -> dict:
    return {"profile": {"names": ["a", "b"], "nbytes": [400, 800], "element_size": [4, 4],
                        "t_f": [0.001, 0.002], "t_b": [0.002, 0.004], "t_u": [0.0, 0.0]}}


@pytest.mark.parametrize("change, message", [
    (lambda r: r.pop("profile"), "expected a JSON object with a 'profile' object"),
    (lambda r: r["profile"].update(names=[]), "non-empty list of tensor names"),
    (lambda r: r["profile"].update(names=["a", "a"]), "duplicates"),
    (lambda r: r["profile"].update(t_f=[0.001]), r"profile\.t_f has 1 entries for 2 tensors"),
    (lambda r: r["profile"].update(t_b=[0.001, -1]), r"profile\.t_b\[1\] \(b\) = -1"),
    (lambda r: r["profile"].update(t_b=[0.001, "fast"]), r"profile\.t_b\[1\] \(b\) = 'fast'"),
    (lambda r: r["profile"].update(nbytes=[400, 801]), "not a positive multiple"),
    (lambda r: r["profile"].update(nbytes=[400, 80.5]), r"nbytes\[1\].*integer"),
    (lambda r: r["profile"].update(element_size=[4, 3]), "bytes per element"),
    (lambda r: r["profile"].update(t_f=[0, 0], t_b=[0, 0]), "all zero"),
    (lambda r: r["profile"].pop("t_b"), r"profile\.t_b must be a list"),
])
def test_malformed_profiles_are_refused(tmp_path, change, message: str) -> None:
    record = good_record()
    change(record)
    path = write(tmp_path, record)
    with pytest.raises(ReplayError, match=message) as info:
        replay.load(path)
    assert path in str(info.value)


def test_unreadable_profiles_are_refused(tmp_path) -> None:
    with pytest.raises(ReplayError, match="is not JSON"):
        replay.load(write(tmp_path, "{not json"))
    with pytest.raises(ReplayError, match="cannot read profile"):
        replay.load(str(tmp_path / "missing.json"))
    with pytest.raises(ReplayError, match="no shipped profile 'alexnet'"):
        replay.shipped("alexnet")
    record = good_record()
    record["profile"]["t_f"] = [float("nan"), 0.1]
    with pytest.raises(ReplayError, match="finite"):
        replay.profile_from_record(record)


def test_shipped_profiles_match_the_architectures_and_anchors() -> None:
    anchors = {"resnet50": 256 / 1200, "vgg16": 192 / 249, "gpt2_small": 0.300}
    for name in replay.SHIPPED:
        profile, record = replay.load(replay.shipped(name))
        assert "source" in record and "FLOPs" in record["source"]
        assert list(profile.names) == [n for n, _ in zoo.shapes(name)]
        assert [list(s) for _, s in zoo.shapes(name)] == record["shapes"]
        assert profile.total_bytes == 4 * zoo.num_params(name)
        assert profile.forward_time + profile.backward_time == pytest.approx(anchors[name])


# ------------------------------------------------------------------ the model

def test_model_shapes_and_gradients() -> None:
    profile = small_profile()
    d = Dilation.for_cluster("10gbit", "1gbit", byte_scale=10)    # K = 1
    model = replay.build_model(profile, d, clock=replay.ReplayClock())
    params = list(model.parameters())
    assert [p.numel() for p in params] == [d.numel(b, 4) for b in profile.nbytes]
    assert all(p.dtype == torch.float32 for p in params)
    model(replay.replay_input()).sum().backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in params)
    assert model.clock.waits == 2 * profile.num_tensors


def test_float16_profiles_make_float16_tensors() -> None:
    profile = Profile.from_lists(["a"], [2000], [2], [0.001], [0.001])
    model = replay.build_model(profile, Dilation.for_cluster("1gbit", "1gbit", byte_scale=1))
    assert next(model.parameters()).dtype == torch.float16


def test_merging_tiny_layers_keeps_every_tensor() -> None:
    profile = small_profile(n=10, t=0.0001)
    d = Dilation.for_cluster("1gbit", "1gbit", byte_scale=1)
    merged = replay.build_model(profile, d, merge_wall=0.001)
    assert len(merged.layers) < 10
    assert sum(len(layer.indices) for layer in merged.layers) == 10
    assert sum(1 for _ in merged.parameters()) == 10


def test_replayed_iteration_takes_the_profile_times_dilated() -> None:
    """40 layers of 1 ms forward, 2 ms backward at K=2: 240 ms, never less, and no more than 3%
    beyond what the clock reports as CPU delay it could not absorb (a preempted rank on a
    loaded machine), with the CPU mostly idle."""
    replay.tighten_timer_slack()
    profile = small_profile(n=40, t=0.001)
    d = Dilation.for_cluster("10gbit", "500mbit", byte_scale=10)       # K = 2
    model = replay.build_model(profile, d)
    x = replay.replay_input()
    want = d.wall(profile.forward_time + profile.backward_time)
    model(x).sum().backward()
    best = math.inf
    for _ in range(3):
        model.clock.idle()
        began, cpu, late = time.perf_counter(), time.process_time(), model.clock.late
        model(x).sum().backward()
        wall = time.perf_counter() - began
        unabsorbed = model.clock.late - late
        best = min(best, wall - unabsorbed)
        assert want <= wall * 1.0005, (wall, want)
        used = time.process_time() - cpu
    assert best < want * 1.03, (best, want)
    assert used < 0.5 * wall


def test_clock_absorbs_small_gaps_and_restarts_after_long_ones() -> None:
    clock = replay.ReplayClock(slack=0.005)
    began = time.perf_counter()
    for _ in range(20):
        clock.wait(0.001)
        x = 0
        while time.perf_counter() - began < 0:          # no-op: CPU between waits is small
            x += 1
    assert time.perf_counter() - began < 0.020 * 1.10
    assert clock.restarts == 0
    time.sleep(0.02)                                    # longer than the slack: device idle
    clock.wait(0.001)
    assert clock.restarts == 1 and clock.late >= 0.02
    clock.idle()
    time.sleep(0.01)
    clock.wait(0.0)
    assert clock.restarts == 1                          # an announced idle is not "late"
    with pytest.raises(ReplayError, match="slack"):
        replay.ReplayClock(slack=-1)


def test_emulated_profile_is_dilated_and_scaled() -> None:
    profile = small_profile()
    d = Dilation.for_cluster("10gbit", "100mbit", byte_scale=20)       # K = 5
    emulated = replay.emulated_profile(profile, d)
    assert emulated.t_b == tuple(5 * t for t in profile.t_b)
    assert emulated.nbytes == tuple(4 * d.numel(b, 4) for b in profile.nbytes)


# ------------------------------------------------------------------ round trip

def test_profile_out_replays_as_written(tmp_path) -> None:
    """A file written by the runtime's ``profile_out`` path (``planning.write``) replays."""
    profile = small_profile()
    cost = CostModel(a=1e-4, b=1e-9)
    made = plan(profile, cost, 8000)
    path = str(tmp_path / "out.json")
    planning.write(path, cost, [(1000, 1e-4)], profile, made, [(8000, 0.05)])
    loaded, record = replay.load(path)
    assert loaded == profile
    assert record["plan"]["partition_bytes"] == 8000
    d = Dilation.for_cluster("25gbit", "250mbit", byte_scale=100)      # K = 1
    model = replay.build_model(loaded, d)
    assert [n.split(".")[-1] for n, _ in model.named_parameters()] == \
        [n.replace(".", "_") for n in profile.names]


# ------------------------------------------------------------------ the emulated report

def fake_results(profile: Profile, d: Dilation, hosts: int, times: dict) -> dict:
    def run(ms: float, busy: float = 0.2) -> dict:
        return {"ms_mean": ms, "ms": [ms], "machine_busy_fraction": busy,
                "job_cpu_fraction": busy / 2}
    return {"hosts": hosts, "compute": run(times.pop("compute")),
            "communication": run(times.pop("communication")),
            "policies": {name: run(ms) for name, ms in times.items()}}


@pytest.fixture
def vgg16_8h(monkeypatch) -> tuple:
    """The shipped VGG-16 profile on 8 emulated hosts of 10 Gbit/s (a 100 Mbit/s link, bytes
    scaled by 25), under a 4 ms Horovod cycle and 5 MiB fusion: ``(profile, dilation,
    emulated profile, the link's seconds per byte)``, as the report tests price it."""
    from dcredit_hvd.bench import emulate_report

    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "4")
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", str(5 << 20))
    profile, _ = replay.load(replay.shipped("vgg16"))
    d = Dilation.for_cluster("10gbit", "100mbit", byte_scale=25)
    emulated = replay.emulated_profile(profile, d)
    b = emulate_report.link_need(emulated.total_bytes, 8, "100000000bit")["seconds"] \
        / emulated.total_bytes
    return profile, d, emulated, b


def test_report_bounds_checks_and_speedups() -> None:
    from dcredit_hvd.bench import emulate_report

    profile, _ = replay.load(replay.shipped("vgg16"))
    d = Dilation.for_cluster("10gbit", "100mbit", byte_scale=25)
    b = emulate_report.bounds(profile, 8, d)
    assert b["compute_ms"] == pytest.approx(771.08, abs=0.01)
    # ring on 8 hosts: 2 * 7/8 * bytes over 1.25 GB/s
    assert b["link_ms"] == pytest.approx(1.75 * profile.total_bytes / 1.25e9 * 1e3)
    results = fake_results(profile, d, 8, {"compute": 780.0, "communication": b["link_ms"] * 1.1,
                                           "horovod": 1200.0, "bytescheduler": 1000.0,
                                           "dcredit": 800.0})
    emulate_report.analyse(results, profile, d, kept={})
    checks = results["checks"]
    assert checks["compute_replay"]["ok"] and not checks["communication"]["ok"]
    assert checks["cpu"]["ok"]
    assert "simulator:horovod" in checks and "simulator:dcredit" not in checks   # no plan kept
    ups = emulate_report.speedups(results)
    assert ups["dcredit"]["horovod"] == pytest.approx(1.5)
    assert ups["dcredit"]["bytescheduler"] == pytest.approx(1.25)
    assert results["policies"]["dcredit"]["x_bound"] == pytest.approx(800 / b["bound_ms"])


def test_report_simulates_td_rows_without_horovods_cycle_on_their_own_fit(vgg16_8h) -> None:
    """A ``-td`` row (torch.distributed): no cycle, no fusion, its own live fit's startup; the
    rows over Horovod keep the dilated cycle and the Horovod-measured startup, even when the
    -td row made its fit first."""
    import types

    from dcredit_hvd.bench import emulate_report
    from dcredit_hvd.planning import simulator
    from dcredit_hvd.planning.costmodel import CostModel

    profile, d, emulated, b = vgg16_8h
    sizes = types.SimpleNamespace(partition_bytes=160_000, credit_bytes=640_000)

    def kept(a: float) -> types.SimpleNamespace:
        return types.SimpleNamespace(scheduler_config=sizes, plan=None,
                                     measured=(None, CostModel(a=a, b=1e-9)))
    results = fake_results(profile, d, 8, {"compute": 780.0, "communication": 800.0,
                                           "wfbp-td": 900.0, "wfbp": 950.0})
    emulate_report.analyse(results, profile, d, kept={"wfbp-td": kept(0.002),
                                                      "wfbp": kept(0.03)})
    common = {"overlap_forward": True, "partition_bytes": 160_000, "credit_bytes": 640_000}
    td = simulator.simulate(emulated, CostModel(a=0.002, b=b), "wfbp", cycle_s=0.0,
                            fusion_bytes=0, **common).iteration_s
    horovod = simulator.simulate(emulated, CostModel(a=0.03, b=b), "wfbp", cycle_s=0.004,
                                 fusion_bytes=5 << 20, **common).iteration_s
    assert results["simulated"]["a_wall_s"] == 0.03
    assert results["policies"]["wfbp-td"]["simulated_ms"] == pytest.approx(d.cluster(td) * 1e3)
    assert results["policies"]["wfbp"]["simulated_ms"] == pytest.approx(d.cluster(horovod) * 1e3)
    assert td != pytest.approx(horovod)


def test_report_simulates_with_the_live_fits_floor(vgg16_8h) -> None:
    """The live fit's floor (``CostModel.floor``) reaches the predictions: a floor that the
    partitions' all-reduces fall under changes the simulated time, and is kept in the JSON."""
    import types

    from dcredit_hvd.bench import emulate_report
    from dcredit_hvd.planning import simulator
    from dcredit_hvd.planning.costmodel import CostModel

    profile, d, emulated, b = vgg16_8h
    sizes = types.SimpleNamespace(partition_bytes=160_000, credit_bytes=640_000)
    fitted = CostModel(a=0.001, b=1e-9, floor=0.2)
    results = fake_results(profile, d, 8, {"compute": 780.0, "communication": 800.0,
                                           "bytescheduler": 950.0})
    emulate_report.analyse(results, profile, d, kept={"bytescheduler": types.SimpleNamespace(
        scheduler_config=sizes, plan=None, measured=(None, fitted))})
    common = {"overlap_forward": True, "partition_bytes": 160_000, "credit_bytes": 640_000,
              "cycle_s": 0.004, "fusion_bytes": 5 << 20}
    floored = simulator.simulate(emulated, CostModel(a=0.001, b=b, floor=0.2), "bytescheduler",
                                 **common).iteration_s
    line = simulator.simulate(emulated, CostModel(a=0.001, b=b), "bytescheduler",
                              **common).iteration_s
    assert results["simulated"]["floor_wall_s"] == 0.2
    assert results["policies"]["bytescheduler"]["simulated_ms"] == pytest.approx(
        d.cluster(floored) * 1e3)
    assert floored > line * 1.05


def test_report_simulates_sharded_rows_on_the_halves_with_their_fitted_costs(vgg16_8h) -> None:
    """A ``-shard`` row is predicted as the runtime runs it (reduce-scatters, the step's
    barrier, all-gathers; ``simulate(shard=True)``) with the halves its optimizer fitted, not
    as the unsharded policy."""
    import types

    from dcredit_hvd.bench import emulate_report
    from dcredit_hvd.planning import simulator
    from dcredit_hvd.planning.costmodel import CostModel

    profile, d, emulated, b = vgg16_8h
    sizes = types.SimpleNamespace(partition_bytes=160_000, credit_bytes=640_000)
    fitted = CostModel(a=0.001, b=1e-9)
    halves = (CostModel(a=0.002, b=0.8 * b), CostModel(a=0.003, b=0.9 * b))   # Gloo's, slower
    results = fake_results(profile, d, 8, {"compute": 780.0, "communication": 800.0,
                                           "wfbp": 900.0, "wfbp-shard-sync": 950.0})
    kept = {name: types.SimpleNamespace(scheduler_config=sizes, plan=None, halves=halves,
                                        measured=(None, fitted))
            for name in ("wfbp", "wfbp-shard-sync")}
    emulate_report.analyse(results, profile, d, kept=kept)
    common = {"partition_bytes": 160_000, "credit_bytes": 640_000, "cycle_s": 0.004,
              "fusion_bytes": 5 << 20}
    sharded = simulator.simulate(emulated, CostModel(a=0.001, b=b), "wfbp", shard=True,
                                 workers=8, scatter_cost=halves[0], gather_cost=halves[1],
                                 overlap_forward=False, **common).iteration_s
    plain = simulator.simulate(emulated, CostModel(a=0.001, b=b), "wfbp", overlap_forward=True,
                               **common).iteration_s
    rows = results["policies"]
    assert rows["wfbp-shard-sync"]["simulated_ms"] == pytest.approx(d.cluster(sharded) * 1e3)
    assert rows["wfbp"]["simulated_ms"] == pytest.approx(d.cluster(plain) * 1e3)
    assert sharded > plain * 1.05


def test_report_simulates_dear_with_the_buffer_size_its_run_used(vgg16_8h) -> None:
    """The emulated run scales DeAR's 25 MiB buffers like the tensors (``group_bytes``): its
    prediction must use that size, not DeAR's default (one buffer for the whole model)."""
    import types

    from dcredit_hvd.bench import emulate_report
    from dcredit_hvd.config import SchedulerConfig
    from dcredit_hvd.planning import simulator
    from dcredit_hvd.planning.costmodel import CostModel
    from dcredit_hvd.policies import DeAR

    profile, d, emulated, b = vgg16_8h
    buffer = (25 << 20) // 25
    config = SchedulerConfig.resolve(environ={}, policy="dear", group_bytes=buffer)
    results = fake_results(profile, d, 8, {"compute": 780.0, "communication": 800.0,
                                           "dear": 900.0})
    emulate_report.analyse(results, profile, d, kept={"dear": types.SimpleNamespace(
        scheduler_config=config, plan=None, measured=(None, CostModel(a=0.001, b=1e-9)))})
    common = {"overlap_forward": True, "cycle_s": 0.004, "fusion_bytes": 5 << 20}
    scaled = simulator.simulate(emulated, CostModel(a=0.001, b=b), DeAR(buffer),
                                **common).iteration_s
    default = simulator.simulate(emulated, CostModel(a=0.001, b=b), DeAR(), **common).iteration_s
    assert results["policies"]["dear"]["simulated_ms"] == pytest.approx(d.cluster(scaled) * 1e3)
    assert default > scaled * 1.05


def test_grid_summary_names_the_best_baseline_and_each_missed_target() -> None:
    import importlib.util

    from dcredit_hvd.bench import emulate_report

    spec = importlib.util.spec_from_file_location(
        "bench_emulated", Path(__file__).resolve().parents[2] / "scripts" / "bench_emulated.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    profile, _ = replay.load(replay.shipped("vgg16"))
    d = Dilation.for_cluster("10gbit", "100mbit", byte_scale=25)
    cells = []
    for name, dcredit in (("fast", 800.0), ("slow", 900.0)):
        results = fake_results(profile, d, 8, {"compute": 780.0, "communication": 800.0,
                                               "horovod": 1200.0, "bytescheduler": 870.0,
                                               "dcredit": dcredit})
        emulate_report.analyse(results, profile, d, kept={})
        cells.append({**results, "cell": name})
    rows = {line.split(" | ")[0][2:]: line for line in script.summary_markdown(cells).splitlines()[2:]}
    bound = cells[0]["bounds"]["bound_ms"]
    assert f"800.0 ({800 / bound:.2f}x) | bytescheduler 870.0 | {800 / 870:.3f} | 1.50x" in rows["fast"]
    assert rows["fast"].endswith("| none |")
    assert rows["slow"].endswith("| 1.10x bound, 2% of best |")


def test_grid_report_rejudges_dear_and_sharded_rows_as_the_run_did(monkeypatch) -> None:
    """``--report-only`` re-simulates each cell from its JSON alone: DeAR with its scaled
    buffers (recorded, or emulate's rule for cells written before), a sharded row on the two
    halves with the costs its optimizer fitted."""
    import dataclasses
    import importlib.util

    from dcredit_hvd.bench import emulate, emulate_report
    from dcredit_hvd.planning import simulator
    from dcredit_hvd.planning.costmodel import CostModel
    from dcredit_hvd.policies import DeAR

    spec = importlib.util.spec_from_file_location(
        "bench_emulated", Path(__file__).resolve().parents[2] / "scripts" / "bench_emulated.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    # reanalyse() sets both for the cell: restored after the test (later tests read them)
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "1")
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", str(128 << 20))
    profile, _ = replay.load(replay.shipped("vgg16"))
    d = Dilation.for_cluster("10gbit", "100mbit", byte_scale=25)
    live = CostModel(a=0.001, b=1e-9)
    halves = (CostModel(a=0.002, b=5e-8), CostModel(a=0.003, b=6e-8))
    record = fake_results(profile, d, 8, {"compute": 780.0, "communication": 800.0,
                                          "dear": 900.0, "wfbp-shard": 950.0})
    sizes = {"partition_bytes": 160_000, "credit_bytes": 640_000,
             "live_cost": dataclasses.asdict(live)}
    record["policies"]["dear"]["setup"] = dict(sizes)            # written before group_bytes was
    record["policies"]["wfbp-shard"]["setup"] = {
        **sizes, "halves_cost": [dataclasses.asdict(h) for h in halves]}
    record.update(profile="vgg16", target_rate=d.target_rate, link_rate=d.link_rate,
                  time_factor=d.time_factor, byte_scale=d.byte_scale)
    script.reanalyse(record)
    emulated = replay.emulated_profile(profile, d)
    b = emulate_report.link_need(emulated.total_bytes, 8, "100000000bit")["seconds"] \
        / emulated.total_bytes
    common = {"cycle_s": d.time_factor * 1e-3, "fusion_bytes": d.scaled_bytes(128 << 20)}
    dear = simulator.simulate(emulated, CostModel(a=0.001, b=b), DeAR(
        d.scaled_bytes(emulate.DEAR_BUFFER_BYTES)), overlap_forward=True, **common).iteration_s
    sharded = simulator.simulate(emulated, CostModel(a=0.001, b=b), "wfbp", shard=True,
                                 workers=8, scatter_cost=halves[0], gather_cost=halves[1],
                                 overlap_forward=True, partition_bytes=160_000,
                                 credit_bytes=640_000, **common).iteration_s
    rows = record["policies"]
    assert rows["dear"]["simulated_ms"] == pytest.approx(d.cluster(dear) * 1e3)
    assert rows["wfbp-shard"]["simulated_ms"] == pytest.approx(d.cluster(sharded) * 1e3)


def test_emulate_refuses_suffixes_on_a_baseline() -> None:
    from dcredit_hvd.bench import emulate

    base = ["--profile", "vgg16", "--target-rate", "10gbit", "--link-rate", "100mbit",
            "--byte-scale", "25"]
    with pytest.raises(SystemExit):
        emulate.parse_args([*base, "--policy", "ddp-td"])
    assert emulate.parse_args([*base, "--policy", "ddp,dcredit-td"]).policies == ["ddp",
                                                                                  "dcredit-td"]


def test_emulate_refuses_no_warmup_or_no_iterations(capsys) -> None:
    """The ranks line up before the last warm-up iteration, so at least one is needed."""
    from dcredit_hvd.bench import emulate

    base = ["--profile", "vgg16", "--target-rate", "10gbit", "--link-rate", "100mbit",
            "--byte-scale", "25"]
    for flags in (["--warmup", "0"], ["--iters", "0"]):
        with pytest.raises(SystemExit):
            emulate.parse_args([*base, *flags])
        assert "must be at least 1" in capsys.readouterr().err
    assert emulate.parse_args([*base, "--warmup", "1", "--iters", "1"]).warmup == 1


def test_emulate_takes_the_race_rounds_as_whole_numbers(capsys) -> None:
    from dcredit_hvd.bench import emulate

    base = ["--profile", "vgg16", "--target-rate", "10gbit", "--link-rate", "100mbit",
            "--byte-scale", "25"]
    assert emulate.parse_args([*base, "--tune-rounds", "4,8"]).tune_rounds == (4, 8)
    assert emulate.parse_args(base).tune_rounds is None
    with pytest.raises(SystemExit):
        emulate.parse_args([*base, "--tune-rounds", "4,many"])
    assert "give whole numbers" in capsys.readouterr().err


def test_race_report_prices_the_race_against_a_thousand_iterations_of_the_row(capsys) -> None:
    from dcredit_hvd.bench import emulate_report

    row = {"candidate": "dcredit #1 (incumbent)", "predicted_ms": 90.0, "measured_ms": 100.0,
           "stderr_ms": 1.5, "iterations": 24, "verdict": "won"}
    results = {"policies": {"horovod": {"ms_mean": 120.0},
                            "dcredit": {"ms_mean": 100.0, "ms": [96.0, 97.0, 99.0, 98.0, 110.0],
                                        "timed_changes": 0, "race": {
                                "winner": "dcredit #1 (incumbent)", "iterations": 60,
                                "cluster_ms": 6400.0, "cost_ms": 250.0, "table": [row]}}}}
    emulate_report.print_races(results)
    out = capsys.readouterr().out
    assert "race of dcredit: dcredit #1 (incumbent) won after 60 iterations (6.4 s cluster)" in out
    assert "cost 250 ms = 0.25% of a 1,000-iteration run" in out        # 250 / (1000 * 100)
    assert "then timed: median 98.0 ms, mean 100.0" in out
    assert "races among the timed iterations: 0" in out
    assert "race of horovod" not in out and "won" in out.splitlines()[-1]


def test_gpt2_bound_counts_the_tied_embedding() -> None:
    from dcredit_hvd.bench import emulate_report

    profile, _ = replay.load(replay.shipped("gpt2_small"))
    d = Dilation.for_cluster("25gbit", "100mbit", byte_scale=50)
    b = emulate_report.bounds(profile, 16, d)
    assert b["dependency_tensor"] == "wte.weight" and b["dependency_excess_ms"] > 0
    assert b["bound_ms"] >= max(b["compute_ms"], b["link_ms"])


def test_emulate_refuses_bad_factors_before_any_launch() -> None:
    from dcredit_hvd.bench import emulate

    with pytest.raises(SystemExit):
        emulate.parse_args(["--profile", "vgg16", "--target-rate", "10gbit"])   # no S or K
    args = emulate.parse_args(["--profile", "vgg16", "--target-rate", "10gbit",
                               "--link-rate", "100mbit", "--byte-scale", "0"])
    with pytest.raises(ReplayError, match="byte scale S=0"):
        emulate.main(["--profile", "vgg16", "--target-rate", "10gbit", "--link-rate",
                      "100mbit", "--byte-scale", str(args.byte_scale)])


def test_horovods_wait_runs_at_sched_idle_and_its_cpu_is_counted_apart() -> None:
    """The emulation's plain-Horovod rows wait in ``hvd.synchronize``'s yield loop: at
    SCHED_IDLE (it takes only CPU no emulated host wants), counted as spin, not demand; the
    thread's scheduling is restored afterwards, also when the wait raises."""
    import os

    from dcredit_hvd.bench.emulate import IdleSpin

    spin = IdleSpin()
    before = os.sched_getscheduler(0), os.sched_getparam(0)
    with spin():
        assert os.sched_getscheduler(0) == os.SCHED_IDLE
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
    assert (os.sched_getscheduler(0), os.sched_getparam(0)) == before
    assert 0.04 < spin.seconds < 1.0
    with pytest.raises(RuntimeError), spin():
        raise RuntimeError("the wait failed")
    assert os.sched_getscheduler(0) == before[0]


def test_report_prices_dear_with_the_launchs_own_fit_of_the_two_halves(vgg16_8h) -> None:
    """Where the launch fitted the reduce-scatter and the all-gather (``halves_wall``), DeAR's
    row is priced with them: Horovod's Gloo reduce-scatter is no half of an all-reduce."""
    import types

    from dcredit_hvd.bench import emulate_report
    from dcredit_hvd.config import SchedulerConfig
    from dcredit_hvd.planning import simulator
    from dcredit_hvd.planning.costmodel import CostModel
    from dcredit_hvd.policies import DeAR

    profile, d, emulated, b = vgg16_8h
    buffer = (25 << 20) // 25
    config = SchedulerConfig.resolve(environ={}, policy="dear", group_bytes=buffer)
    scatter, gather = CostModel(a=0.005, b=0.8 * b, floor=0.07), CostModel(a=0.0, b=0.53 * b)

    def dear_ms(halves):
        results = fake_results(profile, d, 8, {"compute": 780.0, "communication": 800.0,
                                               "dear": 900.0})
        if halves:
            results["halves_wall"] = halves
        emulate_report.analyse(results, profile, d, kept={"dear": types.SimpleNamespace(
            scheduler_config=config, plan=None, measured=(None, CostModel(a=0.001, b=1e-9)))})
        return results["policies"]["dear"]["simulated_ms"]

    common = {"overlap_forward": True, "cycle_s": 0.004, "fusion_bytes": 5 << 20}
    fitted = simulator.simulate(emulated, CostModel(a=0.001, b=b), DeAR(buffer),
                                scatter_cost=scatter, gather_cost=gather, **common).iteration_s
    assert dear_ms([vars(scatter), vars(gather)]) == pytest.approx(d.cluster(fitted) * 1e3)
    assert dear_ms(None) < dear_ms([vars(scatter), vars(gather)]) / 1.05


def test_report_simulates_every_row_after_the_races_refit_of_the_live_fit(vgg16_8h) -> None:
    """The race of the row whose live fit prices the table found each all-reduce cheaper than
    the fit said: the rows are priced on the corrected link (``candidates.corrected``), as the
    next plan is, and the JSON says so."""
    import types

    from dcredit_hvd.bench import emulate_report
    from dcredit_hvd.planning import simulator
    from dcredit_hvd.planning.candidates import corrected
    from dcredit_hvd.planning.costmodel import CostModel

    profile, d, emulated, b = vgg16_8h
    sizes = types.SimpleNamespace(partition_bytes=160_000, credit_bytes=640_000)
    fitted = CostModel(a=0.02, b=1e-9, floor=0.2)
    results = fake_results(profile, d, 8, {"compute": 780.0, "communication": 800.0,
                                           "bytescheduler": 950.0})
    results["policies"]["bytescheduler"]["race"] = {"refit_per_allreduce_s": -0.015}
    emulate_report.analyse(results, profile, d, kept={"bytescheduler": types.SimpleNamespace(
        scheduler_config=sizes, plan=None, measured=(None, fitted))})
    common = {"overlap_forward": True, "partition_bytes": 160_000, "credit_bytes": 640_000,
              "cycle_s": 0.004, "fusion_bytes": 5 << 20}
    after = simulator.simulate(emulated, corrected(CostModel(a=0.02, b=b, floor=0.2), -0.015),
                               "bytescheduler", **common).iteration_s
    sim = results["simulated"]
    assert sim["refit_wall_s"] == -0.015 and "refit" in sim["a_source"]
    assert sim["a_wall_s"] == pytest.approx(0.005) and sim["floor_wall_s"] == pytest.approx(0.185)
    assert results["policies"]["bytescheduler"]["simulated_ms"] == pytest.approx(
        d.cluster(after) * 1e3)
