"""Rank 0's parameters and buffers on every rank over torch.distributed, as DDP's constructor
(and its ``broadcast_buffers`` rule) does: shared by the HF Trainer and Accelerate, whose
models are not wrapped in DDP."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def broadcast_from_rank0(model: nn.Module, parameters: bool = True) -> None:
    """Rank 0's parameters and buffers (or buffers only) on every rank, as DDP does: one
    broadcast per dtype and device, the tensors flattened."""
    seen: set[int] = set()
    groups: dict[tuple, list[torch.Tensor]] = {}
    for tensor in (list(model.parameters()) if parameters else []) + list(model.buffers()):
        if id(tensor) not in seen and tensor.numel() > 0:
            seen.add(id(tensor))
            groups.setdefault((tensor.dtype, tensor.device), []).append(tensor.data)
    with torch.no_grad():
        for tensors in groups.values():
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.broadcast(flat, src=0)
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
