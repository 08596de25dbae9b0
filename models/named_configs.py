"""A network's named sizes ("debug", "gpt2", "resnet-18") looked up with some fields changed: the one lookup every
family's network (models/<family>/network.py) makes from its table of named configs."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, TypeVar

from core.errors import UserError

Config = TypeVar("Config")  # a family's frozen config dataclass: GPTConfig, LlamaConfig, ...


def named_config(configs: dict[str, Config], name: str, overrides: dict[str, Any]) -> Config:
    """The config named ``name`` with the fields in ``overrides`` replaced (fields set to None are left as they
    are); an unknown name is refused, naming the known ones."""
    if name not in configs:
        raise UserError(f"unknown model.model_name '{name}': choose one of {', '.join(configs)}")
    return replace(configs[name], **{key: value for key, value in overrides.items() if value is not None})
