"""``pytorch_lightning.Trainer(strategy="dcredit")``: gradients all-reduced by the scheduler.

    import dcredit_hvd.frameworks.pytorch_lightning   # registers "dcredit" (also: dcredit_hvd.lightning)
    trainer = pytorch_lightning.Trainer(strategy="dcredit", accelerator="cpu", devices=2)
    trainer = Trainer(strategy=DCreditStrategy(policy="bytescheduler", model_overlap=False))

Launched as ``strategy="ddp"`` is (``torchrun``, Lightning's own process launch, a cluster
manager) on torch.distributed, or with ``horovodrun`` on Horovod.  The body is
``lightning_strategy.DCreditStrategyBody``, shared with the unified ``lightning`` package's
strategy (``frameworks/lightning.py``); this module supplies ``pytorch_lightning``'s classes.
"""
from __future__ import annotations

import pytorch_lightning
from lightning_fabric.plugins import ClusterEnvironment
from lightning_fabric.utilities.seed import reset_seed
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.core.optimizer import LightningOptimizer
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.model_helpers import is_overridden

from .horovod_env import HorovodRanks
from .lightning_steps import LightningKit
from .lightning_strategy import NAME, DCreditStrategyBody
from .versions import require

__all__ = ["NAME", "DCreditStrategy", "HorovodEnvironment"]

require("pytorch_lightning", pytorch_lightning.__version__)


class HorovodEnvironment(HorovodRanks, ClusterEnvironment):
    """``pytorch_lightning``'s cluster environment with Horovod's ranks (``HorovodRanks``)."""


class DCreditStrategy(DCreditStrategyBody, DDPStrategy):
    __doc__ = DCreditStrategyBody.__doc__
    kit = LightningKit(package="pytorch_lightning", Callback=Callback,
                       LightningOptimizer=LightningOptimizer, TrainerFn=TrainerFn,
                       is_overridden=is_overridden, reset_seed=reset_seed,
                       HorovodEnvironment=HorovodEnvironment)


DCreditStrategy.register_strategies(StrategyRegistry)
