"""Measure the zoo models layer by layer on one device, then predict every policy from the
measured profiles with the simulator, from 8 to 128 GPUs on 10 to 400 Gbit/s links.

    python scripts/gpu_profile_zoo.py all --out OUT                       # on a GPU machine
    python scripts/gpu_profile_zoo.py all --device cpu --models resnet50 --batch-size 2 \\
        --iters 2 --warmup 1 --out /tmp/zoo                               # a quick CPU check

``measure`` builds ResNet-50, VGG-16 and GPT-2 small as ``torch.nn`` modules (``dcredit_hvd.bench.zoo``'s
builders, written in the project since torchvision is not available), checks that their
parameters, in the order the forward pass first uses them, have exactly the names and shapes of
the zoo's torch-free specs, and times one training iteration per layer at the zoo's batch sizes:

* forward: a CUDA event (a host clock on CPU) when each module that owns parameters starts;
  a layer's forward time runs to the start of the next such module, so parameter-free work
  (activations, pooling, residual adds, attention scores, the tied LM head, the loss) is
  charged to the nearest preceding layer, as the zoo's specs do; split evenly among the layer's
  tensors (``profile.Profile``);
* backward: an event when each parameter's gradient has been accumulated
  (``register_post_accumulate_grad_hook``), measured from the start of backward: ready times
  ``r_l``, made non-decreasing towards the input, and ``t_b(l) = r_l - r_{l+1}`` (as
  ``dcredit_hvd.planning.profiler.StepProfiler`` does with host clocks, which cannot time GPU work without
  a synchronize per layer);
* the median of ``--iters`` iterations after ``--warmup``; the iteration without hooks is timed
  too, to show what the hooks cost.

Each model's profile is written as ``profile_<model>.json`` in the format
``python -m dcredit_hvd simulate --profile FILE.json`` reads.  The ``cost`` in that file is the
ring all-reduce model of a reference link (``--reference``, 16 GPUs at 10 Gbit/s); ``predict``
replaces it with ``simulator.link_cost`` for every size and speed of the sweep and writes
``predictions.md`` and ``predictions.json``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from dcredit_hvd.__main__ import _size as cli_size  # noqa: E402
from dcredit_hvd.__main__ import parse_rate, parse_time, simulator_policies  # noqa: E402
from dcredit_hvd.bench import zoo  # noqa: E402
from dcredit_hvd.planning import simulator  # noqa: E402
from dcredit_hvd.planning.profile import Profile  # noqa: E402

DEFAULT_MODELS = "resnet50,vgg16,gpt2_small"
DEFAULT_WORKERS = "8,16,32,64,128"
DEFAULT_BANDWIDTHS = "10Gbit,25Gbit,100Gbit,400Gbit"
DEFAULT_POLICIES = "horovod,wfbp,bytescheduler,dcredit"


# ------------------------------------------------------------------------------------------
# measure
# ------------------------------------------------------------------------------------------

class Clock:
    """Timestamps that work the same on CPU (host clock) and CUDA (events on the current stream)."""

    def __init__(self, device: Any) -> None:
        import torch

        self.cuda = device.type == "cuda"
        self._torch = torch

    def mark(self) -> Any:
        if self.cuda:
            event = self._torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            self._torch.cuda.synchronize()

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds from ``start`` to ``end``; call ``sync`` first."""
        if self.cuda:
            return start.elapsed_time(end) / 1e3
        return end - start


