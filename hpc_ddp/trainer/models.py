"""Models by name: torchvision's (`resnet18`, `resnet50`, ...), small built-ins (`cnn`, `mlp`, and `gpt`, a
GPT-style decoder built from a config), or the user's own `package.module:factory` (called with
num_classes=, in_channels=, image_size=)."""

from __future__ import annotations

import importlib

import torch
from torch import nn

from hpc_ddp.common.errors import SpecError

__all__ = ["build_model"]


def build_model(name: str, *, num_classes: int, in_channels: int, image_size: int,
                decoder: dict | None = None) -> nn.Module:
    """`decoder`: the gpt model's n_layer, n_head, n_embd (its vocabulary is num_classes, its context
    image_size: the tokens dataset's block_size)."""
    if name == "gpt":
        return GPT(vocab=num_classes, block_size=image_size, **(decoder or {}))
    if ":" in name:
        return _user_factory(name, num_classes=num_classes, in_channels=in_channels, image_size=image_size)
    if name == "cnn":
        return SmallCNN(in_channels, num_classes)
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size * image_size, 256), nn.ReLU(),
                             nn.Linear(256, num_classes))
    return _torchvision(name, num_classes=num_classes, in_channels=in_channels, image_size=image_size)


class SmallCNN(nn.Module):
    """Two conv blocks and a linear head: trains in seconds on CPU, enough for MNIST-like data."""

    def __init__(self, in_channels: int, num_classes: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(4))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.1), nn.Linear(32 * 16, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class GPT(nn.Module):
    """A GPT-2-style decoder (pre-norm blocks of causal self-attention and an MLP, learned positions), built
    from a config, initialised as GPT-2 is (normal, std 0.02). `blocks` are what FSDP shards one by one.
    forward(tokens (B, T)) gives logits as (B, vocab, T): the layout cross_entropy takes with targets (B, T)."""

    def __init__(self, *, vocab: int, block_size: int, n_layer: int = 2, n_head: int = 2, n_embd: int = 64):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(_Block(n_embd, n_head) for _ in range(n_layer))
        self.norm, self.head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).transpose(1, 2).contiguous()  # not a view: FSDP hooks its output


class _Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.norm1, self.qkv, self.proj = nn.LayerNorm(n_embd), nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.norm2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for z in self.qkv(self.norm1(x)).split(c, dim=2))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


def _torchvision(name: str, *, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    import torchvision.models as tvm

    try:
        factory = tvm.get_model_builder(name)
    except ValueError:
        raise SpecError(f"unknown model {name!r}",
                        hint="use cnn, mlp, a torchvision model name (resnet18, resnet50, ...) or package.module:factory") from None
    model = factory(weights=None, num_classes=num_classes)
    if hasattr(model, "conv1") and isinstance(model.conv1, nn.Conv2d):
        _adapt_resnet_stem(model, in_channels, image_size)
    elif in_channels != 3:
        raise SpecError(f"model {name!r} expects 3-channel images; this dataset has {in_channels}",
                        hint="use a resnet, cnn or mlp for 1-channel data")
    return model


def _adapt_resnet_stem(model: nn.Module, in_channels: int, image_size: int) -> None:
    """1-channel input, and for small images (<= 64 px) the CIFAR-style stem: a 3x3 stride-1 conv and no
    max-pool, so 28-32 px inputs are not shrunk to nothing before the first block."""
    old = model.conv1
    if image_size <= 64:
        model.conv1 = nn.Conv2d(in_channels, old.out_channels, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != old.in_channels:
        model.conv1 = nn.Conv2d(in_channels, old.out_channels, old.kernel_size, old.stride, old.padding, bias=False)


def _user_factory(spec: str, **kwargs) -> nn.Module:
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise SpecError(f"cannot load model factory {spec!r}: {exc}",
                        hint="the module must be importable on the compute nodes (PYTHONPATH or installed)") from None
    model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise SpecError(f"model factory {spec!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model
