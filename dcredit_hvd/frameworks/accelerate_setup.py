"""What ``DCreditAccelerator`` checks when it is built: its ``dcredit=`` settings, and the
setups it refuses (they reduce gradients or wrap the model their own way)."""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Optional

import accelerate
import torch.distributed as dist
from accelerate.utils import DistributedType, DynamoBackend

from dcredit_hvd.config import SchedulerConfig

from .keywords import dcredit_keywords

#: Launchers' world sizes without torch.distributed (horovodrun, mpirun).
_WORLD_VARIABLES = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_REFUSED_TYPES = {DistributedType.DEEPSPEED: "DeepSpeed", DistributedType.FSDP: "FSDP",
                  DistributedType.MEGATRON_LM: "Megatron-LM", DistributedType.XLA: "XLA (TPU)"}


def check(acc: accelerate.Accelerator, shard: bool = False) -> bool:
    """Several torch.distributed processes (one trains as the plain Accelerator); a clear
    error for setups that reduce gradients or wrap the model their own way."""
    where = "dcredit_hvd.frameworks.accelerate: DCreditAccelerator"
    refused = _REFUSED_TYPES.get(acc.distributed_type)
    if refused is not None:
        raise ValueError(f"{where} does not support {refused}: that setup reduces gradients "
                         "(or wraps the model) its own way; use accelerate.Accelerator for it")
    if acc.parallelism_config is not None:
        raise ValueError(f"{where} does not support parallelism_config (tensor/context "
                         "parallelism); use accelerate.Accelerator for it")
    if acc.mixed_precision == "fp16" or acc.scaler is not None:
        raise ValueError(f"{where} does not support fp16 loss scaling (the scaler reads and "
                         "unscales gradients before they are reduced); use bf16")
    if acc.mixed_precision == "fp8":
        raise ValueError(f"{where} does not support fp8 training; use bf16")
    if acc.state.dynamo_plugin.backend != DynamoBackend.NO:
        raise ValueError(f"{where} does not support dynamo_backend (torch.compile): the "
                         "scheduler's hooks need the eager model; use dynamo_backend='no'")
    if shard and sync_each_batch(acc):
        raise ValueError(f"{where} does not support shard=True with "
                         "GradientAccumulationPlugin(sync_each_batch=True): a sharded reduction "
                         "leaves each rank only its slice, and the next micro-batch cannot add "
                         "to it; use sync_each_batch=False (the default) or shard=False")
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    launched = max(int(os.environ.get(name, "1") or 1) for name in _WORLD_VARIABLES)
    if launched > 1 or acc.num_processes > 1:
        raise RuntimeError(f"{where}: {launched} processes but torch.distributed is not "
                           "initialised; launch with torchrun or accelerate launch "
                           "(horovodrun is not supported: Accelerate has no Horovod backend)")
    return False


def sync_each_batch(acc: accelerate.Accelerator) -> bool:
    """``GradientAccumulationPlugin(sync_each_batch=True)``: DDP reduces in every backward."""
    return bool(acc.gradient_state.plugin_kwargs.get("sync_each_batch", False))


def settings(dcredit: Optional[Mapping[str, Any] | SchedulerConfig],
             policy: Optional[str]) -> dict[str, Any]:
    """``DistributedOptimizer`` keywords from ``dcredit=`` and ``dcredit_policy=``, checked now
    rather than at ``prepare``; the transport is Accelerate's torch.distributed group."""
    return dcredit_keywords(
        dcredit, policy, who="dcredit_hvd.frameworks.accelerate",
        set_by="the accelerator sets them (the prepared model, gradient_accumulation_steps)",
        transport_refusal="dcredit_hvd.frameworks.accelerate: DCreditAccelerator reduces over "
                          "Accelerate's torch.distributed group; transport must be "
                          "'torch.distributed' (Accelerate has no Horovod backend)")
