#!/usr/bin/env python3
"""`make bench`: every policy on the zoo models at several emulated bandwidths, 2 ranks.

Each (model, bandwidth) is one launch of ``python -m dcredit_hvd.bench`` under
``scripts/netshape.sh RATE -- mpirun -np 2 ...`` (all policies side by side in that launch);
the JSON results land in ``results/bench/`` and this script then writes
``results/bench/benchmarks.md`` (tables ready for ``docs/benchmarks.md``) and PNG plots.

The models keep their exact parameter shapes (so the bytes communicated are the real ones) but
run on small inputs so one CPU core per rank computes an iteration in about a second; the inputs
are part of each table's heading.  ``--quick`` runs one bandwidth and fewer iterations.
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
POLICIES = "horovod,ddp,wfbp,bytescheduler,dcredit-sync,dcredit"
#: name -> (zoo model, builder options, batch size, description of the input)
MODELS = {
    "resnet50": ("resnet50", {"image_size": 64}, 8, "ResNet-50 (25.6 M params), 64x64 images, batch 8"),
    "vgg16": ("vgg16", {"image_size": 32, "pool_size": 1}, 8,
              "VGG-16 convolutions with a 1x1-pooled classifier (37.7 M params), 32x32 images, batch 8"),
    "gpt2_small": ("gpt2_small", {"seq_len": 64, "layers": 4}, 2,
                   "GPT-2 small's embedding, head and blocks, 4 of its 12 layers (67.7 M params), "
                   "64 tokens, batch 2"),
}


def run(model: str, rate: str, iters: int, out: Path) -> Path:
    zoo_name, options, batch, _ = MODELS[model]
    result = out / f"{model}-{rate}.json"
    venv_python = os.environ.get("PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    cmd = [str(ROOT / "scripts" / "netshape.sh"), rate, "--",
           "timeout", "-k", "10", "3600", "mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none",
           "--map-by", "slot", "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo",
           "--mca", "oob_tcp_if_include", "lo", "-x", "PATH",
           venv_python, "-m", "dcredit_hvd.bench", "--model", zoo_name, "--batch-size", str(batch),
           "--num-warmup-batches", "2", "--num-batches-per-iter", "2", "--num-iters", str(iters),
           "--policy", POLICIES, "--json", str(result)]
    for key, value in options.items():
        cmd += ["--model-arg", f"{key}={value}"]
    print(f"[bench] {model} at {rate}: {' '.join(cmd)}", flush=True)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               DCREDIT_LOG_LEVEL=os.environ.get("DCREDIT_LOG_LEVEL", "INFO"))
    started = time.time()
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    print(f"[bench] {model} at {rate} took {time.time() - started:.0f} s", flush=True)
    return result


def table(data: dict) -> str:
    policies = data["policies"]
    base = policies.get("horovod", {}).get("seconds_per_iteration")
    bound = max(data["compute"]["seconds_per_iteration"],
                data["communication"]["seconds_per_iteration"])
    simulated = data.get("simulated", {})
    lines = [f"compute only {data['compute']['seconds_per_iteration'] * 1e3:.0f} ms, communication "
             f"only {data['communication']['seconds_per_iteration'] * 1e3:.0f} ms, lower bound "
             f"{bound * 1e3:.0f} ms", "",
             "| policy | ms / iteration | img/s per rank (mean +- 1.96 std) | speedup over horovod "
             "| x lower bound | simulated ms | simulator error |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in policies.items():
        t = r["seconds_per_iteration"]
        sim = simulated.get(name)
        lines.append(
            f"| {name} | {t * 1e3:.1f} | {r['img_sec_mean']:.1f} +- {r['img_sec_conf']:.1f} | "
            f"{base / t:.2f}x | {t / bound:.2f} | "
            f"{sim['predicted'] * 1e3:.1f} | {sim['error_percent']:+.1f}% |" if sim else
            f"| {name} | {t * 1e3:.1f} | {r['img_sec_mean']:.1f} +- {r['img_sec_conf']:.1f} | "
            f"{base / t:.2f}x | {t / bound:.2f} | - | - |")
    return "\n".join(lines)


def plot(results: list[tuple[str, str, dict]], out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for model in sorted({m for m, _, _ in results}):
        rows = [(rate, data) for m, rate, data in results if m == model]
        fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 3.6), squeeze=False)
        for ax, (rate, data) in zip(axes[0], rows):
            names = list(data["policies"])
            times = [data["policies"][n]["seconds_per_iteration"] * 1e3 for n in names]
            bound = max(data["compute"]["seconds_per_iteration"],
                        data["communication"]["seconds_per_iteration"]) * 1e3
            ax.bar(names, times, color=["#888" if n in ("horovod", "ddp") else "#2a7" for n in names])
            ax.axhline(bound, color="red", linestyle="--", label="lower bound")
            ax.set_title(f"{model}, {rate}")
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
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rates", default="1gbit,5gbit")
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="1gbit only, 2 iterations")
    parser.add_argument("--out", default=str(ROOT / "results" / "bench"))
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the report and plots from existing JSON files")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rates = ["1gbit"] if args.quick else args.rates.split(",")
    iters = 2 if args.quick else args.iters
    results = []
    for model in args.models.split(","):
        for rate in rates:
            path = out / f"{model}-{rate}.json"
            if not args.report_only:
                run(model, rate, iters, out)
            if path.exists():
                results.append((model, rate, json.loads(path.read_text())))
    sections = ["# Benchmark tables (generated by `make bench`)", ""]
    for model, rate, data in results:
        sections += [f"## {MODELS[model][3]}, 2 ranks, emulated {rate}", "", table(data), ""]
    for png in plot(results, out):
        sections.append(f"![{png.stem}]({png.name})")
    (out / "benchmarks.md").write_text("\n".join(sections) + "\n")
    print(f"[bench] report: {out / 'benchmarks.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
