"""The liveness channel's settings (``DCREDIT_LIVENESS*``) and their validation.

Apart from the channel (``liveness.py``): ``config.SchedulerConfig`` carries these settings as
its ``liveness*`` fields and validates each with ``validate`` (one rule each), and a channel
started without an optimizer resolves them here (``settings``).  ``liveness`` re-exports the
names, so ``liveness.Settings`` and ``liveness.settings()`` keep working.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from . import interfaces


@dataclass(frozen=True)
class Settings:
    """How the channel runs.  ``DCREDIT_LIVENESS*`` variables, see ``settings``."""

    #: Run the channel at all (``DCREDIT_LIVENESS``, 1/0).
    enabled: bool = True
    #: Seconds between heartbeats (``DCREDIT_LIVENESS_INTERVAL``).
    interval: float = 1.0
    #: Seconds without a heartbeat after which a peer is declared lost
    #: (``DCREDIT_LIVENESS_TIMEOUT``): long enough for a process whose thread cannot run for a
    #: while (a loaded host, a long call holding the GIL), short enough for the 30 s budget.
    timeout: float = 10.0
    #: Seconds the training thread has, after a loss, to raise ``PeerLostError`` and exit
    #: before the process is ended with ``EXIT_STATUS`` (``DCREDIT_LIVENESS_EXIT_SECONDS``;
    #: 0: never force the exit).
    exit_seconds: float = 10.0
    #: The address, or interface name, to listen on (``DCREDIT_LIVENESS_BIND``); empty: the
    #: collective library's (``interfaces.listen_address`` gives the rules).
    bind: str = ""


ENV = {"enabled": "DCREDIT_LIVENESS", "interval": "DCREDIT_LIVENESS_INTERVAL",
       "timeout": "DCREDIT_LIVENESS_TIMEOUT", "exit_seconds": "DCREDIT_LIVENESS_EXIT_SECONDS",
       "bind": "DCREDIT_LIVENESS_BIND"}
#: The ``config.SchedulerConfig`` field that carries each setting.
CONFIG_FIELD = {"enabled": "liveness", "interval": "liveness_interval",
                "timeout": "liveness_timeout", "exit_seconds": "liveness_exit_seconds",
                "bind": "liveness_bind"}
_SWITCH = {"1": True, "true": True, "yes": True, "on": True,
           "0": False, "false": False, "no": False, "off": False}


def validate(name: str, raw: Any, what: str) -> Any:
    """One setting (a ``Settings`` field name), validated; ``what`` names it in the error.
    ``config.SchedulerConfig`` validates its ``liveness*`` fields here too (one rule each)."""
    if name == "enabled":
        key = str(raw).strip().lower() if not isinstance(raw, bool) else str(int(raw))
        if key not in _SWITCH:
            raise ValueError(f"{what} must be 1 or 0 (also true/false, yes/no, on/off), "
                             f"got {raw!r}")
        return _SWITCH[key]
    if name == "bind":
        choice = str(raw).strip()
        if choice and interfaces.resolve_choice(choice) is None:
            names = ", ".join(interfaces.interface_addresses()) or "none found"
            raise ValueError(f"{what} must be an IP address of this host or the name of one of "
                             f"its network interfaces ({names}), got {raw!r}")
        return choice
    try:
        number = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number of seconds, got {raw!r}") from None
    low_ok = number >= 0 if name == "exit_seconds" else number > 0
    if not (low_ok and number < float("inf")):
        bound = ">= 0" if name == "exit_seconds" else "> 0"
        raise ValueError(f"{what} must be a finite number of seconds {bound}, got {raw!r}")
    return number


def check(result: Settings) -> Settings:
    """The rule between fields: a timeout of at least two heartbeats."""
    if result.timeout < 2 * result.interval:
        raise ValueError(f"liveness timeout ({result.timeout:g} s, {ENV['timeout']}) must be at "
                         f"least twice the heartbeat interval ({result.interval:g} s, "
                         f"{ENV['interval']}), or one late heartbeat declares a live peer lost")
    return result


def settings(environ: Optional[Mapping[str, str]] = None, **keywords: Any) -> Settings:
    """Keyword (when not None) > ``DCREDIT_LIVENESS*`` variable > default, validated: for a
    channel started without an optimizer (``watch_peers()`` of a transport).  The same rule and
    texts as ``config.SchedulerConfig``'s, whose ``liveness*`` fields these are (config imports
    this module, so this one resolves on its own rather than through config)."""
    environ = os.environ if environ is None else environ
    unknown = set(keywords) - set(ENV)
    if unknown:
        raise TypeError(f"unknown liveness setting(s): {', '.join(sorted(unknown))}; "
                        f"known: {', '.join(ENV)}")
    values = {}
    for name, variable in ENV.items():
        if keywords.get(name) is not None:
            values[name] = validate(name, keywords[name], CONFIG_FIELD[name])
        elif environ.get(variable, "") != "":
            values[name] = validate(name, environ[variable], f"{variable} (environment)")
    return check(Settings(**values))
