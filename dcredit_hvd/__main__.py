"""Command line: ``python -m dcredit_hvd <command> ...``.

Commands live in a registry (``COMMANDS``); another module adds one with ``register``::

    register(Command("bench", "run the benchmark", configure=add_args, run=do_bench))

``simulate`` prints every policy side by side for a zoo model on a modelled link; ``plan`` prints
D-Credit's chosen partition and windows.  With ``--profile FILE.json`` (written by the runtime when
``DCREDIT_PROFILE_OUT`` is set) both use the MEASURED profile and fitted cost model instead of a zoo
model and a modelled link.  Neither needs torch nor Horovod.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: Bandwidth units, in bits per second.  Decimal, as network speeds are quoted.
#: ``GB``/``MB`` are refused: bytes or bits would be a guess.
_RATE_UNITS = {"": 1.0, "bit": 1.0, "bps": 1.0,
               "k": 1e3, "kbit": 1e3, "kbps": 1e3,
               "m": 1e6, "mbit": 1e6, "mbps": 1e6,
               "g": 1e9, "gbit": 1e9, "gbps": 1e9,
               "t": 1e12, "tbit": 1e12, "tbps": 1e12}
_TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
               "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30}
_NUMBER = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Zµ/]*)\s*"


def _parse(text: str, units: dict, what: str, example: str) -> float:
    match = re.fullmatch(_NUMBER, str(text))
    unit = match.group(2).lower() if match else None
    if unit and units is _RATE_UNITS and unit.endswith("/s"):
        unit = unit[:-2]  # "10Gbit/s"
    if not match or unit not in units:
        raise argparse.ArgumentTypeError(f"{what} {text!r} not understood; write e.g. {example}")
    return float(match.group(1)) * units[unit]


def parse_rate(text: str) -> float:
    """``10Gbit``, ``1Gbit``, ``25Gbps``, ``100Mbit`` -> bits per second (a bare number is bit/s)."""
    value = _parse(text, _RATE_UNITS, "bandwidth", "10Gbit, 25Gbit or 100Mbit")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"bandwidth must be > 0, got {text!r}")
    return value


def parse_time(text: str) -> float:
    """``50us``, ``1ms``, ``0.5s`` -> seconds (a bare number is seconds)."""
    value = _parse(text, _TIME_UNITS, "time", "50us, 1ms or 0.002s")
    if value < 0:
        raise argparse.ArgumentTypeError(f"time must be >= 0, got {text!r}")
    return value


def parse_size(text: str) -> int:
    """``4MiB``, ``4MB``, ``4000000``, ``0`` -> bytes (decimal ``MB``, binary ``MiB``)."""
    return int(_parse(text, _BYTE_UNITS, "size", "4MiB, 4MB or 4194304"))


def _positive_size(text: str) -> int:
    value = parse_size(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0 bytes, got {text!r}")
    return value


@dataclass(frozen=True)
class Command:
    """One subcommand: ``configure`` adds its arguments, ``run`` executes it (exit status)."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def register(command: Command) -> Command:
    """Add ``command`` to the CLI (replacing one of the same name)."""
    COMMANDS[command.name] = command
    return command


#: The simulator's names that neither the runtime nor the bench takes, one line each.
SIMULATOR_ONLY = {
    "immediate": "every block sent the moment its gradient is ready, at partition_bytes, no "
                 "window (the non-gate ranks' rule)",
}


def simulator_policies() -> dict[str, str]:
    """Every name ``simulate --policies`` accepts, with its one line: the runtime's policies'
    (``policies.DESCRIBE``), Horovod's the bench's, the rest ``SIMULATOR_ONLY``."""
    from .bench.report import BASELINE_DESCRIPTIONS
    from .planning import simulator
    from .policies import DESCRIBE

    known = {**DESCRIBE, "horovod": BASELINE_DESCRIPTIONS["horovod"], **SIMULATOR_ONLY}
    return {name: known[name] for name in simulator.POLICY_NAMES}


