"""The framework versions each entry point is tested with; outside them it refuses at import,
naming the installed version and the fix, rather than failing later inside a fit."""
from __future__ import annotations

#: Package -> (lowest supported, first unsupported), as ``major.minor`` tuples.
SUPPORTED = {
    "pytorch_lightning": ((2, 6), (2, 7)),
    "lightning": ((2, 6), (2, 7)),
    "transformers": ((5, 24), (5, 25)),
    "accelerate": ((1, 15), (1, 16)),
}
EXTRA = {"pytorch_lightning": "lightning", "lightning": "lightning", "transformers": "hf",
         "accelerate": "hf"}


def _major_minor(version: str) -> tuple[int, int]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit()) or "0"
        parts.append(int(digits))
    return (parts + [0])[0], (parts + [0, 0])[1]


def require(package: str, version: str) -> None:
    """Raise ``ImportError`` when ``version`` of ``package`` is outside ``SUPPORTED``."""
    low, high = SUPPORTED[package]
    found = _major_minor(version)
    if not low <= found < high:
        raise ImportError(
            f"dcredit_hvd.frameworks: {package} {version} is not supported (tested with "
            f"{low[0]}.{low[1]}.x; supported: >={low[0]}.{low[1]}, <{high[0]}.{high[1]}); "
            f"install the tested version: pip install 'dcredit_hvd[{EXTRA[package]}]'")
