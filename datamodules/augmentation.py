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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core.seeding import derive_seed

DRAWS_PER_IMAGE = 6  # uniforms in [0, 1): crop top, crop left, angle, shift x, shift y, flip


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
    ``augmentation`` says."""
    if not augmentation.enabled:
        return images
    B, C, H, W = images.shape
    crop_top, crop_left, angle, shift_x, shift_y, flip = draws.to(images.device).unbind(1)  # each (B,)
    pad = augmentation.crop_padding
    if pad > 0:
        windows = F.pad(images, (pad, pad, pad, pad)).unfold(2, H, 1).unfold(3, W, 1)  # (B, C, 2p+1, 2p+1, H, W)
        top, left = (crop_top * (2 * pad + 1)).long(), (crop_left * (2 * pad + 1)).long()  # each in [0, 2 * pad]
        images = windows[torch.arange(B, device=images.device), :, top, left]  # (B, C, H, W)
    if augmentation.rotation_degrees or augmentation.translate_fraction:
        radians = torch.deg2rad((2 * angle - 1) * augmentation.rotation_degrees)
        cos, sin = radians.cos(), radians.sin()
        # affine_grid works in coordinates that span [-1, 1] on each axis, so a size fraction t is a shift of 2t, and
        # a rotation of the pixel grid is scaled by the aspect ratio (which is 1 for square images)
        shift = 2 * augmentation.translate_fraction
        tx, ty = (2 * shift_x - 1) * shift, (2 * shift_y - 1) * shift
        theta = torch.stack([torch.stack([cos, -sin * H / W, tx], dim=1),
                             torch.stack([sin * W / H, cos, ty], dim=1)], dim=1).to(images.dtype)  # (B, 2, 3)
        grid = F.affine_grid(theta, [B, C, H, W], align_corners=False)  # (B, H, W, 2): where each pixel reads
        images = F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    if augmentation.horizontal_flip:
        images = torch.where((flip < 0.5).view(B, 1, 1, 1), images.flip(-1), images)
    return images
