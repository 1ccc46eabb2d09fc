"""Replayed compute for an emulated GPU cluster: a model whose layers wait instead of compute.

A GPU cluster's CPU is nearly idle: the GPU computes, the CPU only launches kernels and moves
gradients.  On this project's CPU machines real compute takes the very cores that TCP, MPI's
reduction and the scheduler need, which no GPU cluster does (``docs/benchmarks.md``,
"Emulated GPU cluster").  So the emulation replays each layer's compute as a timed wait that
releases the CPU, from a per-layer profile in the format ``profile_out`` /
``DCREDIT_PROFILE_OUT`` writes and ``python -m dcredit_hvd simulate --profile`` reads::

    {"profile": {"names": [...], "nbytes": [...], "element_size": [...],
                 "t_f": [...], "t_b": [...], "t_u": [...]}, "cost": {...}, ...}

Time dilation and byte scale (``Dilation``): a fast target cluster (NICs of ``target_rate``) is
emulated on slower shaped links (``link_rate``).  Every compute time is multiplied by ``K`` and
every gradient's size divided by ``S``, with ``K * S = target_rate / link_rate``: then a
gradient of ``M`` bytes takes ``M / S / link_rate = K * M / target_rate`` on the emulated link,
``K`` times what it takes on the target, the same factor as compute.  Every wall-clock figure
divided by ``K`` is the target cluster's time.  Horovod's cycle and our polling interval are
multiplied by ``K`` too (``Dilation.environment``).

Waits (``ReplayClock``): ``time.sleep`` overshoots by 50-100 us a call, the autograd engine
adds its own overhead between layers, and on a shared CPU a rank may be preempted for
milliseconds.  A GPU hides all of it (the CPU queues kernels ahead of the device), so the clock
keeps a deadline chain, like a GPU stream: each wait ends at the previous deadline plus the
layer's time, as long as the CPU came back within ``slack`` of that deadline.  Where the device
really is idle the chain restarts from now: after ``step()`` (the harness calls
``ReplayClock.idle``: a synchronous step waits for all-reduces there), when a layer's
parameters were held by dcredit's read guard (the layer times its reads), and after any gap
longer than ``slack``.  ``restarts`` and ``late`` count the last kind: CPU delay the chain could
not absorb, which a real GPU cluster would not have had.
"""
from __future__ import annotations

import ctypes
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..planning.profile import Profile

#: Accepted ranges: dilation beyond 1,000 makes a 100 ms iteration take 100 s; a byte scale
#: beyond 100,000 leaves most tensors a single element.
TIME_FACTOR_RANGE = (1.0, 1000.0)
BYTE_SCALE_RANGE = (1, 100_000)
#: Memory the whole emulated run may take (every rank's replica), issue 21's budget.
MEMORY_BUDGET_BYTES = 16 << 30
#: Horovod 0.28's default cycle and dcredit_hvd's default poll, both dilated by ``K``.
HOROVOD_CYCLE_MS = 1.0
POLL_SECONDS = 0.0005
#: Reads of a layer's parameters that take longer than this waited for the read guard.
GUARD_WAIT_S = 0.0002
_DTYPES = {2: "float16", 4: "float32", 8: "float64"}


class ReplayError(ValueError):
    """A profile the replay cannot use, or dilation factors out of range; says which and why."""


