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
    by its crop. F.affine_grid's result, in elementwise ops on a pixel grid built once per size: affine_grid builds its
    own on every call, and a batch of 2x3 matrix products is slow on a CPU (together most of a digits micro-batch's
    augmentation)."""
    B, pad = len(draws), augmentation.crop_padding
    # a random crop (pad with zeros, cut a window of the old size) is a shift by whole pixels in [-pad, pad]
    crop_pixels = (draws[:, :2] * (2 * pad + 1)).floor() - pad  # (B, 2): x, y
    largest = torch.tensor([math.radians(augmentation.rotation_degrees), *[2 * augmentation.translate_fraction] * 2],
                           device=draws.device)  # a shift by a fraction t of the size is 2t in these coordinates
    angle_and_shift = torch.addcmul(-largest, draws[:, 2:5], 2 * largest)  # (B, 3): each uniform in [-largest, largest]
    pixel = torch.tensor([2 / width, 2 / height], device=draws.device)
    shift = torch.addcmul(angle_and_shift[:, 1:], crop_pixels, pixel).view(B, 1, 1, 2)
    cos, sin = angle_and_shift[:, 0].cos(), angle_and_shift[:, 0].sin()
    # a rotation of the pixel grid is scaled by the aspect ratio (which is 1 for square images)
    reads_per_x = torch.stack([cos, sin * (width / height)], dim=1).view(B, 1, 1, 2)
    reads_per_y = torch.stack([-sin * (height / width), cos], dim=1).view(B, 1, 1, 2)
    x, y = pixel_centres(height, width, draws.device)  # each (1, H, W, 1)
    return torch.addcmul(torch.addcmul(shift, x, reads_per_x), y, reads_per_y)


@functools.cache
def pixel_centres(height: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pixel's centre x and y in grid_sample's [-1, 1] coordinates (align_corners=False), each (1, H, W, 1)."""
    grid = F.affine_grid(torch.eye(2, 3, device=device)[None], [1, 1, height, width], align_corners=False)
    return grid[..., 0:1], grid[..., 1:2]
