"""The tools that measure the library; none of the runtime imports them.

* ``sidebyside``: real trainings, every policy beside plain Horovod and DDP in one launch
  (``python -m dcredit_hvd.bench``); ``report``: its rows, lower bound and table;
* ``emulate``: an emulated GPU cluster, a shipped profile replayed with dilated time on virtual
  hosts (``python -m dcredit_hvd.emulate``); ``emulate_report``: its checks and table;
  ``replay``: replaying a profile's compute, and the shipped ``profiles/*.json``;
* ``zoo``: the models of the benchmarks and the simulator; ``hfmodels``: tiny ``transformers``
  models for them; ``energy``: energy per iteration where the hardware reports it.
"""
