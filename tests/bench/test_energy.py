"""EnergyMeter against a fake ``pynvml`` whose counter the test sets; and the per-GPU sum."""
from __future__ import annotations

import sys
import types

import pytest

from dcredit_hvd.bench import energy
from dcredit_hvd.bench.energy import EnergyMeter, gpu_energy_per_iteration


class NVMLError(Exception):
    pass


class FakeNVML(types.ModuleType):
    """Enough of pynvml for EnergyMeter: GPUs by index and UUID, a settable energy counter."""

    def __init__(self, gpus=("GPU-aaaa", "GPU-bbbb"), counter_mj=0, supported=True,
                 init_error=None):
        super().__init__("pynvml")
        self.NVMLError = NVMLError
        self.gpus = list(gpus)
        self.counter_mj = {uuid: counter_mj for uuid in self.gpus}
        self.supported = supported
        self.init_error = init_error
        self.read_error = None
        self.inits = 0
        self.shutdowns = 0

    def nvmlInit(self):
        if self.init_error is not None:
            raise self.init_error
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        if not 0 <= index < len(self.gpus):
            raise NVMLError("Invalid Argument")
        return self.gpus[index]

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid not in self.gpus:
            raise NVMLError("Not Found")
        return uuid

    def nvmlDeviceGetIndex(self, handle):
        return self.gpus.index(handle)

    def nvmlDeviceGetName(self, handle):
        return b"Fake H200"            # old bindings return bytes

    def nvmlDeviceGetUUID(self, handle):
        return handle

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        if not self.supported:
            raise NVMLError("Not Supported")
        if self.read_error is not None:
            raise self.read_error
        return self.counter_mj[handle]


@pytest.fixture
def install(monkeypatch):
    def put(fake):
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        return fake
    return put


def test_counter_millijoules_are_reported_in_joules(install):
    install(FakeNVML(counter_mj=123_456))
    meter = EnergyMeter(0)
    assert meter.available and meter.reason is None
    assert meter.read_joules() == pytest.approx(123.456)


def test_interval_is_the_counter_difference_in_joules(install):
    fake = install(FakeNVML(counter_mj=5_000))
    meter = EnergyMeter(1)
    meter.start()
    fake.counter_mj["GPU-bbbb"] = 7_500
    fake.counter_mj["GPU-aaaa"] = 999_999          # another GPU: must not be read
    assert meter.stop() == pytest.approx(2.5)
    assert meter.joules == pytest.approx(2.5)


def test_context_manager_measures_the_block(install):
    fake = install(FakeNVML(counter_mj=1_000))
    with EnergyMeter(0) as meter:
        fake.counter_mj["GPU-aaaa"] = 41_000
    assert meter.joules == pytest.approx(40.0)


def test_gpu_is_found_by_uuid_with_or_without_the_gpu_prefix(install):
    fake = install(FakeNVML(counter_mj=0))
    fake.counter_mj["GPU-bbbb"] = 2_000
    for uuid in ("bbbb", "GPU-bbbb"):
        meter = EnergyMeter(0, uuid=uuid)        # the index is wrong; the UUID wins
        assert meter.device_index == 1 and meter.uuid == "GPU-bbbb"
        assert meter.read_joules() == pytest.approx(2.0)


def test_unknown_uuid_falls_back_to_the_index(install):
    install(FakeNVML(counter_mj=3_000))
    meter = EnergyMeter(0, uuid="GPU-zzzz")
    assert meter.available and meter.uuid == "GPU-aaaa"
    assert meter.read_joules() == pytest.approx(3.0)


def test_unsupported_counter_makes_the_meter_unavailable_with_a_reason(install):
    fake = install(FakeNVML(supported=False))
    meter = EnergyMeter(0)
    assert not meter.available
    assert "Volta" in meter.reason and "Not Supported" in meter.reason
    assert meter.read_joules() is None
    meter.start()
    assert meter.stop() is None
    assert "n/a" in meter.describe() and "Volta" in meter.describe()
    assert fake.shutdowns == fake.inits == 1      # NVML released


def test_nvml_init_failure_makes_the_meter_unavailable(install):
    install(FakeNVML(init_error=NVMLError("Driver Not Loaded")))
    meter = EnergyMeter(0)
    assert not meter.available
    assert "initialise" in meter.reason and "Driver Not Loaded" in meter.reason
    assert meter.read_joules() is None


def test_missing_pynvml_makes_the_meter_unavailable_and_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)     # import pynvml -> ImportError
    meter = EnergyMeter(0)
    assert not meter.available
    assert "nvidia-ml-py" in meter.reason
    assert meter.read_joules() is None
    assert meter.stop() is None


def test_no_gpu_makes_the_meter_unavailable(install):
    install(FakeNVML(gpus=()))
    meter = EnergyMeter(0)
    assert not meter.available and "no GPU" in meter.reason


def test_index_past_the_last_gpu_makes_the_meter_unavailable(install):
    install(FakeNVML())
    meter = EnergyMeter(5)
    assert not meter.available and "index 5" in meter.reason


def test_failed_reading_returns_none_instead_of_raising(install):
    fake = install(FakeNVML(counter_mj=1_000))
    meter = EnergyMeter(0)
    meter.start()
    fake.read_error = NVMLError("GPU is lost")
    assert meter.read_joules() is None
    assert meter.stop() is None
    assert "GPU is lost" in meter.last_error
    fake.read_error = None
    assert meter.read_joules() == pytest.approx(1.0)      # recovers


