"""The gate rank's decision (``planning``): a partition the user set is kept; otherwise the
simulator's search picks it.  Its record round-trips through JSON."""
import json

from dcredit_hvd.config import SchedulerConfig
from dcredit_hvd.planning import decision as planning
from dcredit_hvd.planning.costmodel import CostModel
from dcredit_hvd.planning.profile import Profile

PROFILE = Profile.from_lists(["emb", "mid", "head"], [400_000, 40_000, 400_000], [4, 4, 4],
                             [0.002, 0.001, 0.002], [0.004, 0.002, 0.004])
COST = CostModel(a=0.001, b=8e-9)


def test_a_partition_the_user_set_is_planned_as_given_without_a_search():
    config = SchedulerConfig.resolve(environ={}, partition_bytes=65536)
    plan, profile, search = planning.decide(PROFILE, COST, config, overlap_forward=True)
    assert plan.partition_bytes == 65536 and search == () and profile is PROFILE


def test_the_default_partition_is_the_fastest_the_simulator_found():
    config = SchedulerConfig.resolve(environ={})
    plan, _, search = planning.decide(PROFILE, COST, config, overlap_forward=True)
    assert len(search) > 1
    fastest = min(search, key=lambda row: row[1])[0]
    assert plan.partition_bytes == fastest


def test_the_written_record_holds_the_plan_and_the_link(tmp_path):
    config = SchedulerConfig.resolve(environ={}, partition_bytes=65536)
    plan, profile, search = planning.decide(PROFILE, COST, config, overlap_forward=False)
    path = tmp_path / "plan.json"
    planning.write(str(path), COST, [(4096, 0.001)], profile, plan, search)
    record = json.loads(path.read_text())
    assert record["plan"]["partition_bytes"] == 65536
    assert sum(record["plan"]["windows"]) == sum(-(-n // 65536) for n in PROFILE.nbytes)
    assert record["cost"]["b"] == COST.b


SMALL = Profile.from_lists(["emb", "ln.w", "ln.b", "fc", "out.b"], [400_000, 1024, 1024, 400_000, 64],
                           [4] * 5, [0.002] * 5, [0.004] * 5, kinds=["torch.float32"] * 5)


def test_a_group_limit_the_user_set_groups_the_small_tensors_it_covers():
    config = SchedulerConfig.resolve(environ={}, partition_bytes=65536, group_bytes=4096)
    plan, _, _ = planning.decide(SMALL, COST, config, overlap_forward=True)
    assert plan.groups == (1, 2, 1, 1) and plan.group_bytes == 4096 and plan.num_parameters == 5


def test_a_partition_set_alone_plans_one_unit_per_tensor_as_before():
    config = SchedulerConfig.resolve(environ={}, partition_bytes=65536)
    plan, _, _ = planning.decide(SMALL, COST, config, overlap_forward=True)
    assert plan.groups == () and plan.num_tensors == 5


def test_tensors_of_an_ungroupable_kind_stay_alone_whatever_the_limit():
    cuda = Profile.from_lists(SMALL.names, SMALL.nbytes, SMALL.element_size, SMALL.t_f, SMALL.t_b,
                              kinds=[""] * 5)
    config = SchedulerConfig.resolve(environ={}, group_bytes="1MiB")
    plan, _, _ = planning.decide(cuda, COST, config, overlap_forward=True)
    assert plan.groups == ()


def test_group_bytes_accepts_zero_and_sizes_and_names_the_variable_when_wrong():
    assert SchedulerConfig.resolve(environ={"DCREDIT_GROUP_BYTES": "0"}).group_bytes == 0
    assert SchedulerConfig.resolve(environ={}, group_bytes="64KiB").group_bytes == 65536
    try:
        SchedulerConfig.resolve(environ={"DCREDIT_GROUP_BYTES": "lots"})
    except ValueError as exc:
        assert "DCREDIT_GROUP_BYTES" in str(exc)
    else:
        raise AssertionError("a bad DCREDIT_GROUP_BYTES was accepted")
