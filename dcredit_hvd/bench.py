"""Side-by-side benchmark of gradient schedulers, in the format of Horovod's
``examples/pytorch/pytorch_synthetic_benchmark.py``.

    mpirun -np 2 python -m dcredit_hvd.bench --model vgg16 --model-arg width=16 \\
        --policy horovod,wfbp,bytescheduler

Every policy runs one after another in the SAME launch (same processes, same machine state), from
the same initial weights and data, so every ratio printed comes from one run.  Also measured in
the same launch: compute alone (no all-reduce) and communication alone (the iteration's gradients
all-reduced back to back, as plain Horovod would submit them); their maximum is the lower bound
no scheduler can beat.  Rank 0 prints; ``--json`` writes the figures for plots.

A policy with a ``-td`` suffix (``dcredit-td``) is the same dcredit_hvd policy on the
``torch.distributed`` transport, over the Gloo process group the ``ddp`` row uses, so the
scheduler on both transports and DDP compare in one run.

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
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

#: Policies that are not dcredit_hvd's: plain Horovod and PyTorch DDP.
BASELINES = ("horovod", "ddp")
#: Policy-name suffixes: without ``model=`` (step() waits for every gradient), and on the
#: ``torch.distributed`` transport (the Gloo group of the ``ddp`` row) instead of Horovod.
SYNC, TORCH_DISTRIBUTED = "-sync", "-td"


@dataclass(frozen=True)
class PolicyName:
    """What a ``--policy`` entry asks for: ``<base>[-sync][-td]`` (suffixes in either order)."""

    name: str
    base: str
    overlap: bool             # model= given: the next forward overlaps the all-reduces
    transport: Optional[str]  # None: Horovod; "torch.distributed" for the -td rows

    @classmethod
    def parse(cls, name: str) -> PolicyName:
        base, overlap, transport = name, True, None
        while True:
            if base.endswith(SYNC):
                base, overlap = base.removesuffix(SYNC), False
            elif base.endswith(TORCH_DISTRIBUTED):
                base, transport = base.removesuffix(TORCH_DISTRIBUTED), "torch.distributed"
            else:
                return cls(name, base, overlap, transport)

    @property
    def baseline(self) -> bool:
        return self.base in BASELINES


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
                        "waits for every gradient instead of overlapping the next forward; a "
                        "'-td' suffix (e.g. dcredit-td) runs it on transport='torch.distributed' "
                        "over ddp's Gloo group instead of Horovod")
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
    for policy in map(PolicyName.parse, args.policies):
        if policy.baseline and policy.name != policy.base:
            parser.error(f"--policy {policy.name}: the {SYNC} and {TORCH_DISTRIBUTED} suffixes "
                         f"apply to dcredit_hvd's policies (e.g. dcredit{TORCH_DISTRIBUTED}), "
                         f"not to {policy.base}")
    args.options = {}
    for item in args.model_arg:
        key, _, value = item.partition("=")
        if not value:
            parser.error(f"--model-arg {item!r}: expected KEY=INT")
        args.options[key] = int(value)
    return args


def check_policies(policies: list[str]) -> None:
    """Resolves every dcredit_hvd policy's configuration, so that a bad name fails on every
    rank before any work."""
    from dcredit_hvd.config import SchedulerConfig

    for policy in map(PolicyName.parse, policies):
        if not policy.baseline:
            SchedulerConfig.resolve(policy=policy.base, transport=policy.transport)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.device == "cuda":
        problem = cuda_unavailable_reason(torch)
        if problem is not None:     # every rank stops here, before any collective
            print(f"python -m dcredit_hvd.bench: error: --device cuda: {problem}",
                  file=sys.stderr, flush=True)
            return 2

    import horovod.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    # Synthetic data turns some values subnormal after a few steps, and CPU arithmetic on them is
    # several times slower (GPUs flush them by default): every benchmark flushes them.
    flushes = torch.set_flush_denormal(True)
    check_policies(args.policies)
    launch = Launch(args, torch, hvd, flushes)
    launch.print_header()
    results = launch.results_header()
    if any(p.base == "ddp" or p.transport for p in map(PolicyName.parse, args.policies)):
        init_gloo_process_group(hvd)
    optimizers = launch.run_rounds(results)
    launch.finish(results, optimizers)
    return 0


class Launch:
    """One benchmark launch: the ranks, the device, the synthetic batch and the model, and the
    timed runs of each policy on them."""

    def __init__(self, args: argparse.Namespace, torch: Any, hvd: Any, flushes: bool) -> None:
        self.args, self.torch, self.hvd, self.flushes = args, torch, hvd, flushes
        self.rank0 = hvd.rank() == 0
        self.cuda = args.device == "cuda"
        self.device = "GPU" if self.cuda else "CPU"
        self.meter: Any = None
        self.gpu_identity: dict[str, str] = {}
        if self.cuda:
            from dcredit_hvd.energy import EnergyMeter

            self.gpu = hvd.local_rank() % torch.cuda.device_count()
            torch.cuda.set_device(self.gpu)
            self.target_device = torch.device("cuda", self.gpu)
            self.meter = EnergyMeter.for_cuda_device(self.gpu)
            self.gpu_identity = {"host": platform.node(), "gpu": cuda_identity(torch, self.gpu)}
        else:
            self.target_device = torch.device("cpu")
        self.loss_of = self._synthetic_batch()
        self.compression = (hvd.Compression.fp16 if args.fp16_allreduce
                            else hvd.Compression.none)
        self.n_params = sum(p.numel() for p in self.fresh_model(on_device=False).parameters())
        self.hosts = hvd.allgather_object(platform.node())

    def log(self, *parts: Any) -> None:
        if self.rank0:
            print(*parts, flush=True)

    # -- the workload ---------------------------------------------------------------------------
    def _synthetic_batch(self) -> Callable[[Any], Any]:
        """The launch's one batch (images or tokens, seed 0) and the loss of a model on it."""
        from dcredit_hvd import hfmodels, zoo

        torch, args = self.torch, self.args
        F = torch.nn.functional
        unit = "sequences" if hfmodels.is_hf(args.model) else zoo.entry(args.model).unit
        torch.manual_seed(0)
        if unit == "images":
            size = args.options.get("image_size", 224)
            classes = args.options.get("num_classes", 1000)
            data = torch.randn(args.batch_size, 3, size, size).to(self.target_device)
            target = torch.randint(0, classes, (args.batch_size,)).to(self.target_device)

            def loss_of(model: Any) -> Any:
                return F.cross_entropy(model(data), target)
            return loss_of
        vocab = args.options.get("vocab", 50257)
        tokens = args.options.get("seq_len", args.options.get("ctx", 1024))
        data = torch.randint(0, vocab, (args.batch_size, tokens + 1)).to(self.target_device)

        def loss_of(model: Any) -> Any:
            logits = model(data[:, :-1])
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
        return loss_of

    def fresh_model(self, on_device: bool = True) -> Any:
        """The model at its initial weights (seed 42), the same for every policy."""
        from dcredit_hvd import hfmodels, zoo

        self.torch.manual_seed(42)
        args = self.args
        model = (hfmodels.build(args.model, **args.options) if hfmodels.is_hf(args.model)
                 else zoo.build(args.model, **args.options))
        return model.to(self.target_device) if self.cuda and on_device else model

    def synchronize(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.target_device)

    # -- what the launch prints first and records ---------------------------------------------
    def print_header(self) -> None:
        args, hvd, log = self.args, self.hvd, self.log
        log(f"Model: {args.model} {args.options or ''} ({self.n_params / 1e6:.2f} M parameters, "
            f"{self.n_params * 4 / 2**20:.1f} MiB of float32 gradients)")
        log(f"Batch size: {args.batch_size}")
        log(f"Number of {self.device}s: {hvd.size()}")
        log(f"Policies: {', '.join(args.policies)} (one after another in this launch)")
        log(f"Hosts: {', '.join(f'rank {r} on {h}' for r, h in enumerate(self.hosts))}")
        log(f"All-reduce: {collective_algorithm()}")
        log("Subnormals flushed to zero (torch.set_flush_denormal)" if self.flushes else
            "WARNING: this CPU cannot flush subnormals; synthetic data may slow down after a few "
            "steps")
        if self.cuda:
            placements = hvd.allgather_object((hvd.rank(), self.gpu_identity["host"],
                                               str(self.target_device),
                                               self.torch.cuda.get_device_name(self.target_device)))
            for rank, host, where, name in placements:
                log(f"rank {rank}: {host} {where} ({name})")
            log(f"{self.meter.describe()} [rank 0]")

    def results_header(self) -> dict[str, Any]:
        """The JSON's description of the launch (the policies' runs are added to it)."""
        args = self.args
        return {"model": args.model, "options": args.options, "batch_size": args.batch_size,
                "ranks": self.hvd.size(), "parameters": self.n_params,
                "fp16_allreduce": args.fp16_allreduce, "machine": platform.platform(),
                "started": time.time(), "device": args.device, "energy": energy_note(self.meter),
                "hosts": self.hosts, "allreduce": collective_algorithm(),
                "flush_denormal": self.flushes, "loadavg_start": os.getloadavg(), "policies": {}}

    # -- timing -----------------------------------------------------------------------------------
    def timed(self, step: Callable[[], None], number: int) -> float:
        if not self.cuda:
            return timeit.timeit(step, number=number)

        # GPU work is asynchronous: wait for it at the ends of the timed batches, never inside.
        def batches() -> None:
            for _ in range(number):
                step()
            self.synchronize()
        self.synchronize()
        return timeit.timeit(batches, number=1)

    def timed_run(self, label: str, make_step: Callable[[], Callable[[], None]]) -> dict[str, Any]:
        """Warm-up, then ``--num-iters`` timed iterations of ``--num-batches-per-iter`` steps."""
        args, log, device = self.args, self.log, self.device
        step = make_step()
        log(f"[{label}] Running warmup...")
        self.timed(step, args.num_warmup_batches)
        log(f"[{label}] Running benchmark...")
        seconds = []
        if self.meter is not None:
            self.synchronize()
            self.meter.start()
        for i in range(args.num_iters):
            t = self.timed(step, args.num_batches_per_iter)
            seconds.append(t / args.num_batches_per_iter)
            log(f"[{label}] Iter #{i}: {args.batch_size / seconds[-1]:.1f} img/sec per {device} "
                f"({seconds[-1] * 1e3:.1f} ms/iteration; iteration {i + 1} of {args.num_iters})")
        rates = args.batch_size / np.array(seconds)
        result = {"label": label, "seconds_per_iteration": float(np.mean(seconds)),
                  "seconds": seconds, "img_sec_mean": float(rates.mean()),
                  "img_sec_conf": float(1.96 * rates.std()), "energy_j_per_iter": None}
        if self.meter is not None:
            self._energy(label, result)
        size = self.hvd.size()
        log(f"[{label}] Img/sec per {device}: {result['img_sec_mean']:.1f} "
            f"+-{result['img_sec_conf']:.1f}")
        log(f"[{label}] Total img/sec on {size} {device}(s): "
            f"{size * result['img_sec_mean']:.1f} +-{size * result['img_sec_conf']:.1f}")
        return result

    def _energy(self, label: str, result: dict[str, Any]) -> None:
        """Every GPU's energy over the timed iterations, into ``result`` (and printed)."""
        from dcredit_hvd.energy import gpu_energy_per_iteration

        joules = self.meter.stop()
        readings = self.hvd.allgather_object(dict(self.gpu_identity, rank=self.hvd.rank(),
                                                  joules=joules))
        energy = gpu_energy_per_iteration(
            readings, iterations=self.args.num_iters * self.args.num_batches_per_iter)
        result["energy_j_per_iter"] = energy["total"]
        result["energy_per_gpu"] = energy["per_gpu"]
        gpus = ", ".join(f"rank {g['rank']} {g['host']} {g['gpu']}: "
                         + ("n/a" if g["j_per_iter"] is None else f"{g['j_per_iter']:.2f} J")
                         for g in energy["per_gpu"])
        total = "n/a" if energy["total"] is None else f"{energy['total']:.2f} J"
        self.log(f"[{label}] Energy per iteration, {len(energy['per_gpu'])} GPU(s) summed: "
                 f"{total} ({gpus})")

    # -- the steps ----------------------------------------------------------------------------------
    def optimizer(self, name: str, model: Any) -> Any:
        """The optimizer of policy ``name`` (or ``compute``: the local one alone) on ``model``."""
        hvd, args = self.hvd, self.args
        opt = self.torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
        policy = PolicyName.parse(name)
        if policy.base == "horovod":
            return hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                            compression=self.compression)
        if policy.base in ("compute", "ddp"):
            return opt
        import dcredit_hvd

        return dcredit_hvd.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(), compression=self.compression,
            model=model if policy.overlap else None, policy=policy.base,
            transport=policy.transport, partition_bytes=args.partition_bytes,
            credit_bytes=args.credit_bytes)

    def training_step(self, name: str, optimizers: dict[str, Any]
                      ) -> Callable[[], Callable[[], None]]:
        """Builds policy ``name``'s step (kept in ``optimizers``) when the timed run starts."""
        def make() -> Callable[[], None]:
            model = self.fresh_model()
            self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            if name == "ddp":
                model = self.torch.nn.parallel.DistributedDataParallel(
                    model, bucket_cap_mb=25,
                    device_ids=[self.target_device] if self.cuda else None)
            opt = optimizers[name] = self.optimizer(name, model)

            def step() -> None:
                opt.zero_grad()
                self.loss_of(model).backward()
                opt.step()
            # dcredit profiles its first iterations, then plans: run those before timing.
            profiling = getattr(opt, "scheduler_config", None)
            if profiling is not None and profiling.policy == "dcredit":
                for _ in range(profiling.profile_warmup + profiling.profile_steps + 1):
                    step()
            return step
        return make

    def communication_step(self) -> Callable[[], None]:
        """The iteration's gradients all-reduced back to back, as plain Horovod submits them."""
        hvd = self.hvd
        model = self.fresh_model()
        grads = [(name, self.torch.zeros_like(p)) for name, p in model.named_parameters()
                 if p.requires_grad]

        def step() -> None:
            handles = [hvd.allreduce_async_(g, name=f"bench.comm.{name}") for name, g in grads]
            for h in handles:
                hvd.synchronize(h)
        return step

    # -- the launch ---------------------------------------------------------------------------------
    def run_rounds(self, results: dict[str, Any]) -> dict[str, Any]:
        """The bounds and every policy, ``--rounds`` times in turn, pooled into ``results``;
        returns what the simulator check needs of each policy's optimizer."""
        args, batch = self.args, self.args.batch_size
        optimizers: dict[str, Any] = {}
        for round_ in range(args.rounds):
            if args.rounds > 1:
                self.log(f"Round {round_ + 1} of {args.rounds}")
            if not args.no_bounds:
                pool(results, "compute",
                     self.timed_run("compute only", self.training_step("compute", optimizers)),
                     batch)
                del optimizers["compute"]       # a plain SGD: nothing for the simulator check
                pool(results, "communication",
                     self.timed_run("communication only", self.communication_step), batch)
            for policy in args.policies:
                pool(results["policies"], policy,
                     self.timed_run(policy, self.training_step(policy, optimizers)), batch)
                optimizers[policy] = kept_of(optimizers.pop(policy))
                gc.collect()
        return optimizers

    def finish(self, results: dict[str, Any], optimizers: dict[str, Any]) -> None:
        """The link's need, the simulator check and the bound; rank 0 prints and writes."""
        args = self.args
        results["link"] = link_need(self.n_params * (2 if args.fp16_allreduce else 4),
                                    self.hvd.size(), os.environ.get("VCLUSTER_RATE"))
        results["simulated"] = simulator_check(results, optimizers, args)
        results["bound"] = lower_bound(results)
        # the machine's load beside the figures: other work on the same cores slows every policy
        results["loadavg_end"] = os.getloadavg()
        if self.rank0:
            print_table(results)
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump(results, fh, indent=2)
                print(f"results written to {args.json}")
        if self.meter is not None:
            self.meter.close()


