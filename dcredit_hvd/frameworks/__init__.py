"""The frameworks' entry points, one module per framework (none is imported here: each needs
its framework installed, and ``import dcredit_hvd`` must stay cheap).

* ``pytorch_lightning``: ``Trainer(strategy="dcredit")`` for the ``pytorch_lightning`` package;
* ``lightning``: the same strategy for the unified ``lightning`` package (``lightning.pytorch``);
* ``lightning_strategy`` (the wrap, the optimizers, the step, the end), ``lightning_buffers``
  (rank 0's state, DDP's buffer rule), ``lightning_steps``, ``horovod_env`` (Horovod's ranks
  and collectives): what both strategies share;
* ``fabric``: ``lightning.Fabric(strategy="dcredit")``; ``fabric_launch``: its processes;
* ``accelerate``: ``DCreditAccelerator``; ``accelerate_setup``: its settings and refusals;
* ``hf``: the Hugging Face ``DCreditTrainer``; ``hf_setup``: its settings and refusals;
  ``hf_shards``: ``shard=True`` under it (clipping, checkpoints);
* ``versions``: the framework versions each entry point accepts;
* ``aliases``: the names 0.2.0 released (``dcredit_hvd.lightning``, ``dcredit_hvd.hf``).
"""