_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def parse_rate(text: str | float) -> float:
    """A rate in bits per second, from a number or tc's units (``200mbit``, ``10gbit``)."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        import re

        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*(bit|kbit|mbit|gbit|tbit)\s*", text.lower())
        if m is None:
            raise ReplayError(f"rate {text!r}: expected a tc bit rate such as 200mbit or 10gbit")
        value = float(m.group(1)) * _RATE_UNITS[m.group(2)]
    if not (math.isfinite(value) and value > 0):
        raise ReplayError(f"rate {text!r} must be a positive finite number of bits per second")
    return value


@dataclass(frozen=True)
class Dilation:
    """How the emulation maps onto the target cluster: ``K`` (time) and ``S`` (bytes)."""

    #: NIC rate of the cluster being emulated, bits/s.
    target_rate: float
    #: NIC rate of the shaped emulation links, bits/s.
    link_rate: float
    #: ``K``: wall seconds per cluster second (compute waits, Horovod's cycle, polling).
    time_factor: float
    #: ``S``: target gradient bytes per emulated byte.
    byte_scale: int

    def __post_init__(self) -> None:
        lo, hi = TIME_FACTOR_RANGE
        if not (math.isfinite(self.time_factor) and lo <= self.time_factor <= hi):
            raise ReplayError(f"time dilation K={self.time_factor:g} is out of range: it must lie "
                              f"in [{lo:g}, {hi:g}] (K multiplies every compute time; pick a "
                              "faster emulation link or a larger byte scale S)")
        lo_s, hi_s = BYTE_SCALE_RANGE
        if isinstance(self.byte_scale, bool) or not isinstance(self.byte_scale, int) \
                or not lo_s <= self.byte_scale <= hi_s:
            raise ReplayError(f"byte scale S={self.byte_scale!r} is out of range: it must be an "
                              f"integer in [{lo_s}, {hi_s}] (S divides every gradient's size)")
        ratio = self.target_rate / self.link_rate
        if abs(self.time_factor * self.byte_scale - ratio) > 1e-6 * ratio:
            raise ReplayError(f"K*S = {self.time_factor * self.byte_scale:g} but the target and "
                              f"emulation rates need K*S = {ratio:g} (target over link rate)")

    @classmethod
    def for_cluster(cls, target_rate: str | float, link_rate: str | float, *,
                    byte_scale: int | None = None,
                    time_factor: float | None = None) -> Dilation:
        """``K`` and ``S`` for a target cluster emulated on ``link_rate``: give ``S`` (``K``
        follows) or ``K`` (``S`` is rounded to an integer, then ``K`` follows exactly)."""
        target, link = parse_rate(target_rate), parse_rate(link_rate)
        ratio = target / link
        if ratio < 1.0:
            raise ReplayError(f"the emulation link ({link / 1e9:g} Gbit/s) is faster than the "
                              f"target cluster's ({target / 1e9:g} Gbit/s): nothing to dilate; "
                              "shape the links to the target rate or slower")
        if (byte_scale is None) == (time_factor is None):
            raise ReplayError("give exactly one of the byte scale S and the time dilation K")
        if byte_scale is None:
            assert time_factor is not None
            if not (math.isfinite(time_factor) and time_factor > 0):
                raise ReplayError(f"time dilation K={time_factor!r} must be a positive number")
            if time_factor > ratio * (1 + 1e-9):
                raise ReplayError(f"time dilation K={time_factor:g} is out of range: with a "
                                  f"target {ratio:g} times faster than the link, K*S = {ratio:g} "
                                  f"and S >= 1, so K <= {ratio:g}")
            byte_scale = max(1, round(ratio / time_factor))
        if isinstance(byte_scale, bool) or not isinstance(byte_scale, int) or byte_scale < 1:
            raise ReplayError(f"byte scale S={byte_scale!r} must be an integer >= 1")
        return cls(target, link, ratio / byte_scale, byte_scale)

    def wall(self, cluster_seconds: float) -> float:
        """Wall seconds of the emulation for ``cluster_seconds`` of the target."""
        return cluster_seconds * self.time_factor

    def cluster(self, wall_seconds: float) -> float:
        """The target cluster's seconds for ``wall_seconds`` measured in the emulation."""
        return wall_seconds / self.time_factor

    def numel(self, nbytes: int, element_size: int) -> int:
        """Elements of the replayed gradient: the target's ``nbytes`` over ``S``, at least 1."""
        return max(1, math.ceil(nbytes / element_size / self.byte_scale))

    def scaled_bytes(self, nbytes: int) -> int:
        """A byte setting of the target (a partition, a bucket) in the emulation's bytes."""
        return max(1, round(nbytes / self.byte_scale))

    @property
    def poll_seconds(self) -> float:
        """dcredit_hvd's poll interval, dilated (also how the emulation's own waits poll)."""
        return POLL_SECONDS * self.time_factor

    def environment(self) -> dict[str, str]:
        """Horovod's cycle and dcredit_hvd's poll, dilated; set before ``hvd.init``."""
        return {"HOROVOD_CYCLE_TIME": f"{HOROVOD_CYCLE_MS * self.time_factor:g}",
                "DCREDIT_POLL_SECONDS": f"{self.poll_seconds:g}"}

    def check_memory(self, profile: Profile, hosts: int, copies: int = 5) -> int:
        """Bytes the run's replicas need (``copies`` per gradient: parameter, gradient,
        momentum, fusion and scheduler buffers); refuses a run over ``MEMORY_BUDGET_BYTES``."""
        per_rank = sum(self.numel(b, e) * e for b, e in zip(profile.nbytes, profile.element_size))
        need = per_rank * copies * hosts
        if need > MEMORY_BUDGET_BYTES:
            smallest = math.ceil(self.byte_scale * need / MEMORY_BUDGET_BYTES)
            raise ReplayError(f"{hosts} hosts x {per_rank / 2**20:.0f} MiB of gradients x "
                              f"{copies} copies = {need / 2**30:.1f} GiB, over the "
                              f"{MEMORY_BUDGET_BYTES >> 30} GiB budget: use a byte scale S >= "
                              f"{smallest}")
        return need


