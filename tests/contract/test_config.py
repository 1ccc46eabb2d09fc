"""Configuration: keyword > DCREDIT_* environment > default, and clear errors for bad values."""
import dataclasses

import pytest

from dcredit_hvd.config import SchedulerConfig, parse_bytes


def test_keyword_beats_environment_beats_default():
    env = {"DCREDIT_POLICY": "wfbp", "DCREDIT_CREDIT_BYTES": "1MiB"}
    config = SchedulerConfig.resolve(env, policy="bytescheduler")
    assert config.policy == "bytescheduler" and config.sources["policy"] == "keyword"
    assert config.credit_bytes == 2**20 and config.sources["credit_bytes"] == "environment"
    assert config.partition_bytes == 4_000_000 and config.sources["partition_bytes"] == "default"


@pytest.mark.parametrize("text,expected", [("4MiB", 4 * 2**20), ("4MB", 4_000_000),
                                           ("512", 512), ("1.5k", 1500), (2048, 2048)])
def test_sizes_accept_units(text, expected):
    assert parse_bytes(text, "partition_bytes") == expected


def test_unknown_policy_names_the_choices():
    expected = r"'fastest' is not a known policy; choose one of dcredit, bytescheduler, wfbp"
    with pytest.raises(ValueError, match=expected):
        SchedulerConfig.resolve({}, policy="fastest")


def test_unknown_policy_from_environment_names_the_variable():
    with pytest.raises(ValueError, match="DCREDIT_POLICY"):
        SchedulerConfig.resolve({"DCREDIT_POLICY": "nope"})


@pytest.mark.parametrize("bad", [0, -5, "0", "-1MiB", "lots", "nan"])
def test_partition_must_be_a_positive_size(bad):
    with pytest.raises(ValueError, match="partition_bytes must be"):
        SchedulerConfig.resolve({}, partition_bytes=bad)


def test_credit_from_environment_must_be_a_number():
    with pytest.raises(ValueError, match=r"DCREDIT_CREDIT_BYTES \(environment\) must be a number"):
        SchedulerConfig.resolve({"DCREDIT_CREDIT_BYTES": "many"})


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="unknown scheduler option"):
        SchedulerConfig.resolve({}, credits=5)


@pytest.mark.parametrize("text,expected", [("1", True), ("true", True), ("off", False),
                                           ("0", False), ("auto", None), (" Yes ", True)])
def test_cuda_staging_reads_a_switch_from_the_environment(text, expected):
    config = SchedulerConfig.resolve(environ={"DCREDIT_CUDA_STAGING": text})
    assert config.cuda_staging is expected


def test_cuda_staging_keyword_false_overrides_the_environment():
    config = SchedulerConfig.resolve(environ={"DCREDIT_CUDA_STAGING": "1"}, cuda_staging=False)
    assert config.cuda_staging is False and config.sources["cuda_staging"] == "keyword"


def test_cuda_staging_rejects_other_words_naming_the_variable():
    with pytest.raises(ValueError, match=r"DCREDIT_CUDA_STAGING \(environment\) must be 1, 0 or auto"):
        SchedulerConfig.resolve(environ={"DCREDIT_CUDA_STAGING": "sometimes"})


def test_every_config_field_is_a_keyword_of_the_distributed_optimizer():
    import inspect

    import dcredit_hvd

    keywords = set(inspect.signature(dcredit_hvd.DistributedOptimizer).parameters)
    environment_only = {"liveness_bind"}       # README's Configuration table says so
    missing = set(SchedulerConfig.ENV) - keywords - environment_only
    assert not missing, f"SchedulerConfig fields DistributedOptimizer does not take: {missing}"


def test_every_default_is_accepted_when_passed_explicitly():
    """A keyword set to its own default (race_amplifier=0: off) is not refused."""
    defaults = SchedulerConfig.resolve({})
    for f in dataclasses.fields(SchedulerConfig):
        value = getattr(defaults, f.name)
        if value is None or f.name == "sources" or not f.init:
            continue
        again = SchedulerConfig.resolve({}, **{f.name: value})
        assert getattr(again, f.name) == value, f.name
