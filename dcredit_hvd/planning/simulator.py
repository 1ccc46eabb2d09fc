"""Discrete-event simulation of steady-state training iterations under each scheduling policy.

What is simulated, per iteration, on ``n`` identical workers (one timeline stands for all):

* compute: forward of tensors ``0..L-1`` (``t_f``), backward ``L-1..0`` (``t_b``; gradient ``l`` is
  ready at ``r_l`` after backward starts, ``Profile.ready_times``), optimizer updates (``t_u``);
  communication never slows compute (no contention is modelled);
* the runtime gate: a priority queue of ready blocks (lowest ``(tensor, index)`` first) and the
  policy, DRIVEN THROUGH ITS OWN ``Policy`` INTERFACE exactly as ``scheduler.BlockScheduler``
  drives it (``bind``, ``start_iteration``, ``on_ready`` then pump, ``on_backward_end`` then pump,
  ``on_complete`` for each finished block then pump; pump = release the head while ``admit``
  says yes).  There is no second implementation of any window rule here;
* Horovod underneath (0.28 defaults): its background loop starts a cycle every ``cycle_s``
  (``HOROVOD_CYCLE_TIME``, 1 ms) or, when the previous cycle's all-reduces ran longer, as soon as
  they finish; a cycle takes every block submitted before it started, fuses them in submission
  order into buffers of at most ``fusion_bytes`` (``HOROVOD_FUSION_THRESHOLD``, 128 MiB; 0 = one
  all-reduce per block) and runs those all-reduces one after the other, each costing
  ``a + b * bytes`` (``costmodel.CostModel``).  Blocks released while a cycle runs wait for the
  next cycle; completions reach the gate after the next cycle has started (the runtime learns of
  them by polling).  This is the synchronous CPU (MPI/Gloo) execution the project runs on; with
  NCCL, Horovod enqueues all-reduces on a stream and does not wait, which this model ignores.

Two modes.  ``overlap_forward=False``: ``step()`` waits for every all-reduce, updates, then the
next forward starts (what the runtime does today).  ``overlap_forward=True``: the forward of
tensor ``l`` in the next iteration waits only for tensor ``l``'s reduced gradient and its update
(D-Credit's phase 2, Gao et al., IEEE TNSE 12(2), 2025; ByteScheduler's cross-iteration overlap).
The plain ``horovod`` baseline is ``hvd.DistributedOptimizer``, which synchronises in ``step()``,
so it never overlaps the next forward.

Reported per policy: the iteration period in steady state (mean over ``iterations`` after
``warmup``), link busy time, exposed communication (period minus compute), and the lower bound
``max(compute, a + b * total bytes)``: no schedule can beat one fused all-reduce of everything
hidden entirely behind compute (spec §1).  ``no_overlap_bound`` is the tighter limit of any
schedule whose ``step()`` waits for every all-reduce.

The simulator is the honest ``predict`` for ``planner.choose_partition`` (``best_dcredit``):
unlike the planner's own timeline it sees Horovod's cycle, fusion and per-window startups.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..policies.base import Immediate, Policy
from ..policies.bytescheduler import ByteScheduler
from ..policies.dear import DeAR
from ..policies.wfbp import WFBP
from . import halves as two_halves
from .blocks import TensorLayout, build_layout, group_runs, partition
from .costmodel import CostModel
from .engine import Engine, Execution, Iteration, Op, SimulationStalled  # noqa: F401  (re-exported)
from .plan import GATHER_ORDERS
from .profile import Profile

#: ByteScheduler's defaults, 1M and 4M float32 elements (spec §7), as in ``config.py``.
DEFAULT_PARTITION_BYTES = 4_000_000
DEFAULT_CREDIT_BYTES = 16_000_000
#: Horovod 0.28 defaults: ``HOROVOD_CYCLE_TIME`` 1 ms, ``HOROVOD_FUSION_THRESHOLD`` 128 MiB.
DEFAULT_CYCLE_S = 0.001
DEFAULT_FUSION_BYTES = 128 << 20


def horovod_execution(environ: Mapping[str, str]) -> Execution:
    """Horovod's cycle and fusion threshold as Horovod reads them from ``environ`` at ``init``:
    ``HOROVOD_CYCLE_TIME`` (ms) and ``HOROVOD_FUSION_THRESHOLD`` (bytes), else its defaults
    above; a value that is not a number >= 0 counts as unset.  (Under ``HOROVOD_AUTOTUNE``
    Horovod changes both while it runs; schedules are then priced at the starting values.)"""
    def number(name: str, default: float) -> float:
        text = environ.get(name, "").strip()
        try:
            value = float(text) if text else default
        except ValueError:
            return default
        return value if value >= 0 else default

    return Execution(cycle_s=number("HOROVOD_CYCLE_TIME", DEFAULT_CYCLE_S * 1e3) / 1e3,
                     fusion_bytes=int(number("HOROVOD_FUSION_THRESHOLD", DEFAULT_FUSION_BYTES)))

#: Fixed cost of one all-reduce besides the network (kernel launch, fusion-buffer set-up,
#: Horovod's per-response bookkeeping).  The per-cycle negotiation is the cycle itself.
DEFAULT_OP_OVERHEAD_S = 50e-6
#: Partition sizes the D-Credit search tries: 256 KiB .. 64 MiB, powers of two.
DEFAULT_CANDIDATES: tuple[int, ...] = tuple(1 << k for k in range(18, 27))
#: Planner rules the D-Credit search tries at every candidate partition (``planner.plan``
#: keywords; ``cycle_s`` and ``overlap_forward`` are added from the simulation).  The first is
#: spec §3 literally; ``docs/algorithm.md`` argues the other two.
DEFAULT_PLAN_RULES: tuple[dict[str, str], ...] = (
    {"phase1": "greedy", "short_gap": "one_block"},
    {"phase1": "greedy", "short_gap": "defer"},
    {"phase1": "batched"},
)

#: Phase-2 rules (``planner.plan(phase2=...)``) the search crosses with every rule above when
#: the next forward overlaps (without overlap phase 2 drains at once and they are all the same
#: plan).  The first is spec §4 literally; ``docs/algorithm.md`` §4b argues the others.
DEFAULT_PHASE2_RULES: tuple[str, ...] = ("per_tensor", "pipelined", "grouped", "grouped_pipelined")

#: Names ``simulate`` accepts besides Policy objects.
POLICY_NAMES = ("horovod", "wfbp", "bytescheduler", "dcredit", "dear", "immediate")
#: Row names of the bounds in ``compare``.
LOWER_BOUND = "lower_bound"
NO_OVERLAP_BOUND = "no_overlap_bound"

def link_cost(bandwidth_bits_per_s: float, latency_s: float, workers: int,
              op_overhead_s: float = DEFAULT_OP_OVERHEAD_S) -> CostModel:
    """The alpha-beta cost of a ring all-reduce among ``workers`` over links of the given speed.

    A ring all-reduce sends ``2(n-1)/n`` of the buffer over each link in ``2(n-1)`` steps, so
    ``b = 2(n-1)/n * 8 / bandwidth`` seconds per byte and ``a = 2(n-1) * latency + op_overhead_s``.
    One worker communicates nothing: ``b = 0``, ``a = op_overhead_s``.
    """
    if bandwidth_bits_per_s <= 0:
        raise ValueError(f"bandwidth must be > 0 bit/s, got {bandwidth_bits_per_s}")
    if latency_s < 0 or op_overhead_s < 0:
        raise ValueError("latency and per-op overhead must be >= 0 seconds")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    n = workers
    return CostModel(a=2 * (n - 1) * latency_s + op_overhead_s,
                     b=2 * (n - 1) / n * 8.0 / bandwidth_bits_per_s)


@dataclass(frozen=True)
class SimResult:
    """Steady-state figures of one policy; times in seconds, per iteration."""

    policy: str
    description: str
    iteration_s: float
    compute_s: float
    link_busy_s: float
    lower_bound_s: float
    ops_per_iteration: float
    blocks_per_iteration: int
    partition_bytes: int | None
    overlap_forward: bool
    fusion_bytes: int
    cycle_s: float
    #: The last measured iteration's all-reduces, times from the start of its backward.
    trace: tuple[Op, ...] = ()
    #: The D-Credit plan simulated, when the policy is ``dcredit``.
    plan: Any = None
    #: ``(partition_bytes, simulated seconds)`` tried by the partition search, if one ran, for
    #: the planner rule that won (``plan.rule``).
    search: tuple[tuple[int, float], ...] = ()
    #: ``(rule, partition_bytes, simulated seconds)`` for every rule and partition tried.
    search_all: tuple[tuple[str, int, float], ...] = ()
    #: Each all-reduce ran as a reduce-scatter and an all-gather (``dear``, or ``shard``).
    halves: bool = False
    #: The update ran on a ``1/workers`` shard (optimizer state ``1/workers`` per rank).
    shard: bool = False
    #: ``best_dcredit``: the best result of each planner rule, grouping and gather order
    #: tried, fastest first, distinct plans only (the race's challengers, ``planning/race.py``).
    ranked: tuple[SimResult, ...] = ()

    @property
    def exposed_comm_s(self) -> float:
        """Time the iteration is longer than its compute: communication not hidden."""
        return self.iteration_s - self.compute_s

    @property
    def gap(self) -> float:
        """Iteration time over the lower bound (1.0 = the physical limit)."""
        return self.iteration_s / self.lower_bound_s if self.lower_bound_s > 0 else math.inf


def _layouts(profile: Profile, partition_bytes: int | None) -> list[TensorLayout]:
    numels = []
    for name, nbytes, esize in zip(profile.names, profile.nbytes, profile.element_size):
        if nbytes % esize:
            raise ValueError(f"tensor {name}: {nbytes} bytes is not a whole number of "
                             f"{esize}-byte elements")
        numels.append(nbytes // esize)
    return build_layout(profile.names, numels, profile.element_size, partition_bytes, prefix="sim")


def with_block_overhead(profile: Profile, layouts: Sequence[TensorLayout],
                        block_overhead_s: float) -> Profile:
    """``profile`` with ``block_overhead_s`` of CPU per block added to its unit's backward time.

    The gate's work per block (hook, submission, completion, the update call) runs on the cores
    that compute; charging it to backward makes every extra block cost what it costs the
    runtime, which is what makes grouping small tensors pay (``docs/algorithm.md`` §1b).
    """
    if block_overhead_s < 0:
        raise ValueError(f"block_overhead_s must be >= 0, got {block_overhead_s}")
    if not block_overhead_s:
        return profile
    t_b = tuple(t + block_overhead_s * len(layout.blocks)
                for t, layout in zip(profile.t_b, layouts))
    return replace(profile, t_b=t_b)


def dependencies(profile: Profile, cost: CostModel) -> list[float]:
    """Per tensor ``l``: ``r_l + T(M_l) + t_u(l) + forward of layers l..L-1``, the earliest the
    next iteration's backward can start as far as tensor ``l`` alone decides
    (:func:`dependency_bound` is their maximum)."""
    ready = profile.ready_times()
    t_u = profile.t_u or (0.0,) * profile.num_tensors
    ends = [0.0] * profile.num_tensors
    tail = 0.0
    for l in range(profile.num_tensors - 1, -1, -1):
        tail += profile.t_f[l]
        ends[l] = ready[l] + cost.time(profile.nbytes[l]) + t_u[l] + tail
    return ends


def dependency_bound(profile: Profile, cost: CostModel) -> float:
    """``max_l (r_l + T(M_l) + t_u(l) + forward of layers l..L-1)``.

    Tensor ``l``'s gradient is ready at ``r_l`` after backward starts; its bytes cannot all be
    reduced before ``r_l + a + b M_l``, and the next forward cannot pass layer ``l`` before that
    plus its update.  A tied embedding (read first by forward, produced last by backward) makes
    this exceed ``compute`` by about one all-reduce of the embedding, whatever the schedule.
    """
    return max(dependencies(profile, cost), default=0.0)


def lower_bound(profile: Profile, cost: CostModel) -> float:
    """``max(compute, a + b * total bytes, dependency_bound)``: the limit of one iteration.

    Spec §1's ``max(compute, communication)``, raised where one tensor's own dependency is
    longer (:func:`dependency_bound`: a tied embedding), so ratios to it stay honest.
    """
    compute = profile.forward_time + profile.backward_time + sum(profile.t_u)
    return max(compute, cost.time(profile.total_bytes), dependency_bound(profile, cost))


def no_overlap_bound(profile: Profile, cost: CostModel) -> float:
    """The best any schedule can do when ``step()`` waits for every all-reduce.

    All communication happens between the first gradient (``r_{L-1}``) and the step, costs at
    least one startup plus every byte, and tensor 0's bytes cannot leave before backward ends::

        forward + updates + max(r_{L-1} + T(total bytes), r_0 + T(M_0))

    Only overlapping the next forward (``overlap_forward=True``) can go below it, down to
    :func:`lower_bound`.
    """
    ready = profile.ready_times()
    span = max(ready[-1] + cost.time(profile.total_bytes), ready[0] + cost.time(profile.nbytes[0]))
    return profile.forward_time + sum(profile.t_u) + span


def make_policy(name: str, profile: Profile, cost: CostModel, *,
                partition_bytes: int = DEFAULT_PARTITION_BYTES,
                credit_bytes: int = DEFAULT_CREDIT_BYTES, overlap_forward: bool = False,
                cycle_s: float = 0.0) -> Policy:
    """The policy object a simulator name stands for (``horovod`` is ``Immediate`` on whole tensors).

    ``dcredit`` is spec §3's plan at ``partition_bytes`` (``cycle_s`` enters its model timeline),
    spent by ``DCredit(plan, overlap_forward=overlap_forward)``, as the runtime would spend it.
    """
    if name in ("horovod", "immediate"):
        return Immediate()
    if name == "wfbp":
        return WFBP()
    if name == "bytescheduler":
        return ByteScheduler(credit_bytes)
    if name == "dear":
        return DeAR()
    if name == "dcredit":
        from ..policies.dcredit import DCredit
        from .planner import plan
        return DCredit(plan(profile, cost, partition_bytes, cycle_s=cycle_s,
                            overlap_forward=overlap_forward), overlap_forward=overlap_forward)
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")


def simulate(profile: Profile, cost: CostModel, policy: str | Policy, *,
             partition_bytes: int | None = DEFAULT_PARTITION_BYTES,
             credit_bytes: int = DEFAULT_CREDIT_BYTES, overlap_forward: bool = False,
             cycle_s: float = DEFAULT_CYCLE_S, fusion_bytes: int | None = None,
             warmup: int = 1, iterations: int = 2, block_overhead_s: float = 0.0,
             shard: bool = False, workers: int | None = None,
             scatter_cost: CostModel | None = None,
             gather_cost: CostModel | None = None) -> SimResult:
    """Simulate ``policy`` (a name in ``POLICY_NAMES`` or a ``Policy`` object) on ``profile``.

    A ``DCredit`` whose plan groups tensors (``Plan.groups``) runs on the units it forms
    (``Profile.grouped``), as the runtime does.  ``block_overhead_s``: CPU seconds the runtime
    spends per block (:func:`with_block_overhead`; 0: free).

    ``partition_bytes`` is offered to the policy (``Policy.partition_bytes``: ``wfbp`` keeps
    tensors whole, ``dcredit`` uses its plan's).  ``horovod`` sends whole tensors at their ready
    time with fusion and never overlaps the next forward.  ``fusion_bytes=None`` means Horovod's
    128 MiB, except for ``wfbp``, which by definition sends one all-reduce per tensor with no
    fusion (spec §7).  A Policy object passed in is bound to this profile's layout.

    The two halves (``halves``): ``dear`` always splits each all-reduce into a reduce-scatter
    in backward and an all-gather in the next forward (no Horovod fusion, like ``wfbp``: its
    buffers are its fusion); ``shard=True`` does the same for any other policy, the all-gathers
    under ``Policy.gather_rule``, the update on a ``1/workers`` shard between the halves.  Their
    costs default to ``halves.split_cost(cost)``; the bound is ``halves.lower_bound``.
    """
    if cycle_s < 0:
        raise ValueError(f"cycle_s must be >= 0, got {cycle_s}")
    if warmup < 0 or iterations < 1:
        raise ValueError("need warmup >= 0 and iterations >= 1")
    if isinstance(policy, str):
        label = policy.lower()
        obj = make_policy(label, profile, cost, partition_bytes=partition_bytes or DEFAULT_PARTITION_BYTES,
                          credit_bytes=credit_bytes, overlap_forward=overlap_forward,
                          cycle_s=cycle_s)
    else:
        label, obj = policy.name, policy
    _check_shard(label, shard, workers)
    split = shard or label == "dear"
    part = None if label == "horovod" else obj.partition_bytes(partition_bytes)
    # horovod's step() waits for every all-reduce; dear's all-gathers run in the next forward.
    overlap_forward = label == "dear" or (overlap_forward and label != "horovod")
    if fusion_bytes is None:
        fusion_bytes = 0 if label in ("wfbp", "dear") else DEFAULT_FUSION_BYTES
    rs, ag = two_halves.split_cost(cost)
    rs, ag = scatter_cost or rs, gather_cost or ag
    bound, compute = _limits(profile, cost, (rs, ag) if split else None, shard, workers or 1)
    groups = obj.groups(profile.nbytes, profile.group_kinds())
    if groups:
        profile = profile.grouped(groups)
    layouts = _layouts(profile, part)
    obj.bind(layouts)
    profile = with_block_overhead(profile, layouts, block_overhead_s)
    halves = (two_halves.make_halves(label, obj, rs, ag, profile, workers or 1)
              if split else None)
    gate = obj.scatter_rule() if split else obj      # the runtime's gate on the halves
    if gate is not obj:
        gate.bind(layouts)
    engine = Engine(profile, cost, gate, layouts, cycle_s, fusion_bytes, halves)
    starts, busy, ops, last = _iterate(engine, profile, overlap_forward, warmup, iterations)
    t0 = starts[-2]
    trace = tuple(replace(o, start=o.start - t0, end=o.end - t0) for o in last.ops)
    return SimResult(
        policy=label,
        description="horovod(DistributedOptimizer)" if label == "horovod" else obj.describe(),
        iteration_s=(starts[-1] - starts[warmup]) / iterations,
        compute_s=compute,
        link_busy_s=busy / iterations,
        lower_bound_s=bound,
        ops_per_iteration=ops / iterations,
        blocks_per_iteration=sum(len(layout.blocks) for layout in layouts),
        partition_bytes=part,
        overlap_forward=overlap_forward,
        fusion_bytes=fusion_bytes,
        cycle_s=cycle_s,
        trace=trace,
        plan=getattr(obj, "plan", None),
        halves=split,
        shard=shard,
    )


def _check_shard(label: str, shard: bool, workers: int | None) -> None:
    if shard and label == "horovod":
        raise ValueError("simulate: horovod's DistributedOptimizer all-reduces in step(); "
                         "shard=True needs a policy that overlaps the next forward")
    if shard and (workers is None or workers < 1):
        raise ValueError("simulate: shard=True needs workers (the ranks the state is split over)")


def _limits(profile: Profile, cost: CostModel, split: tuple[CostModel, CostModel] | None,
            shard: bool, workers: int) -> tuple[float, float]:
    """The lower bound and the compute of one iteration: all-reduces, or their two halves
    (``split``: their costs), with the update on a ``1/workers`` shard when ``shard``."""
    if split is None:
        return lower_bound(profile, cost), profile.forward_time + profile.backward_time + sum(profile.t_u)
    update = two_halves.shard_update_times(profile, workers) if shard else profile.t_u
    return (two_halves.lower_bound(profile, *split, workers, sharded=shard),
            profile.forward_time + profile.backward_time + sum(update))


def _iterate(engine: Engine, profile: Profile, overlap_forward: bool, warmup: int,
             iterations: int) -> tuple[list[float], float, float, Iteration]:
    """Run ``warmup + iterations`` iterations back to back: each backward starts when the
    previous iteration's forward ends, which waits for every all-reduce and update
    (``overlap_forward=False``) or, layer by layer, for its own tensor's (True).  Returns every
    iteration's start, then the link busy seconds and all-reduces summed over the measured
    iterations, and the last iteration.  Sharded (``Halves.update_in_forward`` False), the
    update already ran between a tensor's halves: the forward waits only for its all-gather."""
    t_f = profile.t_f
    t_u = profile.t_u or (0.0,) * profile.num_tensors
    shard_updates = 0.0           # run after backward, before the forward (Halves' docstring)
    if engine.halves is not None and not engine.halves.update_in_forward:
        t_u = (0.0,) * profile.num_tensors
        shard_updates = sum(engine.halves.shard_update_s)
    fwd, bwd, upd = profile.forward_time, profile.backward_time, sum(t_u)
    start = fwd                     # iteration 0's forward waits for nothing
    starts = [start]
    busy = ops = 0.0
    last: Iteration | None = None
    for k in range(warmup + iterations):
        it = engine.iteration(start)
        if overlap_forward:
            f = start + bwd + shard_updates
            for l in range(profile.num_tensors):
                f = max(f, it.done[l]) + t_u[l] + t_f[l]
            start = f
        else:
            start = max(start + bwd + shard_updates, it.last_end) + upd + fwd
        starts.append(start)
        if k >= warmup:
            busy += it.busy
            ops += len(it.ops)
            last = it
    assert last is not None
    return starts, busy, ops, last


def best_dcredit(profile: Profile, cost: CostModel, *,
                 candidates: Sequence[int] = DEFAULT_CANDIDATES, overlap_forward: bool = False,
                 cycle_s: float = DEFAULT_CYCLE_S, fusion_bytes: int | None = None,
                 warmup: int = 1, iterations: int = 2,
                 rules: Sequence[Mapping[str, Any]] = DEFAULT_PLAN_RULES,
                 phase2_rules: Sequence[str] = DEFAULT_PHASE2_RULES,
                 group_limits: Sequence[int] = (0,),
                 block_overhead_s: float = 0.0, shard: bool = False,
                 workers: int | None = None, scatter_cost: CostModel | None = None,
                 gather_cost: CostModel | None = None) -> SimResult:
    """D-Credit with the grouping, partition size and planner rule chosen by simulation.

    Every ``group_limits`` entry forms units (``blocks.group_runs``: runs of consecutive small
    tensors up to that many bytes share a buffer; 0: none) and the search below runs on them;
    the plan that wins carries its grouping (``Plan.groups``).  ``block_overhead_s`` is charged
    per block (:func:`with_block_overhead`): without it fewer blocks would never pay.

    For every planner rule in ``rules`` (``planner.plan`` keywords), ``planner.choose_partition``
    picks the partition among ``candidates`` with this simulator as the predictor (the paper
    tunes ``S_p`` by Bayesian optimisation on the live job; a simulator makes trying every
    candidate cheap); the fastest rule wins, ties going to the earlier rule in ``rules``.  Each
    plan is made with this simulation's ``cycle_s`` and ``overlap_forward`` and spent by
    ``DCredit(plan, overlap_forward=overlap_forward)``, exactly as the runtime will spend the
    returned ``.plan``.  ``search`` is the winning rule's table, ``search_all`` every row
    (labelled ``Plan.label``).

    With ``overlap_forward`` every rule is crossed with every ``phase2_rules`` entry (rule
    order first, so the spec's ``per_tensor`` wins ties); the winner's phase-2 layout travels in
    the plan (``Plan.phase2_group``, ``Plan.phase2_depth``), which is all ``DCredit`` reads.
    Without overlap ``phase2_rules`` is ignored (phase 2 drains at once).

    ``shard=True`` searches the sharded mode (``simulate(shard=True)``): plans are made on the
    reduce-scatter's cost (``scatter_cost``, fitted live by the runtime; else
    ``halves.split_cost``), the half that phase 1 sends, and every rule is tried with each order
    of the all-gathers (``Plan.gather_order``).
    """
    if not rules:
        raise ValueError("best_dcredit: no planner rules given")
    phase2s: Sequence[str | None] = (None,)
    if overlap_forward:
        if not phase2_rules:
            raise ValueError("best_dcredit: no phase-2 rules given")
        phase2s = phase2_rules
    if not group_limits:
        raise ValueError("best_dcredit: no group limits given (0 means no grouping)")
    sim = {"overlap_forward": overlap_forward, "cycle_s": cycle_s, "fusion_bytes": fusion_bytes,
           "warmup": warmup, "iterations": iterations, "block_overhead_s": block_overhead_s,
           "shard": shard, "workers": workers, "scatter_cost": scatter_cost,
           "gather_cost": gather_cost}
    best: SimResult | None = None
    every: list[tuple[str, int, float]] = []
    ranked: list[SimResult] = []
    crossed = [{**options, **({} if p2 is None else {"phase2": p2})}
               for options in rules for p2 in phase2s]
    tried: set[tuple[int, ...]] = set()
    for limit in sorted({int(x) for x in group_limits}):
        groups = group_runs(profile.nbytes, profile.group_kinds(), limit)
        if groups in tried:            # a larger limit that forms the same units
            continue
        tried.add(groups)
        units = profile.grouped(groups)
        grouping = {} if len(groups) == profile.num_tensors else {"groups": groups,
                                                                  "group_bytes": limit}
        for options, order in itertools.product(crossed, GATHER_ORDERS if shard else (None,)):
            options = {**options, "cycle_s": cycle_s, "overlap_forward": overlap_forward}
            chosen = {**grouping, **({"gather_order": order} if order else {})}
            result, table = _best_partition(profile, units, chosen, cost, candidates, options, sim)
            label = (result.plan.label + (f", groups <= {limit} B" if grouping else "")
                     + (f", gathers in {order} order" if order else ""))
            every.extend((label, s, t) for s, t in table)
            ranked.append(result)
            if best is None or result.iteration_s < best.iteration_s:
                best = result
    assert best is not None
    return replace(best, search_all=tuple(every), ranked=_distinct(ranked))


def _distinct(results: Sequence[SimResult]) -> tuple[SimResult, ...]:
    """``results`` fastest first (ties: the earlier), one per distinct plan."""
    seen: set = set()
    out = []
    for r in sorted(results, key=lambda r: r.iteration_s):
        p = r.plan
        key = (p.partition_bytes, p.windows, p.groups, p.phase2_group, p.phase2_depth,
               p.gather_order)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return tuple(out)


def _best_partition(profile: Profile, units: Profile, grouping: Mapping[str, Any], cost: CostModel,
                    candidates: Sequence[int], options: Mapping[str, Any], sim: Mapping[str, Any]
                    ) -> tuple[SimResult, tuple[tuple[int, float], ...]]:
    """One planner rule (``options``) on one grouping: ``planner.choose_partition`` with this
    simulator as the predictor (plans made on ``units``, run by ``simulate(profile, **sim)``).
    Returns the winner's result, its ``search`` set, and the table."""
    from ..policies.dcredit import DCredit
    from .planner import choose_partition, plan

    cache: dict[int, SimResult] = {}
    same: dict[tuple[tuple[int, int], ...], SimResult] = {}

    plan_cost = (sim.get("scatter_cost") or two_halves.split_cost(cost)[0]) if sim.get("shard") \
        else cost

    def run(size: int) -> SimResult:
        made = replace(plan(units, plan_cost, size, **options), **grouping)
        return simulate(profile, cost, DCredit(made, overlap_forward=sim["overlap_forward"]), **sim)

    def predict(_profile: Profile, _cost: CostModel, size: int) -> float:
        # Partitions that cut every unit into the same blocks make the same plan and
        # the same simulation (a unit of one block is charged its own bytes): run once.
        cut = tuple((len(r), r[0][1] - r[0][0]) if len(r) > 1 else (1, 0)
                    for r in (partition(n // e, e, size)
                              for n, e in zip(units.nbytes, units.element_size)))
        if cut not in same:
            same[cut] = run(size)
        cache[size] = same[cut]
        return cache[size].iteration_s

    size, table = choose_partition(units, cost, candidates, predict)
    result = cache.get(size) or run(size)
    if result.plan.partition_bytes != size:     # shared with an equivalent partition
        result = replace(result, plan=replace(result.plan, partition_bytes=size),
                         partition_bytes=size)
    return replace(result, search=tuple(table)), table


def compare(profile: Profile, cost: CostModel, *,
            policies: Sequence[str] = ("horovod", "wfbp", "bytescheduler", "dcredit"),
            partition_bytes: int = DEFAULT_PARTITION_BYTES,
            credit_bytes: int = DEFAULT_CREDIT_BYTES, overlap_forward: bool = False,
            cycle_s: float = DEFAULT_CYCLE_S, fusion_bytes: int | None = None,
            candidates: Sequence[int] = DEFAULT_CANDIDATES,
            warmup: int = 1, iterations: int = 2, shard: bool = False,
            workers: int | None = None) -> list[SimResult]:
    """Every policy side by side on one profile and link, then the bounds as last rows:
    ``no_overlap_bound`` (only when ``overlap_forward`` is False) and ``lower_bound``.

    ``shard=True`` runs every policy but ``horovod`` (which cannot) in the sharded mode over
    ``workers`` ranks; the last row is then ``halves.lower_bound``.

    ``dcredit`` gets its partition from :func:`best_dcredit` (``candidates``); the baselines run
    at ``partition_bytes``/``credit_bytes`` (ByteScheduler's defaults unless told otherwise).
    """
    rows = []
    for name in policies:
        sharded = {"shard": shard and name != "horovod", "workers": workers}
        if name == "dcredit":
            rows.append(best_dcredit(profile, cost, candidates=candidates,
                                     overlap_forward=overlap_forward, cycle_s=cycle_s,
                                     fusion_bytes=fusion_bytes, warmup=warmup,
                                     iterations=iterations, **sharded))
        else:
            rows.append(simulate(profile, cost, name, partition_bytes=partition_bytes,
                                 credit_bytes=credit_bytes, overlap_forward=overlap_forward,
                                 cycle_s=cycle_s, fusion_bytes=fusion_bytes, warmup=warmup,
                                 iterations=iterations, **sharded))
    bound = lower_bound(profile, cost)
    if shard:
        rs, ag = two_halves.split_cost(cost)
        bound = two_halves.lower_bound(profile, rs, ag, workers or 1, sharded=True)
    compute = profile.forward_time + profile.backward_time + sum(profile.t_u)
    if not overlap_forward:
        rows.append(SimResult(
            policy=NO_OVERLAP_BOUND,
            description="forward + updates + max(r_{L-1} + T(total), r_0 + T(M_0))",
            iteration_s=no_overlap_bound(profile, cost), compute_s=compute,
            link_busy_s=cost.time(profile.total_bytes), lower_bound_s=bound, ops_per_iteration=1,
            blocks_per_iteration=profile.num_tensors, partition_bytes=None,
            overlap_forward=False, fusion_bytes=0, cycle_s=0.0))
    rows.append(SimResult(
        policy=LOWER_BOUND, description=("max(compute, T_rs(total) + T_ag(total))" if shard else
                                         "max(compute, a + b * total bytes)"), iteration_s=bound,
        compute_s=compute, link_busy_s=cost.time(profile.total_bytes), lower_bound_s=bound,
        ops_per_iteration=1, blocks_per_iteration=profile.num_tensors, partition_bytes=None,
        overlap_forward=overlap_forward, fusion_bytes=0, cycle_s=0.0))
    return rows
