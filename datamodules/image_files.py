"""Labelled images in memory: scikit-learn's handwritten digits (the embedded default), or a folder of image files.

A folder is laid out one sub-folder per class, the layout of torchvision's ImageFolder and of most image sets:

    data_dir/<class name>/*.png|jpg|jpeg|bmp|gif|webp|tif|tiff    classes in sorted order; label i is the i-th
    data_dir/train/<class name>/..., data_dir/val/<class name>/...  when data_dir holds a train/ folder (val/ optional)

Without val/, validation takes a fixed stratified fraction of each class (``split_for_validation``), the same
samples at any world size and seed. Images are read with Pillow and kept as uint8 (N, C, H, W): a 32x32 RGB image
costs 3 KiB. All are converted to one mode: grayscale (1 channel) when every image is grayscale, else RGB (3), which
loses no colour. Images of different sizes need ``image_size``, a square side they are all resized to.

Every check that needs only file headers (the folder, the classes, each file readable, the sizes) runs in
``scan_image_folder``, before any training; decoding runs when the datamodule is set up.
"""

from __future__ import annotations

import gzip
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from core.errors import UserError
from core.seeding import derive_seed

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
GRAYSCALE_BANDS = ({"L"}, {"1"}, {"I"}, {"F"})  # Pillow's bands of grayscale modes, alpha set aside
DIGITS_FILE = "datasets/data/digits.csv.gz"  # inside the scikit-learn package: 1,797 rows of 64 pixels and a label
DIGITS_MAX_VALUE = 16  # the digits' pixels are ink counts from 0 to 16
VALIDATION_SPLIT_SEED = derive_seed("validation split")  # fixed, not the run's seed: every run validates alike


@dataclass(frozen=True)
class LabelledImages:
    pixels: torch.Tensor  # (N, C, H, W) uint8
    labels: torch.Tensor  # (N,) int64 class indices
    max_value: int  # the pixel value that means full intensity: 255, or 16 for the digits

    def subset(self, indices: torch.Tensor) -> LabelledImages:
        return LabelledImages(self.pixels[indices], self.labels[indices], self.max_value)


@dataclass(frozen=True)
class ImageFolder:
    """What ``scan_image_folder`` found: the files of each split, the classes and the common shape."""

    train_files: list[tuple[Path, int]]  # (file, label), sorted by class then name
    val_files: list[tuple[Path, int]] | None  # None: no val/ folder, split train_files
    class_names: list[str]
    channels: int  # 1 grayscale, 3 RGB
    image_size: tuple[int, int]  # (height, width) after resizing


def load_digits() -> LabelledImages:
    """scikit-learn's 1,797 handwritten digits, 8x8 grayscale, ten classes, read from the file its wheel ships
    (found without importing scikit-learn, which takes seconds)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the embedded digits come from scikit-learn, which is not installed: pip install -e "
                        "'.[images]', or set data.data_dir to a folder of images")
    path = Path(next(iter(spec.submodule_search_locations))) / DIGITS_FILE
    with gzip.open(path, "rt") as handle:
        table = np.loadtxt(handle, delimiter=",", dtype=np.uint8)  # (1797, 65): 64 pixels, then the label
    pixels = torch.from_numpy(table[:, :64].reshape(-1, 1, 8, 8).copy())
    return LabelledImages(pixels, torch.from_numpy(table[:, 64].astype(np.int64)), DIGITS_MAX_VALUE)


def split_for_validation(labels: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (train, val): round(val_fraction x count) samples of each class, drawn with a fixed seed, go to val.
    Stratified, so that a small set's validation holds every class in its proportion."""
    generator = torch.Generator().manual_seed(VALIDATION_SPLIT_SEED)
    train, val = [], []
    for label in labels.unique(sorted=True).tolist():
        members = (labels == label).nonzero().flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        num_val = round(val_fraction * len(members))
        val.append(members[:num_val])
        train.append(members[num_val:])
    return torch.cat(train).sort().values, torch.cat(val).sort().values


def image_files(folder: Path) -> list[Path]:
    return sorted(path for path in folder.iterdir()
                  if path.suffix.lower() in IMAGE_EXTENSIONS and path.is_file() and not path.name.startswith("."))


def class_folders(folder: Path) -> list[Path]:
    return sorted(path for path in folder.iterdir() if path.is_dir() and not path.name.startswith("."))


