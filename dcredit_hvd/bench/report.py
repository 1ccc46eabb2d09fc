"""The bench's results: pooling rounds, the lower bound, the simulator's rows, the table.

``bench.py`` runs the launch (every policy in the same processes) and hands this module the
figures; this module only computes from them and prints, so a table can be re-made from a
``--json`` file without a launch.  Row names (``PolicyName``) live here: both sides read them.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

#: Policies that are not dcredit_hvd's: plain Horovod and PyTorch DDP.
BASELINES = ("horovod", "ddp")
#: Policy-name suffixes: without ``model=`` (step() waits for every gradient), and on the
#: ``torch.distributed`` transport (the Gloo group of the ``ddp`` row) instead of Horovod.
SYNC, TORCH_DISTRIBUTED, SHARD = "-sync", "-td", "-shard"
#: What each bench-only row name does, one line each (``horovod`` also names the simulator's
#: model of it): the one text every bench's and the simulator's ``--help`` lists.
BASELINE_DESCRIPTIONS = {
    "horovod": "plain hvd.DistributedOptimizer: Horovod's own tensor fusion and cycle, "
               "no scheduler",
    "ddp": "torch DistributedDataParallel over Gloo (25 MiB buckets), no scheduler",
}
#: What each suffix of a dcredit_hvd policy's row does (``PolicyName``), one line each.
SUFFIX_DESCRIPTIONS = {
    SYNC: "without model=: step() waits for every gradient instead of overlapping the next "
          "forward",
    TORCH_DISTRIBUTED: "on transport='torch.distributed', over the ddp row's Gloo group, "
                       "instead of Horovod",
    SHARD: "shard=True: reduce-scatter, each rank updates and keeps state for 1/N, all-gather "
           "(not with dear)",
}


def describe_lines(rows: dict[str, str], indent: str = "  ") -> str:
    """``rows`` (name -> one-line description) as aligned lines, for a raw ``--help`` epilog."""
    width = max(map(len, rows))
    return "\n".join(f"{indent}{name:<{width}}  {text}" for name, text in rows.items())


def policy_epilog() -> str:
    """The ``--help`` epilog of every command that takes bench row names (``PolicyName``):
    dcredit_hvd's policies, the baselines, the suffixes."""
    from ..policies import DESCRIBE, POLICIES

    return ("policy names (comma-separated); dcredit_hvd's policies:\n"
            + describe_lines({name: DESCRIBE[name] for name in POLICIES})
            + "\nbaselines (no suffix):\n" + describe_lines(BASELINE_DESCRIPTIONS)
            + "\nsuffixes of dcredit_hvd's policies, in any order (e.g. dcredit-sync, "
              "bytescheduler-shard, dcredit-td):\n" + describe_lines(SUFFIX_DESCRIPTIONS))


@dataclass(frozen=True)
class PolicyName:
    """What a ``--policy`` entry asks for: ``<base>[-sync][-td][-shard]`` (suffixes in any
    order; ``-shard``: ``shard=True``, its all-gathers overlapping the next forward, or in
    ``step()`` with ``-sync``)."""

    name: str
    base: str
    overlap: bool             # model= given: the next forward overlaps the all-reduces
    transport: Optional[str]  # None: Horovod; "torch.distributed" for the -td rows
    shard: bool = False       # shard=True (-shard)

    @classmethod
    def parse(cls, name: str) -> PolicyName:
        base, overlap, transport, shard = name, True, None, False
        while True:
            if base.endswith(SHARD):
                base, shard = base.removesuffix(SHARD), True
            elif base.endswith(SYNC):
                base, overlap = base.removesuffix(SYNC), False
            elif base.endswith(TORCH_DISTRIBUTED):
                base, transport = base.removesuffix(TORCH_DISTRIBUTED), "torch.distributed"
            else:
                return cls(name, base, overlap, transport, shard)

    @property
    def baseline(self) -> bool:
        return self.base in BASELINES


def pool(table: dict[str, Any], key: str, result: dict[str, Any], batch_size: int) -> None:
    """Add one round's ``timed_run`` result to ``table[key]``, pooling the iterations."""
    if key in table:
        seconds = table[key]["seconds"] + result["seconds"]
        rates = batch_size / np.array(seconds)
        result = dict(result, seconds=seconds, seconds_per_iteration=float(np.mean(seconds)),
                      img_sec_mean=float(rates.mean()), img_sec_conf=float(1.96 * rates.std()))
    table[key] = result


