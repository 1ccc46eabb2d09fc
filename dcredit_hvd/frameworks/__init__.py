"""The frameworks' entry points, one module per framework (none is imported here: each needs
its framework installed, and ``import dcredit_hvd`` must stay cheap).

* ``pytorch_lightning``: ``Trainer(strategy="dcredit")`` for the ``pytorch_lightning`` package;
* ``lightning``: the same strategy for the unified ``lightning`` package (``lightning.pytorch``);
* ``lightning_strategy``, ``lightning_steps``, ``horovod_env``: what both strategies share;
* ``hf``: the Hugging Face ``DCreditTrainer``;
* ``aliases``: the names 0.2.0 released (``dcredit_hvd.lightning``, ``dcredit_hvd.hf``).
"""
