"""What ``DCreditTrainer`` checks when it is built: its ``dcredit=`` settings, whether it
replaces DDP at all (several processes), and the setups it refuses."""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Optional

import torch.distributed as dist
from transformers import Trainer

from dcredit_hvd.config import SchedulerConfig

from .accelerate_setup import sync_each_batch
from .keywords import dcredit_keywords

#: Launchers' world sizes: several processes without torch.distributed (horovodrun, mpirun).
_WORLD_VARIABLES = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def active(trainer: Trainer) -> bool:
    """Several processes on torch.distributed; one process trains as the plain Trainer."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    launched = max(int(os.environ.get(name, "1") or 1) for name in _WORLD_VARIABLES)
    if trainer.args.world_size > 1 or launched > 1:
        raise RuntimeError(
            f"dcredit_hvd.hf: {max(launched, trainer.args.world_size)} processes but "
            "torch.distributed is not initialised; launch with torchrun or accelerate launch "
            "(horovodrun is not supported: Accelerate has no Horovod backend)")
    return False


def refuse_unsupported(trainer: Trainer, settings: dict[str, Any], overlap: bool) -> None:
    """Setups where the Trainer or Accelerate would reduce gradients or wrap the model
    themselves, or where updates cannot overlap: a clear error, never a wrong training."""
    args = trainer.args
    refused = {
        "DeepSpeed": trainer.is_deepspeed_enabled,
        "FSDP": trainer.is_fsdp_enabled or bool(getattr(args, "fsdp", None)),
        "torch_compile": bool(getattr(args, "torch_compile", False)),
        "several GPUs per process (DataParallel)": args.n_gpu > 1,
        "tensor/context/sequence parallelism (parallelism_config)":
            getattr(trainer.accelerator, "parallelism_config", None) is not None,
        "a model sharded at load time (tp_plan / distributed_config)":
            bool(getattr(trainer, "is_distributed_loading_by_transformers", False)),
    }
    for what, on in refused.items():
        if on:
            raise ValueError(f"dcredit_hvd.hf: DCreditTrainer does not support {what}: "
                             "it replaces DDP, and that setup reduces gradients (or wraps "
                             "the model) its own way; use transformers.Trainer for it")
    if settings.get("shard") and sync_each_batch(trainer.accelerator):
        raise ValueError("dcredit_hvd.hf: shard=True with accelerator_config's "
                         "gradient_accumulation_kwargs sync_each_batch=True: a sharded "
                         "reduction leaves each rank only its slice, and the next micro-batch "
                         "cannot add to it; use sync_each_batch=False (the default) or "
                         "shard=False")
    if settings.get("shard") and args.fp16 and args.max_grad_norm:
        raise ValueError("dcredit_hvd.hf: shard=True with fp16 and max_grad_norm > 0: the "
                         "loss scaler unscales the gradients after DCreditTrainer clips "
                         "them by the global norm; use bf16, or max_grad_norm=0")
    if overlap:
        if args.max_grad_norm and args.max_grad_norm > 0:
            raise ValueError(
                f"dcredit_hvd.hf: dcredit_overlap=True needs max_grad_norm=0 (got "
                f"{args.max_grad_norm}): clipping needs every reduced gradient before any "
                "parameter is updated, so updates cannot overlap the next forward pass. "
                "Set max_grad_norm=0, or keep dcredit_overlap=False (clipping works; "
                "updates at step())")
        if args.fp16:
            raise ValueError("dcredit_hvd.hf: dcredit_overlap=True does not work with fp16 "
                             "loss scaling (the scaler reads every gradient before step()); "
                             "use bf16, or dcredit_overlap=False")
        missing = [name for name in ("_wrap_model", "_get_grad_norm")
                   if not callable(getattr(Trainer, name, None))]
        if missing:
            raise RuntimeError(f"dcredit_hvd.hf: this transformers version has no "
                               f"Trainer.{', '.join(missing)}; dcredit_overlap=True relies "
                               "on them: use dcredit_overlap=False")


def settings(dcredit: Optional[Mapping[str, Any] | SchedulerConfig],
             policy: Optional[str]) -> dict[str, Any]:
    """``DistributedOptimizer`` keywords from ``dcredit=`` and ``dcredit_policy=``; the
    transport is torch.distributed (Accelerate's process group) unless chosen."""
    return dcredit_keywords(
        dcredit, policy, who="dcredit_hvd.hf",
        set_by="the Trainer sets them (dcredit_model=, gradient_accumulation_steps)",
        transport_refusal="dcredit_hvd.hf: DCreditTrainer reduces over Accelerate's "
                          "torch.distributed group; transport must be 'torch.distributed'")
