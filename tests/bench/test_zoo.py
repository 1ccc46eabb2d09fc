"""The model zoo: exact parameter counts, torch modules equal to the torch-free description,
and profiles derived from FLOPs."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dcredit_hvd.bench import zoo

FULL = {"resnet50": 25_557_032, "vgg16": 138_357_544, "gpt2_small": 124_439_808}

SMALL = {
    "resnet50": {"depths": (1, 2, 1, 1), "width": 8, "num_classes": 10, "image_size": 32},
    "vgg16": {"width": 8, "hidden": 32, "num_classes": 10, "image_size": 32, "pool_size": 1},
    "gpt2_small": {"vocab": 97, "ctx": 16, "d": 32, "layers": 2, "heads": 4},
}


def example_input(model: str, options: dict, batch: int = 2) -> torch.Tensor:
    if model == "gpt2_small":
        tokens = min(options.get("ctx", 1024), 64)
        return torch.randint(0, options.get("vocab", 50257), (batch, tokens))
    size = options.get("image_size", 224)
    return torch.randn(batch, 3, size, size)


def forward_order(module: torch.nn.Module, x: torch.Tensor) -> list[tuple[str, tuple[int, ...]]]:
    """Parameters in the order forward first uses them (pre-hooks on every module)."""
    names = {id(p): n for n, p in module.named_parameters()}
    seen: list[tuple[str, tuple[int, ...]]] = []

    def hook(mod, _inputs):
        for p in mod.parameters(recurse=False):
            if all(names[id(p)] != n for n, _ in seen):
                seen.append((names[id(p)], tuple(p.shape)))

    handles = [m.register_forward_pre_hook(hook) for m in module.modules()]
    try:
        module(x)
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("model,count", sorted(FULL.items()))
def test_torch_free_parameter_counts_equal_the_reference_models(model, count):
    assert zoo.num_params(model) == count


@pytest.mark.parametrize("model", sorted(FULL))
def test_full_size_torch_module_has_the_torch_free_shapes_in_forward_order(model):
    # Built and run on the meta device: shapes only, no memory, no arithmetic.
    with torch.device("meta"):
        module = zoo.build(model)
        x = example_input(model, {}, batch=1)
        order = forward_order(module, x)
    assert sum(p.numel() for p in module.parameters()) == FULL[model]
    assert order == zoo.shapes(model)
    assert len(order) == len(list(module.parameters()))  # every parameter is used


@pytest.mark.parametrize("model", sorted(SMALL))
def test_small_variant_trains_on_cpu_and_matches_its_torch_free_shapes(model):
    options = SMALL[model]
    torch.manual_seed(0)
    module = zoo.build(model, **options)
    x = example_input(model, options)
    assert forward_order(module, x) == zoo.shapes(model, **options)
    out = module(x)
    if model == "gpt2_small":
        assert out.shape == (*x.shape, options["vocab"])
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), x.flatten())
    else:
        assert out.shape == (x.shape[0], options["num_classes"])
        loss = out.square().mean()
    loss.backward()
    assert all(p.grad is not None for p in module.parameters())
    assert sum(p.numel() for p in module.parameters()) == zoo.num_params(model, **options)


def test_gpt_ties_the_output_head_to_the_token_embedding():
    module = zoo.build("gpt2_small", **SMALL["gpt2_small"])
    names = [n for n, _ in module.named_parameters()]
    assert names[0] == "wte.weight" and not any("lm_head" in n for n in names)


def test_forward_flops_match_the_published_figures():
    # ResNet-50 ~4.1 GMAC and VGG-16 ~15.5 GMAC per 224x224 image (convolutions and FC; our
    # count adds BN, ReLU and pooling); GPT-2 small ~2 x 124M per token plus attention.
    assert 8.1e9 < zoo.forward_flops("resnet50", 1) < 8.4e9
    assert 30.8e9 < zoo.forward_flops("vgg16", 1) < 31.2e9
    per_token = zoo.forward_flops("gpt2_small", 1) / 1024
    assert 2 * 124e6 < per_token < 2 * 124e6 + 60e6


def test_flops_scale_linearly_with_batch():
    for model in FULL:
        assert zoo.forward_flops(model, 8) == pytest.approx(8 * zoo.forward_flops(model, 1))


def test_profile_times_are_flops_over_throughput_with_backward_twice_forward():
    p = zoo.profile("vgg16", 4, 1e12)
    assert p.names == tuple(n for n, _ in zoo.tensors("vgg16"))
    assert p.nbytes == tuple(4 * n for _, n in zoo.tensors("vgg16"))
    assert p.forward_time == pytest.approx(zoo.forward_flops("vgg16", 4) / 1e12)
    assert all(b == pytest.approx(2 * f) for f, b in zip(p.t_f, p.t_b))
    # A layer's time is split evenly between its weight and bias.
    assert p.t_f[0] == pytest.approx(p.t_f[1])
    assert p.t_u == (0.0,) * p.num_tensors
    half = zoo.profile("vgg16", 4, 1e12, element_size=2, update_seconds_per_byte=1e-12)
    assert half.nbytes == tuple(n // 2 for n in p.nbytes)
    assert half.t_u[0] == pytest.approx(1e-12 * half.nbytes[0])


def test_default_batch_is_used_when_none_is_given():
    default = zoo.profile("resnet50", None, 1e12)
    assert default.forward_time == pytest.approx(zoo.profile("resnet50", 64, 1e12).forward_time)


def test_parameter_free_work_is_charged_to_the_preceding_layer():
    # The tied LM head (2 d V FLOPs per token) runs after ln_f, so it is ln_f's time: it must
    # delay every gradient in backward, not only the embedding's.
    layers = zoo.layers("gpt2_small", 1)
    assert layers[-1].name == "ln_f"
    assert layers[-1].flops > 2 * 768 * 50257 * 1024
    assert layers[0].name == "wte" and layers[0].flops == 0


def test_unknown_models_and_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="unknown model"):
        zoo.profile("alexnet", 1, 1e12)
    with pytest.raises(ValueError):
        zoo.profile("vgg16", 0, 1e12)
    with pytest.raises(ValueError):
        zoo.profile("vgg16", 1, 0)
    with pytest.raises(ValueError):
        zoo.layers("gpt2_small", 1, d=10, heads=3)
    assert zoo.entry("GPT2") is zoo.MODELS["gpt2_small"]


def test_torch_free_path_and_simulator_import_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from dcredit_hvd import __main__\n"
        "from dcredit_hvd.bench import zoo\n"
        "from dcredit_hvd.planning import simulator\n"
        "p = zoo.profile('resnet50', 8, 1e13)\n"
        "r = simulator.simulate(p, simulator.link_cost(1e10, 5e-5, 4), 'bytescheduler')\n"
        "assert r.iteration_s > 0 and zoo.num_params('vgg16') == 138357544\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
