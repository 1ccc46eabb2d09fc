"""``optimizer.state`` under ``shard=True`` (``runtime/shards.StateView``) against an unsharded
run's state, on either transport: torch's keys, this rank's elements of each parameter, the
slices of every rank together equal to the whole state, live tensors, a read-only mapping.

Each check returns the problems it found (empty: passed), for the callers' ``assert_all_ranks``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dcredit_hvd.transports.shards import shard_bounds

#: The two optimizers the view is checked with: one with a per-parameter ``step`` beside its
#: moments, one with a single per-element buffer.
OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-4),
}


#: torch's per-parameter (0-d) state keys of the elementwise optimizers.
PER_PARAMETER = ("step", "eta", "mu", "mu_product")


def moment(key: str, value: Any, param: torch.Tensor) -> bool:
    """One value per element of ``param`` in torch's state: of its shape (0-d for a 0-d
    parameter, where the per-parameter values are 0-d too, so the key tells them apart)."""
    return (torch.is_tensor(value) and value.shape == param.shape
            and not (value.dim() == 0 and key in PER_PARAMETER))


def params_of(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def expected_ranges(opt: Any, rank: int, size: int) -> dict[int, list[tuple[int, int]]]:
    """Per parameter position, this rank's ranges of its flat view, from the blocks alone."""
    position = {id(p): i for i, p in enumerate(params_of(opt))}
    out: dict[int, list[tuple[int, int]]] = {}
    for layout in opt.layouts:
        (p,) = opt._state.members[layout.index]
        for block in layout.blocks:
            a, b = shard_bounds(block.numel, size, rank)
            if b > a:
                out.setdefault(position[id(p)], []).append((block.start + a, block.start + b))
    return {i: sorted(r) for i, r in out.items()}


def check_view(opt: Any, plain_state: list[dict], rank: int, size: int,
               gather: Callable[[Any], list]) -> list[str]:
    """``plain_state``: the unsharded run's ``state[p]`` per parameter position (same steps).
    ``gather``: an all-gather of a picklable object over the ranks (a collective)."""
    problems: list[str] = []
    params = params_of(opt)
    if opt.__dict__["state"]:
        problems.append("the user's class keeps a state of its own beside the pieces' state")
    ranges = expected_ranges(opt, rank, size)
    listed = [next(i for i, q in enumerate(params) if q is p) for p in opt.state]
    if listed != sorted(ranges):
        problems.append(f"for p in opt.state lists positions {listed}, not {sorted(ranges)}")
    if len(opt.state) != len(ranges) or not all(params[i] in opt.state for i in ranges):
        problems.append("len(opt.state) or `p in opt.state` disagrees with the listing")
    mine = []
    for i, want in ranges.items():
        entry, full = opt.state[params[i]], plain_state[i]
        if list(entry) != list(full):
            problems.append(f"#{i}: keys {list(entry)}, torch's {list(full)}")
            continue
        if entry.ranges != want:
            problems.append(f"#{i}: ranges {entry.ranges}, expected {want}")
        elements = sum(b - a for a, b in want)
        slices = {}
        for k, v in full.items():
            got = entry[k]
            if moment(k, v, params[i]):
                if tuple(got.shape) != (elements,):
                    problems.append(f"#{i} {k}: shape {tuple(got.shape)}, not ({elements},)")
                    continue
                expected = torch.cat([v.reshape(-1)[a:b] for a, b in want])
                if not torch.allclose(got, expected, rtol=1e-5, atol=1e-7):
                    problems.append(f"#{i} {k}: this rank's slice differs from the unsharded state")
                slices[k] = got.detach().clone()
            elif torch.is_tensor(v):
                if not (torch.is_tensor(got) and torch.equal(got, v)):
                    problems.append(f"#{i} {k}: {got!r}, torch has {v!r}")
            elif got != v:
                problems.append(f"#{i} {k}: {got!r}, torch has {v!r}")
        mine.append((i, want, slices))
    # Every rank's slices, put at their ranges, are the whole unsharded state, element for element.
    rebuilt: dict[tuple[int, str], torch.Tensor] = {}
    covered: dict[tuple[int, str], torch.Tensor] = {}
    for theirs in gather(mine):
        for i, where, slices in theirs:
            for k, got in slices.items():
                numel = params[i].numel()
                whole = rebuilt.setdefault((i, k), torch.zeros(numel, dtype=got.dtype))
                seen = covered.setdefault((i, k), torch.zeros(numel, dtype=torch.int32))
                at = 0
                for a, b in where:
                    whole[a:b] = got[at:at + b - a]
                    seen[a:b] += 1
                    at += b - a
    for i, full in enumerate(plain_state):
        for k, v in full.items():
            if not moment(k, v, params[i]) or not params[i].requires_grad:   # frozen: not sharded
                continue
            if (i, k) not in rebuilt or not bool((covered[(i, k)] == 1).all()):
                problems.append(f"#{i} {k}: the ranks' slices do not cover each element once")
            elif not torch.allclose(rebuilt[(i, k)], v.reshape(-1).float(), rtol=1e-5, atol=1e-7):
                problems.append(f"#{i} {k}: the ranks' slices together differ from the whole")
    return problems


