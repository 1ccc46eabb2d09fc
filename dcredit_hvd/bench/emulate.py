"""The emulated GPU cluster benchmark: every policy on real hosts and all-reduces, with each
layer's compute replayed from a profile (``dcredit_hvd.bench.replay``), in the target cluster's time.

    scripts/vcluster.sh 8 100mbit -- horovodrun -np 8 -H h0:1,...,h7:1 --gloo \\
        python -m dcredit_hvd.bench.emulate --profile vgg16 --target-rate 10gbit --byte-scale 25

(``scripts/bench_emulated.py`` builds these launches, one per model, host count and target.)
Per policy, in one launch as ``dcredit_hvd.bench.sidebyside`` does: ms per iteration in cluster time
(wall / K), x the lower bound, the speed-up over each baseline, the simulator's prediction on
the same profile and link, and the fidelity checks of issue 21: compute-only replay within 3%
of the profile, communication-only within 5% of the link model, the CPU busy fraction under
50% (else the run says it measured the CPU, not a cluster), the simulator within 5% of every
policy.  Byte settings of the target (Horovod's 128 MiB fusion, DDP's 25 MiB buckets,
ByteScheduler's 4 MB partitions and 16 MB credit) are divided by ``S`` like the gradients.
Policy names are ``dcredit_hvd.bench.sidebyside``'s: ``-sync`` without ``model=``, ``-td`` on
``torch.distributed`` over the ``ddp`` row's Gloo group (``dcredit-td`` beside ``ddp``).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import resource
import sys
import time
from collections.abc import Iterator
from typing import Any, Callable

from . import replay
from .sidebyside import PolicyName, collective_algorithm, init_gloo_process_group, kept_of

#: Target-cluster byte settings (Horovod 0.28, torch DDP, ByteScheduler's defaults).
FUSION_BYTES = 128 << 20
DDP_BUCKET_BYTES = 25 << 20
DEAR_BUFFER_BYTES = 25 << 20      # DeAR's THRESHOLD (policies/dear.py), in the target's bytes
PARTITION_BYTES = 4_000_000
CREDIT_BYTES = 16_000_000
POLICIES = "horovod,ddp,wfbp,bytescheduler,dcredit-sync,dcredit"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from .report import policy_epilog

    p = argparse.ArgumentParser(prog="python -m dcredit_hvd.bench.emulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=policy_epilog())
    p.add_argument("--profile", required=True, help="a shipped profile (resnet50, vgg16, "
                   "gpt2_small) or a JSON file written by profile_out / DCREDIT_PROFILE_OUT")
    p.add_argument("--target-rate", required=True, help="NIC rate of the emulated cluster, "
                   "e.g. 10gbit")
    p.add_argument("--link-rate", default=os.environ.get("VCLUSTER_RATE"),
                   help="rate of the shaped links (default $VCLUSTER_RATE)")
    scale = p.add_mutually_exclusive_group(required=True)
    scale.add_argument("--byte-scale", type=int, help="S: every gradient is 1/S of its size")
    scale.add_argument("--time-factor", type=float, help="K: every compute time times K")
    p.add_argument("--policy", default=POLICIES,
                   help=f"comma-separated row names, listed below (default {POLICIES})")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--tune-rounds", default=None,
                   help="iterations per round of dcredit's race (tune_rounds), e.g. 4,8; the "
                   "race runs to its end before a dcredit row is timed (default: the config's)")
    p.add_argument("--slack", type=float, default=0.005,
                   help="wall seconds of CPU delay the replay clock absorbs (replay.ReplayClock)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not args.link_rate:
        p.error("no --link-rate and no VCLUSTER_RATE: run under scripts/vcluster.sh")
    if args.warmup < 1 or args.iters < 1:
        p.error(f"--warmup {args.warmup} --iters {args.iters}: both must be at least 1 (the "
                "last warm-up iteration leaves the link as the timed ones find it)")
    args.policies = [x.strip() for x in args.policy.split(",") if x.strip()]
    if args.tune_rounds is not None:
        try:
            args.tune_rounds = tuple(int(x) for x in args.tune_rounds.split(","))
        except ValueError:
            p.error(f"--tune-rounds {args.tune_rounds!r}: give whole numbers, e.g. 4,8")
    for policy in map(PolicyName.parse, args.policies):
        if policy.baseline and policy.name != policy.base:
            p.error(f"--policy {policy.name}: the -sync and -td suffixes apply to dcredit_hvd's "
                    f"policies (e.g. dcredit-td), not to {policy.base}")
    return args


def cpu_ticks() -> tuple[int, int]:
    """``(busy, total)`` jiffies of the whole machine, from /proc/stat."""
    with open("/proc/stat") as fh:
        fields = [int(v) for v in fh.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


class IdleSpin:
    """Where plain Horovod's optimizer waits: at ``SCHED_IDLE``, its CPU counted apart.

    ``hvd.synchronize`` waits by yielding in a loop.  On a GPU host that is one core of many;
    on this machine's 2 cores the main threads of 8-16 emulated hosts would spin in it and take
    the CPU the other hosts' all-reduces need (measured: back-to-back 1 MiB all-reduces on 8
    hosts took 1.98 cores through ``synchronize``, 0.40 polled, at the same rate), slowing
    plain Horovod for a reason a cluster does not have.  So its wait (``opt.synchronize()``,
    Horovod's public method) runs at ``SCHED_IDLE``: the loop gets only CPU no other thread
    wants, and its CPU is the run's ``spin``, not part of the job's demand (check 4)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
        began = time.thread_time()
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        try:
            yield
        finally:
            os.sched_setscheduler(0, policy, param)
            self.seconds += time.thread_time() - began


class Runner:
    """Timed runs of one step function with the CPU they took, gathered over the ranks."""

    def __init__(self, hvd: Any, args: argparse.Namespace, dilation: replay.Dilation,
                 clock: replay.ReplayClock) -> None:
        self.hvd, self.args, self.dilation, self.clock = hvd, args, dilation, clock
        self.spin = IdleSpin()

    def log(self, *parts: Any) -> None:
        if self.hvd.rank() == 0:
            print(*parts, flush=True)

    def run(self, label: str, step: Callable[[], None]) -> dict[str, Any]:
        # The ranks line up before the LAST warm-up iteration, not before the first timed one:
        # that all-reduce waits for every one queued before it, so behind it the link would be
        # empty and the first timed iteration would not pay the all-reduces the previous one
        # left for its forward pass (measured: dcredit 306 ms, then 518 and 514).
        for _ in range(self.args.warmup - 1):
            step()
        self.hvd.allreduce(__import__("torch").zeros(1), name=f"emulate.sync.{label}")
        step()
        late, restarts = self.clock.late, self.clock.restarts
        ru0, ticks0, seconds = resource.getrusage(resource.RUSAGE_SELF), cpu_ticks(), []
        spun = self.spin.seconds
        for _ in range(self.args.iters):
            began = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - began)
        ru1, ticks1 = resource.getrusage(resource.RUSAGE_SELF), cpu_ticks()
        wall = sum(seconds)
        spin = self.spin.seconds - spun
        mine = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime) - spin
        gathered = self.hvd.allgather_object((mine, spin))
        cores, spin_cores = (sum(g[i] for g in gathered) / wall for i in (0, 1))
        busy = (ticks1[0] - ticks0[0]) / max(1, ticks1[1] - ticks0[1])
        lost = max(self.hvd.allgather_object(self.clock.late - late))
        ms = [self.dilation.cluster(s) * 1e3 for s in seconds]
        result = {"label": label, "ms": ms, "ms_mean": sum(ms) / len(ms),
                  "job_cores": cores, "job_cpu_fraction": cores / (os.cpu_count() or 1),
                  "spin_cores": spin_cores,
                  "machine_busy_fraction": busy, "loadavg": os.getloadavg()[0],
                  "clock_restarts": self.clock.restarts - restarts,
                  "clock_late_ms_per_iter": self.dilation.cluster(lost) * 1e3 / len(seconds)}
        self.log(f"[{label}] {result['ms_mean']:.1f} ms per iteration in cluster time "
                 f"({', '.join(f'{m:.0f}' for m in ms)}); CPU: job {cores:.2f} cores (+ {spin_cores:.2f} "
                 f"spinning at SCHED_IDLE), machine "
                 f"{100 * busy:.0f}% busy, load {result['loadavg']:.1f}; replay clock late "
                 f"{result['clock_late_ms_per_iter']:.2f} ms/iter")
        return result


