#!/usr/bin/env python3
"""`make bench`: every policy on the zoo models, on virtual clusters of 2 and 4 hosts.

Each (model, hosts, bandwidth) is one launch of ``python -m dcredit_hvd.bench`` under
``scripts/vcluster.sh N RATE -- mpirun -np N -H h0,...`` (one rank per host, each host's NIC
shaped to RATE in both directions; all policies side by side in that launch); the JSON results
land in ``results/bench/`` and this script then writes ``results/bench/benchmarks.md`` (tables
ready for ``docs/benchmarks.md``) and PNG plots.

The all-reduce algorithm is fixed per cluster size, for every policy and the lower bound alike
(``ALGORITHM``): the fastest Open MPI algorithm measured for a 24 MiB ``hvd.allreduce`` on that
cluster (``scripts/allreduce_probe.py``; ``ddp`` runs Gloo's own). Subnormals are flushed
(``dcredit_hvd.bench.sidebyside``).

The models keep their exact parameter shapes (so the bytes communicated are the real ones) but
run on small inputs so one CPU core per rank computes an iteration in about a second; the inputs
are part of each table's heading.  ``--quick`` runs one bandwidth, 2 hosts, fewer iterations.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dcredit_hvd.bench.sidebyside import gloo_rows  # noqa: E402

POLICIES = "horovod,ddp,wfbp,bytescheduler,dcredit-sync,dcredit"
#: name -> (zoo model, builder options, batch size, description of the input)
MODELS = {
    "resnet50": ("resnet50", {"image_size": 64}, 8, "ResNet-50 (25.6 M params), 64x64 images, batch 8"),
    "vgg16": ("vgg16", {"image_size": 32, "pool_size": 1}, 8,
              "VGG-16 convolutions with a 1x1-pooled classifier (37.7 M params), 32x32 images, batch 8"),
    "gpt2_small": ("gpt2_small", {"seq_len": 32, "layers": 4}, 2,
                   "GPT-2 small's embedding, head and blocks, 4 of its 12 layers (67.7 M params), "
                   "32 tokens, batch 2"),
    "gpt_tied": ("gpt2_small", {"vocab": 8192, "ctx": 128, "seq_len": 128, "d": 256, "layers": 8,
                                "heads": 8}, 4,
                 "GPT-style transformer, tied embedding, d=256, 8 layers, vocab 8192 (8.4 M "
                 "params in 100 tensors, 75 of them under 100 k elements), 128 tokens, batch 4"),
    "gpt_4m": ("gpt2_small", {"vocab": 4096, "ctx": 128, "seq_len": 128, "d": 256, "layers": 4,
                              "heads": 8}, 4,
               "GPT-style transformer, tied embedding, d=256, 4 layers, vocab 4096 (4.2 M params "
               "in 52 tensors, 36 of them under 100 k elements), 128 tokens, batch 4"),
    "hf_llama": ("hf_llama", {"vocab": 4096, "ctx": 128, "seq_len": 128, "d": 256, "layers": 4,
                              "heads": 8, "ffn": 688}, 4,
                 "transformers LlamaForCausalLM, tied embedding, d=256, 4 layers, vocab 4096 "
                 "(4.2 M params in 38 tensors), 128 tokens, batch 4"),
}
#: Open MPI all-reduce per host count (coll_tuned_allreduce_algorithm), measured fastest for a
#: 24 MiB hvd.allreduce at 1 Gbit/s: recursive doubling (3) on 2 hosts (one exchange of the
#: whole vector: 1.08x what the link needs), ring (4) on 4 (1.62x; recursive doubling needs
#: log2(4) = 2 full exchanges and measured 3.0x). Open MPI's default decision took 1.5x and 2.5x.
ALGORITHM = {2: 3, 4: 4}


def hosts_of(n: int) -> str:
    return ",".join(f"h{i}" for i in range(n))


def run(model: str, n: int, rate: str, iters: int, out: Path, rounds: int = 1,
        policies: str = POLICIES) -> bool:
    """One launch; False when it failed (the next ones still run, the report says which)."""
    zoo_name, options, batch, _ = MODELS[model]
    result = out / f"{model}-{n}h-{rate}.json"
    venv_python = os.environ.get("PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    algorithm = ["--mca", "coll_tuned_use_dynamic_rules", "1",
                 "--mca", "coll_tuned_allreduce_algorithm", str(ALGORITHM[n])] \
        if n in ALGORITHM else []
    cmd = [str(ROOT / "scripts" / "vcluster.sh"), str(n), rate, "--",
           "timeout", "-k", "10", "3600", "mpirun", "-np", str(n), "-H", hosts_of(n),
           "--bind-to", "none", *algorithm,
           "-x", "PATH", "-x", "DCREDIT_LOG_LEVEL", "-x", "GLOO_SOCKET_IFNAME",
           venv_python, "-m", "dcredit_hvd.bench", "--model", zoo_name, "--batch-size", str(batch),
           "--num-warmup-batches", "2", "--num-batches-per-iter", "2", "--num-iters", str(iters),
           "--rounds", str(rounds), "--policy", policies, "--json", str(result)]
    for key, value in options.items():
        cmd += ["--model-arg", f"{key}={value}"]
    print(f"[bench] {model} on {n} hosts at {rate}: {' '.join(cmd)}", flush=True)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               DCREDIT_LOG_LEVEL=os.environ.get("DCREDIT_LOG_LEVEL", "INFO"))
    started = time.time()
    status = subprocess.run(cmd, env=env, cwd=ROOT).returncode
    print(f"[bench] {model} on {n} hosts at {rate} took {time.time() - started:.0f} s"
          + (f", FAILED with exit status {status}" if status else ""), flush=True)
    return status == 0


def bound_of(data: dict) -> float:
    """The run's lower bound: ``max(compute, communication)`` raised by a tied embedding's own
    dependency (``dcredit_hvd.bench.sidebyside.lower_bound``); older JSON files lack the latter."""
    if data.get("bound"):
        return data["bound"]["seconds"]
    return max(data["compute"]["seconds_per_iteration"],
               data["communication"]["seconds_per_iteration"])


def table(data: dict) -> str:
    policies = data["policies"]
    base = policies.get("horovod", {}).get("seconds_per_iteration")
    ddp = policies.get("ddp", {}).get("seconds_per_iteration")
    bound = bound_of(data)
    simulated = data.get("simulated", {})
    lines = [f"{data['ranks']} ranks on {', '.join(data.get('hosts', ['?']))}; all-reduce: "
             f"{data.get('allreduce', '?')} ({gloo_rows(policies)}: Gloo's); subnormals flushed: "
             f"{data.get('flush_denormal', '?')}" + (
                 f"; load average {data['loadavg_start'][0]:.1f} at the start, "
                 f"{data['loadavg_end'][0]:.1f} at the end (2 CPUs)" if "loadavg_end" in data
                 else ""), "",
             f"compute only {data['compute']['seconds_per_iteration'] * 1e3:.0f} ms, communication "
             f"only {data['communication']['seconds_per_iteration'] * 1e3:.0f} ms, lower bound "
             f"{bound * 1e3:.0f} ms" + (
                 f"; the links need {data['link']['seconds'] * 1e3:.0f} ms for the gradients under "
                 f"this all-reduce" if data.get("link") else "") + (
                 f"; the simulator adds {simulated['untracked_compute_s'] * 1e3:.0f} ms of compute "
                 "outside the profiled layers" if simulated.get("untracked_compute_s") else ""), "",
             "| policy | ms / iteration | img/s per rank (mean +- 1.96 std) | x lower bound "
             "| speed-up over horovod | over ddp | simulated ms | simulator error "
             "| link-model ms | link-model error |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in policies.items():
        t = r["seconds_per_iteration"]
        sim = simulated.get(name)
        over_h = f"{base / t:.2f}x" if base else "-"
        over_d = f"{ddp / t:.2f}x" if ddp else "-"
        sim_cells = f"{sim['predicted'] * 1e3:.1f} | {sim['error_percent']:+.1f}%" if sim \
            else "- | -"
        sim_cells += (f" | {sim['predicted_link'] * 1e3:.1f} | {sim['error_link_percent']:+.1f}%"
                      if sim and "predicted_link" in sim else " | - | -")
        lines.append(f"| {name} | {t * 1e3:.1f} | {r['img_sec_mean']:.1f} +- "
                     f"{r['img_sec_conf']:.1f} | {t / bound:.2f} | {over_h} | {over_d} | "
                     f"{sim_cells} |")
    return "\n".join(lines)


def summary(results: list[tuple[str, str, dict]]) -> str:
    """One row per run: each policy's ms per iteration, x lower bound, speed-up over horovod
    and ddp, and the simulator's error (live cost model / link model)."""
    lines = ["| run | policy | ms / iteration | x lower bound | over horovod | over ddp "
             "| simulator error (live / link model) |", "|---|---|---:|---:|---:|---:|---:|"]
    for model, where, data in results:
        policies = data["policies"]
        base = policies.get("horovod", {}).get("seconds_per_iteration")
        ddp = policies.get("ddp", {}).get("seconds_per_iteration")
        bound = bound_of(data)
        for name, r in policies.items():
            t = r["seconds_per_iteration"]
            sim = data.get("simulated", {}).get(name)
            error = "-" if not sim else f"{sim['error_percent']:+.0f}%" + (
                f" / {sim['error_link_percent']:+.0f}%" if "error_link_percent" in sim else "")
            lines.append(f"| {model}, {where} | {name} | {t * 1e3:.0f} | {t / bound:.2f} | "
                         f"{base / t:.2f}x | {ddp / t:.2f}x | {error} |" if base and ddp else
                         f"| {model}, {where} | {name} | {t * 1e3:.0f} | {t / bound:.2f} | - | - "
                         f"| {error} |")
    return "\n".join(lines)