def scan_image_folder(data_dir: Path, image_size: int | None) -> ImageFolder:
    """The folder's classes and files, checked (see the module docstring); a UserError for the first problem."""
    if not data_dir.is_dir():
        what = "is a file, not a folder" if data_dir.exists() else "does not exist"
        raise UserError(f"data.data_dir {data_dir} {what}: point it at a folder with one sub-folder of images per "
                        "class, or leave it unset to train on the embedded digits")
    train_dir = data_dir / "train" if (data_dir / "train").is_dir() else data_dir
    classes = class_folders(train_dir)
    if not any(image_files(folder) for folder in classes):
        raise UserError(f"{train_dir} holds no images ({', '.join(IMAGE_EXTENSIONS)}) in class folders: lay it out "
                        f"as {train_dir}/<class name>/<image file>, one folder per class")
    if len(classes) < 2:
        raise UserError(f"{train_dir} has one class folder ({classes[0].name}): a classifier needs at least two")
    class_names = [folder.name for folder in classes]
    train_files = labelled_files(train_dir, class_names, train_dir)
    val_files = None
    if train_dir != data_dir and (data_dir / "val").is_dir():
        unknown = [folder.name for folder in class_folders(data_dir / "val") if folder.name not in class_names]
        if unknown:
            raise UserError(f"{data_dir / 'val'} has class folders that {train_dir} lacks ({', '.join(unknown)}): "
                            "give train/ and val/ the same classes")
        val_files = labelled_files(data_dir / "val", class_names, train_dir)
    channels, size = check_headers(train_files + (val_files or []), image_size)
    return ImageFolder(train_files, val_files, class_names, channels, size)


def labelled_files(split_dir: Path, class_names: list[str], train_dir: Path) -> list[tuple[Path, int]]:
    files = []
    for label, name in enumerate(class_names):
        folder = split_dir / name
        found = image_files(folder) if folder.is_dir() else []
        if not found and split_dir == train_dir:  # a val/ without some class is allowed: it is only validation
            raise UserError(f"class folder {folder} holds no images ({', '.join(IMAGE_EXTENSIONS)}): add some, or "
                            "remove the folder")
        files += [(path, label) for path in found]
    return files


def check_headers(files: list[tuple[Path, int]], image_size: int | None) -> tuple[int, tuple[int, int]]:
    """Opens each file's header (not its pixels): the channels all images will have, and their (height, width)."""
    first: tuple[Path, tuple[int, int]] | None = None
    channels = 1
    for path, _ in files:
        try:
            with Image.open(path) as image:
                size, bands = image.size, set(image.getbands()) - {"A"}
        except (OSError, UnidentifiedImageError, ValueError) as error:
            raise UserError(f"{path} cannot be read as an image ({error}): replace or remove it") from None
        if bands not in GRAYSCALE_BANDS:
            channels = 3
        if first is None:
            first = (path, size)
        elif image_size is None and size != first[1]:
            raise UserError(f"images of different sizes: {first[0]} is {first[1][0]}x{first[1][1]} and {path} is "
                            f"{size[0]}x{size[1]} (width x height): set data.image_size to resize them all to one "
                            "square size, e.g. data.image_size=32")
    assert first is not None
    width, height = first[1]
    return channels, (image_size, image_size) if image_size is not None else (height, width)


def read_images(files: list[tuple[Path, int]], channels: int, size: tuple[int, int]) -> LabelledImages:
    """Decodes the files into uint8 (N, channels, height, width), resized where ``size`` differs."""
    mode, (height, width) = ("L" if channels == 1 else "RGB"), size
    pixels = torch.empty(len(files), channels, height, width, dtype=torch.uint8)
    for index, (path, _) in enumerate(files):
        try:
            with Image.open(path) as image:
                image = image.convert(mode)
                if image.size != (width, height):
                    image = image.resize((width, height), Image.Resampling.BILINEAR)
                array = np.asarray(image, dtype=np.uint8).reshape(height, width, channels)
        except (OSError, UnidentifiedImageError, ValueError) as error:  # a header that reads, then broken pixels
            raise UserError(f"{path} cannot be read as an image ({error}): replace or remove it") from None
        pixels[index] = torch.from_numpy(array.copy()).permute(2, 0, 1)  # (H, W, C) -> (C, H, W)
    labels = torch.tensor([label for _, label in files], dtype=torch.long)
    return LabelledImages(pixels, labels, 255)
