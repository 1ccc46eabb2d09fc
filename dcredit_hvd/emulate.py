"""``python -m dcredit_hvd.emulate``: the emulated GPU cluster (``dcredit_hvd.bench.emulate``).

Kept at the top so that the command users know keeps working after the bench moved into
``dcredit_hvd/bench/``.
"""
import sys

if __name__ == "__main__":
    from .bench.emulate import main

    sys.exit(main())
