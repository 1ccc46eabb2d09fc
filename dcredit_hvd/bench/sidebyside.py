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
(``dcredit_hvd.bench.energy``; needs ``pip install nvidia-ml-py`` and a Volta or newer GPU).
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

# the report's names, also read from here by scripts and tests
from .report import (  # noqa: F401  (re-exported where scripts and tests read them)
    BASELINES,
    SYNC,
    TORCH_DISTRIBUTED,
    PolicyName,
    gloo_rows,
    lower_bound,
    network_model,
    pool,
    print_table,
    simulated_row,
    simulator_check,
    with_untracked_compute,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from .report import policy_epilog

    parser = argparse.ArgumentParser(prog="python -m dcredit_hvd.bench.sidebyside", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=policy_epilog())
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
                        help="comma-separated row names: dcredit_hvd's policies, each with "
                        "optional suffixes, and the baselines (every name is listed below)")
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
            print(f"python -m dcredit_hvd.bench.sidebyside: error: --device cuda: {problem}",
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
            from dcredit_hvd.bench.energy import EnergyMeter

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
        from dcredit_hvd.bench import hfmodels, zoo

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
        from dcredit_hvd.bench import hfmodels, zoo

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
        from dcredit_hvd.bench.energy import gpu_energy_per_iteration

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
            credit_bytes=args.credit_bytes, shard=policy.shard or None)

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
                results["policies"][policy]["optimizer_state_bytes"] = state_bytes(
                    optimizers[policy])
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
    state = getattr(opt, "_state", None)
    transport = getattr(state, "transport", None)
    return types.SimpleNamespace(scheduler_config=getattr(opt, "scheduler_config", None),
                                 plan=getattr(opt, "plan", None),
                                 measured=getattr(opt, "measured", None),
                                 halves=getattr(state, "halves_cost", None),
                                 workers=transport.size() if transport is not None else None)


def state_bytes(opt: Any) -> int:
    """Bytes of tensors in ``opt``'s state on this rank; with ``shard=True``, its slices'."""
    from dcredit_hvd.runtime import shards

    sharded = getattr(getattr(opt, "_state", None), "sharded", None)
    return sharded.state_bytes() if sharded is not None else shards.state_bytes(opt.state)


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


if __name__ == "__main__":
    sys.exit(main())
