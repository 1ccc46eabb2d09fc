"""The emulated benchmark's analysis: lower bound, simulator predictions and fidelity checks,
all in the target cluster's time (``dcredit_hvd.bench.emulate`` measures, this judges and prints)."""
from __future__ import annotations

import os
import statistics
from dataclasses import replace
from typing import Any

from ..planning import simulator
from ..planning.candidates import corrected
from ..planning.costmodel import CostModel
from ..planning.profile import Profile
from . import replay
from .report import dear_policy, sharded
from .sidebyside import PolicyName, link_need

BASELINE_ORDER = ("horovod", "ddp", "wfbp", "bytescheduler")
#: Issue 21's limit on the CPU the emulated hosts may take (beyond it they are CPU-bound), and
#: its tolerances: compute-only replay vs the profile, communication-only vs the link model,
#: the simulator vs each policy.
CPU_LIMIT = 0.5
COMPUTE_TOLERANCE, COMMUNICATION_TOLERANCE, SIMULATOR_TOLERANCE = 0.03, 0.05, 0.05


def bounds(profile: Profile, hosts: int, dilation: replay.Dilation) -> dict[str, Any]:
    """Compute, the links' need on the TARGET cluster, and the lower bound (with the tied
    embedding's own dependency, ``simulator.dependencies``), in cluster ms."""
    compute = profile.forward_time + profile.backward_time
    need = link_need(profile.total_bytes, hosts, f"{dilation.target_rate}bit")
    comm = need["seconds"] if need else 0.0
    excess, tensor = 0.0, None
    if need:
        ends = simulator.dependencies(profile, CostModel(a=0.0, b=comm / profile.total_bytes))
        if ends and max(ends) > compute * (1 + 1e-6):
            excess, tensor = max(ends) - compute, profile.names[ends.index(max(ends))]
    return {"compute_ms": compute * 1e3, "link_ms": comm * 1e3,
            "bound_ms": max(compute, comm, compute + excess) * 1e3,
            "dependency_excess_ms": excess * 1e3, "dependency_tensor": tensor}


def predictions(profile: Profile, hosts: int, dilation: replay.Dilation,
                kept: dict[str, Any], policies: list[str], startup_s: float,
                halves: list[dict[str, float]] | None = None,
                refits: dict[str, float] | None = None) -> dict[str, Any]:
    """Each policy simulated on the emulated profile and link (wall seconds, emulated bytes,
    Horovod's dilated cycle), divided by K: cluster ms.  ``a`` and the floor
    (``CostModel.floor``) are dcredit's live fit when it ran (as ``dcredit_hvd.bench.sidebyside`` does:
    taken while the model runs, as the policies see it), else ``a`` is the measured
    one-element all-reduce less half a cycle (the simulator waits for the next cycle itself);
    both are kept in the JSON.  The ``-td`` rows (``torch.distributed``) have no cycle and no
    fusion (each block its own all-reduce at once) and their own live fit's ``a`` and floor
    when they made one.  The sharded rows are simulated on the two halves
    (``simulate(shard=True)``), with the reduce-scatter's and all-gather's costs their
    optimizer fitted live; the ``dear`` rows with the launch's own fit of the two halves
    (``halves``: ``emulate.halves_costs``), when it made one.  Where the row whose live fit
    is used raced (``refits``: its race's per-all-reduce correction, wall seconds), every row
    is priced on the link after that refit (``candidates.corrected``), as the next plan is."""
    from ..policies.dcredit import DCredit

    emulated = replay.emulated_profile(profile, dilation)
    need = link_need(emulated.total_bytes, hosts, f"{dilation.link_rate}bit")
    if need is None:
        return {}
    horovod = simulator.horovod_execution(os.environ)     # as the launch's Horovod reads them
    cycle = horovod.cycle_s
    fits = [(name, k.measured) for name, k in kept.items() if getattr(k, "measured", None)]
    fits.sort(key=lambda fit: PolicyName.parse(fit[0]).transport is not None)   # Horovod's first
    measured = fits[0][1] if fits else None
    probe_a = max(simulator.DEFAULT_OP_OVERHEAD_S, startup_s - cycle / 2)
    link_b = need["seconds"] / emulated.total_bytes
    # The live fit's startup and floor, with the link model's seconds per byte.
    cost = replace(measured[1], b=link_b) if measured else CostModel(a=probe_a, b=link_b)
    refit = (refits or {}).get(fits[0][0], 0.0) if fits else 0.0
    source = "dcredit live fit" if measured else "startup probe"
    if refit:
        cost = corrected(cost, refit)
        source += f", then the race's refit {refit * 1e3:+.1f} ms per all-reduce"
    fusion = horovod.fusion_bytes
    out: dict[str, Any] = {"a_wall_s": cost.a, "floor_wall_s": cost.floor, "a_probe_wall_s": probe_a,
                           "cycle_wall_s": cycle, "refit_wall_s": refit, "a_source": source}
    for name in policies:
        parsed = PolicyName.parse(name)
        base, overlap = parsed.base, parsed.overlap
        if base == "ddp":
            continue
        kwargs: dict[str, Any] = {"overlap_forward": overlap and base != "horovod",
                                  "fusion_bytes": fusion, "cycle_s": cycle}
        row_cost = cost
        if parsed.transport is not None:
            kwargs.update(cycle_s=0.0, fusion_bytes=0)
            own = getattr(kept.get(name), "measured", None)
            if own:
                row_cost = replace(own[1], b=cost.b)
        if parsed.shard:                # fitted live on the emulated link, like ``a``
            kwargs.update(sharded(kept.get(name), hosts))
        policy: Any = base
        config = getattr(kept.get(name), "scheduler_config", None)
        if base in ("wfbp", "bytescheduler") and config is not None:
            kwargs.update(partition_bytes=config.partition_bytes, credit_bytes=config.credit_bytes)
        elif base == "dear" and config is not None:
            policy = dear_policy(config)
        if base == "dear" and halves:
            kwargs.update(scatter_cost=CostModel(**halves[0]), gather_cost=CostModel(**halves[1]))
        elif base == "dcredit":
            made = getattr(kept.get(name), "plan", None)
            if made is None:
                continue
            policy = DCredit(made, overlap_forward=overlap)
        try:
            seconds = simulator.simulate(emulated, row_cost, policy, **kwargs).iteration_s
        except (ValueError, IndexError) as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        out[name] = {"ms": dilation.cluster(seconds) * 1e3}
    return out


