#!/usr/bin/env python3
"""What the read guard costs: forward time with every parameter held (every read of a parameter
goes through the guard's ``__torch_function__``, whose wait returns at once) against the plain
forward, on one process, no Horovod.

This is an upper bound: in training only the parameters whose update is still owed are held,
and each is released (back to full speed) as soon as it is updated.

    .venv/bin/python scripts/bench_readguard.py [--repeats 30]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from dcredit_hvd.bench import zoo
from dcredit_hvd.runtime.readguard import ReadGuard


def _models():
    yield "zoo gpt (4 layers, d=256, tied)", zoo.gpt(vocab=8192, ctx=128, d=256, layers=4, heads=4), \
        torch.randint(0, 8192, (4, 128))
    yield "zoo resnet50 (width 16)", zoo.resnet50(width=16, num_classes=100), \
        torch.randn(4, 3, 64, 64)
    try:
        import transformers as tf
    except ImportError:
        return
    cfg = tf.GPT2Config(vocab_size=1024, n_positions=128, n_embd=128, n_layer=4, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    yield "transformers GPT-2 (4 layers, d=128)", tf.GPT2LMHeadModel(cfg), \
        torch.randint(0, 1024, (4, 128))


def _forward_seconds(model, x) -> float:
    with torch.no_grad():
        started = time.perf_counter()
        model(x)
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    print("| model | tensors | plain forward ms | all held ms | overhead | guarded reads | "
          "us per guarded read |")
    print("|---|---|---|---|---|---|---|")
    for name, model, x in _models():
        model.eval()
        params = list(model.parameters())
        reads = [0]

        def wait(held, reads=reads):
            reads[0] += 1

        guard = ReadGuard(wait)
        guard.hold(params)
        # ReadGuard calls wait() only for reads of held parameters: count them per forward.
        _forward_seconds(model, x)
        per_forward = reads[0]
        guard.release_all()
        # Alternate plain and held forwards, so that load from other processes hits both alike.
        plain_times, held_times = [], []
        for _ in range(args.repeats):
            plain_times.append(_forward_seconds(model, x))
            guard.hold(params)
            held_times.append(_forward_seconds(model, x))
            guard.release_all()
        plain, held = statistics.median(plain_times), statistics.median(held_times)
        extra = held - plain
        print(f"| {name} | {len(params)} | {plain * 1e3:.2f} | {held * 1e3:.2f} | "
              f"{extra / plain * 100:+.1f}% | {per_forward} | "
              f"{extra / max(per_forward, 1) * 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    main()
