"""A PyTorch Lightning script trained with dcredit_hvd: one line away from its DDP version.

The DDP version is the same file without the ``import dcredit_hvd.frameworks.pytorch_lightning``
line and with ``strategy="ddp"`` (the unified package: ``import lightning.pytorch as pl`` and
``import dcredit_hvd.frameworks.lightning``).  Launch it as any Lightning DDP script:

    python examples/lightning_train.py                                 # Lightning starts 2 ranks
    torchrun --nproc-per-node 2 examples/lightning_train.py            # torch.distributed
    horovodrun -np 2 -H localhost:2 --gloo python examples/lightning_train.py   # Horovod

Settings: ``strategy=DCreditStrategy(policy="bytescheduler", model_overlap=False, ...)``
(``from dcredit_hvd.frameworks.pytorch_lightning import DCreditStrategy``), or the ``DCREDIT_*``
variables.
"""
from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dcredit_hvd.frameworks.pytorch_lightning  # noqa: F401  (registers strategy="dcredit")


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                 nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> dict:
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(n: int, seed: int) -> DataLoader:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 3, 32, 32, generator=gen), torch.randint(0, 10, (n,), generator=gen)
    return DataLoader(TensorDataset(x, y), batch_size=32)


if __name__ == "__main__":
    pl.seed_everything(0)
    trainer = pl.Trainer(strategy="dcredit",      # DDP version: strategy="ddp"
                         accelerator="cpu", devices=2, max_epochs=2, gradient_clip_val=1.0,
                         val_check_interval=0.5, logger=False, enable_checkpointing=False)
    trainer.fit(Classifier(), data(1024, 0), data(256, 1))
