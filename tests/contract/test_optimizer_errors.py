"""Bad arguments to ``DistributedOptimizer`` give Horovod's errors, or ours naming the fix.

Single process (Horovod size 1): every check here runs before any collective.
"""
import horovod.torch as hvd
import pytest
import torch

import dcredit_hvd

hvd.init()


def model_and_opt():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_unknown_policy_is_rejected_with_the_choices():
    model, opt = model_and_opt()
    with pytest.raises(ValueError, match="not a known policy; choose one of dcredit, bytescheduler, wfbp"):
        dcredit_hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                         policy="fastest")


@pytest.mark.parametrize("bad", [0, -1, "0MiB"])
def test_partition_of_zero_or_less_is_rejected(bad):
    model, opt = model_and_opt()
    with pytest.raises(ValueError, match="partition_bytes must be > 0"):
        dcredit_hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                         partition_bytes=bad)


def test_unnamed_parameters_raise_horovods_error():
    model, opt = model_and_opt()
    partial = list(model.named_parameters())[:2]
    with pytest.raises(ValueError, match="one or more model parameters were not named"):
        dcredit_hvd.DistributedOptimizer(opt, named_parameters=partial)


def test_duplicate_names_raise_horovods_error():
    model, opt = model_and_opt()
    named = [("same", p) for p in model.parameters()]
    with pytest.raises(ValueError, match="must be unique. Found duplicates: same"):
        dcredit_hvd.DistributedOptimizer(opt, named_parameters=named)


def test_named_parameters_that_are_not_tuples_raise_horovods_error():
    model, opt = model_and_opt()
    with pytest.raises(ValueError, match="should be a sequence of tuples"):
        dcredit_hvd.DistributedOptimizer(opt, named_parameters=list(model.parameters()))


def test_backward_passes_per_step_must_be_positive():
    model, opt = model_and_opt()
    with pytest.raises(ValueError, match="backward_passes_per_step must be > 0"):
        dcredit_hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                         backward_passes_per_step=0)


def test_predivide_with_sum_is_rejected_like_horovod():
    model, opt = model_and_opt()
    with pytest.raises(ValueError, match="gradient_predivide_factor not supported with op != Average"):
        dcredit_hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                         op=hvd.Sum, gradient_predivide_factor=2.0)


def test_groups_are_refused_rather_than_ignored():
    model, opt = model_and_opt()
    with pytest.raises(NotImplementedError, match="groups"):
        dcredit_hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), groups=2)


def test_adasum_is_refused_with_the_alternative():
    model, opt = model_and_opt()
    with pytest.raises(NotImplementedError, match="Adasum"):
        dcredit_hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                         op=hvd.Adasum)


def test_single_process_passes_straight_through_and_keeps_the_class():
    model, opt = model_and_opt()
    wrapped = dcredit_hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    assert isinstance(wrapped, torch.optim.SGD) and type(wrapped).__name__ == "SGD"
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(3, 4)).sum().backward()
    wrapped.step()
    wrapped.zero_grad(set_to_none=True)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_model_whose_parameters_the_optimizer_does_not_update_is_rejected():
    model, opt = model_and_opt()
    other = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="none of whose parameters are updated by this optimizer"):
        dcredit_hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                         model=other)


def test_a_model_missing_some_optimizer_parameters_is_rejected_naming_them():
    model, _ = model_and_opt()
    temperature = torch.nn.Parameter(torch.ones(1))   # e.g. a learnable loss parameter
    opt = torch.optim.SGD(list(model.parameters()) + [temperature], lr=0.1)
    named = list(model.named_parameters()) + [("loss.temperature", temperature)]
    with pytest.raises(ValueError, match=r"does not contain 1 parameter\(s\) that this optimizer "
                                         r"updates: loss.temperature\. .*leave model= out"):
        dcredit_hvd.DistributedOptimizer(opt, named_parameters=named, model=model)
    # The fixes the message gives both work: a module holding both, or no model=.
    holder = torch.nn.Module()
    holder.net, holder.temperature = model, temperature
    dcredit_hvd.DistributedOptimizer(opt, named_parameters=named, model=holder)
    dcredit_hvd.DistributedOptimizer(opt, named_parameters=named)


