"""The sharded mode (``shard=True``): each rank updates, and keeps optimizer state for, only its
``1/N`` of every gradient block.

Each block (a range of one parameter: sharding forbids grouping, ``config.py``) is
reduce-scattered instead of all-reduced, under the policy's windows like any block; rank ``r``
receives the mean gradient of its slice ``transports.shards.shard_bounds(block numel, N, r)``
of the block.  ``step()`` then runs an optimizer of the user's class, with the user's param
groups' hyper-parameters, over *pieces*: one flat tensor per block slice this rank owns, copied
from the parameter just before the update.  Its state exists for the pieces alone: Adam's
8 bytes per parameter become ``8/N`` per rank.  The updated pieces are all-gathered, block by
block, into the parameters, which end equal on every rank (``gathers.py``: under the policy's
gather rule; in ``step()``, or with ``model=`` overlapping the next forward, each parameter held
by the read guard until its own all-gathers land).  ZeRO stage 2 with both halves under
D-Credit's windows (``docs/algorithm.md`` §9).

The slices are a pure function of the parameter and the partition, which the sharded mode keeps
fixed, so a piece is the same range of the same parameter for the whole run, whatever order the
forward pass reveals.  Only elementwise optimizers are correct on slices (each element's update
reads that element's gradient and state alone): others are refused.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..planning.blocks import Block
from ..transports.shards import shard_bounds
from .gathers import Gather

if TYPE_CHECKING:
    from .state import OptimizerState

#: Optimizers whose update of an element reads only that element's gradient and state.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adagrad", "Adamax", "RMSprop", "NAdam", "RAdam", "ASGD")

NOT_ELEMENTWISE = (
    "shard=True updates each rank's slices of the parameters with the optimizer's own step, "
    "which is only correct for elementwise optimizers (torch.optim {names}); {cls} is not one. "
    "Leave shard unset for {cls}."
)
SHARD_KEY = "dcredit_shard"


@dataclass(eq=False)
class Piece:
    """This rank's slice ``[start, stop)`` of one parameter's flat view, and its update copy."""

    param: torch.Tensor
    index: int                     # the parameter's position in the optimizer's groups
    start: int
    stop: int
    tensor: torch.Tensor           # a view of the slice: updated in place, then all-gathered


def check_optimizer(cls: type) -> None:
    """Refuse an optimizer class the sharded mode would update wrongly."""
    names = {c.__name__ for c in cls.__mro__ if c.__module__.startswith("torch.optim")}
    if not names & set(ELEMENTWISE):
        raise ValueError(NOT_ELEMENTWISE.format(names=", ".join(ELEMENTWISE), cls=cls.__name__))


def state_bytes(state: Mapping[Any, Mapping[str, Any]]) -> int:
    """Bytes of the tensors in an optimizer's ``state`` (per parameter, per key)."""
    return sum(v.numel() * v.element_size() for entry in state.values()
               for v in entry.values() if torch.is_tensor(v))


def of(state: OptimizerState, what: str) -> ShardedUpdate:
    """The sharded mode's machinery, or the error that says ``what`` is for it."""
    if state.sharded is None:
        raise RuntimeError(f"{what}() is for shard=True; without it every rank holds the whole "
                           f"reduced gradient and state: use torch.nn.utils.clip_grad_norm_ "
                           f"and state_dict()")
    return state.sharded