# --------------------------------------------------------------------------------------------
# Profiles
# --------------------------------------------------------------------------------------------

def _numbers(p: dict[str, Any], key: str, where: str, kind: type) -> list[Any]:
    values = p.get(key)
    if not isinstance(values, list):
        raise ReplayError(f"{where}: profile.{key} must be a list, got {type(values).__name__}")
    for i, v in enumerate(values):
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        if kind is int:
            ok = ok and float(v).is_integer()
        if not ok or not math.isfinite(v) or v < 0:
            name = p["names"][i] if i < len(p.get("names", [])) else i
            raise ReplayError(f"{where}: profile.{key}[{i}] ({name}) = {v!r}: expected a finite "
                              f"{'integer' if kind is int else 'number'} >= 0")
    return values


def profile_from_record(record: Any, where: str = "profile") -> Profile:
    """The ``Profile`` of a ``profile_out`` record, every field checked with a message that
    names the field and the tensor."""
    if not isinstance(record, dict) or not isinstance(record.get("profile"), dict):
        raise ReplayError(f"{where}: expected a JSON object with a 'profile' object (what "
                          "profile_out / DCREDIT_PROFILE_OUT writes), got "
                          f"{type(record).__name__}" + ("" if not isinstance(record, dict) else
                                                        f" with keys {sorted(record)}"))
    p = record["profile"]
    names = p.get("names")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ReplayError(f"{where}: profile.names must be a non-empty list of tensor names")
    if len(set(names)) != len(names):
        raise ReplayError(f"{where}: profile.names has duplicates")
    fields = {key: _numbers(p, key, where, int if key in ("nbytes", "element_size") else float)
              for key in ("nbytes", "element_size", "t_f", "t_b")}
    t_u = _numbers(p, "t_u", where, float) if p.get("t_u") else []
    for key, values in (*fields.items(), ("t_u", t_u)):
        if values and len(values) != len(names):
            raise ReplayError(f"{where}: profile.{key} has {len(values)} entries for "
                              f"{len(names)} tensors")
    for i, (n, e) in enumerate(zip(fields["nbytes"], fields["element_size"])):
        if e not in _DTYPES:
            raise ReplayError(f"{where}: profile.element_size[{i}] ({names[i]}) = {e}: the "
                              f"replay makes tensors of {sorted(_DTYPES)} bytes per element")
        if n == 0 or n % e:
            raise ReplayError(f"{where}: profile.nbytes[{i}] ({names[i]}) = {n} is not a "
                              f"positive multiple of its element size {e}")
    if sum(fields["t_f"]) + sum(fields["t_b"]) <= 0:
        raise ReplayError(f"{where}: the profile's forward and backward times are all zero")
    return Profile.from_lists(names, fields["nbytes"], fields["element_size"], fields["t_f"],
                              fields["t_b"], t_u, p.get("kinds") or ())


def load(path: str) -> tuple[Profile, dict[str, Any]]:
    """``(profile, record)`` from a JSON file ``profile_out`` wrote (or a shipped profile:
    ``replay.shipped(name)`` gives its path)."""
    from ..planning.decision import read

    try:
        record = read(path)
    except ValueError as exc:
        raise ReplayError(str(exc)) from None
    return profile_from_record(record, where=path), record


def shipped(name: str) -> str:
    """The path of a profile shipped in the package (``resnet50``, ``vgg16``, ``gpt2_small``)."""
    from importlib import resources

    path = resources.files("dcredit_hvd.bench") / "profiles" / f"{name}.json"
    if not path.is_file():
        raise ReplayError(f"no shipped profile {name!r}; shipped: {', '.join(SHIPPED)}")
    return str(path)


SHIPPED = ("resnet50", "vgg16", "gpt2_small")


def resolve(name_or_path: str) -> str:
    """A shipped profile's name, or a path to a JSON file, as a path."""
    return shipped(name_or_path) if name_or_path in SHIPPED else name_or_path


# --------------------------------------------------------------------------------------------
# The clock and the model
# --------------------------------------------------------------------------------------------

