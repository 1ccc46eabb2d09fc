"""On CUDA tensors, parameters after N steps equal plain ``hvd.DistributedOptimizer``'s.

Each rank trains on ``cuda:<local rank modulo the GPU count>`` (two ranks may share one GPU).
Two ranks on one GPU cannot use NCCL, so the plain-Horovod reference is computed on CPU copies of
the same model and batches (same seeds); the GPU parameters, moved to CPU, must match it to float
tolerance.  TF32 is switched off for the module so GPU and CPU matmuls/convolutions agree.

Skipped (the whole module) without CUDA.  Run on every rank under ``mpirun -np 2`` and
``horovodrun -np 2 --gloo`` (``make test``).
"""
from __future__ import annotations

import contextlib

import horovod.torch as hvd
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_parity import OPTIMIZERS, POLICIES, PROFILE, SMALL

import dcredit_hvd

from conftest import assert_all_ranks
from models import batches, make_model, max_rel_diff, params_close, train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

#: GPU against CPU: summation order differs, so not bit-exact.
RTOL, ATOL = 1e-4, 1e-6
#: Side-stream model: four 1024x1024 linears (4 MiB of gradient each), cut into 16 blocks each.
WIDTH, DEPTH = 1024, 4
DEEP_SPLIT = dict(partition_bytes=256 << 10, credit_bytes=1 << 20)
#: GPU clock cycles a ``Delay`` sleeps in backward (about 5-20 ms on current GPUs).
DELAY_CYCLES = 20_000_000


@pytest.fixture(autouse=True, scope="module")
def _exact_float32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def gpu() -> torch.device:
    return torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())


def on_stream(stream: torch.cuda.Stream | None):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def fit(model: nn.Module, opt: torch.optim.Optimizer, data, device, stream=None,
        after_step=None) -> list[torch.Tensor]:
    """Train on ``device`` (everything under ``stream`` when given); the state, on CPU.

    The state is read through ``state_dict()`` on the training stream, as a checkpoint would:
    it must see every update applied, on that stream.
    """
    for x, y in data:
        with on_stream(stream):
            opt.zero_grad()
            F.cross_entropy(model(x.to(device)), y.to(device)).backward()
            opt.step()
        if after_step is not None:
            after_step()
    with on_stream(stream):
        state = [v.detach().to("cpu") for v in model.state_dict().values()]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return state


def make_small() -> nn.Module:
    """``models.SmallNet`` with ``conv.bias`` frozen.  BatchNorm cancels that bias, so its gradient
    is zero up to rounding, and rounding differs between GPU and CPU; Adam scales any nonzero
    gradient to about ``lr`` per step, which would turn that noise into a difference of ``lr``."""
    model = make_model()
    model.conv.bias.requires_grad_(False)
    return model


def cpu_reference(make_opt, steps=5, **hvd_kwargs) -> list[torch.Tensor]:
    """Plain ``hvd.DistributedOptimizer`` on CPU, same model, seeds and batches."""
    model = make_small()
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                   named_parameters=model.named_parameters(), **hvd_kwargs)
    return train(model, opt, steps)


def small_batches(steps: int):
    return [micro[0] for micro in batches(steps)]


def ours_on_gpu(make_opt, steps=5, with_model=True, **kwargs):
    device = gpu()
    model = make_small().to(device)
    opt = dcredit_hvd.DistributedOptimizer(make_opt(model.parameters()),
                                           named_parameters=model.named_parameters(),
                                           model=model if with_model else None, **kwargs)
    on_gpu = all(p.is_cuda for p in model.parameters())
    return fit(model, opt, small_batches(steps), device), opt, on_gpu


def split_check(policy: str, opt) -> tuple[bool, str]:
    blocks = {t.name: len(t.blocks) for t in opt.layouts}
    ok = policy == "wfbp" or all(n > 1 for name, n in blocks.items() if "head.weight" in name)
    return ok, f"large tensors were not split: {blocks}"