class ShardedUpdate:
    """The pieces, their optimizer, and the all-gathers that put the parameters back together."""

    def __init__(self, opt: torch.optim.Optimizer, base: type, state: OptimizerState) -> None:
        self._opt, self._base, self._state = opt, base, state
        self.pieces: dict[tuple[int, int], Piece] = {}       # (parameter index, block start)
        self.reduced: dict[tuple[int, int], torch.Tensor] = {}
        self.inner: Optional[torch.optim.Optimizer] = None
        self._pending_inner: Optional[dict] = None            # loaded before the first step
        self._pending_full: Optional[dict] = None             # the full form, likewise
        self._position = {p: i for i, p in
                          enumerate(p for g in opt.param_groups for p in g["params"])}
        self._of_param: dict[int, list[Piece]] = {}           # index -> its pieces, in order
        self.view = StateView(self)
        # The user's class may make state at construction (Adagrad's ``sum``, for every
        # parameter); the pieces' optimizer keeps the state here, so that copy would only cost
        # the memory sharding saves.
        opt.__dict__["state"].clear()

    # -- completion thread ----------------------------------------------------------------
    def block_reduced(self, p: torch.Tensor, block_start: int, output: torch.Tensor) -> None:
        """This rank's reduced slice of the block of ``p`` that starts at ``block_start``."""
        self.reduced[(self._position[p], block_start)] = output

    # -- training thread --------------------------------------------------------------------
    def _slices(self) -> Iterator[tuple[torch.Tensor, Block, int, int]]:
        """``(p, block, start, stop)`` for every block of the layouts in force, in their order:
        this rank's slice ``[start, stop)`` of ``p``'s flat view (empty for some blocks)."""
        state = self._state
        size, rank = state.transport.size(), state.transport.rank()
        for layout in state.layouts:
            (p,) = state.members[layout.index]
            for block in layout.blocks:
                a, b = shard_bounds(block.numel, size, rank)
                yield p, block, block.start + a, block.start + b

    def _build(self) -> None:
        """The pieces of the layouts in force, and the inner optimizer over them (first step)."""
        for p, block, start, stop in self._slices():
            key = (self._position[p], block.start)
            if stop > start and key not in self.pieces:
                # A view of the parameter's slice: the update lands in the parameter (and in
                # what the all-gather sends) without a copy, and a loaded parameter is seen.
                self.pieces[key] = Piece(p, key[0], start, stop, _slice(p, start, stop))
        for key, pc in sorted(self.pieces.items()):
            self._of_param.setdefault(key[0], []).append(pc)
        groups = []
        for group in self._opt.param_groups:
            owned = {self._position[p] for p in group["params"]}
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": [pc.tensor for key, pc in sorted(self.pieces.items())
                                      if key[0] in owned]})
        self.inner = self._base(groups)
        if self._pending_inner is not None:
            self.inner.load_state_dict(self._pending_inner)
        elif self._pending_full is not None:
            self._load_full(self._pending_full)
        self._pending_inner = self._pending_full = None

    def attach(self) -> None:
        """After the reduce-scatters (``synchronize()``): ``p.grad`` holds the reduced values
        on this rank's slices and zeros elsewhere, and each piece's gradient is a view of its
        slice, so that ``GradScaler.unscale_`` (in place, on ``p.grad``) unscales the pieces
        too.  If any rank's slices hold an inf or a NaN, every rank's first gradient gets a
        NaN: ``GradScaler`` then skips the step on every rank, as it does after an all-reduce
        (a skip on some ranks only would leave the others waiting in the all-gathers)."""
        if self.inner is None:
            self._build()
        state = self._state
        with torch.no_grad():
            for layout in state.layouts:
                (p,) = state.members[layout.index]
                p.grad.zero_()
            total = torch.zeros((), dtype=torch.float64)
            for key, piece in self.pieces.items():
                output = self.reduced.pop(key, None)
                if output is None:
                    raise AssertionError(f"dcredit_hvd: no reduced gradient for the slice "
                                         f"{piece.start}:{piece.stop} of parameter #{key[0]}")
                mine = piece.param.grad.view(-1)[piece.start:piece.stop]
                mine.copy_(output.view(-1))
                piece.tensor.grad = mine
                total += mine.sum(dtype=torch.float64)   # an inf or a NaN stays one
            # One pass per slice: a float64 sum of float32/16 values cannot overflow.
            bad = (~torch.isfinite(total)).double().reshape(1)
            if float(self._reduce_scalar(bad, "sum", "nonfinite")) and state.layouts:
                (first,) = state.members[state.layouts[0].index]
                first.grad.view(-1)[0] = float("nan")

    def step(self, closure: Any = None, overlap: bool = False) -> Any:
        """Update this rank's pieces with the user's hyper-parameters, then all-gather them
        (``gathers.py``): waited for here, or, with ``overlap`` (``model=``), overlapping the
        next forward, each parameter held by the read guard until its own all-gathers land.
        Returns, with ``overlap``, the parameters the guard cannot hold."""
        if closure is not None:
            raise ValueError("shard=True: step(closure) is not supported; call the closure "
                             "(forward and backward) before step()")
        assert self.inner is not None, "attach() runs in synchronize(), before step()"
        for mine, group in zip(self.inner.param_groups, self._opt.param_groups):
            mine.update({k: v for k, v in group.items() if k != "params"})
        with torch.no_grad():
            for piece in self.pieces.values():      # ``p.data = ...`` since: view the new one
                now = _slice(piece.param, piece.start, piece.stop)
                if piece.tensor.data_ptr() != now.data_ptr():
                    piece.tensor.set_(now)
        self.inner.step()                           # on views of the parameters' slices
        gathers = self._state.gathers
        unguarded = gathers.start(self._gather_units())
        if not overlap:
            gathers.drain()
        return unguarded if overlap else None

    def _gather_units(self) -> list[tuple[int, list[Gather], list[torch.Tensor]]]:
        """Per unit (one parameter), every block's updated slice and where the whole block
        lands: the all-gathers that put the parameters back together."""
        units: dict[int, tuple[int, list[Gather], list[torch.Tensor]]] = {}
        for p, block, start, stop in self._slices():   # a piece is a view of the same slice
            unit = units.setdefault(block.tensor, (block.tensor, [], [p]))
            unit[1].append(Gather(block, _slice(p, start, stop), functools.partial(_land, p, block)))
        return list(units.values())

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over every rank's pieces: the global norm of the
        reduced gradients (one scalar all-reduce), the same on every rank."""
        if self.inner is None:
            raise RuntimeError("shard=True: call optimizer.synchronize() before clip_grad_norm_()")
        grads = [pc.tensor.grad for pc in self.pieces.values() if pc.tensor.grad is not None]
        norm_type = float(norm_type)
        if math.isinf(norm_type):
            local = max((g.abs().max().double() for g in grads), default=torch.zeros((), dtype=torch.float64))
            op = "max"
        else:
            local = sum((g.double().norm(norm_type) ** norm_type for g in grads),
                        torch.zeros((), dtype=torch.float64))
            op = "sum"
        total = self._reduce_scalar(local.reshape(1), op, "clip")
        norm = total if math.isinf(norm_type) else total ** (1.0 / norm_type)
        coef = float(max_norm) / (float(norm) + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return norm.reshape(())

    def _reduce_scalar(self, value: torch.Tensor, op: str, what: str) -> torch.Tensor:
        """One float64 scalar summed (or maxed) over the ranks, under the name ``what``."""
        transport, name = self._state.transport, f"{self._state.prefix}.shards.{what}"
        if op == "max":
            values = transport.allgather_object(float(value), name)
            return torch.tensor(max(values), dtype=torch.float64)
        handle = transport.submit(value.clone(), name, transport.sum)
        return transport.wait(handle).reshape(()).double()

    # -- state ----------------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of tensors held by the optimizer state of this rank (the pieces' state)."""
        return 0 if self.inner is None else state_bytes(self.inner.state)

    def state_dict(self, groups: list) -> dict:
        """This rank's state: loads on the same rank of a job of the same size."""
        transport = self._state.transport
        inner = self.inner.state_dict() if self.inner is not None else self._pending_inner
        return {"state": {}, "param_groups": groups,
                SHARD_KEY: {"rank": transport.rank(), "size": transport.size(),
                            "pieces": sorted((k[0], pc.start, pc.stop)
                                             for k, pc in self.pieces.items()),
                            "inner": inner}}

    def load_state_dict(self, loaded: dict) -> dict:
        """Keep what the pieces need from ``loaded`` (sharded, or the full form); return what
        the user's optimizer loads (its param groups, no state)."""
        transport = self._state.transport
        shard = loaded.get(SHARD_KEY)
        if shard is None:                           # the full form: each rank keeps its slices
            if self.inner is not None:
                self._load_full(loaded)
            else:
                self._pending_full = loaded
            return {"state": {}, "param_groups": loaded["param_groups"]}
        if (shard["rank"], shard["size"]) != (transport.rank(), transport.size()):
            raise ValueError(f"shard=True: this state_dict was written by rank {shard['rank']} "
                             f"of {shard['size']} ranks; load each rank's own file on a job of "
                             f"{shard['size']} ranks (this is rank {transport.rank()} of "
                             f"{transport.size()})")
        if self.inner is not None:
            self.inner.load_state_dict(shard["inner"])
        else:
            self._pending_inner = shard["inner"]
        return {"state": {}, "param_groups": loaded["param_groups"]}

    def parameter_state(self, p: torch.Tensor) -> Optional[SliceState]:
        """``p``'s state on this rank (``StateView``), or None where this rank keeps none."""
        index = self._position.get(p)
        if self.inner is None or index is None:
            return None
        pieces = [pc for pc in self._of_param.get(index, []) if self.inner.state.get(pc.tensor)]
        if not pieces:
            return None
        states = [self.inner.state[pc.tensor] for pc in pieces]
        entry: dict[str, Any] = {}
        for k, first in states[0].items():
            if not all(k in s for s in states):
                continue
            if all(_per_element(s[k], pc.stop - pc.start) for s, pc in zip(states, pieces)):
                entry[k] = self._contiguous(pieces, k)
            else:     # per-parameter (Adam's step): each piece keeps its own, all equal
                entry[k] = first.detach().clone() if torch.is_tensor(first) else first
        return SliceState(entry, [(pc.start, pc.stop) for pc in pieces])

    def _contiguous(self, pieces: list[Piece], key: str) -> torch.Tensor:
        """One tensor whose elements *are* the pieces' ``key`` state, in the pieces' order.

        Where the pieces' tensors are not consecutive in one storage (each piece's state is
        allocated apart by the inner optimizer, or replaced by a load), they are moved into one
        buffer, each piece's state becoming a view of its range of it: the inner optimizer
        updates the views in place, so what the user reads is live, and an in-place change by
        the user is what the next step uses."""
        values = [self.inner.state[pc.tensor][key] for pc in pieces]
        if len(values) == 1:
            return values[0]
        if not _consecutive(values):
            home = torch.cat([v.detach() for v in values])
            offset = 0
            for pc, v in zip(pieces, values):
                self.inner.state[pc.tensor][key] = home[offset:offset + v.numel()]
                offset += v.numel()
            return home
        first = values[0]
        whole = torch.empty(0, dtype=first.dtype, device=first.device)
        return whole.set_(first.untyped_storage(), first.storage_offset(),
                          (sum(v.numel() for v in values),))

    # -- the full form: torch.optim's own state_dict, for any rank count or none ---------------
    def full_state_dict(self, saved: dict) -> dict:
        """Every rank's slices of the state gathered into ``torch.optim``'s form over the whole
        parameters (a collective: call it on every rank).  ``saved``: the user's optimizer's
        own state_dict (its param groups)."""
        mine = []
        for pc in self.pieces.values():
            kept = self.inner.state.get(pc.tensor, {}) if self.inner is not None else {}
            mine.append((pc.index, pc.start, pc.stop,
                         {k: v.detach().clone() if torch.is_tensor(v) else v
                          for k, v in kept.items()}))
        everyone = self._state.transport.allgather_object(mine, f"{self._state.prefix}.full_state")
        params = list(self._position)
        state: dict[int, dict] = {}
        for index, start, stop, kept in (piece for rank in everyone for piece in rank):
            entry, p = state.setdefault(index, {}), params[index]
            for k, v in kept.items():
                if _per_element(v, stop - start):
                    entry.setdefault(k, torch.zeros(p.numel(), dtype=v.dtype))[start:stop] = v
                else:
                    entry.setdefault(k, v)          # per-parameter values (Adam's step)
        for index, entry in state.items():
            for k, v in entry.items():
                if _per_element(v, params[index].numel()):
                    entry[k] = v.view(params[index].shape)
        return {"state": state, "param_groups": saved["param_groups"]}

    def _load_full(self, full: dict) -> None:
        """This rank's slices of a full state (``full_state_dict``, or an unsharded run's)."""
        assert self.inner is not None
        by_tensor = {pc.tensor: pc for pc in self.pieces.values()}
        loaded = self.inner.state_dict()
        state = {}
        tensors = [t for group in self.inner.param_groups for t in group["params"]]
        for i, t in enumerate(tensors):
            pc = by_tensor[t]
            src = full["state"].get(pc.index, full["state"].get(str(pc.index)))
            if src:
                # Each piece its own copy of a per-parameter value too: Adam's ``step`` is a
                # tensor it increments in place, once per piece (shared, it would count k-fold).
                state[i] = {k: v.reshape(-1)[pc.start:pc.stop].clone()
                            if _per_element(v, pc.param.numel(), flat=False)
                            else (v.clone() if torch.is_tensor(v) else v)
                            for k, v in src.items()}
        loaded["state"] = state
        self.inner.load_state_dict(loaded)


