"""``lightning.Trainer(strategy="dcredit")`` for the unified ``lightning`` package
(``lightning.pytorch``): gradients all-reduced by the scheduler.

    import dcredit_hvd.frameworks.lightning          # registers "dcredit" in lightning's registry
    trainer = lightning.Trainer(strategy="dcredit", accelerator="cpu", devices=2)

The same strategy as ``frameworks/pytorch_lightning.py`` (one body,
``lightning_strategy.DCreditStrategyBody``) built on ``lightning.pytorch``'s classes, so a fit
under the unified package never meets a ``pytorch_lightning`` type (the two packages have
registries and classes of their own).
"""
from __future__ import annotations

import lightning
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden

from .horovod_env import HorovodRanks
from .lightning_steps import LightningKit
from .lightning_strategy import NAME, DCreditStrategyBody
from .versions import require

__all__ = ["NAME", "DCreditStrategy", "HorovodEnvironment"]

require("lightning", lightning.__version__)


class HorovodEnvironment(HorovodRanks, ClusterEnvironment):
    """``lightning``'s cluster environment with Horovod's ranks (``HorovodRanks``)."""


class DCreditStrategy(DCreditStrategyBody, DDPStrategy):
    __doc__ = DCreditStrategyBody.__doc__
    kit = LightningKit(package="lightning.pytorch", Callback=Callback,
                       LightningOptimizer=LightningOptimizer, TrainerFn=TrainerFn,
                       is_overridden=is_overridden, reset_seed=reset_seed,
                       HorovodEnvironment=HorovodEnvironment)


DCreditStrategy.register_strategies(StrategyRegistry)