def make_step(policy: str, model: Any, hvd: Any, dilation: replay.Dilation,
              x: Any, spin: IdleSpin, tune_rounds: Any = None) -> tuple[Callable[[], None], Any]:
    """The training step of ``policy`` on the replay model, and its optimizer."""
    import torch

    import dcredit_hvd

    clock = model.clock
    opt: Any = torch.optim.SGD(model.parameters(), lr=0.01)   # no momentum: a cheap update
    name = PolicyName.parse(policy)
    if policy == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=dilation.scaled_bytes(DDP_BUCKET_BYTES) / 2**20)
    elif policy == "horovod":
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    elif policy != "compute":
        # dcredit's race runs the baselines with the target's byte settings, scaled like these.
        sizes = {"tune_byte_scale": dilation.byte_scale} if name.base == "dcredit" else {
            "partition_bytes": dilation.scaled_bytes(PARTITION_BYTES),
            "credit_bytes": dilation.scaled_bytes(CREDIT_BYTES)}
        if name.base == "dcredit" and tune_rounds:
            sizes["tune_rounds"] = tune_rounds
        if name.base == "dear":             # DeAR's 25 MiB buffers, scaled like the tensors
            sizes = {"group_bytes": dilation.scaled_bytes(DEAR_BUFFER_BYTES)}
        elif name.shard:                    # the sharded mode's fixed partition, scaled
            sizes = {**sizes, "partition_bytes": dilation.scaled_bytes(PARTITION_BYTES)}
        opt = dcredit_hvd.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(),
            model=model if name.overlap else None, policy=name.base, transport=name.transport,
            shard=name.shard or None, **sizes)

    def step() -> None:
        opt.zero_grad()
        model(x).sum().backward()
        if policy == "horovod":
            with spin():
                opt.synchronize()
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        clock.idle()            # step() may have waited for all-reduces: the device was idle

    config = getattr(opt, "scheduler_config", None)
    if config is not None and config.policy == "dcredit":
        for _ in range(config.profile_warmup + config.profile_steps + 1):
            step()              # dcredit profiles, then plans: before the timed iterations
    return step, opt