@pytest.mark.parametrize("with_model", [True, False], ids=["model", "no_model"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("policy", POLICIES)
def test_gpu_parameters_match_plain_horovod_on_cpu_after_five_steps(policy, opt_name, with_model):
    """With ``model=`` this also proves that each update applied in overlap mode is visible to
    the next forward on the same (default) stream: a stale parameter in any of the five
    forwards would change every later step and break the match."""
    make_opt = OPTIMIZERS[opt_name]
    expected = cpu_reference(make_opt)
    extra = PROFILE if policy == "dcredit" else {}
    got, opt, on_gpu = ours_on_gpu(make_opt, with_model=with_model, policy=policy, **SMALL,
                                   **extra)
    assert_all_ranks(on_gpu, "the model is not on the GPU")
    assert_all_ranks(policy != "dcredit" or opt.plan is not None, "the plan never took over")
    assert_all_ranks(*split_check(policy, opt))
    assert_all_ranks(params_close(got, expected, rtol=RTOL, atol=ATOL),
                     f"{policy}/{opt_name}/model={with_model}: max relative difference "
                     f"{max_rel_diff(got, expected)}")


@pytest.mark.parametrize("with_model", [True, False], ids=["model", "no_model"])
@pytest.mark.parametrize("policy", POLICIES)
def test_fp16_compressed_gpu_gradients_match_horovod_fp16_on_cpu(policy, with_model):
    # GPU and CPU gradients differ in the last float32 bits, which can move an element across an
    # fp16 rounding boundary: one fp16 ulp (2**-11 relative) of one gradient, times the learning
    # rate and the momentum sum over five steps.  Hence atol 1e-5 here.
    make_opt = OPTIMIZERS["sgd_momentum"]
    expected = cpu_reference(make_opt, compression=hvd.Compression.fp16)
    extra = PROFILE if policy == "dcredit" else {}
    got, opt, on_gpu = ours_on_gpu(make_opt, with_model=with_model, policy=policy,
                                   compression=hvd.Compression.fp16, **SMALL, **extra)
    assert_all_ranks(on_gpu, "the model is not on the GPU")
    assert_all_ranks(all(t.element_size == 2 for t in opt.layouts),
                     "fp16 blocks should be sized at 2 bytes per element")
    assert_all_ranks(*split_check(policy, opt))
    assert_all_ranks(params_close(got, expected, rtol=1e-3, atol=1e-5),
                     f"{policy}/fp16/model={with_model}: max relative difference "
                     f"{max_rel_diff(got, expected)}")


class _SleepInBackward(torch.autograd.Function):
    """Identity; its backward keeps the GPU stream busy before the layers below it get their
    gradients, so hooks fire (on the host) long before those gradients exist on the device."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if grad.is_cuda:
            torch.cuda._sleep(DELAY_CYCLES)
        return grad


class Delay(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SleepInBackward.apply(x)


def make_deep(seed: int = 11) -> nn.Module:
    """Smooth (tanh, not ReLU): GPU and CPU round differently, and a pre-activation that rounds to
    the other side of a ReLU's kink would change a whole gradient row, not just its last bits."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), Delay(), nn.Tanh()]
    layers.append(nn.Linear(WIDTH, 10))
    return nn.Sequential(*layers)


def deep_batches(steps: int, batch: int = 32):
    gen = torch.Generator().manual_seed(2000 + hvd.rank())
    return [(torch.randn(batch, WIDTH, generator=gen), torch.randint(0, 10, (batch,), generator=gen))
            for _ in range(steps)]


_deep_reference: dict[int, list[torch.Tensor]] = {}


def deep_reference(steps: int) -> list[torch.Tensor]:
    """Plain Horovod on CPU, computed once per step count (every rank computes it in the same
    test, so the collectives line up)."""
    if steps not in _deep_reference:
        model = make_deep()
        opt = hvd.DistributedOptimizer(OPTIMIZERS["sgd_momentum"](model.parameters()),
                                       named_parameters=model.named_parameters())
        _deep_reference[steps] = fit(model, opt, deep_batches(steps), torch.device("cpu"))
    return _deep_reference[steps]


def busy_default_stream(device: torch.device):
    """After each step, queue a long sleep on the default stream: work the optimizer put there
    (reductions, updates) finishes late, so a forward on another stream that does not wait for it
    reads stale values."""
    def after_step() -> None:
        with torch.cuda.stream(torch.cuda.default_stream(device)):
            torch.cuda._sleep(DELAY_CYCLES)
    return after_step


def deep_on_side_stream(policy: str, with_model: bool, steps: int, after_step=None):
    device = gpu()
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        model = make_deep().to(device)        # parameters are made on the side stream
    extra = PROFILE if policy == "dcredit" else {}
    opt = dcredit_hvd.DistributedOptimizer(OPTIMIZERS["sgd_momentum"](model.parameters()),
                                           named_parameters=model.named_parameters(),
                                           model=model if with_model else None, policy=policy,
                                           **DEEP_SPLIT, **extra)
    on_gpu = all(p.is_cuda for p in model.parameters())
    got = fit(model, opt, deep_batches(steps), device, stream=side, after_step=after_step)
    return got, opt, on_gpu


@pytest.mark.parametrize("with_model", [True, False], ids=["model", "no_model"])
@pytest.mark.parametrize("policy", POLICIES)
def test_gradients_made_on_a_side_stream_are_reduced_after_their_kernels_finish(policy,
                                                                                with_model):
    """Forward and backward run under ``torch.cuda.stream(side)``, and each layer's backward
    sleeps on that stream first, so every gradient hook fires while its gradient is still being
    computed.  Reducing (or copying) a gradient without ordering after the side stream sends
    stale or uninitialised values, and the parameters drift from the CPU reference."""
    steps = 5 if policy == "dcredit" else 3
    expected = deep_reference(steps)
    got, opt, on_gpu = deep_on_side_stream(policy, with_model, steps)
    assert_all_ranks(on_gpu, "the model is not on the GPU")
    assert_all_ranks(policy != "dcredit" or opt.plan is not None, "the plan never took over")
    blocks = [len(t.blocks) for t in opt.layouts if t.numel == WIDTH * WIDTH]
    assert_all_ranks(len(blocks) == DEPTH and (policy == "wfbp" or all(n > 1 for n in blocks)),
                     f"the 1024x1024 weights were not split: {blocks}")
    assert_all_ranks(params_close(got, expected, rtol=RTOL, atol=ATOL),
                     f"{policy}/model={with_model}: max relative difference "
                     f"{max_rel_diff(got, expected)}")


@pytest.mark.parametrize("policy", POLICIES)
def test_overlapped_updates_are_visible_to_the_next_forward_on_the_same_side_stream(policy):
    """With ``model=``, ``step()`` returns before the updates are applied; the next forward (on
    the side stream the model trains on) must see each of them.  The default stream is kept busy
    after every step, so an update (or a reduction) queued there without the side stream waiting
    for it is still pending when the next forward reads the parameter.  Parity with the CPU
    reference after several steps proves every forward saw every update."""
    steps = 5 if policy == "dcredit" else 4
    expected = deep_reference(steps)
    got, _, on_gpu = deep_on_side_stream(policy, True, steps, after_step=busy_default_stream(gpu()))
    assert_all_ranks(on_gpu, "the model is not on the GPU")
    assert_all_ranks(params_close(got, expected, rtol=RTOL, atol=ATOL),
                     f"{policy}: max relative difference {max_rel_diff(got, expected)}")