def analyse(results: dict[str, Any], profile: Profile, dilation: replay.Dilation,
            kept: dict[str, Any]) -> None:
    """Adds ``bounds``, ``simulated`` and ``checks`` to ``results``."""
    hosts = results["hosts"]
    b = results["bounds"] = bounds(profile, hosts, dilation)
    sim = results["simulated"] = predictions(profile, hosts, dilation, kept,
                                             list(results["policies"]),
                                             results.get("startup_wall_s", 0.0),
                                             results.get("halves_wall"),
                                             {name: run["race"]["refit_per_allreduce_s"]
                                              for name, run in results["policies"].items()
                                              if "refit_per_allreduce_s" in run.get("race", {})})
    checks: dict[str, Any] = {}
    compute = results["compute"]["ms_mean"]
    checks["compute_replay"] = _check(compute, b["compute_ms"], COMPUTE_TOLERANCE,
                                      "compute-only replay vs the profile's total")
    if b["link_ms"]:
        checks["communication"] = _check(results["communication"]["ms_mean"], b["link_ms"],
                                         COMMUNICATION_TOLERANCE,
                                         "communication-only vs the link model")
    runs = [results["compute"], results["communication"], *results["policies"].values()]
    busiest = max(r["machine_busy_fraction"] for r in runs)
    job = max(r["job_cpu_fraction"] for r in runs)
    checks["cpu"] = {"what": "CPU busy fraction of the job (its ranks' CPU over all cores; "
                     "the machine's, other work included, beside it)",
                     "machine_max": busiest, "job_max": job, "limit": CPU_LIMIT,
                     "ok": job < CPU_LIMIT}
    for name, run in results["policies"].items():
        predicted = sim.get(name, {}).get("ms")
        run["x_bound"] = run["ms_mean"] / b["bound_ms"]
        if predicted is not None:
            run["simulated_ms"] = predicted
            checks[f"simulator:{name}"] = _check(predicted, run["ms_mean"], SIMULATOR_TOLERANCE,
                                                 f"simulator vs measured, {name}")
    results["checks"] = checks


def _check(value: float, reference: float, tolerance: float, what: str) -> dict[str, Any]:
    error = (value - reference) / reference if reference else float("inf")
    return {"what": what, "value_ms": value, "reference_ms": reference,
            "error": error, "tolerance": tolerance, "ok": abs(error) <= tolerance}


