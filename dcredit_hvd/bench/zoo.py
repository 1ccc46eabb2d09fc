"""Benchmark models defined in the project: ResNet-50, VGG-16 and a GPT-2-small style transformer.

Each model exists twice, from one description:

* a torch-free *spec*: the layers in forward order, each with its parameters ``(name, shape)``
  and its forward FLOPs for a given batch, from which ``profile`` builds a simulator ``Profile``;
* a real ``torch.nn.Module`` (``resnet50()``, ``vgg16()``, ``gpt2_small()`` and the configurable
  ``resnet``/``vgg``/``gpt``), whose parameters, in the order forward first uses them, have
  exactly the spec's names and shapes (``tests/bench/test_zoo.py`` checks it).

torchvision does not import beside the project's torch (``docs/environment-facts.md``), so the
models are written here.  Parameter counts at the default sizes: ResNet-50 25,557,032;
VGG-16 138,357,544; GPT-2 small (tied embeddings) 124,439,808.  This module imports torch only
inside the module builders, so the simulator and the CLI run without torch.

Timing assumption of ``profile``: a layer's forward takes ``FLOPs / flops_per_second`` (one
effective device throughput for every layer, no kernel-launch floor), its backward twice that
(``t_b = 2 t_f``: gradients with respect to inputs and to weights each cost about one forward),
and a layer's time is split evenly among its tensors, as ``profile.Profile`` prescribes.
Parameter-free operations (ReLU, pooling, residual adds, attention scores, the tied language-model
head) are charged to the nearest preceding layer that has parameters, so they sit at the right
place in forward and backward.  Tensors are in forward order, index 0 nearest the input, the
order D-Credit's priorities use (Gao et al., IEEE TNSE 12(2), 2025; spec §2).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..planning.profile import Profile

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Layer:
    """One module of the forward pass: its own parameters and its forward FLOPs for a batch."""

    name: str
    #: ``(full parameter name, shape)`` in the order forward first uses them.
    params: tuple[tuple[str, Shape], ...]
    #: Forward FLOPs for the whole batch, parameter-free work folded in (see module docstring).
    flops: float


@dataclass(frozen=True)
class ModelEntry:
    """How to describe, build and size one zoo model."""

    spec: Callable[..., list[Layer]]
    build: Callable[..., Any]
    #: Batch size used by the CLI and ``docs/algorithm.md`` tables unless told otherwise.
    default_batch: int
    #: What the batch counts, for messages ("images", "sequences of 1024 tokens").
    unit: str


def _numel(shape: Shape) -> int:
    return math.prod(shape)


def _conv_out(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


class _Recorder:
    """Collects raw ops in forward order, then folds parameter-free ones into a neighbour."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, tuple[tuple[str, Shape], ...], float]] = []

    def op(self, name: str, params: Sequence[tuple[str, Shape]], flops: float) -> None:
        self.ops.append((name, tuple(params), float(flops)))

    def layers(self) -> list[Layer]:
        out: list[Layer] = []
        carry = 0.0  # parameter-free FLOPs seen before the first layer with parameters
        for name, params, flops in self.ops:
            if params:
                out.append(Layer(name, params, flops + carry))
                carry = 0.0
            elif out:
                last = out[-1]
                out[-1] = Layer(last.name, last.params, last.flops + flops)
            else:
                carry += flops
        if carry and out:
            first = out[0]
            out[0] = Layer(first.name, first.params, first.flops + carry)
        return out


# --------------------------------------------------------------------------------------------
# ResNet (bottleneck, "v1.5": stride on the 3x3 convolution)
# --------------------------------------------------------------------------------------------

