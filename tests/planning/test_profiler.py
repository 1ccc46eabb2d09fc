"""The step profiler turns hook timestamps into the planner's Profile."""
import pytest

from dcredit_hvd.planning.profiler import StepProfiler


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def run_iteration(prof, clock, ready_after_forward, layer_times=None):
    """One iteration: layers (module, keys, seconds) in forward order, then gradients ready at
    the given offsets after the end of forward."""
    for module, keys, seconds in layer_times or []:
        prof.layer_start(module)
        clock.now += seconds
        prof.layer_end(module, keys)
    prof.forward_end()
    start = clock.now
    for key, offset in sorted(ready_after_forward.items(), key=lambda kv: kv[1]):
        clock.now = start + offset
        prof.ready(key)
    prof.end_iteration()


def test_ready_times_are_measured_from_the_end_of_forward_and_averaged_after_warmup():
    clock = Clock()
    prof = StepProfiler(warmup=1, steps=2, clock=clock)
    run_iteration(prof, clock, {"a": 9.0, "b": 9.0, "c": 9.0})          # warm-up, ignored
    run_iteration(prof, clock, {"a": 0.6, "b": 0.3, "c": 0.1})
    run_iteration(prof, clock, {"a": 0.8, "b": 0.5, "c": 0.1})
    assert prof.done
    profile = prof.profile(["a", "b", "c"], ["a", "b", "c"], [4, 4, 4], [4, 4, 4])
    assert profile.ready_times() == pytest.approx([0.7, 0.4, 0.1])
    assert profile.t_b == pytest.approx((0.3, 0.3, 0.1))


def test_forward_time_of_a_layer_is_split_among_the_tensors_it_owns():
    clock = Clock()
    prof = StepProfiler(warmup=0, steps=1, clock=clock)
    run_iteration(prof, clock, {"w1": 0.2, "b1": 0.2, "w2": 0.1},
                  layer_times=[("layer1", ["w1", "b1"], 0.4), ("layer2", ["w2"], 0.3)])
    profile = prof.profile(["w1", "b1", "w2"], ["w1", "b1", "w2"], [4, 4, 4], [4, 4, 4])
    assert profile.t_f == pytest.approx((0.2, 0.2, 0.3))


def test_out_of_order_or_missing_gradients_never_give_negative_backward_times():
    clock = Clock()
    prof = StepProfiler(warmup=0, steps=1, clock=clock)
    # "b" (nearer the output) is ready after "a"; "c" never becomes ready (unused parameter)
    run_iteration(prof, clock, {"a": 0.2, "b": 0.5})
    profile = prof.profile(["a", "b", "c"], ["a", "b", "c"], [4, 4, 4], [4, 4, 4])
    assert all(t >= 0 for t in profile.t_b)
    assert profile.t_b[2] == 0.0
    assert profile.ready_times()[0] == pytest.approx(0.5)


def test_profiling_is_done_after_warmup_plus_steps_iterations():
    prof = StepProfiler(warmup=2, steps=3, clock=Clock())
    for _ in range(4):
        prof.end_iteration()
    assert not prof.done
    prof.end_iteration()
    assert prof.done


def test_profiling_needs_at_least_one_measured_step():
    with pytest.raises(ValueError, match="steps >= 1"):
        StepProfiler(warmup=0, steps=0)


def test_a_layer_that_calls_other_layers_is_charged_only_its_own_forward_time():
    """A root with a bare parameter (a class token, a logit scale) around the whole forward."""
    clock = Clock()
    prof = StepProfiler(warmup=0, steps=1, clock=clock)
    prof.layer_start("root")
    clock.now += 0.1                     # the root's own work before its children
    prof.layer_start("child")
    clock.now += 0.5
    prof.layer_end("child", ["w"])
    clock.now += 0.2
    prof.layer_end("root", ["token"])
    prof.forward_end()
    prof.ready("w")
    prof.ready("token")
    prof.end_iteration()
    profile = prof.profile(["token", "w"], ["token", "w"], [4, 4], [4, 4])
    assert profile.t_f == pytest.approx((0.3, 0.5))
