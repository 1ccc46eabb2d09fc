"""GPU energy from NVML's total-energy counter, for the benchmark's energy per iteration.

``nvmlDeviceGetTotalEnergyConsumption`` counts the millijoules a GPU has used since the driver
was loaded (Volta and newer).  The difference of two readings is the energy the whole GPU used
in between: every process on it, not only this one, so ranks sharing a GPU share one figure.

``pynvml`` (the ``nvidia-ml-py`` package) is optional: without it, without a driver, without a
GPU or on a GPU without the counter, :class:`EnergyMeter` says it is unavailable and why, and
every reading is ``None``.  Nothing here raises into the caller once constructed.

    meter = EnergyMeter.for_cuda_device(torch.cuda.current_device())
    with meter:
        train(...)
    print(meter.describe(), meter.joules)     # joules over the block, or None
"""
from __future__ import annotations

import importlib
import os
from collections.abc import Iterable
from typing import Any, Optional

#: What to install when pynvml is missing.
INSTALL_HINT = "pip install nvidia-ml-py"


def _text(value: Any) -> str:
    """NVML strings come back as ``bytes`` from old bindings and ``str`` from new ones."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class EnergyMeter:
    """Energy used by one GPU, from NVML's total-energy counter.

    ``device_index`` is NVML's index (all GPUs of the machine, in PCI order, whatever
    ``CUDA_VISIBLE_DEVICES`` says); ``uuid`` (``GPU-...``), when given, names the GPU instead and
    wins if NVML knows it.  :meth:`for_cuda_device` finds both for a ``torch.cuda`` index.

    ``available`` is False when no reading can be taken; ``reason`` then says why.
    """

    def __init__(self, device_index: int = 0, uuid: Optional[str] = None) -> None:
        self.device_index = device_index
        self.available = False
        self.reason: Optional[str] = None
        self.name: Optional[str] = None
        self.uuid: Optional[str] = None
        #: Joules between the last ``start()`` and ``stop()`` (None until then, or if unknown).
        self.joules: Optional[float] = None
        #: The last error a reading hit, as text (the reading itself returned None).
        self.last_error: Optional[str] = None
        self._nvml: Any = None
        self._handle: Any = None
        self._start_mj: Optional[int] = None
        self._open(uuid)

    @classmethod
    def for_cuda_device(cls, cuda_index: int) -> EnergyMeter:
        """The meter of ``torch.cuda`` device ``cuda_index``.

        The GPU is found by its UUID (as torch reports it), which is right whatever
        ``CUDA_VISIBLE_DEVICES`` or ``CUDA_DEVICE_ORDER`` say; failing that, by mapping the index
        through a numeric ``CUDA_VISIBLE_DEVICES``.
        """
        uuid = None
        try:
            import torch
            uuid = str(torch.cuda.get_device_properties(cuda_index).uuid)
        except Exception:       # no CUDA, or an old torch: fall back to the index
            uuid = None
        return cls(_nvml_index(cuda_index), uuid=uuid)

    # -- set-up ------------------------------------------------------------------------------

    def _open(self, uuid: Optional[str]) -> None:
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError:
            self.reason = f"pynvml is not installed ({INSTALL_HINT})"
            return
        try:
            nvml.nvmlInit()
        except Exception as exc:
            self.reason = f"NVML failed to initialise ({_error_text(exc)}): no NVIDIA driver?"
            return
        self._nvml = nvml
        try:
            count = nvml.nvmlDeviceGetCount()
        except Exception as exc:
            self._fail(f"NVML cannot count GPUs ({_error_text(exc)})")
            return
        if count < 1:
            self._fail("NVML sees no GPU")
            return
        handle = self._handle_by_uuid(uuid) if uuid else None
        if handle is None:
            if not 0 <= self.device_index < count:
                self._fail(f"no GPU at NVML index {self.device_index} (NVML sees {count})")
                return
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(self.device_index)
            except Exception as exc:
                self._fail(f"NVML cannot open GPU {self.device_index} ({_error_text(exc)})")
                return
        self._handle = handle
        self.name = self._query("nvmlDeviceGetName")
        self.uuid = self._query("nvmlDeviceGetUUID") or self.uuid
        try:
            nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        except Exception as exc:
            self._fail(f"{self._label()} has no total-energy counter ({_error_text(exc)}); "
                       "nvmlDeviceGetTotalEnergyConsumption needs a Volta or newer GPU")
            return
        self.available = True

    def _handle_by_uuid(self, uuid: str) -> Any:
        """NVML's handle for ``uuid`` (with or without the ``GPU-`` prefix); None if unknown."""
        names = [uuid] if uuid.startswith(("GPU-", "MIG-")) else [f"GPU-{uuid}", uuid]
        for name in names:
            try:
                handle = self._nvml.nvmlDeviceGetHandleByUUID(name)
            except Exception:
                continue
            self.uuid = name
            try:
                self.device_index = int(self._nvml.nvmlDeviceGetIndex(handle))
            except Exception:
                pass
            return handle
        return None

    def _query(self, function: str) -> Optional[str]:
        try:
            return _text(getattr(self._nvml, function)(self._handle))
        except Exception:
            return None

    def _fail(self, reason: str) -> None:
        self.reason = reason
        self._handle = None
        self.close()

    def _label(self) -> str:
        return f"GPU {self.device_index}" + (f" ({self.name})" if self.name else "")

    # -- readings ----------------------------------------------------------------------------

    def read_joules(self) -> Optional[float]:
        """The counter now, in joules since the driver loaded; None if it cannot be read."""
        millijoules = self._read_millijoules()
        return None if millijoules is None else millijoules / 1000.0

    def _read_millijoules(self) -> Optional[int]:
        if not self.available or self._handle is None:
            return None
        try:
            value = int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except Exception as exc:
            self.last_error = _error_text(exc)
            return None
        return value

    def start(self) -> None:
        """Begin an interval: the energy from now to :meth:`stop`."""
        self.joules = None
        self._start_mj = self._read_millijoules()

    def stop(self) -> Optional[float]:
        """Joules since :meth:`start` (also kept in ``joules``).

        None when unavailable, when ``start()`` was not called or its reading failed, when this
        reading fails, or when the counter went backwards (the driver was reloaded).
        """
        end = self._read_millijoules()
        begin, self._start_mj = self._start_mj, None
        if begin is None or end is None:
            self.joules = None
        elif end < begin:
            self.last_error = f"the energy counter went backwards ({begin} -> {end} mJ)"
            self.joules = None
        else:
            self.joules = (end - begin) / 1000.0
        return self.joules

    def __enter__(self) -> EnergyMeter:
        self.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    # -- reporting ---------------------------------------------------------------------------

    def describe(self) -> str:
        """One line for logs: which GPU is metered and how, or why energy is not measured."""
        if not self.available:
            return f"GPU energy: n/a ({self.reason})"
        uuid = f", {self.uuid}" if self.uuid else ""
        return (f"GPU energy: {self._label()}{uuid}, NVML total-energy counter "
                "(whole GPU, every process on it)")

    def close(self) -> None:
        """Release NVML (it counts initialisations; each meter releases its own)."""
        if self._nvml is None:
            return
        nvml, self._nvml = self._nvml, None
        self.available = False
        if self.reason is None:
            self.reason = "closed"
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def _error_text(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _nvml_index(cuda_index: int) -> int:
    """NVML's index for ``torch.cuda`` device ``cuda_index`` under a numeric
    ``CUDA_VISIBLE_DEVICES`` (``"2,3"``: cuda:1 is NVML's 3); otherwise ``cuda_index``."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return cuda_index
    entries = [item.strip() for item in visible.split(",") if item.strip()]
    try:
        numbers = [int(item) for item in entries]
    except ValueError:
        return cuda_index          # UUIDs: for_cuda_device finds the GPU by its UUID
    return numbers[cuda_index] if 0 <= cuda_index < len(numbers) else cuda_index


def gpu_energy_per_iteration(readings: Iterable[dict], iterations: int) -> dict:
    """Combine every rank's reading into the job's GPU energy per iteration.

    ``readings``: one dict per rank with ``rank``, ``host``, ``gpu`` (the GPU's identity on that
    host, e.g. its UUID) and ``joules`` over the same timed iterations (None if not measured).
    Ranks that share a GPU read the same whole-GPU counter, so each GPU is counted once, from
    its lowest rank.  Returns ``{"total": J per iteration summed over the job's GPUs, or None if
    any GPU has no reading, "per_gpu": [{"host", "gpu", "rank", "ranks", "j_per_iter"}, ...]}``.
    """
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    gpus: dict[tuple[str, str], dict] = {}
    for reading in sorted(readings, key=lambda r: r["rank"]):
        key = (reading["host"], reading["gpu"])
        if key not in gpus:
            joules = reading["joules"]
            gpus[key] = {"host": key[0], "gpu": key[1], "rank": reading["rank"], "ranks": [],
                         "j_per_iter": None if joules is None else joules / iterations}
        gpus[key]["ranks"].append(reading["rank"])
    per_gpu = list(gpus.values())
    values = [g["j_per_iter"] for g in per_gpu]
    total = None if not values or any(v is None for v in values) else float(sum(values))
    return {"total": total, "per_gpu": per_gpu}
