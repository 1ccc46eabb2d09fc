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
