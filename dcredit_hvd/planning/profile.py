"""The measured (or modelled) shape of one training iteration: the planner's and simulator's input.

Tensors are indexed ``l = 0..L-1`` in FORWARD order (0 = nearest the input, the order in which
forward first uses them; spec §2).  All times are seconds, all sizes bytes as sent (after
compression).  A layer owning several tensors (weight, bias) charges its forward and backward time
to its tensors; the profiler splits it evenly among them, the zoo does the same.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    """Per-tensor sizes and compute times of one iteration."""

    names: tuple[str, ...]
    #: ``M_l``: bytes of gradient ``l`` as sent.
    nbytes: tuple[int, ...]
    #: Bytes per element as sent (4 for float32, 2 under fp16 compression).
    element_size: tuple[int, ...]
    #: ``t_f(l)``: forward time charged to tensor ``l``.
    t_f: tuple[float, ...]
    #: ``t_b(l)``: backward time charged to tensor ``l``.
    t_b: tuple[float, ...]
    #: Optimizer update time per tensor (0 when unknown).
    t_u: tuple[float, ...] = ()
    #: Which tensors may share a flat buffer (``blocks.group_runs``): equal strings (dtype and
    #: device) may, an empty string never does.  Empty tuple: every tensor may group.
    kinds: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.names)
        for field_name in ("nbytes", "element_size", "t_f", "t_b"):
            if len(getattr(self, field_name)) != n:
                raise ValueError(f"Profile.{field_name} has {len(getattr(self, field_name))} "
                                 f"entries for {n} tensors")
        if self.t_u and len(self.t_u) != n:
            raise ValueError(f"Profile.t_u has {len(self.t_u)} entries for {n} tensors")
        if self.kinds and len(self.kinds) != n:
            raise ValueError(f"Profile.kinds has {len(self.kinds)} entries for {n} tensors")
        if any(b < 0 for b in self.nbytes) or any(e <= 0 for e in self.element_size):
            raise ValueError("Profile: sizes must be >= 0 and element sizes > 0")
        if any(t < 0 for t in (*self.t_f, *self.t_b, *self.t_u)):
            raise ValueError("Profile: times must be >= 0")

    @property
    def num_tensors(self) -> int:
        return len(self.names)

    def ready_times(self) -> list[float]:
        """``r_l = sum_{k >= l} t_b(k)``: when gradient ``l`` is ready, from the start of backward."""
        ready = [0.0] * self.num_tensors
        acc = 0.0
        for l in range(self.num_tensors - 1, -1, -1):
            acc += self.t_b[l]
            ready[l] = acc
        return ready

    @property
    def forward_time(self) -> float:
        return sum(self.t_f)

    @property
    def backward_time(self) -> float:
        return sum(self.t_b)

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes)

    def group_kinds(self) -> tuple[object, ...]:
        """Per tensor, the key ``blocks.group_runs`` compares (None: never grouped)."""
        if not self.kinds:
            return tuple(self.element_size)
        return tuple((k, e) if k else None for k, e in zip(self.kinds, self.element_size))

    def grouped(self, groups: Sequence[int]) -> Profile:
        """The profile of the units ``groups`` forms (``blocks.build_layout``): per unit the
        sums of its members' bytes and times.  A unit is ready when its last member is, which
        for consecutive tensors is ``r`` of its first: ``ready_times`` stay exact."""
        from .blocks import check_groups, unit_name

        groups = tuple(groups)
        check_groups(groups, self.num_tensors)
        if all(g == 1 for g in groups):
            return self
        spans, first = [], 0
        for g in groups:
            spans.append(range(first, first + g))
            first += g
        for span in spans:
            if len({self.element_size[i] for i in span}) != 1:
                raise ValueError("Profile.grouped: a unit mixes element sizes")
        t_u = self.t_u
        return Profile(
            names=tuple(unit_name(self.names[s[0]], len(s)) for s in spans),
            nbytes=tuple(sum(self.nbytes[i] for i in s) for s in spans),
            element_size=tuple(self.element_size[s[0]] for s in spans),
            t_f=tuple(sum(self.t_f[i] for i in s) for s in spans),
            t_b=tuple(sum(self.t_b[i] for i in s) for s in spans),
            t_u=tuple(sum(t_u[i] for i in s) for s in spans) if t_u else (),
            kinds=tuple(self.kinds[s[0]] for s in spans) if self.kinds else ())

    @classmethod
    def from_lists(cls, names: Sequence[str], nbytes: Sequence[int], element_size: Sequence[int],
                   t_f: Sequence[float], t_b: Sequence[float],
                   t_u: Sequence[float] = (), kinds: Sequence[str] = ()) -> Profile:
        return cls(tuple(names), tuple(int(b) for b in nbytes), tuple(int(e) for e in element_size),
                   tuple(float(t) for t in t_f), tuple(float(t) for t in t_b),
                   tuple(float(t) for t in t_u), tuple(str(k) for k in kinds))
