"""ms per step of one LightningModule under Lightning's ``strategy="ddp"`` and ``"dcredit"``, and of
the same model in a plain torchrun loop with ``dcredit_hvd.DistributedOptimizer``, on 2 virtual
hosts (``scripts/vcluster.sh``, each NIC shaped to 1 Gbit/s full duplex).

    python scripts/bench_lightning.py [--rate 1gbit] [--steps 14] [--rounds 3] [--json FILE]

Without torchrun's variables it launches itself: ``scripts/vcluster.sh 2 RATE --
scripts/torchrun_cluster.sh 2 python scripts/bench_lightning.py ...`` (root; one torchrun per
host, one rank each, Gloo over the shaped NICs).  Every rank then runs the three modes in turn,
``--rounds`` times (a slow spell of the shared machine then falls on every mode), and rank 0
prints a markdown table.

Why these figures: the issue's targets are that the framework path costs nothing (Lightning's
``dcredit`` within 3% of the plain loop) and that it beats Lightning's DDP where communication
is about equal to compute.  The model is a VGG-style CNN whose fully connected layers carry
most of its 3.4 M parameters (13.7 MB of gradients, about 110 ms on a 1 Gbit/s link) while its
convolutions take about as long to compute on one core.  A step is timed from one batch start to
the next (the next forward waits for the overlapped updates, so every update is counted); the
first ``--warmup`` steps of each fit (``dcredit`` measures and plans there) are not.

The plan race (on by default) is off here (``DCREDIT_TUNE=0`` unless set): it runs for tens of
steps, so a fit this short would time each row in the middle of a race among different
schedules; the rows measure what a framework costs over one plan.  The race is measured by
the emulated grid (``docs/benchmarks.md``).
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
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
BATCH = 32


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1gbit", help="each NIC's rate (vcluster.sh)")
    parser.add_argument("--steps", type=int, default=14, help="steps per fit, warm-up included")
    parser.add_argument("--warmup", type=int, default=6, help="steps of each fit not timed")
    parser.add_argument("--rounds", type=int, default=4, help="times each mode runs, in turn")
    parser.add_argument("--json", help="also write the figures here (rank 0)")
    parser.add_argument("--summary", help="append the summary table's rows here (rank 0)")
    return parser.parse_args()


def launch(args: argparse.Namespace) -> int:
    """Not under torchrun: run this script on the virtual cluster, one torchrun per host."""
    command = [str(ROOT / "scripts" / "vcluster.sh"), "2", args.rate, "--",
               str(ROOT / "scripts" / "torchrun_cluster.sh"), "-x", "PYTHONPATH=" + str(ROOT),
               "2", sys.executable, str(Path(__file__).resolve()), "--rate", args.rate,
               "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--rounds", str(args.rounds)]
    if args.json:
        command += ["--json", str(Path(args.json).resolve())]
    if args.summary:
        command += ["--summary", str(Path(args.summary).resolve())]
    env = dict(os.environ, DCREDIT_TUNE=os.environ.get("DCREDIT_TUNE", "0"))
    return subprocess.call(command, cwd=ROOT, env=env)


def build_model() -> Any:
    import torch.nn as nn
    conv = []
    for cin, cout in ((3, 32), (32, 64), (64, 64)):
        conv += [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
    return nn.Sequential(*conv, nn.Flatten(), nn.Linear(64 * 4 * 4, 3072), nn.ReLU(),
                         nn.Linear(3072, 64), nn.ReLU(), nn.Linear(64, 10))


def main(args: argparse.Namespace) -> None:
    import pytorch_lightning as pl
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import dcredit_hvd
    import dcredit_hvd.frameworks.pytorch_lightning  # noqa: F401  (registers strategy="dcredit")

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)          # synthetic data turns values subnormal: slow on CPU
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gen = torch.Generator().manual_seed(0)
    n = BATCH * world * args.steps
    data = TensorDataset(torch.randn(n, 3, 32, 32, generator=gen),
                         torch.randint(0, 10, (n,), generator=gen))

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = build_model()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, *args: Any) -> None:
            self.starts.append(time.perf_counter())

        def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            for p in module.parameters():   # the last step's updates are part of its time
                p.detach().sum()
            self.starts.append(time.perf_counter())

    def lightning(strategy: str) -> list[float]:
        clock = Clock()
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, num_nodes=world,
                             max_steps=args.steps, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False,
                             callbacks=[clock])
        trainer.fit(Module(), DataLoader(data, batch_size=BATCH))
        return clock.starts

    def plain() -> list[float]:
        model = Module().net
        opt = dcredit_hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
            named_parameters=model.named_parameters(), model=model)
        for p in model.state_dict().values():
            dist.broadcast(p, 0)
        x_all, y_all = data.tensors
        starts = []
        for step in range(args.steps):
            starts.append(time.perf_counter())
            at = (step * world + rank) * BATCH
            x, y = x_all[at:at + BATCH], y_all[at:at + BATCH]
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        opt.apply_pending_updates()
        starts.append(time.perf_counter())
        opt.close()
        return starts

    def fabric(dcredit: bool) -> list[float]:
        """The same model, data and optimizer in a Fabric loop: Fabric(strategy="ddp") or
        Fabric(strategy=DCreditFabricStrategy())."""
        import lightning as L

        from dcredit_hvd.frameworks.fabric import DCreditFabricStrategy
        strategy: Any = DCreditFabricStrategy() if dcredit else "ddp"
        fab = L.Fabric(strategy=strategy, accelerator="cpu", devices=1, num_nodes=world)
        fab.launch()
        net = Module().net
        model, opt = fab.setup(net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9))
        x_all, y_all = data.tensors
        starts = []
        for step in range(args.steps):
            starts.append(time.perf_counter())
            at = (step * world + rank) * BATCH
            x, y = x_all[at:at + BATCH], y_all[at:at + BATCH]
            opt.zero_grad()
            fab.backward(F.cross_entropy(model(x), y))
            opt.step()
        if dcredit:
            fab.strategy.teardown()         # closes the wrapper: the owed updates applied
        starts.append(time.perf_counter())
        return starts

    modes: dict[str, Callable[[], list[float]]] = {
        "Lightning, strategy=\"ddp\"": lambda: lightning("ddp"),
        "Lightning, strategy=\"dcredit\"": lambda: lightning("dcredit"),
        "Fabric, strategy=\"ddp\"": lambda: fabric(False),
        "Fabric, DCreditFabricStrategy()": lambda: fabric(True),
        "plain torchrun loop, dcredit_hvd": plain,
    }
    steps: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(args.rounds):
        for name, run in modes.items():
            starts = run()[args.warmup:]
            steps[name] += [b - a for a, b in zip(starts, starts[1:])]
    if rank == 0:
        report(args, steps)


def report(args: argparse.Namespace, steps: dict[str, list[float]]) -> None:
    """Median and lower quartile (a 2-core machine shared with other jobs adds spikes; the
    quartile shows the steps they spared) per mode, and the framework's cost on both."""
    def quartile(values: list[float]) -> float:
        return statistics.quantiles(values, n=4)[0]
    median = {name: 1000 * statistics.median(values) for name, values in steps.items()}
    low = {name: 1000 * quartile(values) for name, values in steps.items()}
    names = list(median)
    ddp = median[names[0]]
    print(f"\n2 hosts, {args.rate} NICs, {args.rounds} rounds x {args.steps - args.warmup} "
          f"timed steps per mode\n")
    print("| run | ms/step (median) | ms/step (lower quartile) | speed-up over Lightning DDP "
          "(median) |")
    print("|---|---:|---:|---:|")
    for name in names:
        print(f"| {name} | {median[name]:.1f} | {low[name]:.1f} | {ddp / median[name]:.2f}x |")
    plain = names[-1]
    cost = {what: figures[names[1]] / figures[plain] - 1
            for what, figures in (("median", median), ("lower quartile", low))}
    print("\nframework cost (Lightning dcredit against the plain dcredit loop): "
          + ", ".join(f"{100 * value:+.1f}% ({what})" for what, value in cost.items()))
    if args.summary:
        with open(args.summary, "a") as out:
            for framework, own, ours in (("Lightning", names[0], names[1]),
                                         ("Fabric", names[2], names[3])):
                out.write(f"| {framework} | {median[own]:.1f} | {median[ours]:.1f} "
                          f"| {median[plain]:.1f} | {100 * (median[ours] / median[plain] - 1):+.1f}% "
                          f"| {median[own] / median[ours]:.2f}x |\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"median_ms": median, "lower_quartile_ms": low,
                                               "steps": steps, "rate": args.rate}, indent=1))


if __name__ == "__main__":
    arguments = parse()
    if "RANK" not in os.environ:
        sys.exit(launch(arguments))
    main(arguments)