def test_failed_start_reading_gives_no_interval(install):
    fake = install(FakeNVML(counter_mj=1_000))
    meter = EnergyMeter(0)
    fake.read_error = NVMLError("Unknown Error")
    meter.start()
    fake.read_error = None
    fake.counter_mj["GPU-aaaa"] = 9_000
    assert meter.stop() is None


def test_stop_without_start_gives_no_interval(install):
    install(FakeNVML(counter_mj=1_000))
    assert EnergyMeter(0).stop() is None


def test_counter_going_backwards_gives_no_interval(install):
    fake = install(FakeNVML(counter_mj=50_000))
    meter = EnergyMeter(0)
    meter.start()
    fake.counter_mj["GPU-aaaa"] = 10                  # driver reloaded
    assert meter.stop() is None
    assert "backwards" in meter.last_error


def test_describe_names_the_gpu_when_available(install):
    install(FakeNVML())
    text = EnergyMeter(1).describe()
    assert "GPU 1" in text and "Fake H200" in text and "GPU-bbbb" in text


def test_close_releases_nvml_and_stops_readings(install):
    fake = install(FakeNVML(counter_mj=1_000))
    meter = EnergyMeter(0)
    meter.close()
    meter.close()
    assert fake.shutdowns == 1
    assert not meter.available and meter.read_joules() is None


@pytest.mark.parametrize("visible, cuda_index, expected", [
    (None, 1, 1), ("2,3", 1, 3), ("3", 0, 3), ("GPU-aaaa,GPU-bbbb", 1, 1)])
def test_cuda_index_maps_through_numeric_cuda_visible_devices(monkeypatch, visible, cuda_index,
                                                              expected):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert energy._nvml_index(cuda_index) == expected


def test_for_cuda_device_finds_the_gpu_by_torch_uuid(install, monkeypatch):
    import torch

    fake = install(FakeNVML(counter_mj=0))
    fake.counter_mj["GPU-bbbb"] = 4_000
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(uuid="bbbb"))
    meter = EnergyMeter.for_cuda_device(0)
    assert meter.uuid == "GPU-bbbb" and meter.read_joules() == pytest.approx(4.0)


def test_shared_gpu_is_counted_once_and_gpus_are_summed():
    readings = [
        {"rank": 1, "host": "a", "gpu": "GPU-0", "joules": 999.0},   # shares rank 0's GPU
        {"rank": 0, "host": "a", "gpu": "GPU-0", "joules": 100.0},
        {"rank": 2, "host": "b", "gpu": "GPU-0", "joules": 50.0},    # same UUID text, other host
    ]
    out = gpu_energy_per_iteration(readings, iterations=10)
    assert out["total"] == pytest.approx(15.0)
    first = out["per_gpu"][0]
    assert first["rank"] == 0 and first["ranks"] == [0, 1] and first["j_per_iter"] == 10.0
    assert len(out["per_gpu"]) == 2


def test_any_gpu_without_a_reading_makes_the_total_unknown():
    readings = [{"rank": 0, "host": "a", "gpu": "GPU-0", "joules": 100.0},
                {"rank": 1, "host": "a", "gpu": "GPU-1", "joules": None}]
    out = gpu_energy_per_iteration(readings, iterations=4)
    assert out["total"] is None
    assert [g["j_per_iter"] for g in out["per_gpu"]] == [25.0, None]
    assert gpu_energy_per_iteration([], iterations=4)["total"] is None


def bench_results(energy_note, joules):
    run = {"seconds_per_iteration": 0.1, "img_sec_mean": 160.0, "energy_j_per_iter": joules}
    return {"policies": {"dcredit": run}, "energy": energy_note}


def test_bench_table_prints_energy_per_iteration_and_how_it_was_summed(capsys):
    from dcredit_hvd.bench import sidebyside as bench

    note = {"scope": bench.ENERGY_SCOPE, "meter_rank0": "GPU energy: GPU 0", "available": True}
    bench.print_table(bench_results(note, 12.345))
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("dcredit"))
    assert row.split()[-1] == "12.35"
    assert "summed over the job's GPUs" in out and "counted once" in out


def test_bench_table_prints_energy_as_na_on_cpu_and_when_unmeasured(capsys):
    from dcredit_hvd.bench import sidebyside as bench

    bench.print_table(bench_results(None, None))
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("dcredit"))
    assert row.split()[-1] == "n/a" and "--device cpu" in out
    reason = "GPU energy: n/a (pynvml is not installed (pip install nvidia-ml-py))"
    bench.print_table(bench_results({"scope": bench.ENERGY_SCOPE, "meter_rank0": reason,
                                     "available": False}, None))
    assert "nvidia-ml-py" in capsys.readouterr().out


def test_bench_device_cuda_error_names_the_fix_on_a_cpu_only_torch():
    from dcredit_hvd.bench import sidebyside as bench

    cpu_only = types.SimpleNamespace(__version__="2.13.0+cpu",
                                     version=types.SimpleNamespace(cuda=None))
    assert "CPU-only build" in bench.cuda_unavailable_reason(cpu_only)
    assert "--device cpu" in bench.cuda_unavailable_reason(cpu_only)
    no_gpu = types.SimpleNamespace(__version__="2.13.0", version=types.SimpleNamespace(cuda="12.8"),
                                   cuda=types.SimpleNamespace(is_available=lambda: False))
    assert "nvidia-smi" in bench.cuda_unavailable_reason(no_gpu)
    has_gpu = types.SimpleNamespace(__version__="2.13.0", version=types.SimpleNamespace(cuda="12.8"),
                                    cuda=types.SimpleNamespace(is_available=lambda: True))
    assert bench.cuda_unavailable_reason(has_gpu) is None
