"""The image-classification DataModule: labelled images in, (images, labels) micro-batches out, each training
micro-batch augmented at once by a draw keyed by its step and its place in the step's global batch.

With no ``data_dir`` it trains on scikit-learn's handwritten digits (8x8 grayscale, ten classes; see
datamodules/image_files.py for the folder layout otherwise). The samples of each step are the run plan's global
batch, as for language modeling (datamodules/samplers.py). The training sampler hands the dataset each sample's
index with its step and its place in the step's global batch (a ``SampleAt``), and the DataLoader hands the dataset
a whole micro-batch of them (``__getitems__``), so that the dataset, in the loader's worker processes if there are
any, augments the micro-batch in batched ops with the generator its step and first place seed
(datamodules/augmentation.py): nothing else needs to know the step. Validation images are not augmented.

Images are scaled to [0, 1], augmented, then normalised per channel with the training split's mean and std.
Padding samples (see EvenShardSampler) are zero images labelled IGNORE_INDEX, which the loss and accuracy skip.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils.data import Dataset

from core.errors import UserError, check_ranges
from core.run_plan import RunPlan
from core.tokens import IGNORE_INDEX
from datamodules.augmentation import Augmentation, augment_images, augmentation_seed, draw_augmentations
from datamodules.base import ShardedDataModule
from datamodules.image_files import (
    ImageFolder, LabelledImages, load_digits, read_images, scan_image_folder, split_for_validation,
)
from datamodules.samplers import GlobalBatchSampler
from datamodules.token_files import PADDING_INDEX

DIGITS_CLASSES = [str(digit) for digit in range(10)]


class SampleAt(NamedTuple):
    """A training sample and where it is used: optimizer step, and place in that step's global batch."""

    index: int
    step: int
    place: int


class LocatedSampler(GlobalBatchSampler):
    """GlobalBatchSampler's indices, each with its step and place in the step's global batch (a ``SampleAt``)."""

    def items(self, step: int, places: list[int], indices: list[int]) -> list[SampleAt]:
        return [SampleAt(index, step, place) for index, place in zip(indices, places, strict=True)]


class NormalisedImages(Dataset):
    """Sample i is (image normalised per channel, label); PADDING_INDEX is a zero image labelled IGNORE_INDEX."""

    def __init__(self, images: LabelledImages, mean: torch.Tensor, std: torch.Tensor) -> None:
        self.images = images
        self.mean = mean.view(-1, 1, 1)  # (C, 1, 1)
        self.std = std.view(-1, 1, 1)

    def __len__(self) -> int:
        return len(self.images.labels)

    def scaled(self, index: int | torch.Tensor) -> torch.Tensor:
        """Image ``index`` as (C, H, W) floats in [0, 1]; a tensor of B indices gives (B, C, H, W)."""
        return self.images.pixels[index].float() / self.images.max_value

    def normalise(self, image: torch.Tensor) -> torch.Tensor:
        return (image - self.mean) / self.std

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if index == PADDING_INDEX:
            return torch.zeros(self.images.pixels.shape[1:]), IGNORE_INDEX
        return self.normalise(self.scaled(index)), int(self.images.labels[index])


class AugmentedImages(Dataset):
    """The training images, read a micro-batch of ``SampleAt`` at a time and augmented by its step and places."""

    def __init__(self, images: NormalisedImages, augmentation: Augmentation, seed: int) -> None:
        self.images = images
        self.augmentation = augmentation
        self.seed = seed
        self.generator = torch.Generator()  # seeded afresh for each micro-batch: its state carries nothing over

    def __len__(self) -> int:
        return len(self.images)

    def __getitems__(self, micro_batch: list[SampleAt]) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's (B, C, H, W) normalised images and (B,) labels: the DataLoader's whole batch
        (``already_collated``)."""
        first = micro_batch[0]
        places = [at.place for at in micro_batch]
        if places != list(range(first.place, first.place + len(places))) or micro_batch[-1].step != first.step:
            raise ValueError("a micro-batch must be consecutive places of one step's global batch, as LocatedSampler "
                             f"hands them out in micro_batch_size groups; got (step, place) "
                             f"{[(at.step, at.place) for at in micro_batch]}")
        indices = torch.tensor([at.index for at in micro_batch])  # once: torch converts a list on every indexing
        self.generator.manual_seed(augmentation_seed(self.seed, first.step, first.place))
        images = augment_images(self.images.scaled(indices), draw_augmentations(self.generator, len(indices)),
                                self.augmentation)
        return self.images.normalise(images), self.images.images.labels[indices]


def already_collated(micro_batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The training loader's collate: AugmentedImages hands over whole micro-batches."""
    return micro_batch