def tighten_timer_slack() -> bool:
    """Set the calling thread's timer slack to 1 ns (default 50 us: every sleep may be that
    late); True when the kernel accepted it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(29, 1, 0, 0, 0) == 0      # PR_SET_TIMERSLACK
    except (OSError, AttributeError):
        return False


class ReplayClock:
    """Timed waits on a deadline chain (module docstring): overshoot and per-layer CPU overhead
    within ``slack`` seconds are absorbed, a longer gap is idle device time."""

    def __init__(self, slack: float = 0.005) -> None:
        if not (math.isfinite(slack) and slack >= 0):
            raise ReplayError(f"clock slack must be >= 0 seconds, got {slack!r}")
        self.slack = slack
        self._deadline: float | None = None
        #: Wall seconds asked for, and how many waits, since construction (for the checks).
        self.asked = 0.0
        self.waits = 0
        #: Waits that restarted the chain (the CPU came back later than ``slack``), and the
        #: wall seconds those gaps lost.
        self.restarts = 0
        self.late = 0.0

    def idle(self) -> None:
        """The device was idle until now (the CPU waited on something else): restart the
        chain at the next wait."""
        self._deadline = None

    def wait(self, seconds: float) -> None:
        """Wait ``seconds`` of device time, releasing the CPU (and the GIL)."""
        now = time.perf_counter()
        last = self._deadline
        start = now
        if last is not None:
            if now - last <= self.slack:
                start = last
            else:
                self.restarts += 1
                self.late += now - last
        self._deadline = start + seconds
        self.asked += seconds
        self.waits += 1
        left = self._deadline - now
        if left > 0:
            time.sleep(left)


def _segments(profile: Profile, dilation: Dilation, merge_wall: float) -> list[list[int]]:
    """Runs of consecutive tensors replayed as one layer: a run grows while its forward plus
    backward wait is under ``merge_wall`` wall seconds (0: one layer per tensor)."""
    runs: list[list[int]] = []
    for i in range(profile.num_tensors):
        if runs and merge_wall > 0:
            run = runs[-1]
            wall = dilation.wall(sum(profile.t_f[j] + profile.t_b[j] for j in (*run, i)))
            if wall < merge_wall:
                run.append(i)
                continue
        runs.append([i])
    return runs


def build_model(profile: Profile, dilation: Dilation, *, clock: ReplayClock | None = None,
                merge_wall: float = 0.0) -> Any:
    """An ``nn.Module`` replaying ``profile`` under ``dilation``: parameters in forward order
    with ``Dilation.numel`` elements each, forward and backward waiting ``K`` times the
    profile's times.  Call it on ``replay_input()``; ``.sum()`` of the output is the loss."""
    import torch
    from torch import nn

    clock = clock or ReplayClock()

    class _Wait(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, forward_s: float, backward_s: float,
                    *params: Any) -> Any:
            clock.wait(forward_s)
            ctx.backward_s = backward_s
            ctx.shapes = [(p.shape, p.dtype) for p in params]
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            clock.wait(ctx.backward_s)
            return (grad, None, None, *(torch.zeros(s, dtype=d) for s, d in ctx.shapes))

    class Layer(nn.Module):
        def __init__(self, indices: Sequence[int]) -> None:
            super().__init__()
            self.indices = tuple(indices)
            self.forward_s = dilation.wall(sum(profile.t_f[i] for i in indices))
            self.backward_s = dilation.wall(sum(profile.t_b[i] for i in indices))
            for i in indices:
                dtype = getattr(torch, _DTYPES[profile.element_size[i]])
                n = dilation.numel(profile.nbytes[i], profile.element_size[i])
                self.register_parameter(profile.names[i].replace(".", "_"),
                                        nn.Parameter(torch.zeros(n, dtype=dtype)))

        def forward(self, x: Any) -> Any:
            params = list(self.parameters())
            began = time.perf_counter()
            for p in params:        # a read: dcredit's read guard waits here for the update
                p.detach()
            if time.perf_counter() - began > GUARD_WAIT_S:
                clock.idle()        # the device waited for the update
            return _Wait.apply(x, self.forward_s, self.backward_s, *params)

    class ReplayModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer(run) for run in
                                        _segments(profile, dilation, merge_wall))
            self.clock = clock
            self.dilation = dilation
            self.profile = profile

        def forward(self, x: Any) -> Any:
            for layer in self.layers:
                x = layer(x)
            return x

    return ReplayModel()


def replay_input() -> Any:
    """The replay's input: one float, the thread of the autograd chain."""
    import torch

    return torch.zeros(1)


def emulated_profile(profile: Profile, dilation: Dilation) -> Profile:
    """``profile`` as the emulation runs it: times in wall seconds, sizes in emulated bytes
    (what the simulator needs to predict the emulation before dividing by ``K``)."""
    sizes = [dilation.numel(b, e) * e for b, e in zip(profile.nbytes, profile.element_size)]
    return Profile.from_lists(profile.names, sizes, profile.element_size,
                              [dilation.wall(t) for t in profile.t_f],
                              [dilation.wall(t) for t in profile.t_b],
                              [dilation.wall(t) for t in profile.t_u], profile.kinds)
