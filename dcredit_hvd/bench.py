"""Side-by-side benchmark of gradient schedulers, in the format of Horovod's
``examples/pytorch/pytorch_synthetic_benchmark.py``.

    mpirun -np 2 python -m dcredit_hvd.bench --model vgg16 --model-arg width=16 \\
        --policy horovod,wfbp,bytescheduler

Every policy runs one after another in the SAME launch (same processes, same machine state), from
the same initial weights and data, so every ratio printed comes from one run.  Also measured in
the same launch: compute alone (no all-reduce) and communication alone (the iteration's gradients
all-reduced back to back, as plain Horovod would submit them); their maximum is the lower bound
no scheduler can beat.  Rank 0 prints; ``--json`` writes the figures for plots.

``--device cuda`` runs on ``cuda:<local rank modulo the GPU count>`` (so several ranks may share
one GPU) and adds the GPUs' energy per iteration, from NVML's total-energy counter
(``dcredit_hvd.energy``; needs ``pip install nvidia-ml-py`` and a Volta or newer GPU).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import timeit
import types
from typing import Any, Callable

import numpy as np

#: Policies that are not dcredit_hvd's: plain Horovod and PyTorch DDP.
BASELINES = ("horovod", "ddp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m dcredit_hvd.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vgg16", help="zoo model (resnet50, vgg16, gpt2_small) "
                        "or a transformers model (hf_llama)")
    parser.add_argument("--model-arg", action="append", default=[], metavar="KEY=INT",
                        help="zoo builder option, e.g. width=16 (repeatable)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-warmup-batches", type=int, default=3)
    parser.add_argument("--num-batches-per-iter", type=int, default=3)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the bounds and every policy this many times, in turn, and "
                        "pool the iterations of each: on a shared machine, a slow spell then "
                        "falls on every policy alike instead of on whichever ran during it")
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
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the model and data live (default cpu); cuda uses "
                        "cuda:<local rank modulo GPU count> and reports the GPUs' energy per "
                        "iteration when NVML's energy counter is readable (pynvml)")
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
    import torch
    import torch.nn.functional as F

    if args.device == "cuda":
        problem = cuda_unavailable_reason(torch)
        if problem is not None:     # every rank stops here, before any collective
            print(f"python -m dcredit_hvd.bench: error: --device cuda: {problem}",
                  file=sys.stderr, flush=True)
            return 2

    import horovod.torch as hvd

    import dcredit_hvd
    from dcredit_hvd import zoo

    hvd.init()
    torch.set_num_threads(1)
    # Synthetic data turns some values subnormal after a few steps, and CPU arithmetic on them is
    # several times slower (GPUs flush them by default): every benchmark flushes them.
    flushes = torch.set_flush_denormal(True)
    rank0 = hvd.rank() == 0
    cuda = args.device == "cuda"
    meter = None
    if cuda:
        from dcredit_hvd.energy import EnergyMeter

        gpu = hvd.local_rank() % torch.cuda.device_count()
        torch.cuda.set_device(gpu)
        target_device = torch.device("cuda", gpu)
        meter = EnergyMeter.for_cuda_device(gpu)
        gpu_identity = {"host": platform.node(), "gpu": cuda_identity(torch, gpu)}
    else:
        target_device = torch.device("cpu")

    def log(*parts: Any) -> None:
        if rank0:
            print(*parts, flush=True)

    for policy in args.policies:
        if policy not in BASELINES:
            from dcredit_hvd.config import SchedulerConfig
            # fail fast, on every rank, before any work
            SchedulerConfig.resolve(policy=policy.removesuffix("-sync"))

    from dcredit_hvd import hfmodels

    unit = "sequences" if hfmodels.is_hf(args.model) else zoo.entry(args.model).unit
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
    if cuda:
        data = data.to(target_device)
        if unit == "images":
            target = target.to(target_device)

    def fresh_model(on_device: bool = True) -> Any:
        torch.manual_seed(42)
        model = (hfmodels.build(args.model, **args.options) if hfmodels.is_hf(args.model)
                 else zoo.build(args.model, **args.options))
        return model.to(target_device) if cuda and on_device else model

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize(target_device)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    device = "GPU" if cuda else "CPU"
    n_params = sum(p.numel() for p in fresh_model(on_device=False).parameters())
    log(f"Model: {args.model} {args.options or ''} ({n_params / 1e6:.2f} M parameters, "
        f"{n_params * 4 / 2**20:.1f} MiB of float32 gradients)")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of {device}s: {hvd.size()}")
    log(f"Policies: {', '.join(args.policies)} (one after another in this launch)")
    hosts = hvd.allgather_object(platform.node())
    log(f"Hosts: {', '.join(f'rank {r} on {h}' for r, h in enumerate(hosts))}")
    log(f"All-reduce: {collective_algorithm()}")
    log("Subnormals flushed to zero (torch.set_flush_denormal)" if flushes else
        "WARNING: this CPU cannot flush subnormals; synthetic data may slow down after a few steps")
    if cuda:
        placements = hvd.allgather_object((hvd.rank(), gpu_identity["host"], str(target_device),
                                           torch.cuda.get_device_name(target_device)))
        for rank, host, where, name in placements:
            log(f"rank {rank}: {host} {where} ({name})")
        log(f"{meter.describe()} [rank 0]")

    def timed(step: Callable[[], None], number: int) -> float:
        if not cuda:
            return timeit.timeit(step, number=number)

        # GPU work is asynchronous: wait for it at the ends of the timed batches, never inside.
        def batches() -> None:
            for _ in range(number):
                step()
            synchronize()
        synchronize()
        return timeit.timeit(batches, number=1)

    def timed_run(label: str, make_step: Callable[[], Callable[[], None]]) -> dict[str, Any]:
        step = make_step()
        log(f"[{label}] Running warmup...")
        timed(step, args.num_warmup_batches)
        log(f"[{label}] Running benchmark...")
        seconds = []
        if meter is not None:
            synchronize()
            meter.start()
        for i in range(args.num_iters):
            t = timed(step, args.num_batches_per_iter)
            seconds.append(t / args.num_batches_per_iter)
            log(f"[{label}] Iter #{i}: {args.batch_size / seconds[-1]:.1f} img/sec per {device} "
                f"({seconds[-1] * 1e3:.1f} ms/iteration; iteration {i + 1} of {args.num_iters})")
        rates = args.batch_size / np.array(seconds)
        result = {"label": label, "seconds_per_iteration": float(np.mean(seconds)),
                  "seconds": seconds, "img_sec_mean": float(rates.mean()),
                  "img_sec_conf": float(1.96 * rates.std()), "energy_j_per_iter": None}
        if meter is not None:
            from dcredit_hvd.energy import gpu_energy_per_iteration

            joules = meter.stop()
            readings = hvd.allgather_object(dict(gpu_identity, rank=hvd.rank(), joules=joules))
            energy = gpu_energy_per_iteration(
                readings, iterations=args.num_iters * args.num_batches_per_iter)
            result["energy_j_per_iter"] = energy["total"]
            result["energy_per_gpu"] = energy["per_gpu"]
            gpus = ", ".join(f"rank {g['rank']} {g['host']} {g['gpu']}: "
                             + ("n/a" if g["j_per_iter"] is None else f"{g['j_per_iter']:.2f} J")
                             for g in energy["per_gpu"])
            total = "n/a" if energy["total"] is None else f"{energy['total']:.2f} J"
            log(f"[{label}] Energy per iteration, {len(energy['per_gpu'])} GPU(s) summed: "
                f"{total} ({gpus})")
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
                model = torch.nn.parallel.DistributedDataParallel(
                    model, bucket_cap_mb=25, device_ids=[target_device] if cuda else None)
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
                               "device": args.device, "energy": energy_note(meter),
                               "hosts": hosts, "allreduce": collective_algorithm(),
                               "flush_denormal": flushes, "loadavg_start": os.getloadavg(),
                               "policies": {}}
    if "ddp" in args.policies:
        init_gloo_process_group(hvd)
    for round_ in range(args.rounds):
        if args.rounds > 1:
            log(f"Round {round_ + 1} of {args.rounds}")
        if not args.no_bounds:
            pool(results, "compute", timed_run("compute only", training_step("compute")),
                 args.batch_size)
            pool(results, "communication", timed_run("communication only", communication_step),
                 args.batch_size)
        for policy in args.policies:
            pool(results["policies"], policy, timed_run(policy, training_step(policy)),
                 args.batch_size)
            # Keep only what the simulator check needs: holding every policy's optimizer (model,
            # gradients, state) ran GPT-2 small's 4 ranks out of 24 GiB.
            opt = optimizers.pop(policy)
            if hasattr(opt, "apply_pending_updates"):
                opt.apply_pending_updates()
            optimizers[policy] = types.SimpleNamespace(
                scheduler_config=getattr(opt, "scheduler_config", None),
                plan=getattr(opt, "plan", None), measured=getattr(opt, "measured", None))
            del opt
            gc.collect()
    results["link"] = link_need(n_params * (2 if args.fp16_allreduce else 4), hvd.size(),
                                os.environ.get("VCLUSTER_RATE"))
    results["simulated"] = simulator_check(results, optimizers, args)
    results["bound"] = lower_bound(results)

    # the machine's load beside the figures: other work on the same cores slows every policy
    results["loadavg_end"] = os.getloadavg()
    if rank0:
        print_table(results)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(results, fh, indent=2)
            print(f"results written to {args.json}")
    if meter is not None:
        meter.close()
    return 0


def cuda_unavailable_reason(torch: Any) -> str | None:
    """Why ``--device cuda`` cannot run here, with the fix; None when it can."""
    if torch.version.cuda is None:
        return (f"this PyTorch ({torch.__version__}) is a CPU-only build. Install a CUDA build "
                "of the same torch version (https://pytorch.org/get-started/locally/), rebuild "
                "Horovod against it (pip uninstall -y horovod, then make install), or use "
                "--device cpu")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return (f"PyTorch {torch.__version__} was built for CUDA {torch.version.cuda} but sees "
                f"no GPU{hint}. Check that nvidia-smi lists a GPU and the NVIDIA driver is "
                "loaded, or use --device cpu")
    return None


def cuda_identity(torch: Any, index: int) -> str:
    """The GPU's UUID as torch reports it (the same for every rank on that GPU)."""
    try:
        return str(torch.cuda.get_device_properties(index).uuid)
    except Exception:
        return f"cuda:{index}"


