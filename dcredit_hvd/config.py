"""The scheduler's configuration: one typed dataclass.

Each field is filled from the keyword argument when given, else from its ``DCREDIT_*``
environment variable, else from the default below.  Values are validated once, here, with
errors that name the value, the allowed range and the fix.
"""
from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from .liveness import heartbeat as liveness
from .planning.drift import DriftSettings
from .planning.race import RaceSettings
from .policies import POLICIES

#: ``transport`` values ("" chooses by what is initialised; ``transports.NAMES``).
TRANSPORTS = ("", "horovod", "torch.distributed")

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
}


def parse_bytes(value: Any, what: str) -> int:
    """``4194304``, ``"4MiB"``, ``"4M"`` (decimal) -> bytes; anything else is a clear error."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a number of bytes, got {value!r}")
    if isinstance(value, (int, float)):
        number = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if not match or unit not in _UNITS:
            raise ValueError(
                f"{what} must be a number of bytes such as 4194304, '4MiB' or '4MB', got {value!r}"
            )
        number = float(match.group(1)) * _UNITS[unit]
    if number != number or number <= 0 or number == float("inf"):
        raise ValueError(f"{what} must be > 0 bytes, got {value!r}; pass a positive size such as '4MiB'")
    return int(number)


def _parse_int(value: Any, what: str, low: int) -> int:
    try:
        number = int(str(value).strip()) if not isinstance(value, int) else value
    except ValueError:
        raise ValueError(f"{what} must be a whole number, got {value!r}") from None
    if isinstance(value, bool) or number < low:
        raise ValueError(f"{what} must be a whole number >= {low}, got {value!r}")
    return number


def _parse_float(value: Any, what: str, low: float, inclusive: bool = False) -> float:
    """``value`` as a float above ``low`` (or at it, with ``inclusive``), else a clear error."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number, got {value!r}") from None
    if inclusive and not number >= low:
        raise ValueError(f"{what} must be >= {low}, got {value!r}")
    if not inclusive and not number > low:
        raise ValueError(f"{what} must be > {low}, got {value!r}")
    return number


_SWITCH = {"1": True, "true": True, "yes": True, "on": True,
           "0": False, "false": False, "no": False, "off": False, "auto": None}


def _parse_switch(value: Any, what: str) -> Optional[bool]:
    if isinstance(value, bool):
        return value
    key = str(value).strip().lower()
    if key not in _SWITCH:
        raise ValueError(f"{what} must be 1, 0 or auto (also true/false, yes/no, on/off), "
                         f"got {value!r}")
    return _SWITCH[key]


def _parse_rounds(value: Any, what: str) -> tuple[int, ...]:
    """``"8,16,32"`` or ``(8, 16, 32)``: iterations per round of the race, each >= 2."""
    items = value.split(",") if isinstance(value, str) else list(value) \
        if isinstance(value, (list, tuple)) else [value]
    try:
        rounds = tuple(int(str(x).strip()) for x in items)
    except ValueError:
        rounds = ()
    if not rounds or any(n < 2 for n in rounds):
        raise ValueError(f"{what} must list the iterations of each round of the race, each "
                         f">= 2, such as '8,16,32', got {value!r}")
    return rounds


#: ``SchedulerConfig`` field -> ``liveness.Settings`` field, validated by ``liveness.validate``.
_LIVENESS_SETTING = {field: name for name, field in liveness.CONFIG_FIELD.items()}
#: Their variables (in the class body, ``liveness`` names the field, not the module).
_LIVENESS_ENV = {field: liveness.ENV[name] for name, field in liveness.CONFIG_FIELD.items()}


