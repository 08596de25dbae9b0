"""The ResNet family: the LightningModule that trains a ResNet image classifier (models/resnet/network.py):
cross-entropy, accuracy through torchmetrics, and the optimizer and schedule every family shares (models/module.py).

The images arrive augmented by the datamodule (datamodules/images.py), each micro-batch by a draw keyed by its step
and place in the global batch; the number of classes, the channels and the image size are the data's, linked in by
the CLI.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from jsonargparse import Namespace
from torchmetrics.classification import MulticlassAccuracy

from core.errors import UserError
from core.run_plan import RunPlan
from core.seeding import DEFAULT_SEED
from core.tokens import IGNORE_INDEX
from models.module import CohortModule
from models.optimizer import OptimizerSettings
from models.resnet.network import ResNet, resnet_config

# a short warmup and a high peak for a network with batch norms, decayed to 0
RESNET_OPTIMIZER = OptimizerSettings(learning_rate=1e-2, min_learning_rate_ratio=0.0, weight_decay=5e-4,
                                     betas=(0.9, 0.999), warmup_steps=10)


class ImageClassifier(CohortModule):
    label = "ResNet"
    def __init__(
        self,
        model_name: str = "resnet-small",
        num_classes: int | None = None,
        in_channels: int | None = None,
        image_shape: tuple[int, int] | None = None,
        optimizer: OptimizerSettings = RESNET_OPTIMIZER,
        seed: int = DEFAULT_SEED,
    ) -> None:
        """
        Args:
            model_name: a size from models.resnet.network.RESNET_CONFIGS ("resnet-tiny", "resnet-small", "resnet-18").
            num_classes: the data's classes; the CLI links it from the datamodule.
            in_channels: 1 for grayscale, 3 for colour; the CLI links it from the datamodule.
            image_shape: (height, width) of the images; the CLI links it from the datamodule.
            optimizer: AdamW and its schedule (models/optimizer.py); a field given keeps the others' defaults.
            seed: the initial weights follow from it; the CLI links it to seed_everything.
        """
        super().__init__(optimizer)
        self.save_hyperparameters()
        if num_classes is None or in_channels is None or image_shape is None:
            raise UserError("model.num_classes, model.in_channels and model.image_shape come from the image "
                            "datamodule: set data.class_path to datamodules.images.ImageClassificationDataModule")
        self.config = resnet_config(model_name, num_classes=num_classes, in_channels=in_channels)
        self.image_shape = tuple(image_shape)
        # over the classes (torchmetrics' macro average), of every rank's images
        self.val_accuracy = MulticlassAccuracy(num_classes, ignore_index=IGNORE_INDEX)

    # ----- the family's part of CohortModule -----
    def plain_network(self) -> ResNet:
        return ResNet(self.config)

    def example_batch(self, micro_batch_size: int, sequence_length: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.zeros(micro_batch_size, self.config.in_channels, *self.image_shape, device=device)
        return images, torch.zeros(micro_batch_size, dtype=torch.long, device=device)

    def batch_loss(self, network: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.batch_metrics(network, batch)[0]

    def batch_metrics(self, network: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor | MulticlassAccuracy]]:
        """The loss and the accuracy: in training the micro-batch's share of images classified right, in
        validation ``val_accuracy`` fed the batch (padding images, see EvenShardSampler, count for nothing)."""
        images, labels = batch
        logits = self.float_in_evaluation(network(images))
        loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)
        if self.training:
            return loss, {"accuracy": (logits.argmax(-1) == labels).float().mean()}
        self.val_accuracy.update(logits, labels)
        return loss, {"accuracy": self.val_accuracy}

    @classmethod
    def check_config(cls, model: Namespace, data: Namespace, plan: RunPlan) -> None:
        resnet_config(model.model_name)  # an unknown size, before anything starts

    def describe(self) -> str:
        c = self.config
        return (f"{self.label} '{self.hparams.model_name}', stages of widths {list(c.widths)} x blocks {list(c.blocks)}, "
                f"{c.in_channels} channel(s) of {self.image_shape[0]}x{self.image_shape[1]} in, {c.num_classes} "
                f"classes: {self.num_parameters():,} parameters")
