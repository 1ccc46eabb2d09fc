"""The processes of ``strategy="dcredit"`` on Fabric: Fabric's own ``launch()`` from a plain
``python script.py``, and the ranks and default torch.distributed group, as DDP's strategy
sets them up: what differs from DDP is the gradients, kept in ``fabric.py``."""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_only


def init_processes(strategy: Any) -> None:
    """The global rank, the world size and the default process group of ``strategy`` (a
    ``DCreditFabricStrategy`` whose ``ParallelStrategy.setup_environment`` has run)."""
    env = strategy.cluster_environment
    assert env is not None
    if strategy.num_processes > 1 and not env.creates_processes_externally:
        raise RuntimeError("strategy='dcredit' with several devices needs its processes: "
                           "call fabric.launch() or launch with torchrun")
    env.set_global_rank(strategy.node_rank * strategy.num_processes + strategy.local_rank)
    if env.world_size() < strategy.devices_world_size:
        env.set_world_size(strategy.devices_world_size)
    rank_zero_only.rank = strategy.global_rank       # type: ignore[attr-defined]
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", env.main_address)
        os.environ.setdefault("MASTER_PORT", str(env.main_port))
        backend = strategy.backend or ("nccl" if strategy.root_device.type == "cuda" else "gloo")
        dist.init_process_group(backend, rank=strategy.global_rank,
                                world_size=strategy.world_size, timeout=strategy.timeout)


class ScriptLauncher:
    """Ranks 1..N-1 as new processes running this command line with torchrun's variables
    (``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE``, ``MASTER_*``), as Lightning's DDP launcher does;
    this process is rank 0."""

    is_interactive_compatible = False

    def __init__(self, environment: Any, processes: int) -> None:
        self.environment, self.processes = environment, processes

    def launch(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        command = ([sys.executable, "-m", spec.name] if spec is not None
                   else [sys.executable, os.path.abspath(sys.argv[0])]) + sys.argv[1:]
        os.environ.update(MASTER_ADDR=self.environment.main_address, NODE_RANK="0",
                          MASTER_PORT=str(self.environment.main_port),
                          WORLD_SIZE=str(self.processes))
        for rank in range(1, self.processes):
            subprocess.Popen(command, env={**os.environ, "LOCAL_RANK": str(rank),
                                           "RANK": str(rank)})
        os.environ.update(LOCAL_RANK="0", RANK="0")
        return function(*args, **kwargs)