def set_parameter_state(sharded: ShardedUpdate, p: torch.Tensor, value: Mapping[str, Any]) -> None:
    """``opt.state[p] = value`` with ``value`` holding ``p``'s keys in the view's shapes
    (what device moves write back, e.g. Lightning's teardown): each value goes into the
    pieces, as an in-place change would."""
    current = sharded.parameter_state(p)
    if current is None or not isinstance(value, Mapping) or set(value) != set(current):
        raise TypeError(READ_ONLY.format(what="an entry can be replaced only by one with "
                                         "the same keys, in the shapes opt.state[p] shows"))
    index = sharded._position[p]
    pieces = [pc for pc in sharded._of_param.get(index, []) if sharded.inner.state.get(pc.tensor)]
    for key, new in value.items():
        old = current[key]
        if torch.is_tensor(old) and torch.is_tensor(new) and old.shape != new.shape:
            raise TypeError(READ_ONLY.format(what=f"{key!r} has shape {tuple(old.shape)} "
                                             f"here, not {tuple(new.shape)}"))
        if torch.is_tensor(old) and old.numel() == sum(pc.stop - pc.start for pc in pieces) \
                and old.dim() == 1 and old.numel() != 1:
            old.copy_(new)                         # live: the pieces' own elements
        else:                                      # per-parameter: each piece's copy
            for pc in pieces:
                state = sharded.inner.state[pc.tensor]
                state[key] = new.detach().clone().to(state[key].device) \
                    if torch.is_tensor(new) and torch.is_tensor(state[key]) else new


