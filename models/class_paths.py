"""The class paths that moved, and where to: run configs (``model.class_path``, an FSDP policy's block classes) and
checkpoints (the family's class path, the hyperparameters' ``_class_path``) written before a move name a class by the
path it had then, and are read with today's path in its place. Where a config or checkpoint is read: the CLI's
parsing (app/cli/lightning_cli.py), the checkpoint check on resume (app/safety/checkpoint_reading.py), ``cohort
export`` and ``CohortModule.load_from_checkpoint``."""

from __future__ import annotations

import re

# old path -> today's; the families moved into folders of their own (models/<family>/) after main afed102
MOVED_CLASS_PATHS = {
    "models.language_model.GPTLanguageModel": "models.gpt.family.GPTLanguageModel",
    "models.llama_language_model.LlamaLanguageModel": "models.llama.family.LlamaLanguageModel",
    "models.masked_language_model.BertMaskedLanguageModel": "models.bert.family.BertMaskedLanguageModel",
    "models.image_classifier.ImageClassifier": "models.resnet.family.ImageClassifier",
    "models.gpt.Block": "models.gpt.network.Block",
    "models.llama.Block": "models.llama.network.Block",
    "models.bert.Block": "models.bert.network.Block",
}
# an old path as a whole name, not part of a longer one
MOVED = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, MOVED_CLASS_PATHS)) + r")(?![\w.])")


def class_path_of(cls: type) -> str:
    """The dotted path a config names a class by, e.g. models.gpt.family.GPTLanguageModel."""
    return f"{cls.__module__}.{cls.__qualname__}"


def current_class_path(class_path: str) -> str:
    """Today's path of a class that ``class_path`` names, which may be the path it had before it moved."""
    return MOVED_CLASS_PATHS.get(class_path, class_path)


def with_current_class_paths(text: str) -> str:
    """``text`` (a YAML config, a command-line argument) with every moved class path in it replaced by today's."""
    return MOVED.sub(lambda found: MOVED_CLASS_PATHS[found.group(1)], text)
