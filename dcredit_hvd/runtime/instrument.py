"""Instrumentation: per-layer timing (the profiler, the timeline), the timeline's backward and
wait tracks, and the package's log.

Per-layer hooks exist only while something reads them: two Python hooks per layer cost every
forward a few microseconds per layer.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from typing import Optional

import torch

from .state import OptimizerState
from .weak import weakly

log = logging.getLogger("dcredit_hvd")

#: A wait for an update shorter than this does not show on the timeline.
_TRACED_WAIT = 20e-6


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time, not at creation: a test runner that
    captured and closed an earlier stderr must not turn the exit-time report into a logging
    traceback."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup_logging() -> None:
    """``[dcredit_hvd]`` lines on stderr, at ``DCREDIT_LOG_LEVEL`` (INFO)."""
    if not log.handlers:
        handler = _CurrentStderrHandler()
        handler.setFormatter(logging.Formatter("[dcredit_hvd] %(message)s"))
        log.addHandler(handler)
        log.setLevel(os.environ.get("DCREDIT_LOG_LEVEL", "INFO").upper())
        log.propagate = False


class Instrumentation:
    """Feeds the profiler and the timeline from the hooks; acts on ``state`` only."""

    def __init__(self, state: OptimizerState) -> None:
        self.state = state

    def watch_layers(self, model: torch.nn.Module) -> None:
        """The modules of ``model`` that own parameters this optimizer updates, and names."""
        state = self.state
        owned = set(state.requires_update)
        state.module_names = {m: n or type(m).__name__ for n, m in model.named_modules()}
        state.layer_params = {module: params for module in model.modules()
                              if (params := [p for p in module.parameters(recurse=False)
                                             if p in owned])}

    def wanted(self) -> bool:
        """Whether anything reads per-layer times now (the profiler, the timeline)."""
        return self.state.profiler is not None or self.state.timeline is not None

    def time_layers(self, on: bool) -> None:
        """Add the per-layer forward hooks (``on``) or remove them."""
        layers = self.state.hooks.layers
        if not on:
            for handle in layers:
                handle.remove()
            layers.clear()
        elif not layers:
            start, end = weakly(self.layer_start), weakly(self.layer_end)
            for module in self.state.layer_params:
                layers.append(module.register_forward_pre_hook(start))
                layers.append(module.register_forward_hook(end))

    def layer_start(self, module, inputs) -> None:
        # No wait here: the read guard makes each read of a parameter wait for its update.
        state = self.state
        if state.profiler is not None:
            state.profiler.layer_start(module)
        if state.timeline is not None:
            state.layer_started[module] = time.perf_counter()

    def layer_end(self, module, inputs, output) -> None:
        state = self.state
        if state.profiler is not None:
            state.profiler.layer_end(module, state.layer_params[module])
        if state.timeline is not None and module in state.layer_started:
            state.timeline.layer("forward", state.module_names[module],
                                 state.layer_started.pop(module), time.perf_counter())

    def forward_ended(self) -> None:
        state = self.state
        if state.profiler is not None:
            state.profiler.forward_end()
        if state.timeline is not None:
            state.last_ready = time.perf_counter()

    def gradient_ready(self, p: torch.Tensor) -> None:
        """``p``'s gradient is complete: the profiler's backward time, the backward track."""
        state = self.state
        if state.profiler is not None:
            state.profiler.ready(p)
        if state.timeline is not None:
            self._trace_backward(p)

    def _trace_backward(self, p: torch.Tensor) -> None:
        """Backward track: each gradient spans from the previous gradient's readiness (or the
        end of forward) to its own, the time autograd spent producing it."""
        state = self.state
        now = time.perf_counter()
        start = state.last_ready if state.last_ready is not None else now
        state.timeline.layer("backward", state.names[p], start, now)
        state.last_ready = now

    def wait_started(self) -> float:
        return time.perf_counter() if self.state.timeline is not None else 0.0

    def waited(self, params: list, started: float) -> None:
        """A wait for updates that blocked shows on the forward track (exposed communication)."""
        timeline = self.state.timeline
        if timeline is None or time.perf_counter() - started <= _TRACED_WAIT:
            return
        names = [self.state.names.get(p, "?") for p in params]
        timeline.layer("forward", f"wait for update: {', '.join(names[:3])}"
                       f"{' ...' if len(names) > 3 else ''}", started,
                       time.perf_counter(), parameters=names)

    def mark(self, what: str, **details) -> None:
        if self.state.timeline is not None:
            self.state.timeline.mark(what, **details)

    def on_rank0(self) -> Optional[logging.Logger]:
        """The log, on the job's rank 0 only (set up on first use)."""
        if self.state.transport.job_rank() != 0:
            return None
        setup_logging()
        return log