#: How the energy column is measured and summed (printed under the table, kept in the JSON).
ENERGY_SCOPE = ("GPU energy per iteration over the timed iterations, from NVML's total-energy "
                "counter (whole GPU), summed over the job's GPUs; each GPU is counted once, read by the "
                "lowest rank on it (local rank 0 when ranks share one GPU): ranks sharing a GPU "
                "share its figure, and it includes any other work on those GPUs")


def energy_note(meter: Any) -> dict[str, Any] | None:
    """The JSON's ``energy`` entry: None on CPU, else the scope and rank 0's meter."""
    if meter is None:
        return None
    return {"scope": ENERGY_SCOPE, "meter_rank0": meter.describe(), "available": meter.available}


def collective_algorithm() -> str:
    """Which all-reduce Horovod's MPI operations run (Open MPI's tuned component), as set by
    ``--mca coll_tuned_allreduce_algorithm`` or its ``OMPI_MCA_`` variable."""
    names = {"0": "default decision", "1": "basic linear", "2": "nonoverlapping",
             "3": "recursive doubling", "4": "ring", "5": "segmented ring", "6": "Rabenseifner"}
    algorithm = os.environ.get("OMPI_MCA_coll_tuned_allreduce_algorithm")
    dynamic = os.environ.get("OMPI_MCA_coll_tuned_use_dynamic_rules", "0") not in ("0", "false")
    if algorithm is None or not dynamic:
        return "Open MPI's default decision (fixed rules)"
    return f"Open MPI coll_tuned_allreduce_algorithm {algorithm} ({names.get(algorithm, '?')})"


