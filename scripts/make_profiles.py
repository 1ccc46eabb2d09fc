#!/usr/bin/env python3
"""Write the shipped replay profiles, ``dcredit_hvd/profiles/{resnet50,vgg16,gpt2_small}.json``.

    python scripts/make_profiles.py            # rewrites the three files
    python scripts/make_profiles.py --check    # exits 1 if a file differs from what it would write

Per-tensor names, shapes and bytes are the real architectures' (``dcredit_hvd.bench.zoo``; float32
gradients).  No GPU profile of these models has been taken on a lent GPU yet
(``scripts/gpu_profile_zoo.py``), so the per-layer times are a published iteration time split
over the layers in proportion to their forward FLOPs, backward twice forward (``zoo.profile``):

* ResNet-50: V100 AMP, 1,200 img/s at batch 256 = 213.3 ms per iteration (NVIDIA Deep Learning
  Examples, PyTorch RN50 v1.5 README);
* VGG-16: V100 FP32, 249 img/s at batch 192 = 771.1 ms (Lambda TensorFlow benchmark);
* GPT-2 124M: about 300 ms per step at 64 x 1024 tokens per A100 (llm.c, run_gpt2_124M.sh).

The published time covers the whole step (optimizer and data included); it is all charged to
forward and backward here.  A profile measured by ``gpu_profile_zoo.py`` (same format) should
replace these; each file's ``source`` says where its times come from.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dcredit_hvd.bench import zoo  # noqa: E402
from dcredit_hvd.planning import simulator  # noqa: E402

#: model -> (batch, iteration seconds, where the figure comes from)
ANCHORS = {
    "resnet50": (256, 256 / 1200, "ResNet-50 v1.5, V100 16GB AMP, 1,200 img/s at batch 256 "
                 "(NVIDIA DeepLearningExamples PyTorch/Classification/ConvNets/resnet50v1.5/"
                 "README.md; batch from configs.yml): 213.3 ms per iteration"),
    "vgg16": (192, 192 / 249, "VGG-16, V100 32GB FP32, 249 img/s at batch 192 (Lambda "
              "TensorFlow benchmark, tf-train-throughput-fp32.csv / tf-train-bs-fp32.csv): "
              "771.1 ms per iteration"),
    "gpt2_small": (64, 0.300, "GPT-2 124M, about 300 ms per step at 64 x 1024 tokens per "
                   "A100 80GB (karpathy/llm.c scripts/run_gpt2_124M.sh)"),
}
SPLIT = ("per-layer times: the published iteration time split over layers in proportion to "
         "their forward FLOPs (dcredit_hvd.bench.zoo specs), backward = 2 x forward, a layer's time "
         "split evenly over its tensors; the whole step (optimizer, data) is charged to forward "
         "and backward; not a GPU measurement (none taken yet: scripts/gpu_profile_zoo.py)")


def record(model: str) -> dict:
    """The shipped profile of ``model``: the ``profile_out`` format plus its provenance."""
    batch, seconds, source = ANCHORS[model]
    flops = zoo.forward_flops(model, batch)
    profile = zoo.profile(model, batch, 3.0 * flops / seconds)
    cost = simulator.link_cost(10e9, 0.0, 16)
    return {
        "model": model, "batch_size": batch, "unit": zoo.entry(model).unit,
        "source": f"{source}; {SPLIT}",
        "iteration_s": seconds,
        "shapes": [list(shape) for _, shape in zoo.shapes(model)],
        "profile": dataclasses.asdict(profile),
        "cost": dict(dataclasses.asdict(cost), note="not measured: ring all-reduce of 16 hosts "
                     "at 10 Gbit/s (simulator.link_cost), for `python -m dcredit_hvd simulate "
                     "--profile`; the replay ignores it"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    stale = []
    for model in ANCHORS:
        path = ROOT / "dcredit_hvd" / "profiles" / f"{model}.json"
        text = json.dumps(record(model), indent=1) + "\n"
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path))
            continue
        path.write_text(text)
        print(f"wrote {path}")
    if stale:
        print("stale: " + ", ".join(stale) + " (run scripts/make_profiles.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