def resnet_spec(batch_size: int = 1, *, depths: Sequence[int] = (3, 4, 6, 3), width: int = 64,
                num_classes: int = 1000, image_size: int = 224) -> list[Layer]:
    """Layers of a bottleneck ResNet; the defaults are ResNet-50 on ImageNet (224x224)."""
    rec = _Recorder()
    n = batch_size
    bn_flops = 4  # per element: subtract mean, divide by std, scale, shift

    def conv(name: str, cin: int, cout: int, k: int, s: int, p: int, size: int) -> int:
        out = _conv_out(size, k, s, p)
        rec.op(name, [(f"{name}.weight", (cout, cin, k, k))], 2 * cin * k * k * cout * out * out * n)
        return out

    def bn(name: str, c: int, size: int, relu: bool) -> None:
        rec.op(name, [(f"{name}.weight", (c,)), (f"{name}.bias", (c,))], bn_flops * c * size * size * n)
        if relu:
            rec.op(f"{name}.relu", [], c * size * size * n)

    size = conv("conv1", 3, width, 7, 2, 3, image_size)
    bn("bn1", width, size, relu=True)
    pooled = _conv_out(size, 3, 2, 1)
    rec.op("maxpool", [], 9 * width * pooled * pooled * n)
    size = pooled
    cin = width
    for stage, depth in enumerate(depths):
        planes = width * 2 ** stage
        for i in range(depth):
            stride = 2 if (stage > 0 and i == 0) else 1
            prefix = f"layer{stage + 1}.{i}"
            s1 = conv(f"{prefix}.conv1", cin, planes, 1, 1, 0, size)
            bn(f"{prefix}.bn1", planes, s1, relu=True)
            s2 = conv(f"{prefix}.conv2", planes, planes, 3, stride, 1, s1)
            bn(f"{prefix}.bn2", planes, s2, relu=True)
            s3 = conv(f"{prefix}.conv3", planes, planes * 4, 1, 1, 0, s2)
            bn(f"{prefix}.bn3", planes * 4, s3, relu=False)
            if stride != 1 or cin != planes * 4:
                conv(f"{prefix}.downsample.0", cin, planes * 4, 1, stride, 0, size)
                bn(f"{prefix}.downsample.1", planes * 4, s3, relu=False)
            rec.op(f"{prefix}.add_relu", [], 2 * planes * 4 * s3 * s3 * n)
            cin, size = planes * 4, s3
    rec.op("avgpool", [], cin * size * size * n)
    rec.op("fc", [("fc.weight", (num_classes, cin)), ("fc.bias", (num_classes,))],
           2 * cin * num_classes * n)
    rec.op("loss", [], 3 * num_classes * n)
    return rec.layers()


def resnet(*, depths: Sequence[int] = (3, 4, 6, 3), width: int = 64, num_classes: int = 1000,
           image_size: int = 224) -> Any:
    """A bottleneck ResNet as a ``torch.nn.Module`` (``image_size`` only documents the input)."""
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, cin: int, planes: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(planes)
            self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(planes)
            self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(planes * 4)
            self.relu = nn.ReLU(inplace=True)
            self.downsample: nn.Module | None = None
            if stride != 1 or cin != planes * 4:
                self.downsample = nn.Sequential(
                    nn.Conv2d(cin, planes * 4, 1, stride=stride, bias=False),
                    nn.BatchNorm2d(planes * 4))

        def forward(self, x: Any) -> Any:
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            # The shortcut runs after the main branch, so forward order = definition order.
            identity = x if self.downsample is None else self.downsample(x)
            return self.relu(out + identity)

    class ResNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
            cin = width
            for stage, depth in enumerate(depths):
                planes = width * 2 ** stage
                blocks = []
                for i in range(depth):
                    stride = 2 if (stage > 0 and i == 0) else 1
                    blocks.append(Bottleneck(cin, planes, stride))
                    cin = planes * 4
                setattr(self, f"layer{stage + 1}", nn.Sequential(*blocks))
            self.stages = len(depths)
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(cin, num_classes)

        def forward(self, x: Any) -> Any:
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            for stage in range(self.stages):
                x = getattr(self, f"layer{stage + 1}")(x)
            return self.fc(self.avgpool(x).flatten(1))

    return ResNet()