#: Iterations a dcredit row may race before it is timed (the default rounds take at most 234).
RACE_CAP = 2000


def run_race(opt: Any, step: Callable[[], None], dilation: replay.Dilation) -> dict[str, Any]:
    """Step until ``dcredit``'s race is over, so that the timed iterations are its winner's
    steady state; what the race took and cost, in cluster time ({} when nothing raced)."""
    def racing() -> bool:        # the race in progress (the runtime's state: this package's own)
        state = getattr(opt, "_state", None)
        return state is not None and state.enabled and state.race is not None

    if not racing():
        return {}
    began, n = time.perf_counter(), 0
    while racing():
        if n == RACE_CAP:
            raise RuntimeError(f"dcredit's race did not end within {RACE_CAP} iterations")
        step()
        n += 1
    race = opt.races[-1]
    ms = dilation.cluster(1e-3) * 1e3          # wall ms -> cluster ms
    table = [{**row, **{k: None if row[k] is None else row[k] * ms
                        for k in ("predicted_ms", "measured_ms", "stderr_ms")}}
             for row in race["table"]]
    return {"winner": race["winner"], "iterations": n, "table": table,
            "cluster_ms": dilation.cluster(time.perf_counter() - began) * 1e3,
            "cost_ms": dilation.cluster(race["cost_s"]) * 1e3,
            "refit_per_allreduce_s": race["refit"]["per_allreduce_s"]}