def lower_bound(results: dict[str, Any]) -> dict[str, Any] | None:
    """The lower bound the table's ratios use: ``max(compute only, communication only)``
    measured in this run, raised by what one tensor's own dependency adds beyond compute
    (``simulator.dependency_bound`` on the measured profile and link: a tied embedding is
    produced last by backward and read first by forward, so its all-reduce cannot hide)."""
    if "compute" not in results:
        return None
    compute = results["compute"]["seconds_per_iteration"]
    plain = max(compute, results["communication"]["seconds_per_iteration"])
    excess = results.get("simulated", {}).get("dependency_excess_s", 0.0)
    return {"seconds": max(plain, compute + excess), "max_compute_communication": plain,
            "dependency_excess_s": excess,
            "dependency_tensor": results.get("simulated", {}).get("dependency_tensor")}


def simulator_check(results: dict[str, Any], optimizers: dict[str, Any],
                    args: argparse.Namespace) -> dict[str, Any]:
    """Each measured policy predicted by the simulator from the profile and cost model that
    ``dcredit`` measured in this run; error in percent of the measured time."""
    from dcredit_hvd.planning.decision import simulator

    # Prefer a profile measured with model= (it has per-layer forward times; without the model
    # the profiler cannot see the forward pass), then one measured over Horovod (the rows
    # without a suffix).
    def preference(item: tuple[str, Any]) -> tuple[bool, bool]:
        policy = PolicyName.parse(item[0])
        return not policy.overlap, policy.transport is not None
    candidates = sorted(optimizers.items(), key=preference)
    measured = next((o.measured for _, o in candidates
                     if getattr(o, "measured", None) is not None), None)
    if measured is None:
        return {}
    profile, cost = measured
    profile, untracked = with_untracked_compute(profile, results.get("compute"))
    network = network_model(cost, results.get("link"))
    out: dict[str, Any] = {"untracked_compute_s": untracked} if untracked else {}
    # What one tensor's own dependency adds beyond compute (a tied embedding), on the link.
    compute = profile.forward_time + profile.backward_time + sum(profile.t_u or ())
    ends = simulator.dependencies(profile, network or cost)
    excess = max(ends, default=0.0) - compute
    if excess > 0:
        out["dependency_excess_s"] = excess
        out["dependency_tensor"] = profile.names[ends.index(max(ends))]
    for name, run in results["policies"].items():
        policy = PolicyName.parse(name)
        if policy.base == "ddp":
            continue
        row_cost = cost
        own = getattr(optimizers[name], "measured", None)
        if policy.transport is not None and own is not None:
            row_cost = own[1]           # the -td row's own transport, fitted while it ran
        row = simulated_row(profile, row_cost, policy, optimizers[name],
                            run["seconds_per_iteration"], halves=True)
        if network is not None:
            row_network = network_model(row_cost, results["link"],
                                        bandwidth_optimal=policy.transport is not None)
            on_link = simulated_row(profile, row_network, policy, optimizers[name],
                                    run["seconds_per_iteration"])
            row.update(predicted_link=on_link["predicted"],
                       error_link_percent=on_link["error_percent"])
        out[name] = row
    return out


def simulated_row(profile: Any, cost: Any, policy: PolicyName, kept: Any,
                  measured: float, halves: bool = False) -> dict[str, Any]:
    """One policy simulated on ``profile`` and ``cost``, beside its measured seconds.
    ``halves``: a sharded row is priced with the reduce-scatter and all-gather costs its
    optimizer fitted live (else each is half of ``cost``, ``halves.split_cost``).

    Over Horovod: its cycle and fusion as this environment sets them (its defaults, 1 ms and
    128 MiB, unless ``HOROVOD_*`` says otherwise).  The ``-td`` rows' transport issues each
    block as its own all-reduce as soon as the scheduler releases it: no cycle, no fusion."""
    from dcredit_hvd.planning.decision import simulator
    from dcredit_hvd.policies import DCredit

    horovod = simulator.horovod_execution(os.environ)
    kwargs: dict[str, Any] = {"overlap_forward": policy.overlap and policy.base != "horovod",
                              "fusion_bytes": horovod.fusion_bytes, "cycle_s": horovod.cycle_s}
    if policy.transport is not None:
        kwargs.update(cycle_s=0.0, fusion_bytes=0)
    if policy.shard:                     # split in halves: the runtime's step() (halves.py)
        kwargs.update(sharded(kept, kept.workers, fitted=halves))
    rule: Any = policy.base
    if policy.base in ("wfbp", "bytescheduler"):
        config = kept.scheduler_config
        kwargs.update(partition_bytes=config.partition_bytes, credit_bytes=config.credit_bytes)
    elif policy.base == "dear" and kept.scheduler_config is not None:
        rule = dear_policy(kept.scheduler_config)
    elif policy.base == "dcredit":       # a fresh policy each time: simulate() binds it
        rule = DCredit(kept.plan, overlap_forward=policy.overlap)
    predicted = simulator.simulate(profile, cost, rule, **kwargs).iteration_s
    return {"predicted": predicted, "measured": measured,
            "error_percent": 100.0 * (predicted - measured) / measured}


