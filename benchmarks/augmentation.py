"""What the digits recipe's augmentation costs per image: each image alone, by the per-sample code of an earlier
commit (``augment_image``: one generator and one affine_grid/grid_sample per image, read with ``git show``), vs a
whole micro-batch at once (one generator, batched ops), and this commit's whole training data path (the DataLoader
that ``cohort fit`` reads: index, scale, augment, normalise, collate).

    python -m benchmarks.augmentation                       # the recipe's settings: micro batch 32, crop 1, 10 degrees
    python -m benchmarks.augmentation --micro-batch-size 64 --repeats 9 --per-sample-commit 06d0ea3

The variants are interleaved within each repeat, so that a shared machine's drift hits them alike; the medians over
the repeats are printed, in microseconds per image.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

from core.precision import PRECISIONS
from core.run_plan import RunPlan
from core.seeding import DEFAULT_SEED
from datamodules.augmentation import augment_images, augmentation_seed, draw_augmentations
from datamodules.images import ImageClassificationDataModule

REPO_ROOT = Path(__file__).resolve().parent.parent
PER_SAMPLE_COMMIT = "06d0ea3"  # the last commit whose datamodule augmented each image alone


def module_at(commit: str, path: str) -> types.ModuleType:
    """The module at ``path`` as it was at ``commit``, imported under a name of its own."""
    source = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=REPO_ROOT, capture_output=True, text=True,
                            check=True).stdout
    module = types.ModuleType(f"{Path(path).stem}_at_{commit}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{commit}:{path}", "exec"), module.__dict__)
    return module


def seconds_per_image(run: Callable[[], int]) -> float:
    start = time.perf_counter()
    images = run()
    return (time.perf_counter() - start) / images


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--per-sample-commit", default=PER_SAMPLE_COMMIT, help="whose augment_image to time")
    args = parser.parse_args()

    digits = ImageClassificationDataModule(global_batch_size=args.global_batch_size,
                                           micro_batch_size=args.micro_batch_size)  # the recipe's augmentation
    digits.setup("fit")
    digits.run_plan = RunPlan(devices_per_node=1, num_nodes=1, data_parallel_size=1, tensor_parallel_size=1,
                              global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
                              sequence_length=1, precision=PRECISIONS["32-true"], seed=DEFAULT_SEED, unit="images")
    assert digits.train_set is not None
    images = digits.train_set.scaled(torch.arange(len(digits.train_set)))  # (N, 1, 8, 8) in [0, 1]
    micro_batches = images[: len(images) // args.micro_batch_size * args.micro_batch_size].split(args.micro_batch_size)

    per_sample = module_at(args.per_sample_commit, "datamodules/augmentation.py")
    per_sample_augmentation = per_sample.Augmentation(**vars(digits.augmentation))

    def each_image_alone() -> int:
        for position, image in enumerate(images):
            seed = per_sample.augmentation_seed(DEFAULT_SEED, 0, 0, 0, position)
            per_sample.augment_image(image, torch.Generator().manual_seed(seed), per_sample_augmentation)
        return len(images)

    def micro_batch_at_once() -> int:
        for group, micro_batch in enumerate(micro_batches):
            generator = torch.Generator().manual_seed(augmentation_seed(DEFAULT_SEED, 0, group * args.micro_batch_size))
            augment_images(micro_batch, draw_augmentations(generator, len(micro_batch)), digits.augmentation)
        return sum(len(micro_batch) for micro_batch in micro_batches)

    def training_loader() -> int:
        return sum(len(labels) for _, labels in digits.training_loader(0))  # one data epoch

    variants = {f"each image alone ({args.per_sample_commit})": each_image_alone,
                "micro-batch at once": micro_batch_at_once, "training loader, whole path": training_loader}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, run in variants.items():
            times[name].append(seconds_per_image(run))
    print(f"{len(images)} digits, micro batch {args.micro_batch_size}, {digits.augmentation}, "
          f"{torch.get_num_threads()} torch threads, {args.repeats} repeats")
    for name, seconds in times.items():
        print(f"  {name:<30} {statistics.median(seconds) * 1e6:7.1f} us/image  "
              f"(min {min(seconds) * 1e6:.1f}, max {max(seconds) * 1e6:.1f})")


if __name__ == "__main__":
    main()
