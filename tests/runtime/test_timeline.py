"""The Chrome-trace timeline: valid JSON per rank, tracks and events, and the PNG plotter."""
import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dcredit_hvd.runtime.timeline import (
    BACKWARD_PID,
    FORWARD_PID,
    GATE_PID,
    TENSOR_PID_BASE,
    Timeline,
    from_env,
    rank_path,
)

ROOT = Path(__file__).resolve().parents[2]
PLOT = ROOT / "scripts" / "plot_timeline.py"


def plot_module():
    spec = importlib.util.spec_from_file_location("plot_timeline", PLOT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def track_names(events):
    return {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}


def sort_indices(events):
    return {e["pid"]: e["args"]["sort_index"] for e in events if e.get("name") == "process_sort_index"}


def write_sample(tl):
    """A forward layer, a backward layer, two blocks of tensor 1, one of tensor 0, a release and a
    mark, at fixed offsets (seconds) from the timeline's epoch."""
    t = tl.epoch
    tl.layer("forward", "fc1", t + 0.001, t + 0.002)
    tl.layer("backward", "fc1", t + 0.003, t + 0.005)
    tl.block(1, "fc2.weight", "fc2.weight.b0", t + 0.004, t + 0.006, t + 0.010, 4096)
    tl.block(1, "fc2.weight", "fc2.weight.b1", t + 0.004, t + 0.007, t + 0.011, 2048)
    tl.block(0, "fc1.weight", "fc1.weight", t + 0.005, t + 0.005, t + 0.012, 1024)
    tl.release(2, "ready tensor 1", at=t + 0.006)
    tl.mark("plan installed", at=t + 0.0005, step=3)


def test_a_closed_trace_is_valid_json_with_named_tracks_and_exact_durations(tmp_path):
    tl = Timeline(str(tmp_path / "t.json"), rank=0)
    write_sample(tl)
    tl.close()
    events = json.loads(Path(tl.path).read_text())

    names = track_names(events)
    assert names[FORWARD_PID] == "forward"
    assert names[BACKWARD_PID] == "backward"
    assert names[GATE_PID] == "gate"
    assert names[TENSOR_PID_BASE + 0] == "fc1.weight"
    assert names[TENSOR_PID_BASE + 1] == "fc2.weight"

    fwd = [e for e in events if e["pid"] == FORWARD_PID and e["ph"] == "X"]
    assert [(e["name"], e["ts"], e["dur"]) for e in fwd] == [("fc1", 1000.0, 1000.0)]
    bwd = [e for e in events if e["pid"] == BACKWARD_PID and e["ph"] == "X"]
    assert [(e["name"], e["ts"], e["dur"]) for e in bwd] == [("fc1", 3000.0, 2000.0)]


def test_a_block_is_a_queued_span_followed_by_an_inflight_span_named_after_the_block(tmp_path):
    tl = Timeline(str(tmp_path / "t.json"), rank=0)
    write_sample(tl)
    tl.close()
    events = json.loads(Path(tl.path).read_text())

    b0 = [e for e in events if e.get("name") == "fc2.weight.b0"]
    assert [e["cat"] for e in b0] == ["QUEUED", "INFLIGHT"]
    queued, inflight = b0
    assert (queued["ts"], queued["dur"]) == (4000.0, 2000.0)
    assert (inflight["ts"], inflight["dur"]) == (6000.0, 4000.0)
    assert queued["ts"] + queued["dur"] == inflight["ts"]
    assert queued["args"] == {"bytes": 4096, "phase": "QUEUED"}
    assert inflight["args"] == {"bytes": 4096, "phase": "INFLIGHT"}
    assert all(e["pid"] == TENSOR_PID_BASE + 1 for e in b0)

    # A block released the moment it is ready has an empty QUEUED span.
    b = [e for e in events if e.get("name") == "fc1.weight"]
    assert [(e["cat"], e["dur"]) for e in b] == [("QUEUED", 0.0), ("INFLIGHT", 7000.0)]


def test_overlapping_blocks_of_one_tensor_go_to_separate_lanes(tmp_path):
    tl = Timeline(str(tmp_path / "t.json"), rank=0)
    write_sample(tl)
    t = tl.epoch
    tl.block(1, "fc2.weight", "fc2.weight.b2", t + 0.020, t + 0.021, t + 0.022, 512)
    tl.close()
    events = json.loads(Path(tl.path).read_text())
    lane = {e["name"]: e["tid"] for e in events if e.get("cat") == "QUEUED"}
    assert lane["fc2.weight.b0"] != lane["fc2.weight.b1"]
    assert lane["fc2.weight.b2"] == 0  # lane 0 is free again by then


def test_tensor_tracks_sort_by_priority_index_after_the_fixed_tracks(tmp_path):
    tl = Timeline(str(tmp_path / "t.json"), rank=0)
    t = tl.epoch
    for index in (7, 2, 0, 5):  # created lazily, out of order
        tl.block(index, f"p{index}", f"p{index}", t, t, t, 4)
    tl.layer("forward", "x", t, t)
    tl.layer("backward", "x", t, t)
    tl.release(1, "backward end", at=t)
    tl.close()
    events = json.loads(Path(tl.path).read_text())
    names, order = track_names(events), sort_indices(events)
    ranked = [names[pid] for pid in sorted(order, key=order.get)]
    assert ranked == ["forward", "backward", "gate", "p0", "p2", "p5", "p7"]
    meta = [e for e in events if e.get("name") == "process_name"]
    assert len(meta) == len({e["pid"] for e in meta})  # metadata written once per track


def test_releases_and_marks_are_process_scoped_instants_on_the_gate_track(tmp_path):
    tl = Timeline(str(tmp_path / "t.json"), rank=0)
    write_sample(tl)
    tl.close()
    events = json.loads(Path(tl.path).read_text())
    gate = [e for e in events if e["pid"] == GATE_PID and e["ph"] == "i"]
    assert all(e["s"] == "p" for e in gate)
    by_name = {e["name"]: e for e in gate}
    assert by_name["release"]["args"] == {"count": 2, "reason": "ready tensor 1"}
    assert by_name["release"]["ts"] == 6000.0
    assert by_name["plan installed"]["args"] == {"step": 3}


def test_times_default_to_now_and_metadata_carries_the_wall_clock_epoch(tmp_path):
    tl = Timeline(str(tmp_path / "t.json"), rank=3)
    tl.release(1, "completion")
    tl.mark("plan installed")
    tl.close()
    events = json.loads(Path(tl.path).read_text())
    instants = [e for e in events if e["ph"] == "i"]
    assert [e["name"] for e in instants] == ["release", "plan installed"]
    assert all(e["ts"] >= 0 for e in instants)
    meta = next(e for e in events if e.get("name") == "process_name")
    assert meta["args"]["epoch_unix_us"] == tl.epoch_unix_us
    assert meta["args"]["rank"] == 3


def test_events_from_two_threads_are_all_written_intact(tmp_path):
    tl = Timeline(str(tmp_path / "t.json"), rank=0, flush_every=7)
    t = tl.epoch
    n = 300

    def layers():
        for i in range(n):
            tl.layer("backward", f"layer{i}", t + i * 1e-4, t + (i + 1) * 1e-4)

    def blocks():
        for i in range(n):
            tl.block(i % 5, f"t{i % 5}", f"t{i % 5}.b{i}", t + i * 1e-4, t + i * 1e-4, t + (i + 1) * 1e-4, i)
            tl.release(1, "completion", at=t + i * 1e-4)

    threads = [threading.Thread(target=layers), threading.Thread(target=blocks)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    tl.close()
    events = json.loads(Path(tl.path).read_text())
    assert len([e for e in events if e["pid"] == BACKWARD_PID and e["ph"] == "X"]) == n
    assert len([e for e in events if e["pid"] >= TENSOR_PID_BASE and e["ph"] == "X"]) == 2 * n
    assert len([e for e in events if e["pid"] == GATE_PID and e["ph"] == "i"]) == n
    # Per thread, events keep the order they were recorded in.
    layer_names = [e["name"] for e in events if e["pid"] == BACKWARD_PID and e["ph"] == "X"]
    assert layer_names == [f"layer{i}" for i in range(n)]


def test_close_is_idempotent_and_later_events_are_dropped(tmp_path):
    tl = Timeline(str(tmp_path / "t.json"), rank=0)
    write_sample(tl)
    tl.close()
    text = Path(tl.path).read_text()
    tl.close()
    tl.release(1, "late", at=tl.epoch)
    tl.layer("forward", "late", tl.epoch, tl.epoch)
    assert tl.closed
    assert Path(tl.path).read_text() == text
    json.loads(text)


def test_an_empty_closed_trace_is_an_empty_json_array(tmp_path):
    with Timeline(str(tmp_path / "t.json"), rank=0) as tl:
        pass
    assert json.loads(Path(tl.path).read_text()) == []


def test_layer_rejects_an_unknown_kind(tmp_path):
    with Timeline(str(tmp_path / "t.json"), rank=0) as tl, pytest.raises(ValueError):
        tl.layer("sideways", "x", tl.epoch, tl.epoch)


@pytest.mark.parametrize(
    "path, rank, expected",
    [
        ("/tmp/t.json", 0, "/tmp/t.rank0.json"),
        ("/tmp/t.json", 12, "/tmp/t.rank12.json"),
        ("/tmp/trace", 1, "/tmp/trace.rank1"),
        ("/tmp/run.v2/t.json", 3, "/tmp/run.v2/t.rank3.json"),
        ("/tmp/t-{rank}.json", 4, "/tmp/t-4.json"),
        ("/tmp/r{rank}/t.json", 5, "/tmp/r5/t.json"),
    ],
)
def test_the_rank_goes_into_the_path(path, rank, expected):
    assert rank_path(path, rank) == expected


def test_the_timeline_writes_to_the_rank_path_and_creates_its_folder(tmp_path):
    with Timeline(str(tmp_path / "r{rank}" / "t.json"), rank=2) as tl:
        pass
    assert tl.path == str(tmp_path / "r2" / "t.json")
    assert os.path.exists(tl.path)


def test_from_env_returns_a_timeline_only_when_the_variable_is_set(tmp_path, monkeypatch):
    monkeypatch.delenv("DCREDIT_TIMELINE", raising=False)
    assert from_env(0) is None
    monkeypatch.setenv("DCREDIT_TIMELINE", "")
    assert from_env(0) is None
    monkeypatch.setenv("DCREDIT_TIMELINE", str(tmp_path / "env.json"))
    tl = from_env(1)
    try:
        assert isinstance(tl, Timeline)
        assert tl.path == str(tmp_path / "env.rank1.json")
    finally:
        tl.close()
    assert from_env(0, env={}) is None


def test_every_optimizer_of_a_process_writes_into_one_timeline_per_file(tmp_path):
    """Two optimizers (a GAN's, the bench's rows) with DCREDIT_TIMELINE set: one writer per
    file, so neither truncates nor overwrites the other's events; a closed one is replaced."""
    env = {"DCREDIT_TIMELINE": str(tmp_path / "two.json")}
    first, second = from_env(0, env=env), from_env(0, env=env)
    assert first is second and from_env(1, env=env) is not first
    first.block(0, "g.w", "dcredit.g.w", 1.0, 1.5, 2.0, 4)
    second.block(0, "d.w", "dcredit.d.w", 1.0, 1.5, 2.0, 4)
    first.close()
    from_env(1, env=env).close()
    events = json.loads((tmp_path / "two.rank0.json").read_text())
    assert {e["name"] for e in events if e.get("cat") == "QUEUED"} == {"dcredit.g.w",
                                                                         "dcredit.d.w"}
    third = from_env(0, env=env)
    assert third is not first and not third.closed
    third.close()


def test_a_trace_left_open_is_readable_after_appending_the_bracket(tmp_path):
    tl = Timeline(str(tmp_path / "t.json"), rank=0, flush_every=1)
    write_sample(tl)
    partial = Path(tl.path).read_text()  # the job "died" here: no close()
    try:
        assert not partial.rstrip().endswith("]")
        events = json.loads(partial + "]")
        assert any(e.get("name") == "fc2.weight.b0" for e in events)
        assert plot_module().load_trace(tl.path) == events
    finally:
        tl.close()


def test_a_trace_with_nothing_flushed_yet_is_still_loadable(tmp_path):
    tl = Timeline(str(tmp_path / "t.json"), rank=0, flush_every=1000)
    write_sample(tl)
    try:
        assert plot_module().load_trace(tl.path) == []
    finally:
        tl.close()


def test_the_loader_accepts_a_trailing_comma_like_horovods_timeline(tmp_path):
    path = tmp_path / "hvd.json"
    path.write_text('[\n{"name": "a", "ph": "i", "ts": 1, "pid": 0},\n')
    assert [e["name"] for e in plot_module().load_trace(str(path))] == ["a"]


def test_the_loader_skips_the_lines_of_a_trace_that_do_not_parse(tmp_path, capsys):
    path = tmp_path / "torn.json"
    path.write_text('[\n{"name":"a","ph":"i"},\n{"name":"b","pid":,\n{"name":"c","ph":"i"}\n]\n')
    assert [e["name"] for e in plot_module().load_trace(str(path))] == ["a", "c"]
    assert "1 line(s)" in capsys.readouterr().err


def test_a_job_that_never_closes_the_timeline_leaves_valid_json_at_exit(tmp_path):
    path = tmp_path / "exit.json"
    code = (
        "from dcredit_hvd.runtime.timeline import Timeline\n"
        f"tl = Timeline({str(path)!r}, rank=0)\n"
        "tl.release(1, 'completion', at=tl.epoch)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=str(tmp_path))
    events = json.loads((tmp_path / "exit.rank0.json").read_text())
    assert [e["args"]["reason"] for e in events if e["ph"] == "i"] == ["completion"]


def big_trace(tmp_path, tensors=200):
    tl = Timeline(str(tmp_path / "big.json"), rank=0)
    t = tl.epoch
    for i in range(20):
        tl.layer("forward", f"l{i}", t + i * 1e-3, t + (i + 1) * 1e-3)
        tl.layer("backward", f"l{i}", t + 0.02 + i * 1e-3, t + 0.02 + (i + 1) * 1e-3)
    for idx in range(tensors):
        ready = t + 0.04 - idx * 1e-4
        tl.block(idx, f"layer{idx}.weight", f"layer{idx}.weight", ready, ready + 2e-3, ready + 5e-3, 1 << 20)
    for i in range(10):
        tl.release(4, "completion", at=t + 0.02 + i * 2e-3)
    tl.mark("plan installed", at=t + 0.001)
    tl.close()
    return tl.path


def test_the_plot_script_writes_a_png(tmp_path):
    trace = big_trace(tmp_path)
    out = tmp_path / "chart.png"
    subprocess.run([sys.executable, str(PLOT), trace, "--out", str(out)], check=True, cwd=str(tmp_path))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_script_zooms_into_a_window_and_defaults_the_output_name(tmp_path):
    trace = big_trace(tmp_path, tensors=12)
    subprocess.run([sys.executable, str(PLOT), trace, "--start-ms", "20", "--end-ms", "30"],
                   check=True, cwd=str(tmp_path))
    assert (tmp_path / "big.rank0.png").read_bytes()[:4] == b"\x89PNG"


def test_the_plot_script_reads_a_trace_left_open(tmp_path):
    tl = Timeline(str(tmp_path / "open.json"), rank=0, flush_every=1)
    write_sample(tl)
    out = tmp_path / "open.png"
    try:
        subprocess.run([sys.executable, str(PLOT), tl.path, "--out", str(out)], check=True)
    finally:
        tl.close()
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_a_unit_that_reuses_an_earlier_tensors_index_gets_its_own_named_track(tmp_path):
    # Before a plan groups tensors, index 0 is "a"; after it, index 0 is the unit "a+1".
    tl = Timeline(str(tmp_path / "trace.json"), 0)
    tl.block(0, "a", "dcredit.a.0of1", 0.0, 0.0, 0.0, 4)
    tl.block(0, "a+1", "dcredit.a+1.0of1", 0.0, 0.0, 0.0, 8)
    tl.close()
    events = json.loads((tmp_path / "trace.rank0.json").read_text())
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert sorted(n for p, n in names.items() if p >= TENSOR_PID_BASE) == ["a", "a+1"]
    pid_of = {n: p for p, n in names.items()}
    blocks = {e["name"]: e["pid"] for e in events if e.get("cat") == "INFLIGHT"}
    assert blocks == {"dcredit.a.0of1": pid_of["a"], "dcredit.a+1.0of1": pid_of["a+1"]}


def test_the_stats_script_sums_link_busy_idle_and_forward_waits_per_schedule(tmp_path):
    """Two iterations of 10 s under ``plan 1``: forward 0-3 s (1 s of it waiting for an
    update), backward 3-8 s, one block in flight 4-9 s; the next iteration starts at 10 s."""
    tl = Timeline(str(tmp_path / "s.json"), 0)
    t0 = tl.epoch
    tl.mark("plan installed", at=t0)
    for i in range(3):
        b = t0 + 10 * i
        tl.layer("forward", "wait for update: w", b, b + 1)
        tl.layer("forward", "layer", b + 1, b + 3)
        tl.layer("backward", "w", b + 3, b + 8)
        tl.block(0, "w", "dcredit.w", b + 3, b + 4, b + 9, 4)
    tl.layer("forward", "layer", t0 + 30, t0 + 31)
    tl.close()
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "timeline_stats.py"),
                          tl.path, "--skip", "0"], check=True, capture_output=True,
                         text=True).stdout
    row = next(line for line in out.splitlines() if line.startswith("| plan 1"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # schedule, n, iter, fwd, bwd, wait, busy, idle, idle in bwd, tail, queued (ms)
    assert cells[1:] == ["3", "10000.0", "3000.0", "5000.0", "1000.0", "5000.0", "5000.0",
                         "1000.0", "1000.0", "1000.0"]
