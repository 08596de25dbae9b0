"""Image classification: the digits and image folders, their errors, the augmentation keyed by each micro-batch's
step and place in the global batch, the ResNet."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from core.errors import UserError
from core.precision import PRECISIONS
from core.run_plan import RunPlan
from core.tokens import IGNORE_INDEX
from datamodules.augmentation import Augmentation, augment_images, draw_augmentations
from datamodules.image_files import load_digits, split_for_validation
from datamodules.images import AugmentedImages, ImageClassificationDataModule, SampleAt
from datamodules.samplers import GlobalBatchSampler
from datamodules.token_files import PADDING_INDEX
from models.resnet.network import ResNet, resnet_config

SEED = 7
ALL_ON = Augmentation(crop_padding=2, rotation_degrees=15.0, translate_fraction=0.1, horizontal_flip=True)


def data_parallel_plan(world_size: int, global_batch: int = 64, micro: int = 16, seed: int = SEED) -> RunPlan:
    return RunPlan(devices_per_node=world_size, num_nodes=1, data_parallel_size=world_size, tensor_parallel_size=1,
                   global_batch_size=global_batch, micro_batch_size=micro, sequence_length=1,
                   precision=PRECISIONS["32-true"],
                   seed=seed)


@pytest.fixture(scope="module")
def digits() -> ImageClassificationDataModule:
    datamodule = ImageClassificationDataModule(global_batch_size=64, micro_batch_size=16)
    datamodule.setup("fit")
    return datamodule


def step_batches(datamodule: ImageClassificationDataModule, plan: RunPlan, rank: int,
                 start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    datamodule.run_plan = plan
    return iter(datamodule.training_loader(rank, current_step=lambda: start_step))


def write_png(path: Path, size: tuple[int, int] = (6, 6), mode: str = "L", value: int = 128) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, value if mode == "L" else (value, 0, 255 - value)).save(path)


def augment(images: torch.Tensor, seed: int, augmentation: Augmentation) -> torch.Tensor:
    """A (B, C, H, W) batch augmented by the draws of a generator seeded with ``seed``."""
    return augment_images(images, draw_augmentations(torch.Generator().manual_seed(seed), len(images)), augmentation)


def augmented(dataset: AugmentedImages, micro_batch: list[SampleAt]) -> torch.Tensor:
    """The micro-batch's (B, C, H, W) images as the training loader hands them over."""
    return dataset.__getitems__(micro_batch)[0]


# the data


def test_digits_are_1797_grayscale_8x8_images_of_ten_classes() -> None:
    digits = load_digits()
    assert digits.pixels.shape == (1797, 1, 8, 8) and digits.pixels.dtype == torch.uint8
    assert digits.labels.unique().tolist() == list(range(10))
    assert int(digits.pixels.max()) == digits.max_value == 16
    datamodule = ImageClassificationDataModule()
    assert (datamodule.num_classes, datamodule.in_channels, datamodule.image_shape) == (10, 1, (8, 8))


def test_the_validation_split_is_fixed_and_stratified(digits: ImageClassificationDataModule) -> None:
    labels = load_digits().labels
    train, val = split_for_validation(labels, 0.2)
    again_train, again_val = split_for_validation(labels, 0.2)
    assert torch.equal(train, again_train) and torch.equal(val, again_val)
    assert sorted(train.tolist() + val.tolist()) == list(range(1797))
    for label in range(10):  # every class in its proportion
        assert (labels[val] == label).sum() == round(0.2 * (labels == label).sum().item())
    assert len(digits.train_set) == len(train) and torch.equal(digits.val_set.images.labels, labels[val])


def test_images_are_normalised_with_the_training_statistics(digits: ImageClassificationDataModule) -> None:
    train = torch.stack([digits.train_set[i][0] for i in range(len(digits.train_set))])
    assert train.mean().item() == pytest.approx(0.0, abs=1e-4) and train.std().item() == pytest.approx(1.0, abs=1e-3)
    image, label = digits.val_set[PADDING_INDEX]
    assert image.shape == (1, 8, 8) and label == IGNORE_INDEX


