"""``python -m dcredit_hvd.emulate``: the emulated GPU cluster (``dcredit_hvd.bench.emulate``).

A released command (0.2.0's README and ``scripts/bench_emulated.py`` run it), kept at the top as
an alias after the bench moved into ``dcredit_hvd/bench/``; ``tests/contract/test_imports.py``
checks that it still runs.
"""
import sys

if __name__ == "__main__":
    from .bench.emulate import main

    sys.exit(main())
