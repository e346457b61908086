"""Model factories for the GPU benchmark's trainer runs (`model = "bench.gpu_models:NAME"` in the job's
[train] table). The trainer has no channels_last or torch.compile setting; a factory of one's own is
how a job gets them, so this is what a user would write."""

from __future__ import annotations

import torch
from torch import nn

from hpc_ddp.trainer.models import build_model


class ChannelsLast(nn.Module):
    """Weights and inputs in channels_last (NHWC); the state dict keeps the wrapped model's keys under `inner.`."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner.to(memory_format=torch.channels_last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.contiguous(memory_format=torch.channels_last))


def resnet50_channels_last(*, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    return ChannelsLast(build_model("resnet50", num_classes=num_classes, in_channels=in_channels,
                                    image_size=image_size))


def resnet50_channels_last_compiled(*, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    model = resnet50_channels_last(num_classes=num_classes, in_channels=in_channels, image_size=image_size)
    model.inner.compile()  # in place: the state dict's keys do not change
    return model