def kept_of(opt: Any) -> types.SimpleNamespace:
    """What the simulator check needs of a finished policy's optimizer, once its last updates
    are applied.  Only that is kept: holding every policy's optimizer (model, gradients, state)
    ran GPT-2 small's 4 ranks out of 24 GiB."""
    if hasattr(opt, "apply_pending_updates"):
        opt.apply_pending_updates()
    return types.SimpleNamespace(scheduler_config=getattr(opt, "scheduler_config", None),
                                 plan=getattr(opt, "plan", None),
                                 measured=getattr(opt, "measured", None))


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
                            run["seconds_per_iteration"])
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
                  measured: float) -> dict[str, Any]:
    """One policy simulated on ``profile`` and ``cost``, beside its measured seconds.

    Over Horovod: its 1 ms cycle and 128 MiB fusion.  The ``-td`` rows' transport issues each
    block as its own all-reduce as soon as the scheduler releases it: no cycle, no fusion."""
    from dcredit_hvd import simulator
    from dcredit_hvd.policies import DCredit

    kwargs: dict[str, Any] = {"overlap_forward": policy.overlap and policy.base != "horovod",
                              "fusion_bytes": 128 << 20}
    if policy.transport is not None:
        kwargs.update(cycle_s=0.0, fusion_bytes=0)
    rule: Any = policy.base
    if policy.base in ("wfbp", "bytescheduler"):
        config = kept.scheduler_config
        kwargs.update(partition_bytes=config.partition_bytes, credit_bytes=config.credit_bytes)
    elif policy.base == "dcredit":       # a fresh policy each time: simulate() binds it
        rule = DCredit(kept.plan, overlap_forward=policy.overlap)
    predicted = simulator.simulate(profile, cost, rule, **kwargs).iteration_s
    return {"predicted": predicted, "measured": measured,
            "error_percent": 100.0 * (predicted - measured) / measured}


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


def network_model(cost: Any, link: dict[str, Any] | None, bandwidth_optimal: bool = False) -> Any:
    """The simulator's network model of the virtual cluster: the links' seconds per byte under
    the run's all-reduce (``link_need``), with the live model's startup ``a`` (on this CPU
    mostly Horovod's cycle, not the wire). ``bandwidth_optimal``: under a ring instead (Gloo's
    all-reduce, for the ``-td`` rows). None off the virtual cluster."""
    from dcredit_hvd.costmodel import CostModel

    if link is None:
        return None
    seconds = link["bandwidth_optimal_seconds"] if bandwidth_optimal else link["seconds"]
    return CostModel(a=cost.a, b=seconds / link["bytes"])


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
    note = results.get("energy")
    if note is None:
        print("energy J/iter: n/a on --device cpu (GPU energy only, with --device cuda)")
    else:
        print(f"energy J/iter: {note['scope']}.")
        if not note["available"]:
            print(f"  rank 0: {note['meter_rank0']}")


if __name__ == "__main__":
    sys.exit(main())