def link_need(nbytes: int, ranks: int, rate: str | None) -> dict[str, Any] | None:
    """What the links need for one iteration's all-reduce of ``nbytes`` over ``ranks`` hosts,
    each with a full-duplex NIC of ``rate`` (tc bit units, from scripts/vcluster.sh): every host
    sends and receives 2 (P-1)/P x nbytes in a ring or Rabenseifner all-reduce (the least any
    all-reduce needs), log2(P) x nbytes in recursive doubling. None off the virtual cluster."""
    import math
    import re

    m = re.fullmatch(r"([0-9.]+)(bit|kbit|mbit|gbit|tbit)", (rate or "").lower())
    if m is None or ranks < 2:
        return None
    bytes_per_s = float(m.group(1)) * {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9,
                                       "tbit": 1e12}[m.group(2)] / 8
    algorithm = os.environ.get("OMPI_MCA_coll_tuned_allreduce_algorithm")
    doubling = "recursive doubling" in collective_algorithm()
    factor = math.log2(ranks) if doubling else 2 * (ranks - 1) / ranks
    return {"rate": rate, "bytes": nbytes, "algorithm": algorithm,
            "seconds": factor * nbytes / bytes_per_s,
            "bandwidth_optimal_seconds": 2 * (ranks - 1) / ranks * nbytes / bytes_per_s}


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (Linux SIOCGIFADDR)."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
        except OSError as exc:
            raise RuntimeError(f"GLOO_SOCKET_IFNAME={name!r}: no IPv4 address on that interface "
                               f"({exc}); set it to the interface the hosts share") from exc
    return socket.inet_ntoa(packed[20:24])


