"""A small ResNet image classifier, as plain ``nn.Module`` code, sized for small images (8x8 digits to 64x64).

A 3x3 stem convolution, stages of BasicBlocks (conv-BN-ReLU-conv-BN plus the input, then ReLU), global average
pooling and a linear head, as in He et al. (2016). Each stage after the first halves the resolution with a stride-2
first block, whose skip path is a 1x1 stride-2 projection to the new width. The stem keeps the resolution (stride
1, no max-pool), as ResNets for CIFAR do: an 8x8 digit has no pixels to spare.

BatchNorm and data parallelism: under DDP each rank normalises with the statistics of its own micro-batch, so the
running statistics (and the result) depend on the micro batch, not the global batch, unless the trainer converts
the norms with ``sync_batchnorm=True`` (one all-reduce per norm per forward). Nothing here knows about processes
or devices; that choice is the trainer's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.named_configs import named_config


@dataclass(frozen=True)
class ResNetConfig:
    widths: tuple[int, ...]  # channels of each stage; stage i > 0 halves the resolution
    blocks: tuple[int, ...]  # BasicBlocks in each stage
    in_channels: int = 1  # 1 grayscale, 3 RGB: set from the data
    num_classes: int = 10  # set from the data
    stem_stride: int = 1  # 2 halves larger images (64x64 and up) before the first stage

    def __post_init__(self) -> None:
        if len(self.widths) != len(self.blocks) or not self.widths:
            raise ValueError(f"widths {self.widths} and blocks {self.blocks} must name the same stages (at least one)")
        if min(self.widths) < 1 or min(self.blocks) < 1:
            raise ValueError(f"widths {self.widths} and blocks {self.blocks} must be positive")


# Named sizes. "resnet-tiny" (5 k parameters) is for tests; "resnet-small" (308 k) learns the embedded digits to 98 %
# validation accuracy in 150 steps of 64, seconds on one CPU thread (tests/test_images.py); "resnet-18" (11 M) is
# He et al.'s ResNet-18 with the CIFAR stem, for 32x32 to 64x64 image folders.
RESNET_CONFIGS: dict[str, ResNetConfig] = {
    "resnet-tiny": ResNetConfig(widths=(8, 16), blocks=(1, 1)),
    "resnet-small": ResNetConfig(widths=(32, 64, 128), blocks=(1, 1, 1)),
    "resnet-18": ResNetConfig(widths=(64, 128, 256, 512), blocks=(2, 2, 2, 2)),
}


def resnet_config(name: str, **overrides: int | tuple[int, ...] | None) -> ResNetConfig:
    """The named config with the given fields replaced (fields set to None are left as they are)."""
    return named_config(RESNET_CONFIGS, name, overrides)


class BasicBlock(nn.Module):
    def __init__(self, in_width: int, width: int, stride: int) -> None:
        super().__init__()
        # no conv biases: each conv is followed by a BatchNorm, whose shift does the same job
        self.conv1 = nn.Conv2d(in_width, width, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_width != width:  # the input no longer has the output's shape: project it
            self.shortcut = nn.Sequential(nn.Conv2d(in_width, width, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))  # (B, width, H / stride, W / stride)
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        self.config = config
        self.stem = nn.Sequential(
            nn.Conv2d(config.in_channels, config.widths[0], 3, stride=config.stem_stride, padding=1, bias=False),
            nn.BatchNorm2d(config.widths[0]),
            nn.ReLU(),
        )
        stages, in_width = [], config.widths[0]
        for index, (width, num_blocks) in enumerate(zip(config.widths, config.blocks)):
            stride = 1 if index == 0 else 2
            blocks = [BasicBlock(in_width if block == 0 else width, width, stride if block == 0 else 1)
                      for block in range(num_blocks)]
            stages.append(nn.Sequential(*blocks))
            in_width = width
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(in_width, config.num_classes)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """He initialisation for the convolutions; each block's last BatchNorm starts at zero, so that every block
        starts as the identity and the network as a shallow one (Goyal et al., 2017), which trains faster. Called
        by ``__init__``; call it again after materialising a model built on the meta device."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
                module.reset_running_stats()
            elif isinstance(module, nn.Linear):
                module.reset_parameters()
        for module in self.modules():
            if isinstance(module, BasicBlock):
                nn.init.zeros_(module.bn2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, in_channels, H, W) to class logits (B, num_classes); any H, W of at least 1."""
        x = self.stages(self.stem(x))  # (B, widths[-1], H / 2^(stages - 1), W / 2^(stages - 1)), stride 1 stem
        return self.head(x.mean(dim=(2, 3)))  # global average pool: (B, widths[-1]) -> (B, num_classes)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