class ImageClassificationDataModule(ShardedDataModule):
    unit = "images"  # what the progress line and the monitor count per second
    training_collate = staticmethod(already_collated)
    def __init__(
        self,
        data_dir: str | None = None,
        image_size: int | None = None,
        global_batch_size: int = 64,
        micro_batch_size: int = 32,
        val_fraction: float = 0.2,
        val_samples: int | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        crop_padding: int = 1,
        rotation_degrees: float = 10.0,
        translate_fraction: float = 0.0,
        horizontal_flip: bool = False,
    ) -> None:
        """
        Args:
            data_dir: a folder of images, one sub-folder per class (or train/ and val/ folders of those); None trains
                on the embedded digits (needs scikit-learn: pip install -e '.[images]').
            image_size: resize every image to this square side; needed when a folder's images differ in size.
                None keeps them as they are (the digits are 8x8).
            global_batch_size: samples per optimizer step, over all ranks and accumulation steps.
            micro_batch_size: samples per forward/backward on one device.
            val_fraction: the share of each class held out for validation when there is no val/ folder; a fixed
                draw, the same at any world size and seed.
            val_samples: validate on N samples spread evenly over the validation set and shared out over the
                data-parallel ranks: the same samples at any world size; None for all.
            num_workers: DataLoader worker processes per rank (they augment too).
            pin_memory: page-locked host batches for faster copies to GPUs.
            crop_padding: random crop: pad each side with this many zero pixels, cut back to the image size.
            rotation_degrees: rotate by a random angle in [-rotation_degrees, rotation_degrees].
            translate_fraction: shift each axis by a random fraction of the image size in [-t, t].
            horizontal_flip: mirror half of the images left-right; leave off for digits and text.
        """
        super().__init__()
        self.save_hyperparameters()
        check_ranges("data", {
            "image_size": (image_size is None or image_size >= 1, "a positive integer, or null to keep the sizes"),
            "val_fraction": (0.0 < val_fraction < 1.0, "between 0 and 1"),
            "val_samples": (val_samples is None or val_samples >= 1, "a positive integer, or null for all"),
            "num_workers": (num_workers >= 0, ">= 0 (0 loads batches in the training process)"),
            "crop_padding": (crop_padding >= 0, ">= 0 (0 turns the random crop off)"),
            "rotation_degrees": (0.0 <= rotation_degrees <= 180.0, "between 0 and 180 (0 turns rotation off)"),
            "translate_fraction": (0.0 <= translate_fraction < 1.0, "between 0 and 1 (0 turns shifting off)"),
        }, locals())
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.folder: ImageFolder | None = None
        if self.data_dir is None:
            if image_size is not None:
                raise UserError(f"data.image_size={image_size}: the embedded digits are 8x8 and are not resized; leave "
                                "data.image_size unset, or set data.data_dir to a folder of images")
            self.class_names, self.in_channels, self.image_shape = DIGITS_CLASSES, 1, (8, 8)
        else:  # check user data now, before any work starts
            self.folder = scan_image_folder(self.data_dir, image_size)
            self.class_names, self.in_channels = self.folder.class_names, self.folder.channels
            self.image_shape = self.folder.image_size  # (height, width), linked into the model
        self.num_classes = len(self.class_names)  # linked into the model with in_channels
        self.augmentation = Augmentation(crop_padding, rotation_degrees, translate_fraction, horizontal_flip)
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.val_fraction = val_fraction
        self.val_samples = val_samples
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.run_plan: RunPlan | None = None
        self.train_set: NormalisedImages | None = None
        self.val_set: NormalisedImages | None = None

    def setup(self, stage: str) -> None:
        if stage in ("fit", "validate", "test") and self.val_set is None:
            train, val = self.load()
            pixels = train.pixels.float() / train.max_value  # (N, C, H, W)
            mean, std = pixels.mean(dim=(0, 2, 3)), pixels.std(dim=(0, 2, 3)).clamp_min(1e-6)
            self.train_set, self.val_set = NormalisedImages(train, mean, std), NormalisedImages(val, mean, std)
            if len(self.train_set) < self.global_batch_size:
                raise UserError(f"the training split holds {len(self.train_set)} images, fewer than one global batch "
                                f"of {self.global_batch_size}: use more images or a smaller data.global_batch_size")

    def load(self) -> tuple[LabelledImages, LabelledImages]:
        """The training and validation images: the folder's val/, or a fixed stratified share of the training set."""
        if self.folder is None:
            images = load_digits()
        else:
            images = read_images(self.folder.train_files, self.folder.channels, self.folder.image_size)
            if self.folder.val_files is not None:
                return images, read_images(self.folder.val_files, self.folder.channels, self.folder.image_size)
        train, val = split_for_validation(images.labels, self.val_fraction)
        if len(val) == 0:
            raise UserError(f"data.val_fraction={self.val_fraction} of {len(images.labels)} images leaves none for "
                            "validation: raise it, or add a val/ folder")
        return images.subset(train), images.subset(val)

    def training_stream(self, plan: RunPlan, data_parallel_rank: int,
                        current_step: Callable[[], int]) -> tuple[AugmentedImages, LocatedSampler]:
        assert self.train_set is not None
        dataset = AugmentedImages(self.train_set, self.augmentation, plan.seed)
        return dataset, LocatedSampler(len(self.train_set), plan, data_parallel_rank, current_step)