READ_ONLY = (
    "shard=True: optimizer.state is a view of this rank's slices of the state ({what}); "
    "change a tensor in place (opt.state[p]['exp_avg'].zero_()), or load a state with "
    "opt.load_state_dict(...) (a full form from full_state_dict() is sliced for each rank)"
)


class SliceState(Mapping):
    """``opt.state[p]`` under ``shard=True``: torch's keys for ``p``, for this rank's elements.

    A tensor with one value per element (``exp_avg``, ``momentum_buffer``) is 1-D, of
    ``sum(stop - start for start, stop in ranges)`` elements: ``p.view(-1)[start:stop]`` for each
    range in order.  Those tensors are live: an in-place change is what the next ``step()``
    uses.  A per-parameter value (Adam's ``step``) is a copy, since each slice keeps its own.
    Keys cannot be set or deleted (each piece's state would have to be cut from the new value)."""

    def __init__(self, entry: Mapping[str, Any], ranges: Optional[list[tuple[int, int]]] = None
                 ) -> None:
        # Built from a plain mapping (``type(v)(mapping)``, as collection utilities rebuild a
        # mapping), it is a detached copy: ``ranges`` None.
        self._entry = dict(entry)
        self.ranges = ranges          # [start, stop) of the parameter's flat view, in order

    def __getitem__(self, key: str) -> Any:
        return self._entry[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entry)

    def __len__(self) -> int:
        return len(self._entry)

    def __setitem__(self, key: str, value: Any) -> None:
        raise TypeError(READ_ONLY.format(what=f"cannot set {key!r}"))

    def __delitem__(self, key: str) -> None:
        raise TypeError(READ_ONLY.format(what=f"cannot delete {key!r}"))

    def __repr__(self) -> str:
        return f"SliceState(ranges={self.ranges}, {self._entry!r})"


