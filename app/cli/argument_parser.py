"""The CLI's argument parser: Lightning's, with one line instead of jsonargparse's usage or nested report for
whatever it refuses (app/cli/argument_errors.py), the class paths that have moved read as today's
(models/class_paths.py), and a config's own model family or datamodule parsed without the default class's
defaults."""

from __future__ import annotations

import re
from typing import Any, NoReturn

from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser

from app.cli.argument_errors import UNIMPORTABLE, one_line
from core.errors import UserError
from datamodules.images import ImageClassificationDataModule
from datamodules.language_modeling import LanguageModelingDataModule
from models.class_paths import class_path_of, with_current_class_paths
from models.registry import FAMILIES

# what the shipped configs name besides models/registry.py's families (a class of one's own that subclasses
# LightningDataModule works too)
DATAMODULES = (LanguageModelingDataModule, ImageClassificationDataModule)


class CohortArgumentParser(LightningArgumentParser):
    """Lightning's parser, with one line instead of jsonargparse's usage or nested report for whatever it refuses
    (app/cli/argument_errors.py), and a class_path that names no model family or datamodule named as such."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:  # a parser jsonargparse made for a class's arguments: it catches this itself
            super().error(message, ex)
        key = re.match(r'Parser key "(model|data)"', message)
        problem = re.search(r"class_path '([^']+)':\s*(.*?)\n\s*- Expected a <class 'NoneType'>", message, re.DOTALL)
        if key and ("not correspond to a subclass" in message or (problem and UNIMPORTABLE.search(problem[2]))):
            given = problem[1] if problem else message.rsplit("Given value:", 1)[-1].strip()
            kind, known = {"model": ("model family", [family.module_class for family in FAMILIES]),
                           "data": ("datamodule", DATAMODULES)}[key[1]]
            raise UserError(f"{key[1]}.class_path {given!r} is not a {kind} Cohort can import: use one of "
                            + ", ".join(class_path_of(cls) for cls in known))
        raise UserError(one_line(self, message, ex))

    def parse_string(self, content: str, *args: Any, **kwargs: Any) -> Namespace:
        """jsonargparse's, for every config file and config string: the class paths it names that have moved since
        it was written (models/class_paths.py) read as today's."""
        return super().parse_string(with_current_class_paths(content), *args, **kwargs)

    # "model", "data": where the config chose a class other than the default (GPT, LanguageModelingDataModule)
    replaced_defaults: frozenset[str] = frozenset()

    def get_defaults(self, skip_validation: bool = False, **kwargs: Any) -> Namespace:
        """jsonargparse's defaults, less the default class's arguments where the config replaces that class: else a
        class chosen instead would take the default class's values for the arguments of the same name (jsonargparse's
        issue #460: a datamodule's own global_batch_size=16 would be LanguageModelingDataModule's 32). The values a
        config gives are kept; the class chosen fills in its own defaults for the rest."""
        defaults = super().get_defaults(skip_validation, **kwargs)
        for key in self.replaced_defaults:
            defaults[key] = Namespace(class_path=defaults[key].class_path)
        return defaults


def replace_default_classes(parser: CohortArgumentParser, config: Namespace) -> bool:
    """Whether the config chose a model family or datamodule other than the parser's default; where it did, the
    parser parses it again without the default class's defaults (CohortArgumentParser.get_defaults)."""
    parser.replaced_defaults = frozenset(key for key in ("model", "data")
                                         if config[key].class_path != parser.get_default(key).class_path)
    return bool(parser.replaced_defaults)