def communication_step(model: Any, hvd: Any, poll_seconds: float) -> Callable[[], None]:
    """Every gradient all-reduced back to back, as plain Horovod submits them; waited for by
    polling every ``poll_seconds`` (the scheduler's dilated poll), not ``hvd.synchronize``'s
    spin (``IdleSpin``)."""
    import torch

    from ..transports.horovod import wait

    grads = [(n, torch.zeros_like(p)) for n, p in model.named_parameters()]

    def step() -> None:
        handles = [hvd.allreduce_async_(g, name=f"emulate.comm.{n}") for n, g in grads]
        for h in handles:
            wait(h, poll_seconds)
    return step


def startup_seconds(hvd: Any, repeats: int = 15) -> float:
    """Median wall seconds of a one-element ``hvd.allreduce``: Horovod's cycle (dilated) plus
    its per-operation cost on this CPU, measured beside nothing else (the live fit of dcredit's
    profiler is taken while the model computes, and on a shared CPU comes out high)."""
    import statistics

    import torch

    x = torch.zeros(1)
    seconds = []
    for i in range(repeats):
        began = time.perf_counter()
        hvd.allreduce(x, name=f"emulate.startup.{i}")
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds)


def halves_costs(hvd: Any, total_bytes: int) -> list[dict[str, float]]:
    """The reduce-scatter's and the all-gather's cost models on this link, fitted as the
    sharded optimizer fits them (``profiler.measure_cost_model``), beside nothing else: DeAR's
    rows are priced with them.  ``halves.split_cost`` (half an all-reduce each) is no guess to
    price them with here: Horovod's Gloo reduce-scatter measured 81% of an all-reduce's
    seconds per byte on 8 hosts, its all-gather 53% (docs/benchmarks.md)."""
    import dataclasses

    from dcredit_hvd.planning.profiler import measure_cost_model
    from dcredit_hvd.transports.horovod import HorovodTransport

    transport = HorovodTransport(hvd.global_process_set)
    return [dataclasses.asdict(measure_cost_model(total_bytes, transport, collective=what,
                                                  prefix=f"emulate.halves.{what}")[0])
            for what in ("reduce_scatter", "all_gather")]