# -- the order: arguments before the transport ---------------------------------------------------
# Horovod checks its arguments before anything else, so its own tests build the optimizer with a
# bad argument before hvd.init().  Here neither library is initialised (a fresh interpreter: this
# module's hvd.init() does not reach it), so each bad argument must get its own error, not the
# transport's "no collective library is initialised".
ORDER_CASES = """
import sys, itertools, warnings, torch, dcredit_hvd

def attempt(label, build, **kwargs):
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            dcredit_hvd.DistributedOptimizer(opt, named_parameters=build(model), **kwargs)
    except Exception as exc:
        print(f"{label}|{type(exc).__name__}|{exc}")
    else:
        print(f"{label}|none|")

two = lambda m: itertools.chain(m[0].named_parameters(), m[1].named_parameters())
attempt("duplicates", two)
attempt("not-tuples", lambda m: m.parameters())
attempt("unnamed", lambda m: list(m.named_parameters())[:1])
attempt("passes", lambda m: m.named_parameters(), backward_passes_per_step=0)
attempt("groups", lambda m: m.named_parameters(), groups=2)
attempt("num_groups", lambda m: m.named_parameters(), num_groups=2)
attempt("model-type", lambda m: m.named_parameters(), model="net")
attempt("model-other", lambda m: m.named_parameters(), model=torch.nn.Linear(2, 2))
attempt("fine", lambda m: m.named_parameters())
if "{horovod}" == "yes":            # hvd.Adasum is known without hvd.init()
    import horovod.torch as hvd
    attempt("adasum", lambda m: m.named_parameters(), op=hvd.Adasum)
"""

ORDER_EXPECTED = {
    "duplicates": ("ValueError", "Parameter names in named_parameters must be unique. Found "
                                 "duplicates: "),
    "not-tuples": ("ValueError", "named_parameters should be a sequence of tuples (name, "
                                 "parameter), usually produced by model.named_parameters()."),
    "unnamed": ("ValueError", "named_parameters was specified, but one or more model parameters "
                              "were not named. Python object ids: "),
    "passes": ("ValueError", "backward_passes_per_step must be > 0"),
    "groups": ("NotImplementedError", "groups/num_groups is not supported by dcredit_hvd"),
    "num_groups": ("NotImplementedError", "groups/num_groups is not supported by dcredit_hvd"),
    "model-type": ("TypeError", "model must be a torch.nn.Module, got str"),
    "model-other": ("ValueError", "model= was given a Linear none of whose parameters"),
    "fine": ("RuntimeError", "dcredit_hvd: no collective library is initialised."),
    "adasum": ("NotImplementedError", "op=hvd.Adasum is not supported by dcredit_hvd"),
}


def _order_outcomes(horovod: bool) -> dict:
    import subprocess
    import sys
    absent = "" if horovod else ("sys.modules['horovod'] = None; "
                                 "sys.modules['horovod.torch'] = None\n")
    code = "import sys\n" + absent + ORDER_CASES.replace("{horovod}", "yes" if horovod else "no")
    env = {k: v for k, v in __import__("os").environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "HOROVOD_", "DCREDIT_"))
           and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split("|", 2) for line in result.stdout.splitlines() if line.count("|") >= 2]
    return {label: (kind, text) for label, kind, text in rows}


@pytest.mark.parametrize("horovod", [True, False], ids=["horovod-not-initialised",
                                                        "torch-distributed-only"])
def test_each_bad_argument_gets_its_own_error_before_the_transport_is_chosen(horovod):
    outcomes = _order_outcomes(horovod)
    expected = {k: v for k, v in ORDER_EXPECTED.items() if horovod or k != "adasum"}
    assert set(outcomes) == set(expected), outcomes
    for label, (kind, start) in expected.items():
        got_kind, got_text = outcomes[label]
        assert (got_kind, got_text[:len(start)]) == (kind, start), (label, outcomes[label])
    if not horovod:
        assert "torch.distributed" in outcomes["fine"][1]
