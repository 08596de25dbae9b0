"""Random image augmentation of a whole micro-batch in batched torch ops, whose randomness is a pure function of
where the micro-batch sits in its optimizer step's global batch.

A training micro-batch reads a contiguous run of places in its step's global batch (``RunPlan.micro_batch_group``),
the same places whichever rank and accumulation step reads it. Its augmentation is drawn from one generator, seeded
with

    derive_seed(seed, "augment", step, the place of its first sample in the global batch)

which draws DRAWS_PER_IMAGE numbers per image, row i for the micro-batch's i-th sample, and from nothing else: no
global RNG, no state carried from one micro-batch to the next. So a run on 1 process (2 micro-batches per step)
and one on 2 processes (1 each) augment every sample of a global batch alike when the micro batch is the same size
(another micro batch size groups the places differently, so it draws differently); different places of a step
augment differently, the ranks of one tensor-parallel group alike, a run resumed at step s augments step s exactly
as the first run did without saving any RNG state, and one seed reproduces a whole run. The step is the optimizer
step counted from the start of training, so it names the data epoch too (epoch = step // steps per epoch): a sample
seen again in a later epoch is augmented afresh.

Images are (B, C, H, W) floats in [0, 1], augmented before they are normalised, so that the zeros shifted or rotated
in from outside are black, the background of the digits.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from core.seeding import derive_seed

DRAWS_PER_IMAGE = 6  # uniforms in [0, 1): crop x, crop y, angle, shift x, shift y, flip


@dataclass(frozen=True)
class Augmentation:
    crop_padding: int = 0  # random crop: pad with this many zero pixels on each side, cut a window of the old size
    rotation_degrees: float = 0.0  # rotate by an angle drawn uniformly from [-rotation_degrees, rotation_degrees]
    translate_fraction: float = 0.0  # shift each axis by a uniform fraction of the size in [-t, t]
    horizontal_flip: bool = False  # mirror left-right with probability 1/2; off for digits, a mirrored 2 is no 2

    @property
    def enabled(self) -> bool:
        return bool(self.crop_padding or self.rotation_degrees or self.translate_fraction or self.horizontal_flip)


def augmentation_seed(seed: int, step: int, first_place: int) -> int:
    """The seed of a training micro-batch's augmentation: its step and its first sample's place in the step's global
    batch, nothing else."""
    return derive_seed(seed, "augment", step, first_place)


def draw_augmentations(generator: torch.Generator, count: int) -> torch.Tensor:
    """(count, DRAWS_PER_IMAGE) uniforms, row i for the i-th image. Every draw is made whether or not its
    augmentation is on, so that turning one on or off leaves the others' draws as they were."""
    return torch.rand(count, DRAWS_PER_IMAGE, generator=generator)


def augment_images(images: torch.Tensor, draws: torch.Tensor, augmentation: Augmentation) -> torch.Tensor:
    """(B, C, H, W) images, image i randomly cropped, rotated, shifted and flipped by its row ``draws[i]`` as
    ``augmentation`` says: one grid_sample moves every image, then the flip mirrors some."""
    if not augmentation.enabled:
        return images
    B = len(images)
    draws = draws.to(images.device)  # (B, DRAWS_PER_IMAGE)
    if augmentation.crop_padding or augmentation.rotation_degrees or augmentation.translate_fraction:
        grid = sampling_grid(draws, augmentation, *images.shape[2:]).to(images.dtype)
        images = F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    if augmentation.horizontal_flip:
        images = torch.where((draws[:, 5] < 0.5).view(B, 1, 1, 1), images.flip(-1), images)
    return images


def sampling_grid(draws: torch.Tensor, augmentation: Augmentation, height: int, width: int) -> torch.Tensor:
    """(B, H, W, 2) where each output pixel of each image reads, in grid_sample's coordinates (x, y), which span
    [-1, 1] on each axis: rotated about the centre by the image's angle, then shifted by its fraction of the size and
    by its crop. F.affine_grid's result, in a few elementwise ops on constants built once per size: affine_grid builds
    its pixel grid on every call, and a batch of 2x3 matrix products is slow on a CPU (on 8x8 digits, the count of
    small ops is the cost)."""
    B, constants = len(draws), grid_constants(augmentation, height, width, draws.device)
    crop, angle, shift = torch.addcmul(constants.low, draws[:, :5], constants.span).split([2, 1, 2], dim=1)
    # a random crop (pad with zeros, cut a window of the old size) is a shift by whole pixels in [-pad, pad]
    shift = torch.addcmul(shift, crop.floor(), constants.pixel).view(B, 1, 1, 2)
    cos, sin = angle.cos(), angle.sin()  # each (B, 1)
    # a rotation of the pixel grid is scaled by the aspect ratio (which is 1 for square images)
    reads_per_x = torch.cat([cos, sin * (width / height)], dim=1).view(B, 1, 1, 2)
    reads_per_y = torch.cat([sin * (-height / width), cos], dim=1).view(B, 1, 1, 2)
    return torch.addcmul(torch.addcmul(shift, constants.x, reads_per_x), constants.y, reads_per_y)


class GridConstants(NamedTuple):
    """What sampling_grid needs besides the draws. Draw u of column k becomes low[k] + u * span[k]."""

    low: torch.Tensor  # (5,) at u = 0: crop x, crop y in pixels (before rounding down), angle, shift x, shift y
    span: torch.Tensor  # (5,)
    pixel: torch.Tensor  # (2,) a pixel's width and height in grid_sample's coordinates
    x: torch.Tensor  # (1, H, W, 1) each pixel centre's x in grid_sample's coordinates (align_corners=False)
    y: torch.Tensor  # (1, H, W, 1) and its y


@functools.cache
def grid_constants(augmentation: Augmentation, height: int, width: int, device: torch.device) -> GridConstants:
    pad, angle = augmentation.crop_padding, math.radians(augmentation.rotation_degrees)
    shift = 2 * augmentation.translate_fraction  # a fraction t of the size is 2t in grid_sample's coordinates
    low = torch.tensor([-pad, -pad, -angle, -shift, -shift], device=device)
    span = torch.tensor([2 * pad + 1, 2 * pad + 1, 2 * angle, 2 * shift, 2 * shift], device=device)
    pixel = torch.tensor([2 / width, 2 / height], device=device)
    grid = F.affine_grid(torch.eye(2, 3, device=device)[None], [1, 1, height, width], align_corners=False)
    return GridConstants(low, span, pixel, grid[..., 0:1], grid[..., 1:2])
