"""What one ``DistributedOptimizer`` knows, apart from the code that acts on it.

Like the state objects of PyTorch's ``ddp_comm_hooks``: the parts (``gradients``, ``lifecycle``,
``overlap``, ``instrument``, ``lifetime``) hold no state of their own that another part reads;
everything they share lives here, so each part can be read, and tested, alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..config import SchedulerConfig
from ..planning.blocks import TensorLayout
from ..planning.drift import DriftDetector
from ..planning.profiler import StepProfiler
from ..policies import Policy
from ..transports.base import Transport
from .amplifier import RaceAmplifier
from .device import CudaTransfer
from .readguard import ReadGuard
from .scheduler import BlockScheduler
from .timeline import Timeline
from .updates import ParameterUpdater


@dataclass(eq=False)
class Hooks:
    """Every hook handle an optimizer registered; ``remove`` takes them all off (``close()``,
    or the finalizer of a collected optimizer: it must not reference the optimizer itself)."""

    handles: list = field(default_factory=list)   # parameter and model hooks, for its life
    layers: list = field(default_factory=list)    # per-layer forward hooks, while read

    def remove(self) -> None:
        for handle in self.handles + self.layers:
            handle.remove()
        self.handles.clear()
        self.layers.clear()


@dataclass(eq=False)
class OptimizerState:
    """The arguments, the gradients' progress, the layout and plan in force, the machinery."""

    # -- the arguments (Horovod's and ours) --------------------------------------------------
    config: SchedulerConfig
    transport: Transport
    compression: Any
    op: Any
    predivide: float
    sparse_as_dense: bool
    passes: int                            # backward_passes_per_step
    names: dict                            # parameter -> name
    requires_update: list                  # parameters with requires_grad, in group order
    overlap: bool = False                  # model= given: step() returns at once
    elastic: bool = False                  # ranks come and go (transport.elastic)
    enabled: bool = False                  # more than one rank (or elastic): schedule at all

    # -- this iteration's gradients (``gradients.py``) -----------------------------------------
    delay: dict = field(default_factory=dict)      # parameter -> passes left before it is sent
    pending: set = field(default_factory=set)      # fired at least once since the last sync
    queued: set = field(default_factory=set)       # handed to the scheduler this iteration
    synchronized: bool = False
    should_synchronize: bool = True
    step_in_flight: bool = False           # an overlapped step() whose updates may be owed
    cuda: Optional[CudaTransfer] = None    # CUDA gradients only (device.py)
    cuda_stream: Any = None                # the stream that produced the last CUDA gradients

    # -- the units in force (``gradients.build_layouts``) --------------------------------------
    initial: list = field(default_factory=list)    # construction order
    order: list = field(default_factory=list)      # priority order (rank 0's forward order)
    layouts: list[TensorLayout] = field(default_factory=list)
    index: dict = field(default_factory=dict)      # parameter -> its unit
    offset: dict = field(default_factory=dict)     # parameter -> its offset in the unit
    members: list = field(default_factory=list)    # unit -> its parameters
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)   # grouped unit -> buffer
    slots: dict = field(default_factory=dict)      # member -> its view of the buffer
    arrived: dict[int, list] = field(default_factory=dict)   # grouped unit -> gradients in

    # -- the plan's life (``lifecycle.py``) ----------------------------------------------------
    prefix: str = ""                       # every collective's name starts with it
    is_gate: bool = False                  # rank 0 of the group: its policy gates
    policy: Optional[Policy] = None        # the configured (or planned) policy
    plan: Any = None                       # planner.Plan in force
    #: A baseline the race installed: the block size it was priced with (else the config's).
    schedule_partition: Optional[int] = None
    measured: Any = None                   # (Profile, CostModel) it was made from
    halves_cost: Any = None                # shard=True: (reduce-scatter, all-gather) CostModels
    profiler: Optional[StepProfiler] = None
    forward_order_applied: bool = False
    drift: Optional[DriftDetector] = None
    control: Any = None                    # this iteration's control word (its handle)
    last_end: Optional[float] = None
    iteration: int = 0
    replan_reason: Any = None              # set when a re-plan was agreed
    replans: list[dict] = field(default_factory=list)
    race: Any = None                       # race.LiveRace while the candidates are raced
    races: list[dict] = field(default_factory=list)   # each finished race's summary
    refit_per_allreduce: float = 0.0       # the races' summed correction of the link's start-up
    membership: tuple = ()                 # (size, rank) last seen (elastic)
    membership_lost: bool = False          # a failed collective: elastic will re-initialise

    # -- the machinery ----------------------------------------------------------------------
    amplify: RaceAmplifier = field(default_factory=lambda: RaceAmplifier(0.0))
    guard: Optional[ReadGuard] = None      # model= only
    scheduler: Optional[BlockScheduler] = None
    updater: Optional[ParameterUpdater] = None
    sharded: Any = None                    # shard=True: shards.ShardedUpdate
    gathers: Any = None                    # the all-gather half (shard=True, dear): gathers.Gathers
    timeline: Optional[Timeline] = None
    hooks: Hooks = field(default_factory=Hooks)
    #: This optimizer's lease on the peers' liveness channel (``liveness/channels.py``):
    #: given back at ``close()`` or collection, so the channel ends with its last optimizer.
    peers: Any = None
    closed: Optional[str] = None           # why it was closed (close(), or a newer optimizer)
    compiled: Optional[bool] = None        # model= holds torch.compile'd code (first forward)
    fallback_logged: bool = False

    # -- instrumentation (``instrument.py``) ---------------------------------------------------
    module_names: dict = field(default_factory=dict)   # module -> its name in the model
    layer_params: dict = field(default_factory=dict)   # module -> parameters it owns
    layer_started: dict = field(default_factory=dict)  # module -> forward start (timeline)
    last_ready: Optional[float] = None     # for the backward track of the timeline

    def describe(self, p: torch.Tensor) -> tuple:
        """``(name, shape, dtype)``: how ranks compare a parameter (``agreement.py``)."""
        return (self.names[p], tuple(p.shape), str(p.dtype))

    def reset_delays(self) -> None:
        for p in self.delay:
            self.delay[p] = self.passes