def test_a_folder_of_pngs_loads_with_its_classes(tmp_path: Path) -> None:
    for name, value in (("cat", 40), ("dog", 200)):
        for index in range(10):
            write_png(tmp_path / name / f"{index}.png", value=value)
    (tmp_path / "cat" / "notes.txt").write_text("not an image, skipped")
    datamodule = ImageClassificationDataModule(str(tmp_path), global_batch_size=4, micro_batch_size=2,
                                               val_fraction=0.2)
    assert datamodule.class_names == ["cat", "dog"] and datamodule.num_classes == 2
    assert (datamodule.in_channels, datamodule.image_shape) == (1, (6, 6))
    datamodule.setup("fit")
    assert len(datamodule.train_set) == 16 and datamodule.val_set.images.labels.tolist() == [0, 0, 1, 1]
    pixels = datamodule.train_set.images.pixels
    assert pixels.shape == (16, 1, 6, 6) and set(pixels.unique().tolist()) == {40, 200}


def test_train_and_val_folders_and_mixed_modes_resized(tmp_path: Path) -> None:
    """One RGB image among grayscale ones makes every image RGB; image_size resizes images of other sizes."""
    for split, count in (("train", 4), ("val", 1)):
        for name in ("a", "b"):
            for index in range(count):
                write_png(tmp_path / split / name / f"{index}.png", size=(5 + index, 7))
    write_png(tmp_path / "train" / "b" / "color.jpg", mode="RGB")
    datamodule = ImageClassificationDataModule(str(tmp_path), image_size=4, global_batch_size=2, micro_batch_size=1)
    assert (datamodule.in_channels, datamodule.image_shape, datamodule.class_names) == (3, (4, 4), ["a", "b"])
    datamodule.setup("fit")
    assert datamodule.train_set.images.pixels.shape == (9, 3, 4, 4)
    assert datamodule.val_set.images.labels.tolist() == [0, 1]  # from val/, not split off train/


def test_an_embedded_digits_run_without_scikit_learn_says_how_to_install_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"scikit-learn, which is not installed: pip install -e '\.\[images\]'"):
        load_digits()


def test_folder_errors_name_the_problem_before_training(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=f"data.data_dir {tmp_path / 'missing'} does not exist"):
        ImageClassificationDataModule(str(tmp_path / "missing"))
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="is a file, not a folder"):
        ImageClassificationDataModule(str(tmp_path / "file"))

    empty = tmp_path / "empty"
    (empty / "cat").mkdir(parents=True)
    with pytest.raises(UserError, match=f"{empty} holds no images"):
        ImageClassificationDataModule(str(empty))

    write_png(empty / "cat" / "1.png")
    with pytest.raises(UserError, match="one class folder \\(cat\\): a classifier needs at least two"):
        ImageClassificationDataModule(str(empty))

    (empty / "dog").mkdir()
    with pytest.raises(UserError, match=f"class folder {empty / 'dog'} holds no images"):
        ImageClassificationDataModule(str(empty))


def test_images_of_mixed_sizes_need_an_image_size(tmp_path: Path) -> None:
    write_png(tmp_path / "a" / "1.png", size=(8, 8))
    write_png(tmp_path / "b" / "2.png", size=(10, 12))
    with pytest.raises(UserError, match=(f"{tmp_path / 'a' / '1.png'} is 8x8 and {tmp_path / 'b' / '2.png'} is 10x12 "
                                         ".*set data.image_size")):
        ImageClassificationDataModule(str(tmp_path))
    assert ImageClassificationDataModule(str(tmp_path), image_size=8).image_shape == (8, 8)


