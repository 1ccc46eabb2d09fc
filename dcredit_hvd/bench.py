"""Side-by-side benchmark of gradient schedulers, in the format of Horovod's
``examples/pytorch/pytorch_synthetic_benchmark.py``.

    mpirun -np 2 python -m dcredit_hvd.bench --model vgg16 --model-arg width=16 \\
        --policy horovod,wfbp,bytescheduler

Every policy runs one after another in the SAME launch (same processes, same machine state), from
the same initial weights and data, so every ratio printed comes from one run.  Also measured in
the same launch: compute alone (no all-reduce) and communication alone (the iteration's gradients
all-reduced back to back, as plain Horovod would submit them); their maximum is the lower bound
no scheduler can beat.  Rank 0 prints; ``--json`` writes the figures for plots.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import timeit
from typing import Any, Callable

import numpy as np

#: Policies that are not dcredit_hvd's: plain Horovod and PyTorch DDP.
BASELINES = ("horovod", "ddp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m dcredit_hvd.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vgg16", help="zoo model: resnet50, vgg16, gpt2_small")
    parser.add_argument("--model-arg", action="append", default=[], metavar="KEY=INT",
                        help="zoo builder option, e.g. width=16 (repeatable)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-warmup-batches", type=int, default=3)
    parser.add_argument("--num-batches-per-iter", type=int, default=3)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--policy", default="horovod,ddp,wfbp,bytescheduler,dcredit",
                        help="comma-separated: horovod (hvd.DistributedOptimizer), ddp "
                        "(torch DistributedDataParallel over Gloo) and/or dcredit_hvd policies; a '-sync' "
                        "suffix (e.g. dcredit-sync) runs the policy without model=, so step() "
                        "waits for every gradient instead of overlapping the next forward")
    parser.add_argument("--partition-bytes", default=None)
    parser.add_argument("--credit-bytes", default=None)
    parser.add_argument("--fp16-allreduce", action="store_true")
    parser.add_argument("--no-bounds", action="store_true",
                        help="skip the compute-only and communication-only measurements")
    parser.add_argument("--json", default=None, help="write the results to this file (rank 0)")
    args = parser.parse_args(argv)
    args.policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    args.options = {}
    for item in args.model_arg:
        key, _, value = item.partition("=")
        if not value:
            parser.error(f"--model-arg {item!r}: expected KEY=INT")
        args.options[key] = int(value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F

    import dcredit_hvd
    from dcredit_hvd import zoo

    hvd.init()
    torch.set_num_threads(1)
    rank0 = hvd.rank() == 0

    def log(*parts: Any) -> None:
        if rank0:
            print(*parts, flush=True)

    for policy in args.policies:
        if policy not in BASELINES:
            from dcredit_hvd.config import SchedulerConfig
            # fail fast, on every rank, before any work
            SchedulerConfig.resolve(policy=policy.removesuffix("-sync"))

    unit = zoo.entry(args.model).unit
    torch.manual_seed(0)
    if unit == "images":
        size = args.options.get("image_size", 224)
        classes = args.options.get("num_classes", 1000)
        data = torch.randn(args.batch_size, 3, size, size)
        target = torch.randint(0, classes, (args.batch_size,))

        def loss_of(model: Any) -> Any:
            return F.cross_entropy(model(data), target)
    else:
        vocab = args.options.get("vocab", 50257)
        tokens = args.options.get("seq_len", args.options.get("ctx", 1024))
        data = torch.randint(0, vocab, (args.batch_size, tokens + 1))

        def loss_of(model: Any) -> Any:
            logits = model(data[:, :-1])
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1))

    def fresh_model() -> Any:
        torch.manual_seed(42)
        return zoo.build(args.model, **args.options)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    device = "CPU"
    n_params = sum(p.numel() for p in fresh_model().parameters())
    log(f"Model: {args.model} {args.options or ''} ({n_params / 1e6:.2f} M parameters, "
        f"{n_params * 4 / 2**20:.1f} MiB of float32 gradients)")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of {device}s: {hvd.size()}")
    log(f"Policies: {', '.join(args.policies)} (one after another in this launch)")

    def timed_run(label: str, make_step: Callable[[], Callable[[], None]]) -> dict[str, Any]:
        step = make_step()
        log(f"[{label}] Running warmup...")
        timeit.timeit(step, number=args.num_warmup_batches)
        log(f"[{label}] Running benchmark...")
        seconds = []
        for i in range(args.num_iters):
            t = timeit.timeit(step, number=args.num_batches_per_iter)
            seconds.append(t / args.num_batches_per_iter)
            log(f"[{label}] Iter #{i}: {args.batch_size / seconds[-1]:.1f} img/sec per {device} "
                f"({seconds[-1] * 1e3:.1f} ms/iteration; iteration {i + 1} of {args.num_iters})")
        rates = args.batch_size / np.array(seconds)
        result = {"label": label, "seconds_per_iteration": float(np.mean(seconds)),
                  "seconds": seconds, "img_sec_mean": float(rates.mean()),
                  "img_sec_conf": float(1.96 * rates.std())}
        log(f"[{label}] Img/sec per {device}: {result['img_sec_mean']:.1f} "
            f"+-{result['img_sec_conf']:.1f}")
        log(f"[{label}] Total img/sec on {hvd.size()} {device}(s): "
            f"{hvd.size() * result['img_sec_mean']:.1f} +-{hvd.size() * result['img_sec_conf']:.1f}")
        return result

    optimizers: dict[str, Any] = {}

    def training_step(policy: str) -> Callable[[], Callable[[], None]]:
        def make() -> Callable[[], None]:
            model = fresh_model()
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            if policy == "ddp":
                model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
            opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
            if policy == "horovod":
                opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                               compression=compression)
            elif policy not in ("compute", "ddp"):
                overlap = not policy.endswith("-sync")
                opt = dcredit_hvd.DistributedOptimizer(
                    opt, named_parameters=model.named_parameters(), compression=compression,
                    model=model if overlap else None, policy=policy.removesuffix("-sync"),
                    partition_bytes=args.partition_bytes, credit_bytes=args.credit_bytes)
            optimizers[policy] = opt

            def step() -> None:
                opt.zero_grad()
                loss_of(model).backward()
                opt.step()
            # dcredit profiles its first iterations, then plans: run those before timing.
            profiling = getattr(opt, "scheduler_config", None)
            if profiling is not None and profiling.policy == "dcredit":
                for _ in range(profiling.profile_warmup + profiling.profile_steps + 1):
                    step()
            return step
        return make

    def communication_step() -> Callable[[], None]:
        model = fresh_model()
        grads = [(name, torch.zeros_like(p)) for name, p in model.named_parameters()
                 if p.requires_grad]

        def step() -> None:
            handles = [hvd.allreduce_async_(g, name=f"bench.comm.{name}") for name, g in grads]
            for h in handles:
                hvd.synchronize(h)
        return step

    results: dict[str, Any] = {"model": args.model, "options": args.options,
                               "batch_size": args.batch_size, "ranks": hvd.size(),
                               "parameters": n_params, "fp16_allreduce": args.fp16_allreduce,
                               "machine": platform.platform(), "started": time.time(),
                               "policies": {}}
    if not args.no_bounds:
        results["compute"] = timed_run("compute only", training_step("compute"))
        results["communication"] = timed_run("communication only", communication_step)
    if "ddp" in args.policies:
        init_gloo_process_group(hvd)
    for policy in args.policies:
        results["policies"][policy] = timed_run(policy, training_step(policy))
    results["simulated"] = simulator_check(results, optimizers, args)

    if rank0:
        print_table(results)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(results, fh, indent=2)
            print(f"results written to {args.json}")
    return 0


def init_gloo_process_group(hvd: Any) -> None:
    """torch.distributed over Gloo in the same processes, for the ``ddp`` baseline: rank 0
    picks a free port on loopback and tells the others through Horovod."""
    import os
    import socket

    import torch.distributed as dist

    port = None
    if hvd.rank() == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    port = hvd.broadcast_object(port, root_rank=0, name="bench.ddp.port")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=hvd.rank(),
                            world_size=hvd.size())


def simulator_check(results: dict[str, Any], optimizers: dict[str, Any],
                    args: argparse.Namespace) -> dict[str, Any]:
    """Each measured policy predicted by the simulator from the profile and cost model that
    ``dcredit`` measured in this run; error in percent of the measured time."""
    from dcredit_hvd import simulator
    from dcredit_hvd.policies import DCredit

    # Prefer a profile measured with model= (it has per-layer forward times; without the model
    # the profiler cannot see the forward pass).
    candidates = sorted(optimizers.items(), key=lambda item: item[0].endswith("-sync"))
    measured = next((o.measured for _, o in candidates
                     if getattr(o, "measured", None) is not None), None)
    if measured is None:
        return {}
    profile, cost = measured
    out = {}
    for name, run in results["policies"].items():
        base = name.removesuffix("-sync")
        overlap = not name.endswith("-sync")
        if base == "ddp":
            continue
        kwargs: dict[str, Any] = {"overlap_forward": overlap and base != "horovod",
                                  "fusion_bytes": 128 << 20}
        if base in ("wfbp", "bytescheduler"):
            config = optimizers[name].scheduler_config
            kwargs.update(partition_bytes=config.partition_bytes, credit_bytes=config.credit_bytes)
            policy: Any = base
        elif base == "dcredit":
            plan = optimizers[name].plan
            policy = DCredit(plan, overlap_forward=overlap)
        else:
            policy = base
        predicted = simulator.simulate(profile, cost, policy, **kwargs).iteration_s
        actual = run["seconds_per_iteration"]
        out[name] = {"predicted": predicted, "measured": actual,
                     "error_percent": 100.0 * (predicted - actual) / actual}
    return out


def print_table(results: dict[str, Any]) -> None:
    policies = results["policies"]
    base = policies.get("horovod", {}).get("seconds_per_iteration")
    bound = None
    if "compute" in results:
        bound = max(results["compute"]["seconds_per_iteration"],
                    results["communication"]["seconds_per_iteration"])
        print(f"\ncompute only {results['compute']['seconds_per_iteration'] * 1e3:.1f} ms, "
              f"communication only {results['communication']['seconds_per_iteration'] * 1e3:.1f} ms, "
              f"lower bound max(compute, communication) {bound * 1e3:.1f} ms")
    simulated = results.get("simulated", {})
    print(f"\n{'policy':<15}{'ms/iter':>10}{'img/sec':>10}{'speedup vs horovod':>20}"
          f"{'x lower bound':>15}{'simulated ms':>14}{'error':>8}")
    for name, r in policies.items():
        t = r["seconds_per_iteration"]
        speedup = f"{base / t:.2f}x" if base else "-"
        ratio = f"{t / bound:.2f}" if bound else "-"
        sim = simulated.get(name)
        predicted = f"{sim['predicted'] * 1e3:.1f}" if sim else "-"
        error = f"{sim['error_percent']:+.0f}%" if sim else "-"
        print(f"{name:<15}{t * 1e3:>10.1f}{r['img_sec_mean']:>10.1f}{speedup:>20}{ratio:>15}"
              f"{predicted:>14}{error:>8}")


if __name__ == "__main__":
    sys.exit(main())
