#!/usr/bin/env python3
"""`make demo-drift`: the network changes during training; who keeps up?

Every policy trains the same GPT-style model (zoo ``gpt2_small`` at 4.2 M parameters, tied
embedding, 128 tokens, batch 4) on its own launch of a 2-host virtual cluster whose NICs follow
the same rate schedule (``scripts/vcluster.sh --rate-schedule``, default 1 Gbit/s, 250 Mbit/s
from 25 s, 1 Gbit/s again from 50 s), for the same wall time.  Rank 0 logs the end time and
length of every iteration and the re-plans; the rate log of the virtual cluster says when each
change took effect, so every iteration falls in the phase it ran in.

Printed per policy and phase: the median iteration (ms), its ratio to the phase's lower bound
(``max(compute only, the links' time for the gradients, compute + the tied embedding's own
all-reduce)`` at that phase's rate, ``docs/algorithm.md`` §1b), how many iterations after the
change back the policy took to return within 10% of its first-phase figure, and each re-plan
(when, why).  Policies: ``dcredit`` (re-plans online, ``drift.py``), ``dcredit-static``
(``replan=False``: one plan for the whole run, the behaviour before online re-planning),
``bytescheduler`` and ``horovod``.

    python scripts/bench_drift.py [--schedule 1gbit,250mbit@25,1gbit@50] [--duration 75]
    python scripts/bench_drift.py --steady 1000      # false positives: N iterations, no change
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from dcredit_hvd.bench.sidebyside import link_need  # noqa: E402  (torch-free: the driver imports no torch)

MODEL = {"vocab": 4096, "ctx": 128, "seq_len": 128, "d": 256, "layers": 4, "heads": 8}
BATCH = 4
POLICIES = ("dcredit", "dcredit-static", "bytescheduler", "horovod")
#: This bench's own row beside the runtime's policies and Horovod, one line.
STATIC = {"dcredit-static": "dcredit with replan=False: the first plan kept through every "
                            "rate change (what re-planning is measured against)"}


def policies_epilog() -> str:
    """``--policies`` names: the runtime's policies, Horovod, ``dcredit-static``, one line each."""
    from dcredit_hvd.bench.report import BASELINE_DESCRIPTIONS, describe_lines
    from dcredit_hvd.policies import DESCRIBE

    return ("--policies names:\n" + describe_lines(
        {**DESCRIBE, **STATIC, "horovod": BASELINE_DESCRIPTIONS["horovod"]}))


# ---- the worker: one policy, on every rank, inside the virtual cluster -------------------------

def worker(args: argparse.Namespace) -> int:
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F

    import dcredit_hvd
    from dcredit_hvd.bench import zoo

    hvd.init()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    started = float(os.environ.get("DRIFT_START", time.time()))
    options = {k: v for k, v in MODEL.items()}
    if args.small:
        options.update(d=128, layers=2, vocab=2048, seq_len=64, ctx=64)
    torch.manual_seed(42)
    model = zoo.build("gpt2_small", **{k: v for k, v in options.items()})
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    torch.manual_seed(0)
    data = torch.randint(0, options["vocab"], (BATCH, options["seq_len"] + 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    policy = args.policy
    grads = [(n, torch.zeros_like(p)) for n, p in model.named_parameters()]

    def communicate() -> None:
        """Communication alone: every gradient all-reduced back to back, as Horovod submits
        them (the bench's ``communication only``)."""
        handles = [hvd.allreduce_async_(g, name=f"drift.comm.{n}") for n, g in grads]
        for h in handles:
            hvd.synchronize(h)

    if policy == "horovod":
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    elif policy not in ("compute", "communication"):
        opt = dcredit_hvd.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(), model=model,
            policy="dcredit" if policy.startswith("dcredit") else policy,
            replan=policy != "dcredit-static")
    iterations = []
    last = time.time()
    while True:
        if policy == "communication":
            communicate()
        else:
            opt.zero_grad()
            logits = model(data[:, :-1])
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                            data[:, 1:].reshape(-1)).backward()
            opt.step()
        now = time.time()
        iterations.append((now, now - last))
        last = now
        # Every rank stops at the same iteration: rank 0 decides (one tiny collective per
        # iteration, the same for every policy).
        done = (args.steady and len(iterations) >= args.steady) or (
            not args.steady and now - started >= args.duration)
        flag = torch.tensor([1.0 if done and hvd.rank() == 0 else 0.0])
        if hvd.allreduce(flag, op=hvd.Sum, name="drift.stop").item() > 0:
            break
    if hasattr(opt, "apply_pending_updates"):
        opt.apply_pending_updates()
    if hvd.rank() == 0:
        record = {"policy": policy, "iterations": iterations, "started": started,
                  "replans": getattr(opt, "replans", []),
                  "bytes": sum(p.numel() * 4 for p in model.parameters()),
                  "tied_bytes": model.wte.weight.numel() * 4,
                  "rate_log": _read_rate_log(), "schedule": os.environ.get("VCLUSTER_RATE_SCHEDULE")}
        Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