def resnet50(**options: Any) -> Any:
    """ResNet-50 (25,557,032 parameters at the defaults)."""
    return resnet(**options)


# --------------------------------------------------------------------------------------------
# VGG
# --------------------------------------------------------------------------------------------

VGG16_CFG: tuple[Any, ...] = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M",
                              512, 512, 512, "M", 512, 512, 512, "M")


def _vgg_channels(cfg: Sequence[Any], width: int) -> list[Any]:
    return [c if c == "M" else max(1, c * width // 64) for c in cfg]


def vgg_spec(batch_size: int = 1, *, width: int = 64, hidden: int = 4096, num_classes: int = 1000,
             image_size: int = 224, pool_size: int = 7,
             cfg: Sequence[Any] = VGG16_CFG) -> list[Layer]:
    """Layers of a VGG; the defaults are VGG-16 on ImageNet.  ``width`` scales every channel
    count by ``width/64``; the classifier sees ``channels * pool_size**2`` features (adaptive
    average pooling, as in the reference VGG)."""
    rec = _Recorder()
    n = batch_size
    size, cin, index = image_size, 3, 0
    for c in _vgg_channels(cfg, width):
        if c == "M":
            size //= 2
            rec.op(f"features.{index}", [], cin * size * size * 4 * n)
            index += 1
            continue
        name = f"features.{index}"
        rec.op(name, [(f"{name}.weight", (c, cin, 3, 3)), (f"{name}.bias", (c,))],
               (2 * cin * 9 + 1) * c * size * size * n)
        rec.op(f"features.{index + 1}", [], c * size * size * n)  # ReLU
        cin, index = c, index + 2
    rec.op("avgpool", [], cin * max(size, pool_size) ** 2 * n)
    features = cin * pool_size * pool_size
    dims = [(0, features, hidden), (3, hidden, hidden), (6, hidden, num_classes)]
    for i, (pos, fin, fout) in enumerate(dims):
        name = f"classifier.{pos}"
        rec.op(name, [(f"{name}.weight", (fout, fin)), (f"{name}.bias", (fout,))], 2 * fin * fout * n)
        if i < 2:
            rec.op(f"classifier.{pos + 1}", [], fout * n)  # ReLU (dropout is free)
    rec.op("loss", [], 3 * num_classes * n)
    return rec.layers()


def vgg(*, width: int = 64, hidden: int = 4096, num_classes: int = 1000, image_size: int = 224,
        pool_size: int = 7, cfg: Sequence[Any] = VGG16_CFG) -> Any:
    """A VGG as a ``torch.nn.Module`` (``image_size`` only documents the input)."""
    from torch import nn

    class VGG(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layers: list[nn.Module] = []
            cin = 3
            for c in _vgg_channels(cfg, width):
                if c == "M":
                    layers.append(nn.MaxPool2d(2, 2))
                else:
                    layers += [nn.Conv2d(cin, c, 3, padding=1), nn.ReLU(inplace=True)]
                    cin = c
            self.features = nn.Sequential(*layers)
            self.avgpool = nn.AdaptiveAvgPool2d(pool_size)
            self.classifier = nn.Sequential(
                nn.Linear(cin * pool_size * pool_size, hidden), nn.ReLU(inplace=True), nn.Dropout(),
                nn.Linear(hidden, hidden), nn.ReLU(inplace=True), nn.Dropout(),
                nn.Linear(hidden, num_classes))

        def forward(self, x: Any) -> Any:
            return self.classifier(self.avgpool(self.features(x)).flatten(1))

    return VGG()


def vgg16(**options: Any) -> Any:
    """VGG-16 (138,357,544 parameters at the defaults)."""
    return vgg(**options)


# --------------------------------------------------------------------------------------------
# GPT-2 style decoder-only transformer
# --------------------------------------------------------------------------------------------

def gpt_spec(batch_size: int = 1, *, vocab: int = 50257, ctx: int = 1024, d: int = 768,
             layers: int = 12, heads: int = 12, seq_len: int | None = None) -> list[Layer]:
    """Layers of a pre-LayerNorm GPT with tied input/output embeddings; the defaults are GPT-2
    small.  ``batch_size`` counts sequences of ``seq_len`` tokens (default: the context)."""
    if d % heads:
        raise ValueError(f"gpt: d={d} is not a multiple of heads={heads}")
    t = ctx if seq_len is None else seq_len
    if not 0 < t <= ctx:
        raise ValueError(f"gpt: seq_len must be in 1..ctx={ctx}, got {t}")
    tokens = batch_size * t
    rec = _Recorder()
    ln_flops = 5  # per element: mean, variance, normalise, scale, shift

    def linear(name: str, fin: int, fout: int) -> None:
        rec.op(name, [(f"{name}.weight", (fout, fin)), (f"{name}.bias", (fout,))],
               2 * fin * fout * tokens)

    def layernorm(name: str) -> None:
        rec.op(name, [(f"{name}.weight", (d,)), (f"{name}.bias", (d,))], ln_flops * d * tokens)

    rec.op("wte", [("wte.weight", (vocab, d))], 0.0)          # a lookup
    rec.op("wpe", [("wpe.weight", (ctx, d))], d * tokens)     # lookup + add
    for i in range(layers):
        p = f"h.{i}"
        layernorm(f"{p}.ln_1")
        linear(f"{p}.attn.c_attn", d, 3 * d)
        # Scores Q K^T and weighted values A V over all heads (dense, causal mask not exploited),
        # plus the softmax.
        rec.op(f"{p}.attn.core", [], batch_size * (4 * t * t * d + 5 * heads * t * t))
        linear(f"{p}.attn.c_proj", d, d)
        rec.op(f"{p}.add_1", [], d * tokens)
        layernorm(f"{p}.ln_2")
        linear(f"{p}.mlp.c_fc", d, 4 * d)
        rec.op(f"{p}.mlp.gelu", [], 8 * 4 * d * tokens)
        linear(f"{p}.mlp.c_proj", 4 * d, d)
        rec.op(f"{p}.add_2", [], d * tokens)
    layernorm("ln_f")
    rec.op("lm_head", [], 2 * d * vocab * tokens)  # tied to wte: no parameter of its own
    rec.op("loss", [], 3 * vocab * tokens)
    return rec.layers()


def gpt(*, vocab: int = 50257, ctx: int = 1024, d: int = 768, layers: int = 12,
        heads: int = 12, seq_len: int | None = None) -> Any:
    """A GPT as a ``torch.nn.Module``: token ids ``[batch, seq]`` -> logits ``[batch, seq, vocab]``.

    ``seq_len`` only documents the input; names follow GPT-2's checkpoints, but linear weights
    are ``[out, in]`` (``nn.Linear``) rather than GPT-2's transposed ``Conv1D``.
    """
    import torch
    from torch import nn
    from torch.nn import functional as F

    if d % heads:
        raise ValueError(f"gpt: d={d} is not a multiple of heads={heads}")

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_attn = nn.Linear(d, 3 * d)
            self.c_proj = nn.Linear(d, d)

        def forward(self, x: Any) -> Any:
            b, t, _ = x.shape
            q, k, v = self.c_attn(x).split(d, dim=2)
            q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).reshape(b, t, d))

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_fc = nn.Linear(d, 4 * d)
            self.c_proj = nn.Linear(4 * d, d)

        def forward(self, x: Any) -> Any:
            return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1 = nn.LayerNorm(d)
            self.attn = Attention()
            self.ln_2 = nn.LayerNorm(d)
            self.mlp = MLP()

        def forward(self, x: Any) -> Any:
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(vocab, d)
            self.wpe = nn.Embedding(ctx, d)
            self.h = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)

        def forward(self, idx: Any) -> Any:
            t = idx.shape[1]
            if t > ctx:
                raise ValueError(f"sequence of {t} tokens exceeds the context of {ctx}")
            x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
            for block in self.h:
                x = block(x)
            return F.linear(self.ln_f(x), self.wte.weight)  # tied language-model head

    return GPT()


