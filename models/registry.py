"""The model families Cohort ships, one record each, which everything that lists or looks up a family reads: the
CLI's default family, its messages and ``--help`` (app/cli/lightning_cli.py), and ``cohort export``. A family is
one folder, models/<name>/ (its network, its LightningModule, its Hugging Face adapter), and one line in FAMILIES.
A family of one's own needs neither: ``model.class_path`` names any CohortModule subclass; it is only not listed."""

from __future__ import annotations

from dataclasses import dataclass

from models.bert.family import BertMaskedLanguageModel
from models.class_paths import class_path_of, current_class_path
from models.gpt.family import GPTLanguageModel
from models.interchange import HuggingFaceAdapter
from models.llama.family import LlamaLanguageModel
from models.module import CohortModule
from models.moe.family import MoELanguageModel
from models.resnet.family import ImageClassifier


@dataclass(frozen=True)
class Family:
    name: str  # short, and the name of its folder under models/
    module_class: type[CohortModule]  # its LightningModule, which model.class_path names
    description: str  # one line: what it trains

    @property
    def class_path(self) -> str:
        return class_path_of(self.module_class)

    @property
    def label(self) -> str:
        """What messages call it: "GPT", "BERT"."""
        return self.module_class.label

    @property
    def huggingface(self) -> HuggingFaceAdapter | None:
        """How it reads (model.init_from) and writes (cohort export) Hugging Face folders; None: it does not."""
        return self.module_class.huggingface

    @property
    def model_types(self) -> tuple[str, ...]:
        """The ``model_type``s of the Hugging Face folders it reads and writes (config.json's), if any."""
        return () if self.huggingface is None else self.huggingface.model_types


FAMILIES = (
    Family("gpt", GPTLanguageModel, "GPT-2's architecture, trained to predict the next token"),
    Family("llama", LlamaLanguageModel, "Llama's architecture, trained to predict the next token"),
    Family("moe", MoELanguageModel, "a mixture of experts (Mixtral's, Qwen3-MoE's architecture), next token"),
    Family("bert", BertMaskedLanguageModel, "BERT, pretrained as a masked language model"),
    Family("resnet", ImageClassifier, "a ResNet that classifies images"),
)
EXPORTED = tuple(family for family in FAMILIES if family.huggingface is not None)


def family_named(name: str) -> Family:
    return next(family for family in FAMILIES if family.name == name)


def family_of(class_path: str) -> Family | None:
    """The family whose LightningModule ``class_path`` names (today's path or one it had before it moved)."""
    return next((family for family in FAMILIES if family.class_path == current_class_path(class_path)), None)


# the one family there was before the others: what a config that names no family trains, and what a checkpoint
# that records no family (written before checkpoints did) holds
DEFAULT_FAMILY = family_named("gpt")


def labels(families: tuple[Family, ...], conjunction: str) -> str:
    """The families' labels as a sentence lists them: "GPT, Llama and BERT"."""
    names = [family.label for family in families]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {conjunction} {names[-1]}"


def families_help() -> str:
    """The families as ``--help`` lists them, in one paragraph (argparse rewraps a description's lines)."""
    return "Model families (model.class_path): " + "; ".join(
        f"{family.class_path} ({family.description})" for family in FAMILIES) + "."
