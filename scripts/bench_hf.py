#!/usr/bin/env python
"""ms per step of one Hugging Face model: ``transformers.Trainer`` (DDP) against
``dcredit_hvd.frameworks.hf.DCreditTrainer``, and the same model, optimizer and schedule in a plain
``torchrun`` loop with ``dcredit_hvd.DistributedOptimizer`` (what the Trainer path should cost:
nothing, within 3%), on 2 virtual hosts with 1 Gbit/s NICs.

    python scripts/bench_hf.py                     # root: builds the cluster and launches itself
    python scripts/bench_hf.py --rate 1gbit --steps 12 --rounds 2

Rows (one launch, one process group, in turn; ``--rounds`` repeats the sequence and pools each
row's steps, so a slow spell of a shared machine does not fall on one row only):

* ``Trainer (DDP)``: the plain Trainer; clipping at ``max_grad_norm=1.0`` (its default).
* ``DCreditTrainer``: gradients reduced before clipping, updates at ``step()``.
* ``plain loop, dcredit, sync+clip``: the same work by hand (``synchronize()``, clip,
  ``skip_synchronize()`` + ``step()``): the reference for ``DCreditTrainer``.
* ``DCreditTrainer, overlap`` and ``plain loop, dcredit, overlap``: ``max_grad_norm=0``, each
  update applied as its gradient arrives, overlapping the next forward pass.

The model: GPT-2 (``GPT2LMHeadModel``), 4 layers, d=256, vocab 4096, 128 tokens, batch 4 per rank
(4.2 M parameters, 17 MB of gradients: at 1 Gbit/s about as long to all-reduce as a step's
compute on this machine, the same shape as ``make demo``'s transformer).  Each step's time is
the interval between the ends of consecutive optimizer steps; the first ``--warmup`` steps
(``dcredit``'s profiling included) are not counted.  The plan race is off (``DCREDIT_TUNE=0``
unless set), as in ``bench_lightning.py``: rows this short would be timed mid-race.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent


def _options(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1gbit", help="NIC rate of each virtual host")
    parser.add_argument("--steps", type=int, default=8, help="measured steps per row and round")
    parser.add_argument("--warmup", type=int, default=5, help="uncounted steps per row and round")
    parser.add_argument("--rounds", type=int, default=1, help="times the sequence of rows runs")
    parser.add_argument("--policy", default="dcredit", help="dcredit_hvd policy")
    parser.add_argument("--rows", default="", help="comma-separated row numbers (1-9) to run; "
                        "default all")
    parser.add_argument("--summary", default="", help="append the summary table's rows here "
                        "(rank 0)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def launch(options: argparse.Namespace) -> int:
    """Build the 2-host cluster and run this script on each host under torchrun."""
    command = [str(ROOT / "scripts" / "vcluster.sh"), "2", options.rate, "--",
               str(ROOT / "scripts" / "torchrun_cluster.sh"), "2", sys.executable,
               str(Path(__file__).resolve()), "--worker", "--steps", str(options.steps),
               "--warmup", str(options.warmup), "--rounds", str(options.rounds),
               "--policy", options.policy, "--rate", options.rate, "--rows", options.rows,
               "--summary", str(Path(options.summary).resolve()) if options.summary else ""]
    env = dict(os.environ, DCREDIT_LOG_LEVEL=os.environ.get("DCREDIT_LOG_LEVEL", "WARNING"),
               DCREDIT_TUNE=os.environ.get("DCREDIT_TUNE", "0"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.call(command, env=env, cwd=ROOT)


# -- on each rank ------------------------------------------------------------------------------
def worker(options: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import transformers as tf
    from torch.utils.data import DataLoader, Dataset
    from torch.utils.data.distributed import DistributedSampler

    import dcredit_hvd
    from dcredit_hvd.frameworks.hf import DCreditTrainer

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    tf.logging.set_verbosity_error()
    vocab, seq, batch = 4096, 128, 4
    steps = options.warmup + options.steps
    settings = {"policy": options.policy}

    class Tokens(Dataset):
        def __len__(self) -> int:
            return 10_000

        def __getitem__(self, i: int) -> dict:
            ids = torch.randint(0, vocab, (seq,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids.clone()}

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return tf.GPT2LMHeadModel(tf.GPT2Config(
            vocab_size=vocab, n_positions=seq, n_embd=256, n_layer=4, n_head=8, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))

    def arguments(clip: float, **extra: Any) -> tf.TrainingArguments:
        return tf.TrainingArguments(**extra,
            output_dir=tempfile.mkdtemp(prefix="bench_hf_"), max_steps=steps,
            per_device_train_batch_size=batch, learning_rate=1e-4, max_grad_norm=clip,
            logging_steps=10_000, save_strategy="no", report_to=[], use_cpu=True,
            dataloader_num_workers=0, disable_tqdm=True, log_level="error",
            log_level_replica="error", seed=0)

    class Clock(tf.TrainerCallback):
        def __init__(self, ends: list[float]) -> None:
            self.ends = ends

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.ends.append(time.perf_counter())

    def trainer(cls: type, clip: float, ddp: Any = None, **extra: Any
                ) -> Callable[[list[float]], None]:
        def run(ends: list[float]) -> None:
            args = arguments(clip, ddp_find_unused_parameters=ddp)
            t = cls(model=model(), args=args, train_dataset=Tokens(),
                    callbacks=[Clock(ends)], **extra)
            t.train()
            if isinstance(t, DCreditTrainer) and t.dcredit_optimizer is not None:
                t.dcredit_optimizer.close()
        return run

    def ddp_loop(ends: list[float]) -> None:
        """The same loop on DDP (torch's defaults), clipping at 1.0."""
        net = torch.nn.parallel.DistributedDataParallel(model())
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / steps))
        data = DataLoader(Tokens(), batch_size=batch, sampler=DistributedSampler(Tokens(), seed=0))
        for _, inputs in zip(range(steps), data):
            net(**inputs).loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            sched.step()
            net.zero_grad()
            ends.append(time.perf_counter())

    def plain_loop(overlap: bool) -> Callable[[list[float]], None]:
        """What DCreditTrainer does, by hand: AdamW with the Trainer's weight-decay groups and
        linear schedule, the same data order (a seeded DistributedSampler)."""
        def run(ends: list[float]) -> None:
            net = model()
            net.train()
            decay = [p for n, p in net.named_parameters() if "bias" not in n and "ln" not in n]
            rest = [p for n, p in net.named_parameters() if "bias" in n or "ln" in n]
            opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.0},
                                     {"params": rest, "weight_decay": 0.0}], lr=1e-4)
            opt = dcredit_hvd.DistributedOptimizer(opt, named_parameters=net.named_parameters(),
                                                   model=net, **settings)
            for tensor in list(net.parameters()) + list(net.buffers()):
                dist.broadcast(tensor.data, src=0)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / steps))
            data = DataLoader(Tokens(), batch_size=batch,
                              sampler=DistributedSampler(Tokens(), seed=0))
            for _, inputs in zip(range(steps), data):
                net(**inputs).loss.backward()
                if overlap:
                    opt.step()
                else:
                    opt.synchronize()
                    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                    with opt.skip_synchronize():
                        opt.step()
                sched.step()
                (opt if overlap else net).zero_grad()
                ends.append(time.perf_counter())
            opt.close()
        return run

    def accelerate_loop(dcredit: bool) -> Callable[[list[float]], None]:
        """The plain loop under accelerate.Accelerator() (DDP) or DCreditAccelerator, clipping at
        1.0 through accelerator.clip_grad_norm_."""
        def run(ends: list[float]) -> None:
            import accelerate

            from dcredit_hvd.frameworks.accelerate import DCreditAccelerator
            acc = (DCreditAccelerator(cpu=True, dcredit_policy=options.policy) if dcredit
                   else accelerate.Accelerator(cpu=True))
            net = model()
            net.train()
            opt = torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0.0)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / steps))
            net, opt, sched = acc.prepare(net, opt, sched)
            data = DataLoader(Tokens(), batch_size=batch,
                              sampler=DistributedSampler(Tokens(), seed=0))
            for _, inputs in zip(range(steps), data):
                acc.backward(net(**inputs).loss)
                acc.clip_grad_norm_(net.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
                ends.append(time.perf_counter())
            if isinstance(acc, DCreditAccelerator):  # not end_training(): it destroys the
                acc.settle()                         # process group the next rows use
                for wrapper in acc.dcredit_optimizers:
                    wrapper.close()
        return run

    rows: dict[str, Callable[[list[float]], None]] = {
        "Trainer (DDP)": trainer(tf.Trainer, 1.0),
        "Trainer (DDP, find_unused_parameters=False)": trainer(tf.Trainer, 1.0, ddp=False),
        "DCreditTrainer": trainer(DCreditTrainer, 1.0, dcredit_policy=options.policy),
        "plain loop, dcredit, sync+clip": plain_loop(overlap=False),
        "DCreditTrainer, overlap": trainer(DCreditTrainer, 0.0, dcredit_policy=options.policy,
                                           dcredit_overlap=True),
        "plain loop, dcredit, overlap": plain_loop(overlap=True),
        "plain loop, DDP": ddp_loop,
        "Accelerator (DDP)": accelerate_loop(dcredit=False),
        "DCreditAccelerator": accelerate_loop(dcredit=True),
    }
    assert arguments(1.0).device                 # Accelerate initialises the process group
    if options.rows:
        chosen = {int(i) for i in options.rows.split(",")}
        rows = {k: v for i, (k, v) in enumerate(rows.items(), 1) if i in chosen}
    pooled: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(options.rounds):
        for name, run in rows.items():
            ends: list[float] = []
            dist.barrier()
            run(ends)
            pooled[name] += [b - a for a, b in zip(ends[options.warmup:], ends[options.warmup + 1:])]
    if dist.get_rank() == 0:
        report(pooled, options, sum(p.numel() for p in model().parameters()))


def report(pooled: dict[str, list[float]], options: argparse.Namespace, params: int) -> None:
    """The markdown table: mean and median ms per step, against DDP and against the plain loop."""
    mean = {name: statistics.fmean(times) * 1e3 for name, times in pooled.items()}
    ddp = mean.get("Trainer (DDP)", next(iter(mean.values())))
    loops = {"DCreditTrainer": "plain loop, dcredit, sync+clip",
             "DCreditAccelerator": "plain loop, dcredit, sync+clip",
             "DCreditTrainer, overlap": "plain loop, dcredit, overlap"}
    counted = len(next(iter(pooled.values())))
    print(f"\nGPT-2 4 layers d=256 ({params / 1e6:.1f} M parameters), 2 hosts at {options.rate}, "
          f"policy {options.policy}, {counted} steps per row\n")
    print("| run | ms/step (mean) | ms/step (median) | speed-up over Trainer (DDP) "
          "| vs the plain loop |")
    print("|---|---:|---:|---:|---:|")
    for name, times in pooled.items():
        loop = loops.get(name)
        against = f"{mean[name] / mean[loop] - 1:+.1%}" if loop in mean else ""
        print(f"| {name} | {mean[name]:.0f} | {statistics.median(times) * 1e3:.0f} "
              f"| {ddp / mean[name]:.2f}x | {against} |")
    sys.stdout.flush()
    if options.summary:
        median = {name: statistics.median(times) * 1e3 for name, times in pooled.items()}
        with open(options.summary, "a") as out:
            for framework, own, ours in (("HF Trainer", "Trainer (DDP)", "DCreditTrainer"),
                                         ("Accelerate", "Accelerator (DDP)",
                                          "DCreditAccelerator")):
                plain = "plain loop, dcredit, sync+clip"
                if not {own, ours, plain} <= set(median):
                    continue
                out.write(f"| {framework} | {median[own]:.1f} | {median[ours]:.1f} "
                          f"| {median[plain]:.1f} | {100 * (median[ours] / median[plain] - 1):+.1f}% "
                          f"| {median[own] / median[ours]:.2f}x |\n")


if __name__ == "__main__":
    opts = _options(sys.argv[1:])
    if opts.worker:
        worker(opts)
    else:
        sys.exit(launch(opts))