def gpt2_small(**options: Any) -> Any:
    """GPT-2 small: vocab 50257, context 1024, d=768, 12 layers, 12 heads, tied embeddings
    (124,439,808 parameters)."""
    return gpt(**options)


# --------------------------------------------------------------------------------------------
# Registry and profiles
# --------------------------------------------------------------------------------------------

MODELS: dict[str, ModelEntry] = {
    "resnet50": ModelEntry(resnet_spec, resnet50, default_batch=64, unit="images"),
    "vgg16": ModelEntry(vgg_spec, vgg16, default_batch=64, unit="images"),
    "gpt2_small": ModelEntry(gpt_spec, gpt2_small, default_batch=8, unit="sequences of 1024 tokens"),
}

ALIASES = {"resnet-50": "resnet50", "vgg-16": "vgg16", "gpt2": "gpt2_small",
           "gpt2-small": "gpt2_small", "gpt-2": "gpt2_small"}


def entry(model: str) -> ModelEntry:
    """The registry entry of ``model`` (aliases such as ``gpt2`` accepted)."""
    key = ALIASES.get(model.lower(), model.lower())
    if key not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")
    return MODELS[key]


def layers(model: str, batch_size: int = 1, **options: Any) -> list[Layer]:
    """The forward-order layers of ``model`` for ``batch_size`` (torch-free)."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    return entry(model).spec(batch_size, **options)


def shapes(model: str, **options: Any) -> list[tuple[str, Shape]]:
    """``(name, shape)`` of every parameter in forward (first-use) order (torch-free)."""
    return [p for layer in layers(model, 1, **options) for p in layer.params]


def tensors(model: str, **options: Any) -> list[tuple[str, int]]:
    """``(name, numel)`` of every parameter in forward order (torch-free)."""
    return [(name, _numel(shape)) for name, shape in shapes(model, **options)]


def num_params(model: str, **options: Any) -> int:
    return sum(n for _, n in tensors(model, **options))


def forward_flops(model: str, batch_size: int, **options: Any) -> float:
    """Forward FLOPs of one batch."""
    return sum(layer.flops for layer in layers(model, batch_size, **options))


def build(model: str, **options: Any) -> Any:
    """The ``torch.nn.Module`` of ``model`` (imports torch)."""
    return entry(model).build(**options)


def profile(model: str, batch_size: int | None, flops_per_second: float, element_size: int = 4,
            *, update_seconds_per_byte: float = 0.0, **options: Any) -> Profile:
    """A simulator ``Profile`` of one iteration of ``model`` on a device of ``flops_per_second``.

    ``t_f`` = layer FLOPs / ``flops_per_second`` split evenly over the layer's tensors,
    ``t_b = 2 t_f``, ``t_u = update_seconds_per_byte * M_l`` (0 by default: the optimizer update
    is not modelled unless asked).  ``element_size`` is the bytes per element as sent
    (4 for float32, 2 under fp16 compression).  ``batch_size=None`` uses the model's default.
    """
    if flops_per_second <= 0:
        raise ValueError(f"flops_per_second must be > 0, got {flops_per_second}")
    if batch_size is None:
        batch_size = entry(model).default_batch
    names: list[str] = []
    nbytes: list[int] = []
    t_f: list[float] = []
    for layer in layers(model, batch_size, **options):
        share = layer.flops / flops_per_second / len(layer.params)
        for name, shape in layer.params:
            names.append(name)
            nbytes.append(_numel(shape) * element_size)
            t_f.append(share)
    return Profile.from_lists(names, nbytes, [element_size] * len(names), t_f,
                              [2.0 * t for t in t_f],
                              [update_seconds_per_byte * b for b in nbytes])