def sharded(kept: Any, workers: int, fitted: bool = True) -> dict[str, Any]:
    """``simulate()``'s keywords for a sharded row: the two halves as the runtime's ``step()``
    runs them, priced (``fitted``) with the costs the row's optimizer fitted live, if it did."""
    out: dict[str, Any] = {"shard": True, "workers": workers}
    costs = getattr(kept, "halves", None)
    if fitted and costs is not None:
        out.update(scatter_cost=costs[0], gather_cost=costs[1])
    return out


def dear_policy(config: Any) -> Any:
    """DeAR with the buffer size its run used (``group_bytes`` when given: the emulated
    cluster scales it like the tensors), as ``lifecycle.start_schedule`` builds it."""
    from dcredit_hvd.policies import make_policy

    return make_policy("dear", config.credit_bytes, buffer_bytes=(
        config.group_bytes if config.explicit("group_bytes") else None))


def with_untracked_compute(profile: Any, compute: dict[str, Any] | None) -> tuple[Any, float]:
    """The profile plus the compute its hooks cannot see, and how much that was.

    The profiler times each parameter's layers; work outside them (a tied language-model head
    such as ``F.linear(x, wte.weight)``, the loss, their backward, which runs before the first
    gradient is ready) is missing, so the simulator under-predicts such models. The missing part
    is what ``compute only`` (the whole step, measured in the same launch) exceeds the profile
    by; it is charged one third to the end of the forward pass and two thirds to the start of
    the backward pass (backward costs about twice the forward). A profile already longer than
    ``compute only`` (its iterations ran beside communication, which takes CPU from them) is
    left as it is: that contention is measured, not modelled."""
    from dcredit_hvd.planning.profile import Profile

    if not compute or profile.num_tensors == 0:
        return profile, 0.0
    t_u = profile.t_u or (0.0,) * profile.num_tensors
    missing = compute["seconds_per_iteration"] - (profile.forward_time + profile.backward_time
                                                  + sum(t_u))
    if missing <= 0:
        return profile, 0.0
    t_f, t_b = list(profile.t_f), list(profile.t_b)
    t_f[-1] += missing / 3
    t_b[-1] += 2 * missing / 3
    return Profile.from_lists(profile.names, profile.nbytes, profile.element_size, t_f, t_b,
                              profile.t_u, profile.kinds), missing


def network_model(cost: Any, link: dict[str, Any] | None, bandwidth_optimal: bool = False) -> Any:
    """The simulator's network model of the virtual cluster: the links' seconds per byte under
    the run's all-reduce (``link_need``), with the live model's startup ``a`` and floor (on this CPU
    mostly Horovod's cycle, not the wire). ``bandwidth_optimal``: under a ring instead (Gloo's
    all-reduce, for the ``-td`` rows). None off the virtual cluster."""
    from dataclasses import replace

    if link is None:
        return None
    seconds = link["bandwidth_optimal_seconds"] if bandwidth_optimal else link["seconds"]
    return replace(cost, b=seconds / link["bytes"])


def gloo_rows(policies: Any) -> str:
    """Which rows ran over Gloo's all-reduce (torch.distributed) instead of Horovod's."""
    if any(PolicyName.parse(name).transport for name in policies):
        return f"ddp and the {TORCH_DISTRIBUTED} rows"
    return "ddp"


