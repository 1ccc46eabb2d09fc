"""The gate rank's decision (``planning``): a partition the user set is kept; otherwise the
simulator's search picks it.  Its record round-trips through JSON."""
import json

from dcredit_hvd import planning
from dcredit_hvd.config import SchedulerConfig
from dcredit_hvd.costmodel import CostModel
from dcredit_hvd.profile import Profile

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
