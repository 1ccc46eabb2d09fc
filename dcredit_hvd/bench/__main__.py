"""``python -m dcredit_hvd.bench``: the side-by-side bench (``sidebyside``)."""
import sys

if __name__ == "__main__":
    from .sidebyside import main

    sys.exit(main())