@dataclass
class SchedulerConfig:
    """Everything the scheduler can be told.  See README "Configuration"."""

    #: Window rule: one of ``policies.POLICIES``.  ``DCREDIT_POLICY``.
    policy: str = "dcredit"
    #: The collective library: ``"horovod"``, ``"torch.distributed"``, or ``""`` (Horovod when
    #: it is initialised, else torch.distributed when it is).  ``DCREDIT_TRANSPORT``.
    transport: str = ""
    #: Largest block, in bytes as sent (after compression).  ``DCREDIT_PARTITION_BYTES``.
    #: ByteScheduler's default, 1M float32 elements.  Under ``dcredit`` the planner chooses the
    #: partition unless this is given explicitly (keyword or environment).
    partition_bytes: int = 4_000_000
    #: ``dcredit``: runs of consecutive gradients, each smaller than this many bytes, of one
    #: dtype and on the CPU, share one flat buffer and travel as one unit of blocks
    #: (``blocks.group_runs``, ``docs/algorithm.md`` §1b); 0: never.  Unless given, the planner
    #: chooses it together with the partition (``planning.GROUP_CANDIDATES``).  ``dear``:
    #: given, DeAR's buffer size (its ``THRESHOLD``, 25 MiB unless given; ``policies/dear.py``).
    #: ``DCREDIT_GROUP_BYTES``.
    group_bytes: int = 1 << 20
    #: The sharded mode (``runtime/shards.py``): gradients are reduce-scattered, each rank
    #: updates and keeps optimizer state for its ``1/N`` of every block, the parameters are
    #: all-gathered (in the next forward with ``model=``, else in ``step()``; ``gathers.py``).
    #: Keeps the partition fixed and groups nothing (a slice must stay the same range of the
    #: same parameter).  ``DCREDIT_SHARD`` (1/0).
    shard: bool = False
    #: Bytes in flight allowed by ``bytescheduler``.  ``DCREDIT_CREDIT_BYTES``.
    #: ByteScheduler's default, 4M float32 elements.
    credit_bytes: int = 16_000_000
    #: Seconds between polls of in-flight all-reduces by the completion thread.
    #: ``DCREDIT_POLL_SECONDS``.  Horovod's own cycle is 1 ms, so polling faster gains little.
    poll_seconds: float = 0.0005
    #: Seconds an iteration's blocks may wait before the blocks still outstanding are logged
    #: (``DCREDIT_STALL_SECONDS``), and before the wait raises ``StallError`` in the training
    #: thread (``DCREDIT_STALL_ABORT_SECONDS``; 0 waits for ever, like Horovod).
    stall_seconds: float = 60.0
    stall_abort_seconds: float = 600.0
    #: ``dcredit``: iterations run (under ``bytescheduler`` rules) before profiling starts, and
    #: iterations averaged into the profile; the plan takes over after both, on every rank at
    #: the same step.  ``DCREDIT_PROFILE_WARMUP``, ``DCREDIT_PROFILE_STEPS``.
    profile_warmup: int = 2
    profile_steps: int = 3
    #: ``dcredit``: re-plan online (``drift.py``, ``docs/algorithm.md`` §8): the gate rank
    #: compares each iteration's time and the link's effective speed with what they were after
    #: the plan took over; when either stays off by more than its threshold for ``replan_patience``
    #: iterations in a row, every rank profiles again and switches to a new plan at the same
    #: step.  ``DCREDIT_REPLAN`` (1/0), ``DCREDIT_REPLAN_TIME_THRESHOLD``,
    #: ``DCREDIT_REPLAN_LINK_THRESHOLD`` (relative changes), ``DCREDIT_REPLAN_PATIENCE``.
    replan: bool = True
    replan_time_threshold: float = DriftSettings.time_threshold
    replan_link_threshold: float = DriftSettings.link_threshold
    replan_patience: int = DriftSettings.patience
    #: Wall seconds the off iterations must last as well (``DCREDIT_REPLAN_SECONDS``).
    replan_seconds: float = DriftSettings.seconds
    #: ``dcredit``: race the candidate schedules on the live run after each plan
    #: (``planning/race.py``, ``docs/algorithm.md`` §10): the simulator's pick (run first), its
    #: runners-up and every baseline the runtime can express, timed in blocks of iterations
    #: (the maximum over ranks), the slower half dropped after each round of ``tune_rounds``
    #: iterations (``tune_drop`` more are discarded after each switch); a challenger replaces the
    #: pick only when faster by more than ``max(tune_margin, 2 standard errors)``.
    #: ``DCREDIT_TUNE`` (1/0), ``DCREDIT_TUNE_ROUNDS`` ("8,16,32"), ``DCREDIT_TUNE_DROP``,
    #: ``DCREDIT_TUNE_MARGIN``.  ``tune_force`` (``DCREDIT_TUNE_FORCE``), for tests only: the
    #: candidate whose label starts with it wins, so that a switch is exercised.
    #: ``tune_byte_scale`` (``DCREDIT_TUNE_BYTE_SCALE``): every byte setting of the race's
    #: baselines (ByteScheduler's partition and credit, DDP's 25 MiB buckets) divided by it, for
    #: an emulated cluster whose gradients are 1/S of their size (``bench/emulate.py``); 1 on a
    #: real cluster.
    tune: bool = True
    tune_rounds: tuple = (8, 16, 32)
    tune_drop: int = 2
    tune_margin: float = 0.03
    tune_force: str = ""
    tune_byte_scale: float = 1.0
    #: ``dcredit``: rank 0 writes the measured profile, cost model and plan to this JSON file
    #: (read by ``python -m dcredit_hvd plan --profile``).  ``DCREDIT_PROFILE_OUT``.
    profile_out: Optional[str] = None
    #: CUDA gradients: stage every block through pinned host memory and reduce it with
    #: Horovod's CPU operations (True), or hand CUDA tensors to Horovod (False).  None: stage
    #: only when Horovod was built without GPU operations.  True lets several ranks share one
    #: GPU with an NCCL build (NCCL allows one rank per device).  ``DCREDIT_CUDA_STAGING``
    #: (``1``/``0``/``auto``).  See ``device.py``.
    cuda_staging: Optional[bool] = None
    #: Race amplifier for tests (``amplifier.RaceAmplifier``): the completion thread, the
    #: submission of blocks and each overlapped parameter update sleep a random time in
    #: [0, this many seconds] at the points where an ordering bug would show, so that such a bug
    #: fails a test every run instead of once in many.  0 (default): off.
    #: ``DCREDIT_RACE_AMPLIFIER``.
    race_amplifier: float = 0.0
    #: The liveness channel (``liveness.py``): a TCP heartbeat between the ranks, so that a
    #: dead peer ends the job in seconds.  On/off (``DCREDIT_LIVENESS``), seconds between
    #: heartbeats (``DCREDIT_LIVENESS_INTERVAL``), silence after which a peer is lost
    #: (``DCREDIT_LIVENESS_TIMEOUT``, at least two heartbeats), and seconds the training thread
    #: has to raise and exit after a loss before the process is ended
    #: (``DCREDIT_LIVENESS_EXIT_SECONDS``; 0: never forced); the address or interface it
    #: listens on (``DCREDIT_LIVENESS_BIND``; empty: the collective library's, see
    #: ``interfaces.py``).  Read at the first optimizer of a process set, which starts the
    #: channel.
    liveness: bool = True
    liveness_interval: float = 1.0
    liveness_timeout: float = 10.0
    liveness_exit_seconds: float = 10.0
    liveness_bind: str = ""
    #: Where each field's value came from ("keyword", "environment", "default").
    sources: dict = field(default_factory=dict, compare=False, repr=False)

    ENV = {
        "policy": "DCREDIT_POLICY",
        "transport": "DCREDIT_TRANSPORT",
        "partition_bytes": "DCREDIT_PARTITION_BYTES",
        "group_bytes": "DCREDIT_GROUP_BYTES",
        "credit_bytes": "DCREDIT_CREDIT_BYTES",
        "shard": "DCREDIT_SHARD",
        "poll_seconds": "DCREDIT_POLL_SECONDS",
        "stall_seconds": "DCREDIT_STALL_SECONDS",
        "stall_abort_seconds": "DCREDIT_STALL_ABORT_SECONDS",
        "profile_warmup": "DCREDIT_PROFILE_WARMUP",
        "profile_steps": "DCREDIT_PROFILE_STEPS",
        "profile_out": "DCREDIT_PROFILE_OUT",
        "replan": "DCREDIT_REPLAN",
        "replan_time_threshold": "DCREDIT_REPLAN_TIME_THRESHOLD",
        "replan_link_threshold": "DCREDIT_REPLAN_LINK_THRESHOLD",
        "replan_patience": "DCREDIT_REPLAN_PATIENCE",
        "replan_seconds": "DCREDIT_REPLAN_SECONDS",
        "tune": "DCREDIT_TUNE",
        "tune_rounds": "DCREDIT_TUNE_ROUNDS",
        "tune_drop": "DCREDIT_TUNE_DROP",
        "tune_margin": "DCREDIT_TUNE_MARGIN",
        "tune_force": "DCREDIT_TUNE_FORCE",
        "tune_byte_scale": "DCREDIT_TUNE_BYTE_SCALE",
        "cuda_staging": "DCREDIT_CUDA_STAGING",
        "race_amplifier": "DCREDIT_RACE_AMPLIFIER",
        **_LIVENESS_ENV,
    }

    @classmethod
    def resolve(cls, environ: Optional[Mapping[str, str]] = None, **keywords: Any) -> SchedulerConfig:
        """Keyword (when not None) > ``DCREDIT_*`` variable > default; then validate."""
        environ = os.environ if environ is None else environ
        names = [f.name for f in dataclasses.fields(cls) if f.name != "sources"]
        unknown = set(keywords) - set(names)
        if unknown:
            raise TypeError(f"unknown scheduler option(s): {', '.join(sorted(unknown))}; "
                            f"known: {', '.join(names)}")
        raw: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for name in names:
            if keywords.get(name) is not None:
                raw[name], sources[name] = keywords[name], "keyword"
            elif environ.get(cls.ENV[name], "") != "":
                raw[name], sources[name] = environ[cls.ENV[name]], "environment"
            else:
                sources[name] = "default"
        config = cls(**{k: cls._validate(k, v, sources[k]) for k, v in raw.items()})
        config.sources = sources
        config.liveness_settings()                 # the rule between the liveness fields
        if config.shard:
            config._check_shard()
        return config

    @property
    def split(self) -> bool:
        """Whether each all-reduce runs as a reduce-scatter and an all-gather (``dear``, or
        ``shard=True``: ``runtime/gathers.py``)."""
        return self.shard or self.policy == "dear"

    def _check_shard(self) -> None:
        """``shard=True`` is for policies other than ``dear``, and a slice is a range of one
        parameter for the whole run: no grouping, and a partition the planner keeps
        (``runtime/shards.py``)."""
        if self.policy == "dear":
            raise ValueError("shard=True with policy='dear': DeAR, as its authors ran it, "
                             "all-gathers reduced gradients into fused buffers and every rank "
                             "updates whole tensors; for the sharded mode choose another "
                             "policy (dcredit), or leave shard unset for dear")
        if self.explicit("group_bytes") and self.group_bytes:
            raise ValueError(f"shard=True sends each parameter on its own, but group_bytes="
                             f"{self.group_bytes} groups small ones; leave group_bytes unset "
                             f"(or 0) with shard=True")
        self.group_bytes = 0
        for name in ("group_bytes", "partition_bytes"):
            if not self.explicit(name):
                self.sources[name] = "fixed by shard"

    def liveness_settings(self) -> liveness.Settings:
        return liveness.check(liveness.Settings(
            **{name: getattr(self, field) for name, field in liveness.CONFIG_FIELD.items()}))

    @classmethod
    def _validate(cls, name: str, value: Any, source: str) -> Any:
        what = f"{name}" if source == "keyword" else f"{cls.ENV[name]} (environment)"
        if name == "policy":
            policy = str(value).strip().lower()
            if policy not in POLICIES:
                raise ValueError(f"{what}={value!r} is not a known policy; choose one of "
                                 f"{', '.join(POLICIES)}")
            return policy
        if name == "transport":
            chosen = str(value).strip().lower()
            if chosen not in TRANSPORTS:
                raise ValueError(f"{what}={value!r} is not a transport; choose "
                                 f"{' or '.join(map(repr, TRANSPORTS[1:]))}, or leave it unset "
                                 "(Horovod when initialised, else torch.distributed)")
            return chosen
        if name in ("partition_bytes", "credit_bytes"):
            return parse_bytes(value, what)
        if name == "group_bytes":
            return 0 if str(value).strip() == "0" else parse_bytes(value, what + " (0: never)")
        if name in ("poll_seconds", "stall_seconds"):
            return _parse_float(value, what, 0.0)
        if name == "race_amplifier":
            return _parse_float(value, what, 0.0, inclusive=True)   # 0, its default: off
        if name == "stall_abort_seconds":
            return _parse_float(value, what, -1e-9)
        if name == "profile_warmup":
            return _parse_int(value, what, 0)
        if name == "profile_steps":
            return _parse_int(value, what, 1)
        if name == "profile_out":
            return str(value)
        if name == "cuda_staging":
            return _parse_switch(value, what)
        if name == "tune_rounds":
            return _parse_rounds(value, what)
        if name == "tune_drop":
            return _parse_int(value, what, 0)
        if name == "tune_margin":
            margin = _parse_float(value, what, 0.0, inclusive=True)
            if margin >= 1:
                raise ValueError(f"{what} must be a fraction in [0, 1) such as 0.03, got {value!r}")
            return margin
        if name == "tune_force":
            return str(value).strip()
        if name == "tune_byte_scale":
            return _parse_float(value, what, 1.0 - 1e-12)   # >= 1
        if name in ("replan", "shard", "tune"):
            switch = _parse_switch(value, what)
            if switch is None:
                raise ValueError(f"{what} must be 1 or 0 (also true/false, yes/no, on/off), "
                                 f"got {value!r}")
            return switch
        if name in ("replan_time_threshold", "replan_link_threshold"):
            return _parse_float(value, what, 0.0)
        if name == "replan_seconds":
            return _parse_float(value, what, -1e-9)
        if name == "replan_patience":
            return _parse_int(value, what, 1)
        if name in _LIVENESS_SETTING:
            return liveness.validate(_LIVENESS_SETTING[name], value, what)
        raise AssertionError(name)

    def race_settings(self) -> RaceSettings:
        """The race's rounds, dropped iterations and switch margin (``race.RaceSettings``)."""
        return RaceSettings(rounds=tuple(self.tune_rounds), drop=self.tune_drop,
                            margin=self.tune_margin, force=self.tune_force)

    def drift_settings(self) -> DriftSettings:
        """The detector's thresholds (``drift.DriftSettings``)."""
        return DriftSettings(patience=self.replan_patience, seconds=self.replan_seconds,
                             time_threshold=self.replan_time_threshold,
                             link_threshold=self.replan_link_threshold)

    def explicit(self, name: str) -> bool:
        """Whether the user set ``name`` (keyword or environment) rather than leaving the default."""
        return self.sources.get(name, "default") != "default"

    def summary(self) -> str:
        parts = []
        for name in self.ENV:
            parts.append(f"{name}={getattr(self, name)} ({self.sources.get(name, 'default')})")
        return "dcredit_hvd config: " + ", ".join(parts)
