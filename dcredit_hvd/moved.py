"""Old module paths (before the subpackages) fail with the new path, instead of a bare
``No module named ...``: scripts that imported ``dcredit_hvd.planner`` learn where it went.

A finder on ``sys.meta_path`` that answers only for the names in ``MOVED``; every other import
goes past it untouched.  The old paths do not keep working: two names for one module would give
two copies of its classes and state.
"""
from __future__ import annotations

import importlib.abc
import sys

#: Old module -> new module (release 0.2 moved every module into its concern's folder).
MOVED = {
    **{f"dcredit_hvd.{m}": f"dcredit_hvd.runtime.{m}" for m in (
        "agreement", "amplifier", "checks", "device", "gradients", "instances", "instrument",
        "lifecycle", "lifetime", "overlap", "readguard", "scheduler", "state", "timeline",
        "units", "updates", "weak")},
    "dcredit_hvd.runtime": "dcredit_hvd.runtime.assembly",
    **{f"dcredit_hvd.{m}": f"dcredit_hvd.planning.{m}" for m in (
        "blocks", "costmodel", "drift", "planner", "profile", "profiler", "simulator")},
    "dcredit_hvd.planning": "dcredit_hvd.planning.decision",
    "dcredit_hvd.transport": "dcredit_hvd.transports.base",
    "dcredit_hvd.ordering": "dcredit_hvd.transports.ordering",
    "dcredit_hvd.sidechannel": "dcredit_hvd.transports.sidechannel",
    "dcredit_hvd.liveness": "dcredit_hvd.liveness.heartbeat",
    "dcredit_hvd.liveness_mesh": "dcredit_hvd.liveness.mesh",
    "dcredit_hvd.liveness_settings": "dcredit_hvd.liveness.settings",
    "dcredit_hvd.handshake": "dcredit_hvd.liveness.handshake",
    "dcredit_hvd.interfaces": "dcredit_hvd.liveness.interfaces",
    "dcredit_hvd.bench": "dcredit_hvd.bench.sidebyside",
    "dcredit_hvd.bench_report": "dcredit_hvd.bench.report",
    "dcredit_hvd.emulate_report": "dcredit_hvd.bench.emulate_report",
    **{f"dcredit_hvd.{m}": f"dcredit_hvd.bench.{m}" for m in (
        "energy", "hfmodels", "replay", "zoo")},
}
#: Old names that are packages now: importing them works (they hold the new modules).
_NOW_PACKAGES = {"dcredit_hvd.runtime", "dcredit_hvd.planning", "dcredit_hvd.liveness",
                 "dcredit_hvd.bench"}


def message(old: str) -> str:
    return (f"dcredit_hvd: module {old} moved to {MOVED[old]} in dcredit_hvd 0.2 (one folder "
            f"per concern, docs/design.md); import it from there")


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Raises ``ModuleNotFoundError`` naming the new path for a module that moved."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED and fullname not in _NOW_PACKAGES:
            raise ModuleNotFoundError(message(fullname), name=fullname)
        return None


def install() -> None:
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