def _policies_epilog() -> str:
    """The top-level ``--help``'s list: the runtime's policies, then what simulate adds."""
    from .bench.report import describe_lines
    from .policies import DESCRIBE, POLICIES

    extra = {k: v for k, v in simulator_policies().items() if k not in POLICIES}
    return ("policies (DistributedOptimizer(policy=...), DCREDIT_POLICY, simulate --policies):\n"
            + describe_lines({name: DESCRIBE[name] for name in POLICIES})
            + "\nsimulate --policies also takes:\n" + describe_lines(extra))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dcredit_hvd",
        description="D-Credit communication scheduling for Horovod: tools.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_policies_epilog())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in COMMANDS.values():
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        command.configure(p)
        p.set_defaults(_run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except ValueError as exc:
        parser.exit(2, f"{parser.prog} {args.command}: error: {exc}\n")
    except BrokenPipeError:  # output piped into `head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


# --------------------------------------------------------------------------------------------
# simulate / plan
# --------------------------------------------------------------------------------------------

#: Effective device throughput assumed unless told: 10 TFLOP/s (a V100-class GPU at fp32, or a
#: fast GPU at a realistic fraction of its peak).
DEFAULT_DEVICE_TFLOPS = 10.0


def _list_of(parse: Callable[[str], object]) -> Callable[[str], list]:
    return lambda text: [parse(x.strip()) for x in text.split(",") if x.strip()]


def _add_model_args(p: argparse.ArgumentParser, sweep: bool) -> None:
    from .bench import zoo
    from .planning import simulator

    several = " (comma-separated list to sweep)" if sweep else ""
    p.add_argument("--model", type=_list_of(str), default=None,
                   help=f"zoo model: {', '.join(zoo.MODELS)}{several}")
    p.add_argument("--profile", default=None, metavar="FILE.json",
                   help="a measured profile written by the runtime (DCREDIT_PROFILE_OUT): use its "
                        "profile and fitted cost model instead of --model and the link options")
    p.add_argument("--workers", type=int, default=16, help="data-parallel workers (default 16)")
    p.add_argument("--bandwidth", type=_list_of(parse_rate), default=[10e9],
                   help=f"link bandwidth per worker, e.g. 1Gbit, 10Gbit, 25Gbit{several} "
                        f"(default 10Gbit)")
    p.add_argument("--latency", type=parse_time, default=50e-6,
                   help="one-hop latency, e.g. 50us (default 50us)")
    p.add_argument("--op-overhead", type=parse_time, default=simulator.DEFAULT_OP_OVERHEAD_S,
                   help="fixed cost per all-reduce besides the network (default 50us)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="per-worker batch (default: resnet50 64, vgg16 64, gpt2_small 8 sequences)")
    p.add_argument("--device-tflops", type=float, default=DEFAULT_DEVICE_TFLOPS,
                   help=f"effective device throughput, TFLOP/s (default {DEFAULT_DEVICE_TFLOPS:g})")
    p.add_argument("--element-size", type=int, default=4, choices=(2, 4),
                   help="bytes per gradient element as sent: 4 float32, 2 fp16 compression")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=False,
                   help="overlap communication with the next forward (D-Credit phase 2); "
                        "default --no-overlap, what the runtime does today")
    p.add_argument("--cycle", type=parse_time, default=simulator.DEFAULT_CYCLE_S,
                   help="HOROVOD_CYCLE_TIME (default 1ms)")
    p.add_argument("--fusion", type=parse_size, default=None,
                   help="HOROVOD_FUSION_THRESHOLD (default 128MiB; wfbp always runs unfused)")
    p.add_argument("--candidates", type=_list_of(_positive_size),
                   default=list(simulator.DEFAULT_CANDIDATES),
                   help="comma-separated partition sizes D-Credit tries (default 256KiB..64MiB, x2)")


def _setup(args: argparse.Namespace, model: str, bandwidth: float):
    from .bench import zoo
    from .planning import simulator

    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    if args.device_tflops <= 0:
        raise ValueError(f"--device-tflops must be > 0, got {args.device_tflops}")
    if args.batch_size is not None and args.batch_size <= 0:
        raise ValueError(f"--batch-size must be > 0, got {args.batch_size}")
    entry = zoo.entry(model)
    batch = args.batch_size or entry.default_batch
    profile = zoo.profile(model, batch, args.device_tflops * 1e12, args.element_size)
    cost = simulator.link_cost(bandwidth, args.latency, args.workers, args.op_overhead)
    return entry, batch, profile, cost


def _load_measured(path: str):
    """``(profile, cost, record)`` from a ``DCREDIT_PROFILE_OUT`` file (see ``optimizer.py``)."""
    from .planning import decision as planning
    from .planning.costmodel import CostModel
    from .planning.profile import Profile

    record = planning.read(path)
    try:
        c, p = record["cost"], record["profile"]
        cost = CostModel(a=float(c["a"]), b=float(c["b"]), residual=c.get("residual"),
                         r2=c.get("r2"), floor=float(c.get("floor", 0.0)))
        profile = Profile.from_lists(p["names"], p["nbytes"], p["element_size"], p["t_f"],
                                     p["t_b"], p.get("t_u") or (), p.get("kinds") or ())
    except (KeyError, TypeError) as exc:
        raise ValueError(f"profile {path!r} lacks a field or has a wrong type: {exc!r}; expected "
                         f"{{'cost': {{'a', 'b', ...}}, 'profile': {{'names', 'nbytes', "
                         f"'element_size', 't_f', 't_b', 't_u'}}, ...}}") from None
    if profile.num_tensors == 0:
        raise ValueError(f"profile {path!r} has no tensors")
    return profile, cost, record


def _check_source(args: argparse.Namespace) -> None:
    if (args.model is None) == (args.profile is None):
        raise ValueError("give either --model (a zoo model) or --profile FILE.json (a measured one)")


def _measured_header(args: argparse.Namespace, profile, cost) -> list[str]:
    return [
        (f"measured profile {args.profile}: {profile.num_tensors} tensors, "
         f"{profile.total_bytes / 1e6:.1f} MB of gradients as sent"),
        (f"compute: forward {profile.forward_time * 1e3:.1f} ms, backward "
         f"{profile.backward_time * 1e3:.1f} ms, update {sum(profile.t_u) * 1e3:.1f} ms"),
        (f"fitted cost model: {cost.describe()}; Horovod cycle {args.cycle * 1e3:g} ms, "
         f"fusion {_fusion_text(args)}"),
        f"mode: {_mode_text(args)}",
    ]


def _canonical(model: str) -> str:
    from .bench import zoo
    return zoo.ALIASES.get(model.lower(), model.lower())


def _fusion_text(args: argparse.Namespace) -> str:
    return "128MiB" if args.fusion is None else f"{args.fusion} B"


def _mode_text(args: argparse.Namespace) -> str:
    if getattr(args, "shard", False):
        return (f"sharded over {args.workers} ranks: reduce-scatter in backward, all-gather in "
                f"the next forward (horovod unsharded)")
    return ("overlap with the next forward" if args.overlap
            else "no overlap (step waits for all all-reduces)")


def _header(args: argparse.Namespace, model: str, bandwidth: float, entry, batch: int, profile,
            cost) -> list[str]:
    return [
        (f"model {_canonical(model)}: {profile.num_tensors} tensors, "
         f"{profile.total_bytes / 1e6:.1f} MB of gradients as sent; batch {batch} "
         f"({entry.unit}) per worker"),
        (f"compute at {args.device_tflops:g} TFLOP/s: forward {profile.forward_time * 1e3:.1f} ms, "
         f"backward {profile.backward_time * 1e3:.1f} ms (t_b = 2 t_f), update not modelled"),
        (f"link: {args.workers} workers, {bandwidth / 1e9:g} Gbit/s, latency "
         f"{args.latency * 1e6:g} us -> ring all-reduce a = {cost.a * 1e3:.3f} ms, "
         f"b = {cost.b:.4g} s/B; Horovod cycle {args.cycle * 1e3:g} ms, "
         f"fusion {_fusion_text(args)}"),
        f"mode: {_mode_text(args)}",
    ]


def _table(rows: list[list[str]], right: Sequence[bool], markdown: bool = False) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for k, row in enumerate(rows):
        cells = [c.rjust(w) if right[i] else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        if markdown:
            out.append("| " + " | ".join(cells) + " |")
            if k == 0:
                out.append("|" + "|".join(("-" * (w + 1)) + (":" if right[i] else "-")
                                          for i, w in enumerate(widths)) + "|")
        else:
            out.append("  ".join(cells).rstrip())
            if k == 0:
                out.append("  ".join("-" * w for w in widths))
    return out


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "whole"
    if nbytes % (1 << 20) == 0:
        return f"{nbytes >> 20}MiB"
    if nbytes % (1 << 10) == 0:
        return f"{nbytes >> 10}KiB"
    return f"{nbytes / 1e6:g}MB"


def _configure_simulate(p: argparse.ArgumentParser) -> None:
    from .bench.report import describe_lines
    from .planning import simulator

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = "--policies names:\n" + describe_lines(simulator_policies())
    _add_model_args(p, sweep=True)
    p.add_argument("--partition", type=_positive_size, default=simulator.DEFAULT_PARTITION_BYTES,
                   help="bytescheduler's block size (default 4MB = 1M float32 elements)")
    p.add_argument("--credit", type=_positive_size, default=simulator.DEFAULT_CREDIT_BYTES,
                   help="bytescheduler's credit (default 16MB = 4M float32 elements)")
    p.add_argument("--policies", default="horovod,wfbp,bytescheduler,dcredit",
                   help="comma-separated policies to simulate, listed below (default: "
                        "horovod,wfbp,bytescheduler,dcredit)")
    p.add_argument("--shard", action="store_true",
                   help="the sharded mode (the runtime's shard=True): reduce-scatter in "
                        "backward, each rank updates its 1/N shard, all-gather in the next "
                        "forward (implies --overlap; every policy but horovod)")
    p.add_argument("--markdown", action="store_true", help="print tables in Markdown")


def _run_simulate(args: argparse.Namespace) -> int:
    from .planning import simulator

    policies = [x.strip().lower() for x in args.policies.split(",") if x.strip()]
    if args.shard:
        args.overlap = True
    for name in policies:
        if name not in simulator.POLICY_NAMES:
            raise ValueError(f"unknown policy {name!r}; choose from {', '.join(simulator.POLICY_NAMES)}")
    _check_source(args)
    measured = None
    if args.profile is not None:
        measured = _load_measured(args.profile)
        configs = [(None, None)]
    else:
        configs = [(m, bw) for m in args.model for bw in args.bandwidth]
    sweep = len(configs) > 1
    rows = [(["model", "Gbit/s"] if sweep else [])
            + ["policy", "iteration ms", "vs horovod", "/ bound", "link busy ms", "exposed ms",
               "all-reduces", "partition"]]
    notes: list[str] = []
    headers: list[str] = []
    for model, bandwidth in configs:
        if measured is not None:
            profile, cost, _ = measured
            headers = _measured_header(args, profile, cost)
        elif not sweep:
            entry, batch, profile, cost = _setup(args, model, bandwidth)
            headers = _header(args, model, bandwidth, entry, batch, profile, cost)
        else:
            entry, batch, profile, cost = _setup(args, model, bandwidth)
            line = (f"{_canonical(model)}: batch {batch} ({entry.unit}), "
                    f"{profile.total_bytes / 1e6:.1f} MB of gradients, compute "
                    f"{profile.forward_time * 1e3:.1f} + {profile.backward_time * 1e3:.1f} ms "
                    f"(forward + backward)")
            if line not in headers:
                headers.append(line)
        results = simulator.compare(profile, cost, policies=policies,
                                    partition_bytes=args.partition, credit_bytes=args.credit,
                                    overlap_forward=args.overlap, cycle_s=args.cycle,
                                    fusion_bytes=args.fusion, candidates=args.candidates,
                                    shard=args.shard, workers=args.workers)
        base = next((r.iteration_s for r in results if r.policy == "horovod"), None)
        for r in results:
            rows.append(([_canonical(model), f"{bandwidth / 1e9:g}"] if sweep else []) + [
                r.policy, f"{r.iteration_s * 1e3:.1f}",
                f"{base / r.iteration_s:.3f}x" if base else "-",
                f"{r.gap:.3f}", f"{r.link_busy_s * 1e3:.1f}", f"{r.exposed_comm_s * 1e3:.1f}",
                f"{r.ops_per_iteration:.0f}",
                "-" if r.policy in (simulator.LOWER_BOUND, simulator.NO_OVERLAP_BOUND)
                else _size(r.partition_bytes),
            ])
            if r.search:
                where = f" ({_canonical(model)}, {bandwidth / 1e9:g} Gbit/s)" if sweep else ""
                notes.extend(_search_lines(r, where))
    if sweep:
        c = simulator.link_cost(args.bandwidth[0], args.latency, args.workers, args.op_overhead)
        common = (f"{args.workers} workers, latency {args.latency * 1e6:g} us (a = "
                  f"{c.a * 1e3:.3f} ms per all-reduce), {args.device_tflops:g} TFLOP/s, "
                  f"t_b = 2 t_f, update not modelled; Horovod cycle {args.cycle * 1e3:g} ms, "
                  f"fusion {_fusion_text(args)}; mode: {_mode_text(args)}")
        headers = [common, *headers]
    print("\n".join(headers))
    print()
    print("\n".join(_table(rows, [False] * (3 if sweep else 1) + [True] * 7, args.markdown)))
    if notes:
        print()
        print("\n".join(notes))
    return 0


def _search_lines(result, where: str = "") -> list[str]:
    """One line per planner rule tried by ``simulator.best_dcredit``, the winner marked."""
    rules: dict[str, list[str]] = {}
    for rule, size, seconds in result.search_all or [(result.plan.label, s, t) for s, t in result.search]:
        rules.setdefault(rule, []).append(f"{_size(size)} {seconds * 1e3:.1f}")
    return [f"dcredit search{where}, rule {rule}{' (chosen)' if rule == result.plan.label else ''} "
            f"(simulated ms): {', '.join(tried)}" for rule, tried in rules.items()]


def _configure_plan(p: argparse.ArgumentParser) -> None:
    _add_model_args(p, sweep=False)
    from .planning import planner

    p.add_argument("--partition", type=_positive_size, default=None,
                   help="plan with this block size (spec greedy) instead of searching --candidates")
    p.add_argument("--phase2", choices=planner.PHASE2_RULES, default=planner.PHASE2_PER_TENSOR,
                   help="phase-2 rule with --partition and --overlap (default per_tensor, spec §4)")


def _run_plan(args: argparse.Namespace) -> int:
    from .planning import planner, simulator

    _check_source(args)
    record: dict = {}
    if args.profile is not None:
        profile, cost, record = _load_measured(args.profile)
        print("\n".join(_measured_header(args, profile, cost)))
    else:
        if len(args.model) != 1 or len(args.bandwidth) != 1:
            raise ValueError("plan takes one --model and one --bandwidth")
        model, bandwidth = args.model[0], args.bandwidth[0]
        entry, batch, profile, cost = _setup(args, model, bandwidth)
        print("\n".join(_header(args, model, bandwidth, entry, batch, profile, cost)))
    search: tuple = ()
    if args.partition is None:
        result = simulator.best_dcredit(profile, cost, candidates=args.candidates,
                                        overlap_forward=args.overlap, cycle_s=args.cycle,
                                        fusion_bytes=args.fusion)
        plan, search = result.plan, result.search
    else:
        plan = planner.plan(profile, cost, args.partition, cycle_s=args.cycle,
                            overlap_forward=args.overlap, phase2=args.phase2)
        result = simulator.simulate(profile, cost, _dcredit(plan, args.overlap),
                                    overlap_forward=args.overlap, cycle_s=args.cycle,
                                    fusion_bytes=args.fusion)
    L = plan.num_tensors
    print()
    if search:
        print("\n".join(_search_lines(result)))
    print(f"chosen partition S_p = {plan.partition_bytes} B ({_size(plan.partition_bytes)}); "
          f"simulated iteration {result.iteration_s * 1e3:.1f} ms "
          f"(lower bound {result.lower_bound_s * 1e3:.1f} ms); planner's own model "
          f"{(plan.predicted_iteration or 0) * 1e3:.1f} ms")
    print(plan.describe())
    print()
    print("phase 1 (backward): send budget added when gradient j becomes ready")
    rows = [["window", "j", "tensor", "blocks"]]
    for k, w in enumerate(plan.phase1_windows):
        if w:
            j = L - 1 - k
            rows.append([str(k), str(j), profile.names[j], str(w)])
    print("\n".join(_table(rows, [True, True, False, True])) if len(rows) > 1 else "  (none)")
    print()
    if not args.overlap:
        how = ", all released at once"
    elif not plan.phase2_group and plan.phase2_depth == 1:
        how = ", one window per tensor, each after the previous completed (spec)"
    else:
        how = (f", rule {plan.phase2}: tensors with the same 'sent in' go out as one window, "
               f"up to {plan.phase2_depth} window(s) in flight")
    print("phase 2 (next forward): blocks of tensor l left when backward ends, in forward order"
          + how)
    rows = [["window", "l", "tensor", "blocks", "of", "sent in"]]
    for l, w in enumerate(plan.phase2_windows):
        if w:
            rows.append([str(L - 1 + l), str(l), profile.names[l], str(w),
                         str(plan.blocks_per_tensor[l]),
                         str(plan.phase2_window_of(l)) if args.overlap else "drain"])
    print("\n".join(_table(rows, [True, True, False, True, True, True])) if len(rows) > 1
          else "  (none)")
    print(f"\n{L - 1 - sum(1 for w in plan.phase1_windows if w)} phase-1 and "
          f"{L - sum(1 for w in plan.phase2_windows if w)} phase-2 windows are empty (not shown).")
    if record.get("plan"):
        old = record["plan"]
        windows = list(old.get("windows") or [])
        same = (old.get("partition_bytes") == plan.partition_bytes
                and windows == list(plan.windows))
        print(f"\nthe runtime's recorded plan: S_p = {old.get('partition_bytes')} B, "
              f"{sum(1 for w in windows[:L - 1] if w)} phase-1 windows, "
              f"{sum(windows[L - 1:])} blocks in phase 2"
              + (" (the same windows as above)" if same else " (differs from the plan above)"))
    if record.get("search"):
        print("the runtime's recorded search (predicted ms): "
              + ", ".join(f"{_size(int(s))} {float(t) * 1e3:.1f}" for s, t in record["search"]))
    return 0


def _dcredit(plan, overlap_forward: bool):
    from .policies.dcredit import DCredit
    return DCredit(plan, overlap_forward=overlap_forward)


register(Command("simulate", "simulate every policy on a zoo model and a modelled link, "
                             "or on a measured profile and cost",
                 _configure_simulate, _run_simulate))
register(Command("plan", "print D-Credit's partition and windows for a zoo or measured model",
                 _configure_plan, _run_plan))


if __name__ == "__main__":
    sys.exit(main())