def init_gloo_process_group(hvd: Any) -> None:
    """torch.distributed over Gloo in the same processes, for the ``ddp`` baseline: rank 0
    picks a free port on its address on ``GLOO_SOCKET_IFNAME`` (loopback when unset: one
    host) and tells the others through Horovod."""
    import socket

    import torch.distributed as dist

    iface = os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    where = None
    if hvd.rank() == 0:
        address = "127.0.0.1" if iface == "lo" else interface_address(iface)
        with socket.socket() as sock:
            sock.bind((address, 0))
            where = (address, sock.getsockname()[1])
    address, port = hvd.broadcast_object(where, root_rank=0, name="bench.ddp.port")
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=hvd.rank(),
                            world_size=hvd.size())


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
    profile, untracked = with_untracked_compute(profile, results.get("compute"))
    network = network_model(cost, results.get("link"))
    out: dict[str, Any] = {"untracked_compute_s": untracked} if untracked else {}
    # What one tensor's own dependency adds beyond compute (a tied embedding), on the link.
    compute = profile.forward_time + profile.backward_time + sum(profile.t_u or ())
    link = network or cost
    ends = simulator.dependencies(profile, link)
    excess = max(ends, default=0.0) - compute
    if excess > 0:
        out["dependency_excess_s"] = excess
        out["dependency_tensor"] = profile.names[ends.index(max(ends))]
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
        if network is not None:
            if isinstance(policy, DCredit):     # a fresh copy: simulate() binds the policy
                policy = DCredit(optimizers[name].plan, overlap_forward=overlap)
            link = simulator.simulate(profile, network, policy, **kwargs).iteration_s
            out[name].update(predicted_link=link, error_link_percent=100.0 * (link - actual) / actual)
    return out


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
    from dcredit_hvd.profile import Profile

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


def network_model(cost: Any, link: dict[str, Any] | None) -> Any:
    """The simulator's network model of the virtual cluster: the links' seconds per byte under
    the run's all-reduce (``link_need``), with the live model's startup ``a`` (on this CPU
    mostly Horovod's cycle, not the wire). None off the virtual cluster."""
    from dcredit_hvd.costmodel import CostModel

    if link is None:
        return None
    return CostModel(a=cost.a, b=link["seconds"] / link["bytes"])


def print_table(results: dict[str, Any]) -> None:
    policies = results["policies"]
    base = policies.get("horovod", {}).get("seconds_per_iteration")
    ddp = policies.get("ddp", {}).get("seconds_per_iteration")
    bound = None
    print(f"\n{results.get('ranks', '?')} ranks on {', '.join(results.get('hosts', ['?']))}; all-reduce: "
          f"{results.get('allreduce', '?')} (ddp: Gloo's); subnormals flushed: "
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
    print(f"\n{'policy':<15}{'ms/iter':>10}{'img/sec':>10}{'vs horovod':>12}{'vs ddp':>9}"
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
        print(f"{name:<15}{t * 1e3:>10.1f}{r['img_sec_mean']:>10.1f}{speedup:>12}{over_ddp:>9}"
              f"{ratio:>15}{predicted:>14}{error:>8}{on_link:>12}{link_error:>8}{energy:>15}")
    print("simulated: the simulator on the profile and live cost model dcredit measured; link "
          "model: the same with the links' seconds per byte under this all-reduce")
    if simulated.get("untracked_compute_s"):
        print(f"  both add {simulated['untracked_compute_s'] * 1e3:.1f} ms of compute the profile's "
              "layers miss (compute only minus the profile: work outside them, such as a tied head "
              "and the loss)")
    note = results.get("energy")
    if note is None:
        print("energy J/iter: n/a on --device cpu (GPU energy only, with --device cuda)")
    else:
        print(f"energy J/iter: {note['scope']}.")
        if not note["available"]:
            print(f"  rank 0: {note['meter_rank0']}")


if __name__ == "__main__":
    sys.exit(main())
