"""The cases of ``test_lightning_spawn.py``: ``Trainer(strategy="dcredit_spawn")`` and
``"dcredit_fork"``, whose processes Lightning starts itself (its multiprocessing launcher), beside
its own ``"ddp_spawn"``, from a plain ``python`` process.

``python lightning_spawn_cases.py PACKAGE OUT`` (PACKAGE ``lightning`` or ``pytorch_lightning``):
for each strategy, a fit of a small CNN with batch norm (accumulation over 2 batches, clipping by
norm) from the same weights on the same data.  Every rank writes its parameters and buffers at
the end of the fit (``OUT/<strategy>.rank<r>.pt``) and the launching process writes the ones
Lightning's launcher handed back to it (``OUT/<strategy>.main.pt``; the initial ones:
``OUT/init.pt``): a spawned fit returns its weights to the process that called ``fit``.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch
import torch.nn as nn

PACKAGE = sys.argv[1] if len(sys.argv) > 1 else "lightning"
pl = importlib.import_module("lightning.pytorch" if PACKAGE == "lightning" else PACKAGE)
importlib.import_module(f"dcredit_hvd.frameworks.{PACKAGE}")      # registers the names
STRATEGIES = ("ddp_spawn", "dcredit_spawn", "dcredit_fork")
STEPS, ACCUMULATE, BATCH = 4, 2, 8


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class Net(pl.LightningModule):
    def __init__(self, out: str, strategy: str) -> None:
        super().__init__()
        self.out, self.strategy_label = out, strategy
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 4))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.body(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def on_train_end(self) -> None:
        torch.save(state(self), Path(self.out) / f"{self.strategy_label}.rank{self.global_rank}.pt")


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    n = 2 * BATCH * STEPS * ACCUMULATE
    x, y = torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def fit(out: str, strategy: str) -> None:
    torch.manual_seed(0)
    model = Net(out, strategy)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS,
                         accumulate_grad_batches=ACCUMULATE, gradient_clip_val=0.05,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, data())
    torch.save(state(model), Path(out) / f"{strategy}.main.pt")


if __name__ == "__main__":
    torch.manual_seed(0)
    torch.save(state(Net(sys.argv[2], "init")), Path(sys.argv[2]) / "init.pt")
    for name in STRATEGIES:
        fit(sys.argv[2], name)
