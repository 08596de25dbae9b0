"""Random image augmentation in plain torch ops, whose randomness is a pure function of where a sample is used.

The augmentation of the sample at ``position`` of micro-batch ``micro_batch_index`` of optimizer step ``step`` on
data-parallel rank ``r`` is drawn from its own generator, seeded with

    derive_seed(seed, "augment", r, step, micro_batch_index, position)

and from nothing else: no global RNG, no state carried from one sample to the next. So two data-parallel ranks
augment differently (they also read different samples), ranks of one tensor-parallel group alike, a run resumed at
step s augments step s exactly as the first run did without saving any RNG state, and one seed reproduces a whole
run. The step is the optimizer step counted from the start of training, so it names the data epoch too
(epoch = step // steps per epoch): a sample seen again in a later epoch is augmented afresh.

Images are (C, H, W) floats in [0, 1], augmented before they are normalised, so that the zeros shifted or rotated in
from outside are black, the background of the digits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core.seeding import derive_seed


@dataclass(frozen=True)
class Augmentation:
    crop_padding: int = 0  # random crop: pad with this many zero pixels on each side, cut a window of the old size
    rotation_degrees: float = 0.0  # rotate by an angle drawn uniformly from [-rotation_degrees, rotation_degrees]
    translate_fraction: float = 0.0  # shift each axis by a uniform fraction of the size in [-t, t]
    horizontal_flip: bool = False  # mirror left-right with probability 1/2; off for digits, a mirrored 2 is no 2

    @property
    def enabled(self) -> bool:
        return bool(self.crop_padding or self.rotation_degrees or self.translate_fraction or self.horizontal_flip)


def augmentation_seed(seed: int, data_parallel_rank: int, step: int, micro_batch_index: int, position: int) -> int:
    """The seed of one sample's augmentation: its coordinates in the run, nothing else."""
    return derive_seed(seed, "augment", data_parallel_rank, step, micro_batch_index, position)


def augment_image(image: torch.Tensor, generator: torch.Generator, augmentation: Augmentation) -> torch.Tensor:
    """One (C, H, W) image, randomly cropped, rotated, shifted and flipped as ``augmentation`` says."""
    if not augmentation.enabled:
        return image
    # every draw is made whether or not its augmentation is on, in a fixed order, so that turning one on or off
    # leaves the others' draws as they were
    crop_top, crop_left, angle, shift_x, shift_y, flip = torch.rand(6, generator=generator).tolist()
    C, H, W = image.shape
    pad = augmentation.crop_padding
    if pad > 0:
        top, left = int(crop_top * (2 * pad + 1)), int(crop_left * (2 * pad + 1))  # each in [0, 2 * pad]
        image = F.pad(image, (pad, pad, pad, pad))[:, top : top + H, left : left + W]
    if augmentation.rotation_degrees or augmentation.translate_fraction:
        radians = math.radians((2 * angle - 1) * augmentation.rotation_degrees)
        cos, sin = math.cos(radians), math.sin(radians)
        # affine_grid works in coordinates that span [-1, 1] on each axis, so a size fraction t is a shift of 2t, and
        # a rotation of the pixel grid is scaled by the aspect ratio (which is 1 for square images)
        shift = 2 * augmentation.translate_fraction
        tx, ty = (2 * shift_x - 1) * shift, (2 * shift_y - 1) * shift
        theta = torch.tensor([[cos, -sin * H / W, tx], [sin * W / H, cos, ty]], dtype=image.dtype, device=image.device)
        grid = F.affine_grid(theta[None], [1, C, H, W], align_corners=False)  # (1, H, W, 2): where each pixel reads
        image = F.grid_sample(image[None], grid, mode="bilinear", padding_mode="zeros", align_corners=False)[0]
    if augmentation.horizontal_flip and flip < 0.5:
        image = image.flip(-1)
    return image

