"""dcredit_hvd: D-Credit communication scheduling for Horovod's PyTorch DistributedOptimizer.

    import horovod.torch as hvd, dcredit_hvd
    hvd.init()
    opt = dcredit_hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           model=model)
"""
__version__ = "0.2.0"

from .frameworks import aliases as _aliases  # 0.2.0 released dcredit_hvd.lightning and .hf

_aliases.install()


def __getattr__(name):
    # Horovod is imported lazily so the planner, simulator and CLI work without it.
    if name == "DistributedOptimizer":
        from .optimizer import DistributedOptimizer
        return DistributedOptimizer
    if name == "SchedulerConfig":
        from .config import SchedulerConfig
        return SchedulerConfig
    raise AttributeError(f"module 'dcredit_hvd' has no attribute {name!r}")


__all__ = ["DistributedOptimizer", "SchedulerConfig", "__version__"]