def update_cost(model: Any, dilation: replay.Dilation) -> float:
    """Cluster ms of one plain SGD update of the replay's parameters (real CPU work, not
    replayed; reported beside the table)."""
    import torch

    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    began = time.perf_counter()
    for _ in range(3):
        opt.step()
    return dilation.cluster((time.perf_counter() - began) / 3) * 1e3


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dilation = replay.Dilation.for_cluster(args.target_rate, args.link_rate,
                                           byte_scale=args.byte_scale, time_factor=args.time_factor)
    profile, record = replay.load(replay.resolve(args.profile))
    os.environ.update(dilation.environment())
    os.environ.setdefault("HOROVOD_FUSION_THRESHOLD", str(dilation.scaled_bytes(FUSION_BYTES)))
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dilation.check_memory(profile, hvd.size())
    slack_ok = replay.tighten_timer_slack()
    clock = replay.ReplayClock(args.slack)
    runner = Runner(hvd, args, dilation, clock)
    x = replay.replay_input()

    def fresh() -> Any:
        return replay.build_model(profile, dilation, clock=clock)

    runner.log(f"Emulated cluster: {hvd.size()} hosts, target NICs {dilation.target_rate / 1e9:g} "
               f"Gbit/s emulated on {args.link_rate}: K = {dilation.time_factor:g}, S = "
               f"{dilation.byte_scale}; profile {args.profile} ({profile.num_tensors} tensors, "
               f"{profile.total_bytes / 1e6:.1f} MB, compute {sum(profile.t_f + profile.t_b) * 1e3:.1f}"
               f" ms); HOROVOD_CYCLE_TIME={os.environ['HOROVOD_CYCLE_TIME']} ms, fusion "
               f"{os.environ['HOROVOD_FUSION_THRESHOLD']} B; timer slack 1 ns: {slack_ok}")
    results: dict[str, Any] = {
        "profile": args.profile, "source": record.get("source"), "hosts": hvd.size(),
        "host_names": hvd.allgather_object(platform.node()), "target_rate": dilation.target_rate,
        "link_rate": dilation.link_rate, "time_factor": dilation.time_factor,
        "byte_scale": dilation.byte_scale, "allreduce": allreduce_name(),
        "loadavg_start": os.getloadavg(), "policies": {}}
    results["update_ms"] = update_cost(fresh(), dilation)
    results["startup_wall_s"] = startup_seconds(hvd)
    if any(PolicyName.parse(p).base == "dear" for p in args.policies):
        results["halves_wall"] = halves_costs(hvd, dilation.scaled_bytes(profile.total_bytes))
    results["compute"] = runner.run("compute only", make_step("compute", fresh(), hvd,
                                                             dilation, x, runner.spin)[0])
    results["communication"] = runner.run("communication only", communication_step(
        fresh(), hvd, dilation.poll_seconds))
    if any(p.base == "ddp" or p.transport for p in map(PolicyName.parse, args.policies)):
        init_gloo_process_group(hvd)
    kept: dict[str, Any] = {}
    for policy in args.policies:
        step, opt = make_step(policy, fresh(), hvd, dilation, x, runner.spin, args.tune_rounds)
        race = run_race(opt, step, dilation)
        before = changes(opt)
        results["policies"][policy] = runner.run(policy, step)
        if race:
            results["policies"][policy]["race"] = race
            # A re-plan (or a new race) among the timed iterations makes them another schedule's.
            results["policies"][policy]["timed_changes"] = changes(opt) - before
        kept[policy] = kept_of(opt)
        results["policies"][policy]["setup"] = describe(kept[policy])
        del step, opt
        gc.collect()
    results["loadavg_end"] = os.getloadavg()
    from .emulate_report import analyse, print_report

    analyse(results, profile, dilation, kept)
    if hvd.rank() == 0:
        print_report(results)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(results, fh, indent=1)
            print(f"results written to {args.json}", flush=True)
    return 0


def changes(opt: Any) -> int:
    """Re-plans and races so far (0 for a baseline optimizer)."""
    return len(getattr(opt, "replans", ())) + len(getattr(opt, "races", ()))


def describe(kept: Any) -> dict[str, Any]:
    """What the JSON keeps of a policy's set-up: its byte settings, dcredit's plan and the live
    cost models, the halves' too (so that predictions can be recomputed from the file)."""
    import dataclasses

    out: dict[str, Any] = {}
    config = kept.scheduler_config
    if config is not None:
        out.update(partition_bytes=config.partition_bytes, credit_bytes=config.credit_bytes)
        if config.explicit("group_bytes"):      # DeAR's buffer size, scaled (make_step)
            out["group_bytes"] = config.group_bytes
    if kept.plan is not None and dataclasses.is_dataclass(kept.plan):
        out["plan"] = dataclasses.asdict(kept.plan)
    if kept.measured is not None:
        out["live_cost"] = dataclasses.asdict(kept.measured[1])
    if getattr(kept, "halves", None) is not None:     # the sharded plan's fitted halves
        out["halves_cost"] = [dataclasses.asdict(fit) for fit in kept.halves]
    return out


def allreduce_name() -> str:
    """Which all-reduce carries Horovod's operations in this launch."""
    if os.environ.get("HOROVOD_CPU_OPERATIONS", "").lower() == "gloo" or \
            os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"):
        return "Gloo ring (horovodrun --gloo)"
    return collective_algorithm()


if __name__ == "__main__":
    sys.exit(main())