def test_an_unreadable_image_is_named(tmp_path: Path) -> None:
    write_png(tmp_path / "a" / "1.png")
    write_png(tmp_path / "b" / "2.png")
    (tmp_path / "b" / "broken.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(UserError, match=f"{tmp_path / 'b' / 'broken.jpg'} cannot be read as an image"):
        ImageClassificationDataModule(str(tmp_path))


def test_an_image_cut_short_is_named_when_decoded(tmp_path: Path) -> None:
    """A file whose header reads but whose pixels are cut off passes the scan and fails in setup, before training."""
    write_png(tmp_path / "a" / "1.png", size=(64, 64))
    write_png(tmp_path / "b" / "2.png", size=(64, 64))
    Image.effect_noise((64, 64), 50).save(tmp_path / "b" / "3.png")
    whole = (tmp_path / "b" / "3.png").read_bytes()
    (tmp_path / "b" / "3.png").write_bytes(whole[: len(whole) // 2])
    datamodule = ImageClassificationDataModule(str(tmp_path), global_batch_size=1, micro_batch_size=1)
    with pytest.raises(UserError, match=f"{tmp_path / 'b' / '3.png'} cannot be read as an image"):
        datamodule.setup("fit")


def test_settings_that_cannot_work_are_refused() -> None:
    with pytest.raises(UserError, match="the embedded digits are 8x8"):
        ImageClassificationDataModule(image_size=16)
    with pytest.raises(UserError, match="data.val_fraction=1.5 must be between 0 and 1"):
        ImageClassificationDataModule(val_fraction=1.5)
    with pytest.raises(UserError, match="fewer than one global batch of 4096"):
        ImageClassificationDataModule(global_batch_size=4096).setup("fit")


# which samples each rank reads


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_training_sample_is_read_by_one_rank_per_pass(digits: ImageClassificationDataModule,
                                                            world_size: int) -> None:
    plan = data_parallel_plan(world_size)
    streams = []
    for rank in range(world_size):
        digits.run_plan = plan
        streams.append([at.index for at in digits.training_loader(rank).sampler])
    seen = [index for stream in streams for index in stream]
    steps_per_epoch = len(digits.train_set) // 64
    assert len(seen) == len(set(seen)) == steps_per_epoch * 64
    reference = list(GlobalBatchSampler(len(digits.train_set), data_parallel_plan(1), 0))
    assert set(seen) == set(reference)  # the same samples as one process reads


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_sample_carries_its_step_and_its_place_in_the_global_batch(digits: ImageClassificationDataModule,
                                                                         world_size: int) -> None:
    """Every place of every step is read once, by one rank, and holds the sample one process reads there."""
    def by_place(plan: RunPlan, rank: int) -> dict[tuple[int, int], int]:
        digits.run_plan = plan
        return {(at.step, at.place): at.index for at in digits.training_loader(rank, current_step=lambda: 3).sampler}

    one_process = by_place(data_parallel_plan(1), 0)
    steps_per_epoch = len(digits.train_set) // 64
    assert sorted(one_process) == [(step, place) for step in range(3, 3 + steps_per_epoch) for place in range(64)]
    ranks = [by_place(data_parallel_plan(world_size), rank) for rank in range(world_size)]
    assert sum(len(places) for places in ranks) == len(one_process)
    assert {key: index for places in ranks for key, index in places.items()} == one_process


def test_a_rank_reads_its_micro_batches_as_consecutive_places(digits: ImageClassificationDataModule) -> None:
    """Rank 1 of 2, micro batches of 16, 2 per step: places 16-31 of the step's 64, then 48-63, then the next step."""
    digits.run_plan = data_parallel_plan(2)
    located = list(digits.training_loader(1, current_step=lambda: 3).sampler)
    assert [(at.step, at.place) for at in located[:32]] == [(3, place) for place in [*range(16, 32), *range(48, 64)]]
    assert (located[32].step, located[32].place) == (4, 16)


def test_the_training_stream_follows_the_steps_a_parameter_server_assigns(
        digits: ImageClassificationDataModule) -> None:
    plan = data_parallel_plan(1)
    digits.run_plan = plan
    sampler = digits.training_loader(0).sampler
    sampler.assigned_steps = lambda: iter([5, 2])
    located = list(sampler)
    assert [at.step for at in located] == [5] * 64 + [2] * 64
    reference = GlobalBatchSampler(len(digits.train_set), plan, 0)
    reference.assigned_steps = lambda: iter([5, 2])
    assert [at.index for at in located] == list(reference)


def test_validation_reads_every_image_once_at_any_world_size(digits: ImageClassificationDataModule) -> None:
    for world_size in (1, 2, 3):
        digits.run_plan = data_parallel_plan(world_size, global_batch=16 * world_size)
        read = []
        for rank in range(world_size):
            digits.trainer = SimpleNamespace(global_rank=rank, limit_val_batches=1.0, limit_test_batches=1.0)
            read += [i for i in digits.val_dataloader().sampler if i != PADDING_INDEX]
        assert sorted(read) == list(range(len(digits.val_set)))


# the augmentation


@pytest.mark.parametrize("world_size", [2, 4])
def test_one_process_and_several_augment_the_same_global_batch_alike(digits: ImageClassificationDataModule,
                                                                     world_size: int) -> None:
    """A step's 64 samples in micro-batches of 16: 4 on one process, or spread over 2 or 4 ranks (2 or 1 each)."""
    def global_batch(ranks: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        plan = data_parallel_plan(ranks)
        in_place_order: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for rank in range(ranks):
            stream = step_batches(digits, plan, rank, start_step=step)
            for micro_batch in range(plan.accumulation):
                in_place_order[plan.micro_batch_group(rank, micro_batch)] = next(stream)
        micro_batches = [in_place_order[group] for group in sorted(in_place_order)]
        return torch.cat([images for images, _ in micro_batches]), torch.cat([labels for _, labels in micro_batches])

    for step in (0, 25):  # 25 is in the second data epoch (22 steps each)
        (one_images, one_labels), (images, labels) = global_batch(1, step), global_batch(world_size, step)
        assert torch.equal(one_labels, labels) and torch.equal(one_images, images)


def test_a_resumed_run_augments_its_step_as_the_first_run_did(digits: ImageClassificationDataModule) -> None:
    """Starting at step 5 (a resume) gives step 5's micro-batches exactly, with no RNG state saved."""
    plan = data_parallel_plan(2)  # 2 micro-batches per step on each rank
    first_run = step_batches(digits, plan, 1)
    for _ in range(5 * 2):
        next(first_run)
    resumed = step_batches(digits, plan, 1, start_step=5)
    for _ in range(2):
        (images, labels), (resumed_images, resumed_labels) = next(first_run), next(resumed)
        assert torch.equal(images, resumed_images) and torch.equal(labels, resumed_labels)


def test_loader_worker_processes_hand_over_the_same_micro_batches() -> None:
    plan = data_parallel_plan(1, micro=32)
    streams = []
    for num_workers in (0, 1):
        datamodule = ImageClassificationDataModule(global_batch_size=64, micro_batch_size=32, num_workers=num_workers)
        datamodule.setup("fit")
        streams.append(list(step_batches(datamodule, plan, 0, start_step=3))[:4])
    for (images, labels), (worker_images, worker_labels) in zip(*streams, strict=True):
        assert torch.equal(images, worker_images) and torch.equal(labels, worker_labels)


def test_another_step_epoch_place_or_seed_augments_the_same_sample_differently(
        digits: ImageClassificationDataModule) -> None:
    def sample_0_at(step: int, place: int, seed: int = SEED) -> torch.Tensor:
        return augmented(AugmentedImages(digits.train_set, ALL_ON, seed), [SampleAt(0, step, place)])

    reference = sample_0_at(step=0, place=0)
    assert torch.equal(reference, sample_0_at(0, 0))
    steps_per_epoch = len(digits.train_set) // 64
    for step, place, seed in ((1, 0, SEED), (steps_per_epoch, 0, SEED), (0, 1, SEED), (0, 0, SEED + 1)):
        assert not torch.equal(reference, sample_0_at(step, place, seed)), (step, place, seed)


def test_a_micro_batch_that_is_not_consecutive_places_of_one_step_is_refused(
        digits: ImageClassificationDataModule) -> None:
    dataset = AugmentedImages(digits.train_set, ALL_ON, SEED)
    with pytest.raises(ValueError, match=r"consecutive places .*got \(step, place\) \[\(0, 0\), \(0, 2\)\]"):
        dataset.__getitems__([SampleAt(1, 0, 0), SampleAt(2, 0, 2)])
    with pytest.raises(ValueError, match=r"\[\(0, 0\), \(1, 1\)\]"):
        dataset.__getitems__([SampleAt(1, 0, 0), SampleAt(2, 1, 1)])


def test_validation_is_not_augmented(digits: ImageClassificationDataModule) -> None:
    digits.run_plan = data_parallel_plan(1)
    digits.trainer = SimpleNamespace(global_rank=0, limit_val_batches=1.0, limit_test_batches=1.0)
    images, labels = next(iter(digits.val_dataloader()))  # validation images 0 to 15
    assert torch.equal(images, digits.val_set.normalise(digits.val_set.scaled(torch.arange(16))))
    assert torch.equal(labels, digits.val_set.images.labels[:16])


def test_turning_one_augmentation_on_leaves_the_others_draws_alone(digits: ImageClassificationDataModule) -> None:
    """With the flip on, each image is cropped as without it, and mirrored or not."""
    micro_batch = [SampleAt(index, 3, 16 + index) for index in range(16)]
    cropped = augmented(AugmentedImages(digits.train_set, Augmentation(crop_padding=2), SEED), micro_batch)
    flipped_too = augmented(AugmentedImages(digits.train_set, Augmentation(crop_padding=2, horizontal_flip=True),
                                            SEED), micro_batch)
    mirrored = [torch.equal(image.flip(-1), other) for image, other in zip(cropped, flipped_too, strict=True)]
    kept = [torch.equal(image, other) for image, other in zip(cropped, flipped_too, strict=True)]
    assert all(m or k for m, k in zip(mirrored, kept, strict=True)) and any(mirrored) and any(kept)


def test_a_batch_augments_each_image_as_it_would_alone() -> None:
    images = torch.rand(16, 3, 12, 10)
    draws = draw_augmentations(torch.Generator().manual_seed(0), len(images))
    together = augment_images(images, draws, ALL_ON)
    for i in range(len(images)):
        alone = augment_images(images[i : i + 1], draws[i : i + 1], ALL_ON)
        # pixels in [0, 1]; each output pixel is 4 weighted float32 pixels summed, rounded at most ~8 times by 2^-24
        torch.testing.assert_close(together[i : i + 1], alone, rtol=0, atol=1e-6)


def test_augmentation_keeps_shape_and_dtype_and_is_the_identity_when_off() -> None:
    images = torch.rand(8, 3, 12, 10)
    assert torch.equal(augment(images, SEED, Augmentation()), images)
    augmented_images = augment(images, SEED, ALL_ON)
    assert augmented_images.shape == images.shape and augmented_images.dtype == images.dtype
    assert not torch.equal(augmented_images, images)


def window(image: torch.Tensor, dy: int, dx: int) -> torch.Tensor:
    """(C, 8, 8) ``image`` moved so that pixel (i, j) is its (i + dy, j + dx), zeros outside (|dy|, |dx| <= 2)."""
    return F.pad(image, (2, 2, 2, 2))[:, 2 + dy : 10 + dy, 2 + dx : 10 + dx]


def equal_up_to_grid_rounding(augmented_image: torch.Tensor, expected: torch.Tensor) -> bool:
    """grid_sample moves by whole pixels only up to float32 rounding of its coordinates (~1e-6 of a pixel), which
    mixes in that much of a neighbour; neighbours differ by at most 1."""
    return torch.allclose(augmented_image, expected, rtol=0, atol=1e-5)


def test_the_random_crop_is_a_shift_by_at_most_the_padding_filled_with_zeros() -> None:
    image = torch.rand(1, 8, 8) + 0.1  # no zeros of its own
    shifts = set()
    for cropped in augment(image.expand(40, 1, 8, 8), SEED, Augmentation(crop_padding=2)):
        matches = [(dy, dx) for dy in range(-2, 3) for dx in range(-2, 3)
                   if equal_up_to_grid_rounding(cropped, window(image, dy, dx))]
        assert len(matches) == 1
        shifts.add(matches[0])
    assert len(shifts) > 15  # most of the 25 shifts occur


def test_flipping_mirrors_about_half_the_images_and_only_when_enabled() -> None:
    image = torch.rand(1, 6, 6)
    flipped = augment(image.expand(40, 1, 6, 6), SEED, Augmentation(horizontal_flip=True))
    mirrored = [torch.equal(one, image.flip(-1)) for one in flipped]
    assert 10 <= sum(mirrored) <= 30
    assert all(m or torch.equal(one, image) for m, one in zip(mirrored, flipped, strict=True))  # the rest as they were
    assert not ImageClassificationDataModule().augmentation.horizontal_flip  # off for digits: a mirrored 2 is no 2


def test_draws_at_the_ends_of_their_ranges_turn_a_quarter_and_shift_by_whole_pixels() -> None:
    image = torch.rand(1, 1, 8, 8) + 0.1  # no zeros of its own

    def moved(augmentation: Augmentation, crop_x: float = 0.5, crop_y: float = 0.5, angle: float = 0.5,
              shift_x: float = 0.5, shift_y: float = 0.5) -> torch.Tensor:
        return augment_images(image, torch.tensor([[crop_x, crop_y, angle, shift_x, shift_y, 1.0]]), augmentation)[0]

    quarter_turns = [torch.rot90(image[0], k, dims=(1, 2)) for k in (1, -1)]  # not a mirror image or a shear
    turned = moved(Augmentation(rotation_degrees=90.0), angle=1.0)
    assert any(equal_up_to_grid_rounding(turned, quarter_turn) for quarter_turn in quarter_turns)
    shifted = moved(Augmentation(translate_fraction=0.25), shift_x=1.0)  # 0.25 of 8 pixels
    assert equal_up_to_grid_rounding(shifted, window(image[0], 0, 2))
    shifted = moved(Augmentation(translate_fraction=0.25), shift_y=0.0)
    assert equal_up_to_grid_rounding(shifted, window(image[0], -2, 0))
    cropped = moved(Augmentation(crop_padding=2), crop_x=0.999, crop_y=0.0)
    assert equal_up_to_grid_rounding(cropped, window(image[0], -2, 2))


def test_rotation_and_translation_move_the_image_but_keep_it_on_the_grid() -> None:
    image = torch.zeros(1, 16, 16)
    image[:, 6:10, 6:10] = 1.0  # a square in the centre
    for augmentation in (Augmentation(rotation_degrees=30.0), Augmentation(translate_fraction=0.2)):
        for moved in augment(image.expand(4, 1, 16, 16), 3, augmentation):
            assert moved.shape == image.shape and not torch.allclose(moved, image)
            assert moved.sum().item() == pytest.approx(16.0, rel=0.1)  # the square stays inside, about its area


# the model


@pytest.mark.parametrize(("channels", "size", "stem_stride"), [(1, 8, 1), (3, 32, 1), (3, 64, 2), (1, 7, 1)])
def test_resnet_maps_images_to_class_logits(channels: int, size: int, stem_stride: int) -> None:
    model = ResNet(resnet_config("resnet-tiny", in_channels=channels, num_classes=5, stem_stride=stem_stride))
    assert model(torch.randn(3, channels, size, size)).shape == (3, 5)
    assert model.num_parameters() == sum(p.numel() for p in model.parameters()) > 0


def test_an_unknown_resnet_is_refused_with_the_names() -> None:
    with pytest.raises(UserError, match="unknown model.model_name 'resnet-huge': choose one of resnet-tiny, "):
        resnet_config("resnet-huge")


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
def test_resnet_small_learns_the_digits_in_150_steps() -> None:
    """Measured: 98 % validation accuracy in 1 to 2.5 s on one thread (chance is 10 %)."""
    digits = ImageClassificationDataModule(global_batch_size=64, micro_batch_size=64)
    digits.setup("fit")
    digits.run_plan = data_parallel_plan(1, global_batch=64, micro=64)
    torch.manual_seed(0)
    model = ResNet(resnet_config("resnet-small"))
    steps = 150
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.01, total_steps=steps)
    start, step = time.perf_counter(), 0
    while step < steps:  # 22 steps per pass over the 1,438 training digits
        for images, labels in digits.training_loader(0, current_step=lambda: step):
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            step += 1
            if step == steps:
                break
    model.eval()
    images = torch.stack([digits.val_set[i][0] for i in range(len(digits.val_set))])
    with torch.no_grad():
        accuracy = (model(images).argmax(dim=1) == digits.val_set.images.labels).float().mean().item()
    assert accuracy >= 0.9, f"{accuracy:.1%} after {steps} steps ({time.perf_counter() - start:.1f} s)"