def _read_rate_log() -> list[tuple[float, str]]:
    """``(unix time, rate)`` of each change the virtual cluster applied (``VCLUSTER_RATE_LOG``)."""
    path = os.environ.get("VCLUSTER_RATE_LOG")
    if not path or not os.path.exists(path):
        return []
    changes = []
    for line in Path(path).read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2:
            try:
                changes.append((float(parts[0]), parts[1]))
            except ValueError:
                continue
    return changes


# ---- the driver: one launch per policy, then the table ------------------------------------------

def launch(policy: str, schedule: str | None, args: argparse.Namespace, out: Path) -> dict:
    venv_python = os.environ.get("PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    first_rate = (schedule or "1gbit").split(",")[0]
    shaping = ["--rate-schedule", schedule] if schedule and "," in schedule else []
    cmd = [str(ROOT / "scripts" / "vcluster.sh"), *shaping, "2", first_rate, "--",
           "timeout", "-k", "10", str(int(args.duration) + 300), "mpirun", "-np", "2",
           "-H", "h0,h1", "--bind-to", "none",
           "--mca", "coll_tuned_use_dynamic_rules", "1", "--mca", "coll_tuned_allreduce_algorithm", "3",
           "-x", "PATH", "-x", "DCREDIT_LOG_LEVEL", "-x", "GLOO_SOCKET_IFNAME", "-x", "DRIFT_START",
           "-x", "VCLUSTER_RATE_LOG", "-x", "VCLUSTER_RATE_SCHEDULE",
           venv_python, str(Path(__file__).resolve()), "--worker", "--policy", policy,
           "--duration", str(args.duration), "--out", str(out)]
    if args.steady:
        cmd += ["--steady", str(args.steady)]
    if args.small:
        cmd += ["--small"]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               DCREDIT_LOG_LEVEL=os.environ.get("DCREDIT_LOG_LEVEL", "INFO"),
               DRIFT_START=str(time.time()))
    print(f"[drift] {policy}: {' '.join(cmd)}", flush=True)
    status = subprocess.run(cmd, env=env, cwd=ROOT).returncode
    if status or not out.exists():
        raise SystemExit(f"bench_drift: the {policy} launch failed (exit status {status})")
    return json.loads(out.read_text())


def phases(record: dict) -> list[tuple[str, float, float]]:
    """``(rate, start, end)`` in unix seconds for each phase the cluster ran."""
    changes = record["rate_log"] or [(record["started"], (record["schedule"] or "1gbit").split(",")[0])]
    end = record["iterations"][-1][0] if record["iterations"] else changes[-1][0]
    return [(rate, t, changes[i + 1][0] if i + 1 < len(changes) else end)
            for i, (t, rate) in enumerate(changes)]


def summarise(record: dict, compute_s: float, comm_s: dict[str, float]) -> list[dict]:
    """Per phase: iterations that ran entirely inside it (the first 5 of the run left out:
    start-up and dcredit's profiling), their median and the median of the phase's last 10
    (settled: after any re-plan), and the phase's lower bound: ``max(compute only,
    communication only measured at that rate, compute + the tied embedding's all-reduce)``."""
    rows = []
    iterations = record["iterations"][5:]
    for rate, start, end in phases(record):
        inside = [dt for t, dt in iterations if t - dt >= start and t <= end]
        if not inside:
            continue
        on_link = link_need(record["bytes"], 2, rate)
        if on_link is None:
            raise ValueError(f"bench_drift: unknown rate {rate!r} (use e.g. 250mbit, 1gbit)")
        bound = max(compute_s, comm_s.get(rate, on_link["seconds"]),
                    compute_s + link_need(record["tied_bytes"], 2, rate)["seconds"])
        rows.append({"rate": rate, "start": start, "end": end, "count": len(inside),
                     "median_s": statistics.median(inside), "mean_s": statistics.fmean(inside),
                     "settled_s": statistics.median(inside[-10:]),
                     "bound_s": bound, "all": [(t, dt) for t, dt in iterations
                                               if t - dt >= start and t <= end]})
    return rows