class StateView(Mapping):
    """``optimizer.state`` under ``shard=True``: the parameters this rank keeps state for, each
    mapped to its ``SliceState``, so that ``for p in opt.state`` and ``opt.state[p][key]`` work
    as on torch's ``defaultdict`` (a parameter without state here reads as an empty mapping).
    An entry can be replaced only by one with the same keys and shapes (written into the
    pieces: device moves do that), not deleted; empty before the first ``step()``, as torch's
    is (Adagrad's too, whose torch state exists from construction), and without the parameters
    that require no gradient (they are not sharded; torch's Adagrad keeps a never-used state for them)."""

    def __init__(self, sharded: ShardedUpdate) -> None:
        self._sharded = sharded

    def _params(self) -> list[torch.Tensor]:
        sharded = self._sharded
        if sharded.inner is None:
            return []
        owned = {pc.index for pc in sharded.pieces.values() if sharded.inner.state.get(pc.tensor)}
        return [p for p, i in sharded._position.items() if i in owned]

    def __getitem__(self, p: Any) -> Mapping[str, Any]:
        entry = self._sharded.parameter_state(p) if torch.is_tensor(p) else None
        return SliceState({}, []) if entry is None else entry

    def get(self, p: Any, default: Any = None) -> Any:
        entry = self._sharded.parameter_state(p) if torch.is_tensor(p) else None
        return default if entry is None else entry

    def __contains__(self, p: object) -> bool:
        return any(q is p for q in self._params())

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._params())

    def __len__(self) -> int:
        return len(self._params())

    def __setitem__(self, p: Any, value: Any) -> None:
        if not torch.is_tensor(p):
            raise TypeError(READ_ONLY.format(what="cannot set a parameter's entry"))
        set_parameter_state(self._sharded, p, value)

    def __delitem__(self, p: Any) -> None:
        raise TypeError(READ_ONLY.format(what="cannot delete a parameter's entry"))

    def __repr__(self) -> str:
        return f"StateView({len(self)} parameters with state on this rank)"


