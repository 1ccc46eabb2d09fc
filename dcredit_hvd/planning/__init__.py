"""Planning: plain data one way, profile -> cost model -> plan.

* ``profile``: what one iteration of the job looks like (per-tensor sizes and compute times);
  ``profiler`` measures it live, with the link's cost (``profiler.measure_cost_model``).
* ``costmodel``: the time of one collective, ``T(bytes) = max(floor, a + b * bytes)``, fitted.
* ``blocks``: cutting tensors into blocks and grouping small ones (the layout both the planner
  and the runtime use).
* ``planner``: D-Credit's windows for both phases (``plan``, ``choose_partition``), with
  ``phase1`` and ``phase2`` apart; ``simulator`` replays any policy object of
  ``dcredit_hvd.policies`` on a modelled iteration, the same objects the runtime gates with.
* ``halves``, ``engine``: the sharded mode's two halves (reduce-scatter, all-gather) priced
  and replayed.
* ``candidates``: the schedules a live race runs (the simulator's best plans and the baselines
  the plan space expresses); ``race``: the race itself (successive halving, the switch rule,
  the cost model's refit), plain data from the iteration times the runtime all-gathers.
* ``decision``: the gate rank's choice from a measured profile, its log and its file;
  ``drift``: noticing when the iteration no longer matches the plan.

Torch-free (the command line plans and simulates without torch or a collective library), and
nothing here imports ``dcredit_hvd.bench``.
"""