def make_batch(name: str, batch: int, device: Any, seq_len: int | None, image_size: int) -> Any:
    """A synthetic batch and the loss of a model on it."""
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    if zoo.entry(name).unit == "images":
        data = torch.randn(batch, 3, image_size, image_size, generator=generator).to(device)
        target = torch.randint(0, 1000, (batch,), generator=generator).to(device)

        def loss_of(model: Any) -> Any:
            return F.cross_entropy(model(data), target)
        return loss_of
    tokens = seq_len or 1024
    data = torch.randint(0, 50257, (batch, tokens + 1), generator=generator).to(device)

    def lm_loss(model: Any) -> Any:
        logits = model(data[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
    return lm_loss


def forward_order(model: Any, loss_of: Any) -> list[tuple[str, Any]]:
    """``(module name, module)`` of every module owning parameters directly, in the order one
    forward pass first calls them."""
    owners = [(n, m) for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]
    seen: dict[int, int] = {}
    handles = []
    for index, (_, module) in enumerate(owners):
        def pre(_module: Any, _inputs: Any, index: int = index) -> None:
            seen.setdefault(index, len(seen))
        handles.append(module.register_forward_pre_hook(pre))
    try:
        loss_of(model).backward()
    finally:
        for h in handles:
            h.remove()
    model.zero_grad(set_to_none=True)
    missing = [owners[i][0] for i in range(len(owners)) if i not in seen]
    if missing:
        raise RuntimeError(f"modules with parameters never called in forward: {missing[:5]}")
    return [owners[i] for i in sorted(seen, key=seen.get)]


def tensors_in_order(layers: list[tuple[str, Any]]) -> list[tuple[str, Any, int]]:
    """``(full name, parameter, layer index)`` in forward order."""
    out = []
    for k, (prefix, module) in enumerate(layers):
        for name, p in module.named_parameters(recurse=False):
            out.append((f"{prefix}.{name}" if prefix else name, p, k))
    return out


def check_shapes(name: str, tensors: list[tuple[str, Any, int]]) -> tuple[bool, str]:
    want = zoo.shapes(name)
    got = [(n, tuple(p.shape)) for n, p, _ in tensors]
    if got == want:
        total = sum(p.numel() for _, p, _ in tensors)
        return True, f"{len(got)} tensors, {total:,} parameters: names and shapes match the zoo spec"
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            return False, f"tensor {i}: measured {g}, zoo spec {w}"
    return False, f"{len(got)} tensors measured, {len(want)} in the zoo spec"


def measure_model(name: str, args: argparse.Namespace, device: Any) -> dict[str, Any]:
    import torch

    entry = zoo.entry(name)
    batch = args.batch_size or entry.default_batch
    torch.manual_seed(42)
    model = zoo.build(name).to(device)
    model.train()
    loss_of = make_batch(name, batch, device, args.seq_len, args.image_size)
    layers = forward_order(model, loss_of)
    tensors = tensors_in_order(layers)
    shapes_ok, shapes_note = check_shapes(name, tensors)
    print(f"[{name}] {shapes_note}", flush=True)
    if not shapes_ok:
        raise RuntimeError(f"{name}: parameters differ from the zoo spec: {shapes_note}")

    clock = Clock(device)
    L = len(tensors)
    state: dict[str, Any] = {}

    def pre_hook(k: int):
        def hook(_module: Any, _inputs: Any) -> None:
            if state.get("on") and k not in state["pre"]:
                state["pre"][k] = clock.mark()
        return hook

    def ready_hook(i: int):
        def hook(_param: Any) -> None:
            if state.get("on") and i not in state["ready"]:
                state["ready"][i] = clock.mark()
        return hook

    handles = [module.register_forward_pre_hook(pre_hook(k)) for k, (_, module) in enumerate(layers)]
    handles += [p.register_post_accumulate_grad_hook(ready_hook(i)) for i, (_, p, _) in enumerate(tensors)]

    per_layer = [sum(1 for _, _, k2 in tensors if k2 == k) for k in range(len(layers))]
    samples_f: list[list[float]] = []
    samples_r: list[list[float]] = []
    hooked_totals: list[float] = []
    for it in range(args.warmup + args.iters):
        model.zero_grad(set_to_none=True)
        state.update(on=True, pre={}, ready={})
        start = clock.mark()
        loss = loss_of(model)
        forward_end = clock.mark()
        loss.backward()
        end = clock.mark()
        state["on"] = False
        clock.sync()
        if it < args.warmup:
            continue
        pre = state["pre"]
        starts = [start] + [pre[k] for k in range(1, len(layers))]
        ends = starts[1:] + [forward_end]
        layer_f = [clock.seconds(a, b) for a, b in zip(starts, ends)]
        samples_f.append([layer_f[k] / per_layer[k] for _, _, k in tensors])
        samples_r.append([clock.seconds(forward_end, state["ready"][i]) for i in range(L)])
        hooked_totals.append(clock.seconds(start, end))
    for h in handles:
        h.remove()

    plain_totals = []
    for it in range(args.warmup + args.iters):
        model.zero_grad(set_to_none=True)
        start = clock.mark()
        loss_of(model).backward()
        end = clock.mark()
        clock.sync()
        if it >= args.warmup:
            plain_totals.append(clock.seconds(start, end))

    t_f = [statistics.median(s[i] for s in samples_f) for i in range(L)]
    ready = [statistics.median(s[i] for s in samples_r) for i in range(L)]
    t_b = [0.0] * L
    later = 0.0
    for i in range(L - 1, -1, -1):
        r = max(ready[i], later)
        t_b[i] = r - later
        later = r
    names = [n for n, _, _ in tensors]
    nbytes = [p.numel() * p.element_size() for _, p, _ in tensors]
    element_size = [p.element_size() for _, p, _ in tensors]
    profile = Profile.from_lists(names, nbytes, element_size, t_f, t_b, [0.0] * L)
    ref_workers, ref_bw = args.reference
    cost = simulator.link_cost(ref_bw, args.latency, ref_workers)
    # The zoo's FLOP count is for 224x224 images and 1024-token sequences.
    standard = args.seq_len in (None, 1024) and args.image_size == 224
    flops = zoo.forward_flops(name, batch) if standard else None
    forward_s = profile.forward_time
    record = {
        "model": name,
        "batch_size": batch,
        "unit": entry.unit if args.seq_len is None else f"sequences of {args.seq_len} tokens",
        "device": device_name(device),
        "torch": torch.__version__,
        "dtype": "float32",
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "warmup": args.warmup,
        "iters": args.iters,
        "shapes": shapes_note,
        "profile": {"names": names, "nbytes": nbytes, "element_size": element_size,
                    "t_f": t_f, "t_b": t_b, "t_u": [0.0] * L},
        "cost": {"a": cost.a, "b": cost.b, "residual": None, "r2": None,
                 "note": (f"not measured: ring all-reduce model of {ref_workers} GPUs at "
                          f"{ref_bw / 1e9:g} Gbit/s, latency {args.latency * 1e6:g} us "
                          f"(simulator.link_cost)")},
        "measured": {
            "forward_s": forward_s,
            "backward_s": profile.backward_time,
            "hooked_iteration_s": statistics.median(hooked_totals),
            "plain_iteration_s": statistics.median(plain_totals),
            "forward_flops": flops,
            "effective_forward_tflops": (flops / forward_s / 1e12) if flops and forward_s > 0 else None,
            "gradient_bytes": sum(nbytes),
        },
    }
    del model, loss_of
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def device_name(device: Any) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def run_measure(args: argparse.Namespace) -> list[str]:
    import torch

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no GPU")
        torch.cuda.set_device(device.index or 0)
        torch.backends.cudnn.benchmark = True
    os.makedirs(args.out, exist_ok=True)
    paths = []
    for name in args.models:
        t0 = time.time()
        record = measure_model(name, args, device)
        path = os.path.join(args.out, f"profile_{name}.json")
        with open(path, "w") as fh:
            json.dump(record, fh, indent=1)
        m = record["measured"]
        tflops = m["effective_forward_tflops"]
        print(f"[{name}] batch {record['batch_size']}: forward {m['forward_s'] * 1e3:.1f} ms, "
              f"backward {m['backward_s'] * 1e3:.1f} ms (median of {args.iters}); iteration "
              f"{m['hooked_iteration_s'] * 1e3:.1f} ms with hooks, {m['plain_iteration_s'] * 1e3:.1f} "
              f"ms without" + (f"; forward at {tflops:.3g} TFLOP/s" if tflops else "")
              + f"; {m['gradient_bytes'] / 1e6:.1f} MB of gradients -> {path} "
              f"({time.time() - t0:.0f} s)", flush=True)
        paths.append(path)
    return paths


# ------------------------------------------------------------------------------------------
# predict
# ------------------------------------------------------------------------------------------

def load_profile(path: str) -> tuple[dict[str, Any], Profile]:
    with open(path) as fh:
        record = json.load(fh)
    p = record["profile"]
    profile = Profile.from_lists(p["names"], p["nbytes"], p["element_size"], p["t_f"], p["t_b"],
                                 p.get("t_u") or ())
    return record, profile


def _simulate_one(task: tuple) -> list[dict[str, Any]]:
    path, mode, workers, bandwidth, latency, policies = task
    record, profile = load_profile(path)
    cost = simulator.link_cost(bandwidth, latency, workers)
    results = simulator.compare(profile, cost, policies=policies, overlap_forward=(mode == "overlap"))
    rows = []
    for r in results:
        rows.append({"model": record["model"], "mode": mode, "workers": workers,
                     "gbit_s": bandwidth / 1e9, "policy": r.policy, "iteration_s": r.iteration_s,
                     "compute_s": r.compute_s, "link_busy_s": r.link_busy_s,
                     "exposed_s": r.exposed_comm_s, "gap": r.gap,
                     "all_reduces": r.ops_per_iteration, "partition_bytes": r.partition_bytes,
                     "plan": getattr(r.plan, "label", None) if r.plan is not None else None})
    return rows


def run_predict(args: argparse.Namespace, paths: list[str]) -> None:
    meta = {}
    for path in paths:
        record, profile = load_profile(path)
        meta[record["model"]] = {k: record.get(k) for k in ("batch_size", "unit", "device", "torch",
                                                           "measured", "shapes")}
        meta[record["model"]]["profile_file"] = os.path.basename(path)
        meta[record["model"]]["tensors"] = profile.num_tensors
    out = {"latency_s": args.latency, "workers": args.workers,
           "bandwidths_gbit_s": [b / 1e9 for b in args.bandwidths], "modes": [],
           "policies": args.policies, "models": meta, "rows": []}
    jobs = max(1, args.jobs)
    # One mode after the other (the first given, sync by default, is the fast one), the files
    # rewritten after each: a run stopped by a time limit still leaves the modes it finished.
    for mode in args.modes:
        tasks = [(path, mode, w, bw, args.latency, args.policies)
                 for path in paths for w in args.workers for bw in args.bandwidths]
        tasks.sort(key=lambda t: -os.path.getsize(t[0]))     # the largest models first
        t0 = time.time()
        if jobs == 1:
            parts = [_simulate_one(task) for task in tasks]
        else:
            with ProcessPoolExecutor(max_workers=min(jobs, len(tasks))) as pool:
                parts = list(pool.map(_simulate_one, tasks))
        for part in parts:
            out["rows"].extend(part)
        out["modes"].append(mode)
        print(f"[{mode}] simulated {len(tasks)} configurations in {time.time() - t0:.0f} s "
              f"({min(jobs, len(tasks))} processes)", flush=True)
        with open(args.json_out, "w") as fh:
            json.dump(out, fh, indent=1)
        with open(args.md_out, "w") as fh:
            fh.write(markdown(out))
    print(f"wrote {args.md_out} and {args.json_out}", flush=True)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or not math.isfinite(seconds) else f"{seconds * 1e3:.1f}"


def markdown(out: dict[str, Any]) -> str:
    policies = out["policies"]
    lines = ["# Predicted iteration times from measured per-layer profiles", "",
             "Compute (per-layer forward and backward) was measured on one device; communication "
             f"is the simulator's ring all-reduce model (latency {out['latency_s'] * 1e6:g} us per "
             "hop, Horovod cycle 1 ms, fusion 128 MiB), not a measurement. `sync`: `step()` waits "
             "for every all-reduce (Horovod, `-sync` policies); `overlap`: the next forward waits "
             "per layer (dcredit_hvd with `model=`; the `horovod` row never overlaps). Times in "
             "ms per iteration. `bound`: under `overlap`, max(compute, one fused all-reduce of "
             "every gradient); under `sync`, the best any schedule whose `step()` waits can do.",
             ""]
    for model, meta in out["models"].items():
        m = meta["measured"]
        lines += [f"## {model}", "",
                  f"{meta['device']}, torch {meta['torch']}, batch {meta['batch_size']} "
                  f"({meta['unit']}) per GPU, {meta['tensors']} tensors, "
                  f"{m['gradient_bytes'] / 1e6:.1f} MB of gradients; measured forward "
                  f"{_ms(m['forward_s'])} ms + backward {_ms(m['backward_s'])} ms "
                  f"(iteration {_ms(m['plain_iteration_s'])} ms without timing hooks). "
                  f"Profile: `{meta['profile_file']}`.", ""]
        for mode in out["modes"]:
            rows = [r for r in out["rows"] if r["model"] == model and r["mode"] == mode]
            if not rows:
                continue
            head = ["GPUs", "Gbit/s", *policies, "bound", "dcredit vs horovod", "dcredit partition"]
            lines += [f"### {mode}", "", "| " + " | ".join(head) + " |",
                      "|" + "|".join("---:" for _ in head) + "|"]
            for w in out["workers"]:
                for bw in out["bandwidths_gbit_s"]:
                    cell = {r["policy"]: r for r in rows if r["workers"] == w and r["gbit_s"] == bw}
                    if not cell:
                        continue
                    values = [_ms(cell[p]["iteration_s"]) if p in cell else "-" for p in policies]
                    bound = cell.get(simulator.LOWER_BOUND if mode == "overlap"
                                     else simulator.NO_OVERLAP_BOUND)
                    speed = "-"
                    if "dcredit" in cell and "horovod" in cell:
                        speed = f"{cell['horovod']['iteration_s'] / cell['dcredit']['iteration_s']:.3f}x"
                    part = cell.get("dcredit", {}).get("partition_bytes")
                    lines.append("| " + " | ".join([str(w), f"{bw:g}", *values,
                                                    _ms(bound["iteration_s"] if bound else None),
                                                    speed, _size(part)]) + " |")
            lines.append("")
    return "\n".join(lines)


def _size(nbytes: int | None) -> str:
    """The CLI's byte format (``2MiB``), ``-`` where a policy has no partition."""
    return "-" if not nbytes else cli_size(nbytes)


# ------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from dcredit_hvd.bench.report import describe_lines

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="--policies names (the simulator's):\n"
                                + describe_lines(simulator_policies()))
    p.add_argument("command", nargs="?", default="all", choices=("all", "measure", "predict"),
                   help="measure (profiles), predict (from profiles in --out), or all (default)")
    p.add_argument("--out", default="zoo_profiles", help="folder for profiles and predictions")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--models", default=DEFAULT_MODELS, help=f"default {DEFAULT_MODELS}")
    p.add_argument("--batch-size", type=int, default=None,
                   help="per-GPU batch for every model (default: the zoo's, 64/64/8)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="GPT tokens per sequence (default: the context, 1024)")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--workers", default=DEFAULT_WORKERS, help=f"default {DEFAULT_WORKERS}")
    p.add_argument("--bandwidths", default=DEFAULT_BANDWIDTHS, help=f"default {DEFAULT_BANDWIDTHS}")
    p.add_argument("--latency", type=parse_time, default=50e-6, help="per hop (default 50us)")
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help=f"simulated policies, listed below (default {DEFAULT_POLICIES})")
    p.add_argument("--modes", default="sync,overlap", help="sync and/or overlap (default both)")
    p.add_argument("--reference", default="16,10Gbit",
                   help="WORKERS,BANDWIDTH of the cost model written into the profiles")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="simulator processes (default: every core)")
    p.add_argument("--md-out", default=None, help="default OUT/predictions.md")
    p.add_argument("--json-out", default=None, help="default OUT/predictions.json")
    args = p.parse_args(argv)
    args.models = [zoo.ALIASES.get(m.strip().lower(), m.strip().lower())
                   for m in args.models.split(",") if m.strip()]
    for m in args.models:
        zoo.entry(m)
    args.workers = [int(w) for w in args.workers.split(",") if w.strip()]
    args.bandwidths = [parse_rate(b.strip()) for b in args.bandwidths.split(",") if b.strip()]
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    for name in args.policies:
        if name not in simulator.POLICY_NAMES:
            p.error(f"unknown policy {name!r}")
    args.modes = [x.strip() for x in args.modes.split(",") if x.strip()]
    if not set(args.modes) <= {"sync", "overlap"}:
        p.error("--modes takes sync and/or overlap")
    ref_workers, _, ref_bw = args.reference.partition(",")
    args.reference = (int(ref_workers), parse_rate(ref_bw or "10Gbit"))
    if args.warmup < 0 or args.iters < 1:
        p.error("--warmup must be >= 0 and --iters >= 1")
    args.md_out = args.md_out or os.path.join(args.out, "predictions.md")
    args.json_out = args.json_out or os.path.join(args.out, "predictions.json")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command in ("all", "measure"):
        if args.device is None:
            import torch
            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        paths = run_measure(args)
    else:
        paths = [os.path.join(args.out, f"profile_{m}.json") for m in args.models]
        missing = [p for p in paths if not os.path.exists(p)]
        if missing:
            raise SystemExit(f"no profile {', '.join(missing)}: run measure first")
    if args.command in ("all", "predict"):
        run_predict(args, paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