def print_table(results: dict[str, Any]) -> None:
    policies = results["policies"]
    base = policies.get("horovod", {}).get("seconds_per_iteration")
    ddp = policies.get("ddp", {}).get("seconds_per_iteration")
    bound = None
    print(f"\n{results.get('ranks', '?')} ranks on {', '.join(results.get('hosts', ['?']))}; all-reduce: "
          f"{results.get('allreduce', '?')} ({gloo_rows(policies)}: Gloo's); subnormals flushed: "
          f"{results.get('flush_denormal')}")
    if "loadavg_end" in results:
        print(f"machine load average (1 min) {results['loadavg_start'][0]:.1f} at the start, "
              f"{results['loadavg_end'][0]:.1f} at the end, on {os.cpu_count()} CPUs")
    if results.get("bound"):
        b = results["bound"]
        bound = b["seconds"]
        print(f"compute only {results['compute']['seconds_per_iteration'] * 1e3:.1f} ms, "
              f"communication only {results['communication']['seconds_per_iteration'] * 1e3:.1f} ms, "
              f"max(compute, communication) {b['max_compute_communication'] * 1e3:.1f} ms; "
              f"lower bound {bound * 1e3:.1f} ms" + (
                  f" (compute + {b['dependency_excess_s'] * 1e3:.1f} ms: the all-reduce of "
                  f"{b['dependency_tensor']} cannot start before backward produces it and must "
                  "end before forward reads it; a tied embedding, produced last and read first, "
                  "overlaps neither pass)" if bound > b["max_compute_communication"] else ""))
    link = results.get("link")
    if link:
        print(f"the links ({link['rate']} full duplex per host) need {link['seconds'] * 1e3:.1f} ms "
              f"per iteration for {link['bytes'] / 1e6:.1f} MB under this all-reduce "
              f"(bandwidth-optimal all-reduce: {link['bandwidth_optimal_seconds'] * 1e3:.1f} ms)")
    simulated = results.get("simulated", {})
    width = max([15] + [len(name) + 1 for name in policies])     # names such as wfbp-sync-td
    print(f"\n{'policy':<{width}}{'ms/iter':>10}{'img/sec':>10}{'vs horovod':>12}{'vs ddp':>9}"
          f"{'x lower bound':>15}{'simulated ms':>14}{'error':>8}{'link model':>12}{'error':>8}"
          f"{'energy J/iter':>15}")
    for name, r in policies.items():
        t = r["seconds_per_iteration"]
        speedup = f"{base / t:.2f}x" if base else "-"
        over_ddp = f"{ddp / t:.2f}x" if ddp else "-"
        ratio = f"{t / bound:.2f}" if bound else "-"
        sim = simulated.get(name)
        predicted = f"{sim['predicted'] * 1e3:.1f}" if sim else "-"
        error = f"{sim['error_percent']:+.0f}%" if sim else "-"
        on_link = f"{sim['predicted_link'] * 1e3:.1f}" if sim and "predicted_link" in sim else "-"
        link_error = f"{sim['error_link_percent']:+.0f}%" if sim and "predicted_link" in sim else "-"
        joules = r.get("energy_j_per_iter")
        energy = "n/a" if joules is None else f"{joules:.2f}"
        print(f"{name:<{width}}{t * 1e3:>10.1f}{r['img_sec_mean']:>10.1f}{speedup:>12}{over_ddp:>9}"
              f"{ratio:>15}{predicted:>14}{error:>8}{on_link:>12}{link_error:>8}{energy:>15}")
    print("simulated: the simulator on the profile and live cost model dcredit measured; link "
          "model: the same with the links' seconds per byte under this all-reduce")
    if simulated.get("untracked_compute_s"):
        print(f"  both add {simulated['untracked_compute_s'] * 1e3:.1f} ms of compute the profile's "
              "layers miss (compute only minus the profile: work outside them, such as a tied head "
              "and the loss)")
    memory = {name: r["optimizer_state_bytes"] for name, r in policies.items()
              if r.get("optimizer_state_bytes") is not None}
    if memory:
        print("optimizer state per rank (SGD momentum, 4 bytes per parameter; sharded: its "
              "slices): " + ", ".join(f"{name} {b / 2**20:.2f} MiB" for name, b in memory.items()))
    note = results.get("energy")
    if note is None:
        print("energy J/iter: n/a on --device cpu (GPU energy only, with --device cuda)")
    else:
        print(f"energy J/iter: {note['scope']}.")
        if not note["available"]:
            print(f"  rank 0: {note['meter_rank0']}")