def speedups(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per policy: each baseline's time over its time."""
    runs = results["policies"]
    out: dict[str, dict[str, float]] = {}
    for name, run in runs.items():
        out[name] = {base: runs[base]["ms_mean"] / run["ms_mean"]
                     for base in BASELINE_ORDER if base in runs}
    return out


def print_races(results: dict[str, Any]) -> None:
    """Each dcredit row's race (run to its end before the row was timed), in cluster time: its
    table, the winner, and its cost against running the winner from the start, also as a share
    of a 1,000-iteration run at the row's measured steady state."""
    for name, run in results["policies"].items():
        race = run.get("race")
        if not race:
            continue
        share = race["cost_ms"] / (1000 * run["ms_mean"])
        print(f"\nrace of {name}: {race['winner']} won after {race['iterations']} iterations "
              f"({race['cluster_ms'] / 1e3:.1f} s cluster); cost {race['cost_ms']:.0f} ms = "
              f"{100 * share:.2f}% of a 1,000-iteration run")
        print(f"  then timed: median {statistics.median(run['ms']):.1f} ms, mean {run['ms_mean']:.1f} "
              f"(the race's figures are medians of the slowest rank's iterations); re-plans or "
              f"races among the timed iterations: {run.get('timed_changes', 0)}")
        print(f"  {'candidate':<40}{'predicted':>10}{'measured':>10}{'stderr':>8}{'iters':>6}  verdict")
        for row in race["table"]:
            def ms(x: Any) -> str:
                return "-" if x is None else f"{x:.1f}"
            print(f"  {row['candidate']:<40}{ms(row['predicted_ms']):>10}"
                  f"{ms(row['measured_ms']):>10}{ms(row['stderr_ms']):>8}{row['iterations']:>6}"
                  f"  {row['verdict']}")


def print_report(results: dict[str, Any]) -> None:
    """The table and the checks, rank 0."""
    b = results["bounds"]
    print(f"\nEmulated cluster: {results['hosts']} hosts, {results['target_rate'] / 1e9:g} Gbit/s "
          f"NICs (emulated on {results['link_rate'] / 1e6:g} Mbit/s, K = "
          f"{results['time_factor']:g}, S = {results['byte_scale']}); profile "
          f"{results['profile']}; all-reduce {results['allreduce']}; load "
          f"{results['loadavg_start'][0]:.1f} at the start, {results['loadavg_end'][0]:.1f} at "
          f"the end, {os.cpu_count()} CPUs")
    print(f"cluster time: compute {b['compute_ms']:.1f} ms, the links need {b['link_ms']:.1f} ms"
          f", lower bound {b['bound_ms']:.1f} ms" + (
              f" (compute + {b['dependency_excess_ms']:.1f} ms: {b['dependency_tensor']} "
              "overlaps neither pass)" if b["dependency_excess_ms"] > 0.05 else "")
          + f"; SGD update (real CPU, not replayed) {results['update_ms']:.2f} ms")
    sim = results.get("simulated", {})
    if "a_wall_s" in sim:
        print(f"all-reduce startup a = {sim['a_wall_s'] * 1e3:.1f} ms wall, "
              f"{sim['a_wall_s'] * 1e3 / results['time_factor']:.2f} ms cluster, floor "
              f"{sim.get('floor_wall_s', 0) * 1e3:.1f} ms wall ({sim['a_source']}; a one-element all-reduce: "
              f"{results.get('startup_wall_s', 0) * 1e3:.1f} ms wall)")
    ups = speedups(results)
    bases = [x for x in BASELINE_ORDER if x in results["policies"]]
    head = "".join(f"{'vs ' + x:>16}" for x in bases)
    width = max([15] + [len(name) + 1 for name in results["policies"]])
    print(f"\n{'policy':<{width}}{'ms/iter':>9}{'x bound':>9}{head}{'simulated':>11}{'error':>8}"
          f"{'job CPU':>9}{'machine':>9}")
    for name, run in results["policies"].items():
        sim = run.get("simulated_ms")
        cols = "".join(f"{ups[name][x]:>15.2f}x" for x in bases)
        err = f"{100 * (sim - run['ms_mean']) / run['ms_mean']:+.1f}%" if sim else "-"
        print(f"{name:<{width}}{run['ms_mean']:>9.1f}{run['x_bound']:>9.2f}{cols}"
              f"{(f'{sim:.1f}' if sim else '-'):>11}{err:>8}"
              f"{100 * run['job_cpu_fraction']:>8.0f}%{100 * run['machine_busy_fraction']:>8.0f}%")
    print_races(results)
    print("\nfidelity checks:")
    for key, c in results["checks"].items():
        if key == "cpu":
            verdict = "ok" if c["ok"] else ("FAILED: CPU-bound, this run measured the CPU, "
                                            "not a cluster")
            print(f"  {c['what']}: the job {100 * c['job_max']:.0f}% at most, limit 50%: "
                  f"{verdict}; the machine {100 * c['machine_max']:.0f}% at most" + (
                      " (shared: other work delays the hosts' wake-ups; figures disturbed)"
                      if c["machine_max"] > 0.9 else ""))
            continue
        print(f"  {c['what']}: {c['value_ms']:.1f} vs {c['reference_ms']:.1f} ms "
              f"({100 * c['error']:+.1f}%, tolerance {100 * c['tolerance']:.0f}%): "
              f"{'ok' if c['ok'] else 'FAILED'}")