def check_one_block_concatenates(opt: Any, plain_state: list[dict], size: int,
                                 gather: Callable[[Any], list]) -> list[str]:
    """A parameter of one block: its slices, concatenated in rank order, are its whole state."""
    params = params_of(opt)
    single = [i for i, p in enumerate(params) for layout in opt.layouts
              if opt._state.members[layout.index][0] is p and len(layout.blocks) == 1]
    if not single:
        return ["no parameter of a single block to check"]
    problems = []
    for i in single:
        for k, v in plain_state[i].items():
            if not moment(k, v, params[i]):
                continue
            entry = opt.state[params[i]] if params[i] in opt.state else {}
            part = entry[k].detach().clone() if k in entry else torch.zeros(0, dtype=v.dtype)
            whole = torch.cat(gather(part))
            if not torch.allclose(whole, v.reshape(-1), rtol=1e-5, atol=1e-7):
                problems.append(f"#{i} {k}: the concatenation over {size} ranks differs")
    return problems


def check_live_and_read_only(opt: Any) -> list[str]:
    """An in-place change through the view reaches the pieces' state, and so does replacing an
    entry by one with the same keys and shapes (what device moves such as Lightning's teardown
    write back); any other assignment is refused."""
    problems = []
    p = next(iter(opt.state))
    entry = opt.state[p]
    key = next(k for k, v in entry.items() if torch.is_tensor(v) and v.dim() > 0)
    before = entry[key].detach().clone()
    entry[key].add_(1.0)
    if not torch.allclose(opt.state[p][key], before + 1.0):
        problems.append(f"an in-place add_ on state[p][{key!r}] was not kept")
    entry[key].sub_(1.0)
    opt.state[p] = {k: v.detach().clone() + 2.0 if torch.is_tensor(v) and v.dim() > 0 else v
                    for k, v in entry.items()}
    if not torch.allclose(opt.state[p][key], before + 2.0):
        problems.append("replacing state[p] with the same keys and shapes was not kept")
    opt.state[p] = {k: before if k == key else v for k, v in opt.state[p].items()}
    if not torch.equal(opt.state[p][key], before):
        problems.append("replacing state[p] back did not restore it")
    for what, change in (("set a key", lambda: entry.__setitem__(key, before)),
                         ("set an entry", lambda: opt.state.__setitem__(p, {})),
                         ("delete a key", lambda: entry.__delitem__(key))):
        try:
            change()
        except TypeError as e:
            if "load_state_dict" not in str(e):
                problems.append(f"{what}: the error does not say what to do: {e}")
        else:
            problems.append(f"{what} through the read-only view did not raise")
    return problems


def zero_moments(opt: torch.optim.Optimizer) -> None:
    """Every per-element state tensor zeroed in place, through ``opt.state``."""
    for p in opt.state:
        for v in opt.state[p].values():
            if torch.is_tensor(v) and v.dim() > 0:
                v.zero_()
