"""The NCCL side of ``transports/torch_distributed.py`` on one GPU (``scripts/gpu_check.sh``).

NCCL allows one rank per GPU, so a machine with one GPU runs a group of one: the collectives
are real NCCL all-reduces (an average over one rank changes nothing), which checks what only
NCCL exercises: CUDA tensors reduced in place on the GPU, host tensors of the set-up collectives
moved to the GPU and back, DDP's averaging after the sum, and the issue log.  A multi-rank
NCCL parity check needs a machine with two GPUs; none is written yet (``tests/torchrun`` runs
over Gloo).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def main() -> int:
    if not torch.cuda.is_available():
        print("nccl transport check: no CUDA device, not run")
        return 0 if os.environ.get("GPU_CHECK_ALLOW_CPU") == "1" else 1
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    from dcredit_hvd.transports.torch_distributed import AVERAGE, SUM, TorchTransport
    link = TorchTransport()
    assert link.gpu_operations(), "an NCCL group must report GPU operations"
    grad = torch.arange(6, dtype=torch.float32, device="cuda")
    out = link.wait(link.submit(grad, "check.cuda", AVERAGE, 0.5, 2.0))
    assert out is grad and torch.equal(out.cpu(), torch.arange(6, dtype=torch.float32)), out
    host = torch.tensor([3.0, 4.0])
    out = link.wait(link.submit(host, "check.host", SUM))
    assert out is host and host.device.type == "cpu" and host.tolist() == [3.0, 4.0], host
    assert link.issue_log() == ["check.cuda", "check.host"], link.issue_log()
    assert link.broadcast_object({"plan": 1}, "check.obj") == {"plan": 1}
    torch.cuda.synchronize()
    dist.destroy_process_group()
    print("nccl transport check: OK (CUDA in place, host staged, mean, issue log)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