def _optimizer_state(opt: torch.optim.Optimizer) -> Any:
    state = opt.__dict__.get("_state")
    if state is not None and state.sharded is not None:
        return state.sharded.view
    return opt.__dict__["state"]


def _set_optimizer_state(opt: torch.optim.Optimizer, value: Any) -> None:
    # torch.optim.Optimizer.__init__ sets it (and __setstate__, from load_state_dict, writes
    # the instance's dict): the plain state, empty under shard=True, where the pieces'
    # optimizer keeps the state.
    opt.__dict__["state"] = value


#: ``optimizer.state`` of the generated class (``optimizer.py``).
OPTIMIZER_STATE = property(_optimizer_state, _set_optimizer_state, doc=(
    "torch's per-parameter state; with ``shard=True`` a read-only ``shards.StateView``: "
    "``state[p]`` has torch's keys, but its moments are 1-D and hold only this rank's elements "
    "of ``p`` (``state[p].ranges``; live: an in-place change is what the next step uses); "
    "``full_state_dict()`` gathers the whole parameters' state."))


def _consecutive(values: list[torch.Tensor]) -> bool:
    """Whether ``values`` are contiguous, of one dtype, and follow each other in one storage."""
    first = values[0]
    at = first.storage_offset()
    for v in values:
        if (not v.is_contiguous() or v.dtype != first.dtype or v.device != first.device
                or v.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or v.storage_offset() != at):
            return False
        at += v.numel()
    return True


def _slice(p: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The slice ``[start, stop)`` of ``p``'s flat view (shares ``p``'s storage)."""
    return p.detach().view(-1)[start:stop]


def _land(p: torch.Tensor, block: Block, full: torch.Tensor) -> None:
    """A block's all-gathered values into its range of ``p`` (the gather's completion)."""
    p.view(-1)[block.start:block.stop].copy_(full.view(-1))


def _per_element(value: Any, numel: int, flat: bool = True) -> bool:
    """Whether a state value holds one entry per element (a moment), not per parameter."""
    return (torch.is_tensor(value) and value.dim() > 0 and value.numel() == numel
            and (value.dim() == 1 or not flat))