def recovery(rows: list[dict]) -> int | None:
    """Iterations after the last change until a 5-iteration median is back within 10% of the
    first phase's median (None when it never is, or there was no change back)."""
    if len(rows) < 3:
        return None
    target = rows[0]["median_s"] * 1.10
    after = [dt for _, dt in rows[-1]["all"]]
    for i in range(len(after) - 4):
        if statistics.median(after[i:i + 5]) <= target:
            return i + 5
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=policies_epilog())
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    # The worker's one row (a --policies name, or the bounds compute / communication).
    parser.add_argument("--policy", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    parser.add_argument("--schedule", default="1gbit,250mbit@25,1gbit@50")
    parser.add_argument("--duration", type=float, default=75.0)
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help=f"rows, listed below (default {','.join(POLICIES)})")
    parser.add_argument("--steady", type=int, default=0,
                        help="instead: N iterations at a steady 1 Gbit/s, dcredit only; counts re-plans")
    parser.add_argument("--small", action="store_true", help="a 2-layer d=128 model (faster iterations)")
    parser.add_argument("--results", default=str(ROOT / "results" / "drift"))
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    if args.steady:
        record = launch("dcredit", None, args, out / "steady.json")
        n = len(record["iterations"])
        print(f"\nsteady 1 Gbit/s, {n} iterations of dcredit: {len(record['replans'])} re-plan(s)"
              + "".join(f"\n  iteration {r['iteration']}: {r['reason']}" for r in record["replans"]))
        return 0
    compute = launch("compute", None, argparse.Namespace(**{**vars(args), "duration": 15.0}),
                     out / "compute.json")
    compute_s = statistics.median(dt for _, dt in compute["iterations"][5:])
    comm_s = {}
    for rate in dict.fromkeys(e.split("@")[0] for e in args.schedule.split(",")):
        steady = argparse.Namespace(**{**vars(args), "duration": 15.0})
        record = launch("communication", rate, steady, out / f"communication-{rate}.json")
        comm_s[rate] = statistics.median(dt for _, dt in record["iterations"][3:])
    print(f"\ncompute only: {compute_s * 1e3:.1f} ms per iteration; communication only: "
          + ", ".join(f"{r} {t * 1e3:.1f} ms" for r, t in comm_s.items()))
    table = {}
    for policy in args.policies.split(","):
        record = launch(policy, args.schedule, args, out / f"{policy}.json")
        table[policy] = (summarise(record, compute_s, comm_s), record)
    print(f"\nrate schedule {args.schedule} (seconds from the start of each launch), "
          f"{args.duration:.0f} s per policy, 2 hosts; median ms per iteration over the phase, "
          "then over its last 10 iterations (settled, after any re-plan), x the phase's lower "
          "bound\n")
    names = [row["rate"] + f"@{row['start'] - table[next(iter(table))][1]['started']:.0f}s"
             for row in next(iter(table.values()))[0]]
    print("| policy | " + " | ".join(names) + " | back within 10% after (iterations) | re-plans |")
    print("|---|" + "---:|" * len(names) + "---:|---|")
    for policy, (rows, record) in table.items():
        cells = [f"{r['median_s'] * 1e3:.0f} / {r['settled_s'] * 1e3:.0f} "
                 f"({r['settled_s'] / r['bound_s']:.2f}x, n={r['count']})" for r in rows]
        back = recovery(rows)
        events = "; ".join(f"{r['time'] - record['started']:.0f} s (iteration {r['iteration']}): "
                           f"{r['reason']}" for r in record["replans"]) or "-"
        print(f"| {policy} | " + " | ".join(cells) + f" | {back if back is not None else '-'} | {events} |")
    bounds = next(iter(table.values()))[0]
    print("\nlower bounds: " + ", ".join(f"{r['rate']} {r['bound_s'] * 1e3:.0f} ms" for r in bounds))
    (out / "summary.json").write_text(json.dumps(
        {p: {"phases": [{k: v for k, v in r.items() if k != "all"} for r in rows],
             "recovery": recovery(rows), "replans": rec["replans"]}
         for p, (rows, rec) in table.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
