"""The plan's life cycle: the schedule an optimizer starts from, rank 0's forward order,
profiling, the plan installed at one step on every rank, drift and re-plans, and the fresh
start after an elastic membership change.

Everything here runs in the training thread between iterations, at the same iteration end on
every rank (its collectives must meet), never in the completion thread.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from ..planning import decision as planning
from ..planning.candidates import Schedule, corrected
from ..planning.profiler import StepProfiler, measure_cost_model
from ..policies import Immediate, Policy, make_policy
from . import agreement, checks
from .instrument import Instrumentation
from .race import LiveRace
from .state import OptimizerState
from .units import build_layouts, element_size, kind


def gate_rule(state: OptimizerState) -> Policy:
    """The rule this rank's gate runs: the policy on rank 0 (for the reduce-scatters when each
    all-reduce is split: ``Policy.scatter_rule``, as the simulator drives it; the all-gathers
    run the policy's gather rule, ``gathers.py``); every block at once elsewhere."""
    if not state.is_gate:
        return Immediate()
    return state.policy.scatter_rule() if state.config.split else state.policy


class PlanLifecycle:
    """Acts on ``state``: which layout and policy are in force, and when they change."""

    def __init__(self, state: OptimizerState, instrument: Instrumentation) -> None:
        self.state = state
        self.instrument = instrument

    # -- the start -------------------------------------------------------------------------
    def start_schedule(self) -> Policy:
        """The schedule every optimizer starts from (at construction, and again after an
        elastic reset): the gate on rank 0, the configured policy and layout, no plan.  Returns
        the policy this rank's gate runs (non-gate ranks release every block at once)."""
        state, config = self.state, self.state.config
        state.is_gate = state.transport.rank() == 0
        state.policy = make_policy(config.policy, config.credit_bytes,
                                   overlap_forward=state.overlap,
                                   buffer_bytes=(config.group_bytes if config.explicit("group_bytes")
                                                 else None))
        state.plan = state.measured = state.race = state.schedule_partition = None
        # dcredit profiles the live job first (under bytescheduler rules), then plans.
        state.profiler = (StepProfiler(config.profile_warmup, config.profile_steps)
                          if config.policy == "dcredit" else None)
        state.layouts = build_layouts(state, state.policy.partition_bytes(config.partition_bytes),
                                      self._groups())
        gate_policy = gate_rule(state)
        gate_policy.bind(state.layouts)
        return gate_policy

    def end_iteration(self) -> None:
        """Between iterations, nothing in flight: adopt the forward order, watch for drift,
        advance profiling."""
        state = self.state
        self.apply_forward_order()
        state.iteration += 1
        self._watch_drift()
        if state.profiler is not None:
            state.profiler.end_iteration()
            if state.profiler.done:
                self.install_plan()
        elif state.race is not None:
            self._follow_race()

    # -- rank 0's forward order --------------------------------------------------------------
    def apply_forward_order(self) -> None:
        """Re-index tensors in the order rank 0's first forward read them (spec §2), once,
        between iterations, on every rank at the same step; parameters that forward never read
        keep their relative order, after the others.  The order is rank 0's, broadcast: each
        rank's own forward may read other parameters (LayerDrop, MoE routing, a branch taken by
        one rank), and units cut from different orders would not match on the wire
        (``agreement.py``).  Tensors are compared by identity, never by value."""
        state = self.state
        if state.forward_order_applied or state.guard is None:
            return
        state.forward_order_applied = True
        position = {id(p): i for i, p in enumerate(state.initial)}
        first_reads = [position[id(p)] for p in state.guard.stop_observing() if id(p) in position]
        chosen = agreement.agree_order(first_reads, len(state.initial), state.is_gate,
                                       state.transport.broadcast_object, f"{state.prefix}.order")
        order = [state.initial[i] for i in chosen]
        if [id(p) for p in order] != [id(p) for p in state.order]:
            state.order = order
            state.layouts = build_layouts(state, self._partition(), self._groups())
            state.scheduler.policy.bind(state.layouts)
        checks.check_layouts(state, "after the forward order was agreed")

    def _groups(self) -> tuple[int, ...]:
        """The runs of ``state.order`` that share a buffer: the plan's, or the policy's own
        (DeAR's fused buffers), in the order in force."""
        state = self.state
        if state.plan is not None:
            return tuple(state.plan.groups)
        order = state.order
        return tuple(state.policy.groups(
            [p.numel() * element_size(state, p) for p in order],
            [(kind(p), element_size(state, p)) if kind(p) else None for p in order]))

    def _partition(self) -> Optional[int]:
        state = self.state
        if state.plan is not None:
            return state.plan.partition_bytes
        configured = state.schedule_partition or state.config.partition_bytes
        return state.policy.partition_bytes(configured)

    # -- the plan ----------------------------------------------------------------------------
    def install_plan(self) -> None:
        """Measure the link, plan on rank 0, broadcast, and switch every rank to the plan.

        Called at the same step on every rank (the end of ``synchronize`` once the profiler has
        seen ``profile_warmup + profile_steps`` iterations): it runs collectives.
        """
        state = self.state
        profiler, state.profiler = state.profiler, None
        started = time.perf_counter()
        # Time the path the blocks take: CUDA tensors when the transport reduces them itself.
        device = (state.order[0].device if state.cuda is not None and state.cuda.direct
                  else torch.device("cpu"))
        total = sum(t.nbytes for t in state.layouts)
        cost, samples = measure_cost_model(total, state.transport, device=device,
                                           prefix=f"{state.prefix}.costmodel")
        if state.config.shard:        # the sharded plan is priced on the halves themselves
            state.halves_cost = tuple(measure_cost_model(
                total, state.transport, device=device, collective=what,
                prefix=f"{state.prefix}.costmodel.{what}")[0]
                for what in ("reduce_scatter", "all_gather"))
        payload = None
        race = state.config.tune and state.config.policy == "dcredit"
        if state.is_gate:
            sizes = [element_size(state, p) for p in state.order]
            profile = profiler.profile(state.order, [state.names[p] for p in state.order],
                                       [p.numel() * e for p, e in zip(state.order, sizes)],
                                       sizes, [kind(p) for p in state.order])
            # The last race's refit (``race.refit_offset``) corrects the link it plans on.
            planned_on = corrected(cost, state.refit_per_allreduce)
            keywords = {"overlap_forward": state.overlap, "workers": state.transport.size(),
                        "halves": state.halves_cost, "collectives": state.transport.execution()}
            payload = (planning.decide_race(profile, planned_on, state.config, **keywords)
                       if race else (*planning.decide(profile, planned_on, state.config,
                                                      **keywords), []))
        plan, profile, search, schedules = state.transport.broadcast_object(
            payload, f"{state.prefix}.plan")
        self._switch(plan, profile, cost)
        state.race = (LiveRace(state, self.instrument, self._install_schedule, schedules, cost)
                      if race and len(schedules) > 1 else None)
        log = self.instrument.on_rank0()
        if log is not None:
            planning.log(log, cost, samples, profile, plan, search, time.perf_counter() - started)
            for what, fit in zip(("reduce-scatter", "all-gather"), state.halves_cost or ()):
                log.info("cost model of the %s: T(bytes) = max(%.3g s, %.3g s + %.3g s/B * bytes)",
                         what, fit.floor, fit.a, fit.b)
            if state.config.profile_out:
                planning.write(state.config.profile_out, cost, samples, profile, plan, search)

    def _switch(self, plan, profile, cost) -> None:
        """Every rank: the plan's policy and units in force, checked across ranks."""
        state = self.state
        state.plan, state.schedule_partition = plan, None
        state.measured = (profile, cost)
        if state.overlap:
            self.instrument.time_layers(state.timeline is not None)
        state.policy = make_policy(state.config.policy, state.config.credit_bytes, plan,
                                   overlap_forward=state.overlap)
        state.layouts = build_layouts(state, plan.partition_bytes, plan.groups)
        policy = gate_rule(state)
        policy.bind(state.layouts)
        state.scheduler.policy = policy
        checks.check_layouts(state, "when the plan was installed")
        if state.drift is not None:
            state.drift.reset()
            state.last_end = None
            if state.replan_reason is not None:
                self._record_replan(plan, cost)
        self.instrument.mark("plan installed", partition_bytes=plan.partition_bytes,
                             units=plan.num_tensors, tensors=plan.num_parameters,
                             group_bytes=plan.group_bytes)

    # -- the race (``runtime/race.py``) -----------------------------------------------------
    def _install_schedule(self, schedule: Schedule) -> None:
        """Every rank, between iterations: one of the race's candidates in force."""
        state = self.state
        state.plan = schedule.plan
        state.schedule_partition = schedule.partition_bytes
        state.policy = schedule.policy_object(state.overlap)
        state.layouts = build_layouts(state, self._partition(), self._groups())
        policy = gate_rule(state)
        policy.bind(state.layouts)
        state.scheduler.policy = policy
        checks.check_layouts(state, f"when the race installed {schedule.label}")

    def _follow_race(self) -> None:
        """Every rank, at each iteration end while a race runs; when it ends, the winner is in
        force, its refit kept for the next plan, and the drift detector starts from it."""
        state = self.state
        state.race.end_iteration()
        if state.race.done:
            # The race priced its candidates on the corrected link: its residual adds to it.
            state.refit_per_allreduce += state.race.refit[0]
            state.races.append(state.race.summary())
            state.race = None
            if state.drift is not None:
                state.drift.reset()
                state.last_end = None

    def _record_replan(self, plan, cost) -> None:
        state = self.state
        reason, state.replan_reason = state.replan_reason, None
        reason = reason if isinstance(reason, str) else reason.describe()
        state.replans.append({"iteration": state.iteration, "time": time.time(),
                              "reason": reason, "plan": plan.describe(), "link": cost.describe()})
        self.instrument.mark("re-plan", iteration=state.iteration, reason=reason)
        log = self.instrument.on_rank0()
        if log is not None:
            log.info("re-planned at iteration %d (%s)", state.iteration, reason)

    # -- online re-planning (drift.py, docs/algorithm.md §8) ---------------------------------
    def watching(self) -> bool:
        """A plan is in force and may be replaced: every rank sends the control word."""
        state = self.state
        # ``measured``, not ``plan``: a baseline the race chose runs without a D-Credit plan.
        return (state.drift is not None and state.measured is not None
                and state.profiler is None and state.race is None)

    def submit_control(self) -> None:
        """One float, all-reduced beside the iteration's last blocks (the transport fuses it
        with them: no extra round trip): 1 from the gate rank when its detector fired, 0
        otherwise.  Every rank reads the sum at the same iteration end, so all start the new
        profile at the same step without any other message."""
        state = self.state
        fired = state.is_gate and state.drift.fired is not None
        state.control = state.transport.submit(torch.tensor([1.0 if fired else 0.0]),
                                               f"{state.prefix}.control", state.transport.sum)

    def _watch_drift(self) -> None:
        state = self.state
        if state.control is not None:
            handle, state.control = state.control, None
            if float(state.transport.wait(handle, state.config.poll_seconds)[0]) > 0.5:
                self._start_replan()
                return
        if state.drift is None or not state.is_gate:
            return
        now = time.perf_counter()
        last, state.last_end = state.last_end, now
        nbytes, busy = state.scheduler.link_sample()
        if last is None or not self.watching():
            return
        drift = state.drift.observe(now - last, busy / nbytes if nbytes else None)
        log = self.instrument.on_rank0() if drift is not None else None
        if log is not None:
            log.info("drift at iteration %d: %s; every rank profiles again and re-plans",
                     state.iteration, drift.describe())

    def _start_replan(self) -> None:
        """Every rank, at the same iteration end: profile again (the plan in force keeps
        scheduling meanwhile); ``install_plan`` then switches all of them at the same step."""
        state = self.state
        state.replan_reason = state.drift.fired if state.is_gate else "drift seen by rank 0"
        state.profiler = StepProfiler(0, state.config.profile_steps)
        if state.overlap:
            self.instrument.time_layers(True)
        self.instrument.mark("re-plan: profiling", iteration=state.iteration)

    # -- elastic membership ------------------------------------------------------------------
    def membership(self) -> tuple:
        return (self.state.transport.size(), self.state.transport.rank())

    def follow_membership(self) -> None:
        """Under ``hvd.elastic`` a worker that joins starts from a fresh optimizer while the
        others keep theirs; both must send the same blocks from the next iteration on.  When
        the transport was re-initialised (another size or rank, or a failed collective that
        elastic's ``restore()`` reported), drop whatever is in flight (its handles are gone)
        and start over as at construction: default layout, and for ``dcredit`` a new profile
        and plan, counted from the same iteration on every rank (the first after ``sync()``).
        """
        state = self.state
        if not state.elastic:
            return
        membership = self.membership()
        if membership == state.membership and not state.membership_lost:
            return
        log = self.instrument.on_rank0()
        if state.step_in_flight and log is not None:
            log.warning("Horovod was re-initialised while the last step's updates were in "
                        "flight; they are dropped (elastic's sync() restores rank 0's state)")
        state.membership, state.membership_lost = membership, False
        self.discard_in_flight()
        # A joining worker starts from the construction order: all agree on rank 0's again.
        state.order = list(state.initial)
        if state.guard is not None:
            state.forward_order_applied = False
            state.guard.observe(state.requires_update)
        state.scheduler.policy = self.start_schedule()
        if state.overlap:
            self.instrument.time_layers(self.instrument.wanted())
        if log is not None:
            log.info("elastic: %d ranks now; scheduling restarts%s", membership[0],
                     " with a new profile" if state.profiler is not None else "")

    def discard_in_flight(self) -> None:
        """Forget queued and in-flight blocks and owed updates: the transport was
        re-initialised and their handles are gone; the state loaded or broadcast next
        replaces them."""
        state = self.state
        state.scheduler.reset()
        if state.gathers is not None:
            state.gathers.reset()
        state.updater.reset()
        state.control = None
        state.step_in_flight = False
        state.pending.clear()
        state.queued.clear()
        state.arrived.clear()
        state.reset_delays()