def plot(results: list[tuple[str, str, dict]], out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for model in sorted({m for m, _, _ in results}):
        rows = [(where, data) for m, where, data in results if m == model]
        fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 3.6), squeeze=False)
        for ax, (where, data) in zip(axes[0], rows):
            names = list(data["policies"])
            times = [data["policies"][n]["seconds_per_iteration"] * 1e3 for n in names]
            bound = bound_of(data) * 1e3
            ax.bar(names, times, color=["#888" if n in ("horovod", "ddp") else "#2a7" for n in names])
            ax.axhline(bound, color="red", linestyle="--", label="lower bound")
            ax.set_title(f"{model}, {where}")
            ax.set_ylabel("ms / iteration")
            ax.tick_params(axis="x", rotation=45)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{model}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    from dcredit_hvd.bench.report import policy_epilog

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=policy_epilog())
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--hosts", default="2,4", help="cluster sizes, e.g. 2,4")
    parser.add_argument("--rates", default="1gbit,10gbit")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1,
                        help="each launch runs every policy this many times in turn (pooled)")
    parser.add_argument("--policies", default=POLICIES,
                        help=f"the --policy of every launch, names listed below (default "
                        f"{POLICIES}; e.g. add dcredit-td: dcredit on torch.distributed)")
    parser.add_argument("--quick", action="store_true", help="2 hosts, 1gbit, 2 iterations")
    parser.add_argument("--out", default=str(ROOT / "results" / "bench"))
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the report and plots from existing JSON files")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    try:
        host_counts = [int(h) for h in ("2" if args.quick else args.hosts).split(",")]
    except ValueError:
        parser.error(f"--hosts {args.hosts!r}: expected host counts such as 2,4")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rates = ["1gbit"] if args.quick else args.rates.split(",")
    iters = 2 if args.quick else args.iters
    results, failed = [], []
    for model in models:
        for rate in rates:
            for n in host_counts:
                path = out / f"{model}-{n}h-{rate}.json"
                if not args.report_only and not run(model, n, rate, iters, out, args.rounds, args.policies):
                    failed.append(f"{model} on {n} hosts at {rate}")
                    path.unlink(missing_ok=True)
                if path.exists():
                    results.append((model, f"{n} hosts, {rate}", json.loads(path.read_text())))
    sections = ["# Benchmark tables (generated by `make bench`)", "", "## Summary", "",
                summary(results), ""]
    for model, where, data in results:
        sections += [f"## {MODELS[model][3]}, {where} (virtual cluster)", "", table(data), ""]
    for png in plot(results, out):
        sections.append(f"![{png.stem}]({png.name})")
    (out / "benchmarks.md").write_text("\n".join(sections) + "\n")
    print(f"[bench] report: {out / 'benchmarks.md'}")
    if failed:
        print(f"[bench] FAILED: {'; '.join(failed)} (see the output above)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
