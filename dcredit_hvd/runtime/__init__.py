"""The runtime: what runs inside a training job, between the user's hooks and the transport.

One gradient's path, in the order the code meets it: ``assembly`` builds the parts and registers
the hooks; ``gradients`` cuts each gradient into the blocks of ``units`` and hands them to the
``scheduler`` (queue, gate, completion thread), whose gate asks the policy (``..policies``);
``updates`` applies overlapped updates as gradients arrive and ``readguard`` makes any read of
a parameter wait for its owed update (``overlap`` owns the model's hooks around them).
``lifecycle`` carries the plan through its life (profile, install, drift, re-plan); ``checks``
and ``agreement`` compare the ranks before anything is sent; ``instances``, ``lifetime`` and
``weak`` let several optimizers share a job; ``device`` orders CUDA streams; ``instrument`` and
``timeline`` time and log; ``amplifier`` widens race windows for tests; ``state`` is what the
parts share.

Nothing here imports ``dcredit_hvd.bench``. Users import ``dcredit_hvd.DistributedOptimizer``,
not these modules: they export no public API of their own.
"""
