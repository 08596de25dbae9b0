"""Hugging Face folders, what every family's adapter (models/<family>/huggingface.py) shares: reading a local folder
(``config.json`` and ``model.safetensors``, or shards listed in ``model.safetensors.index.json``) as data (safetensors
holds tensors only; a pickled ``.bin`` is refused), checking it against a family's named size, and checking weights
before they are written as one.

A folder is checked before anything is built (``HuggingFaceAdapter.check_pretrained``): its ``config.json`` must
describe the family's named size exactly, and its tensors must be the network's parameters, by name and shape, with
none left over. The network is then built on the meta device as usual and each rank reads only the tensors of its
own parameters, keeping its own slice (models/parallel/parallelize.py ``load_weights``): no rank ever holds the whole
model, under FSDP2, tensor parallelism or a pipeline. A parameter that stacks what the folder stores as several tensors
(a mixture of experts' experts, one tensor per expert there) is read one of them at a time into its stacked tensor.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open

from core.errors import UserError

WEIGHTS_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
# tensors a Hugging Face file may hold that are not weights (rotary tables, GPT-2's causal masks, BERT's position
# ids) or not this model's (BERT's pooler and next-sentence head, from its pretraining)
NOT_WEIGHTS = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias", "embeddings.position_ids")
NOT_THIS_MODEL = ("bert.pooler.", "cls.seq_relationship.")
# config fields that say how the network trains, not what its weights compute: not compared with a folder's
NOT_COMPARED = ("dropout", "capacity_factor", "load_balance_coefficient")
# where a Cohort parameter is read from: the folder's tensor, or several tensors of one shape stacked on a new first
# dimension in the order given (a mixture of experts' experts), and what turns that into Cohort's layout
Source = tuple[str | tuple[str, ...], Callable[[torch.Tensor], torch.Tensor]]


class HuggingFaceFolder:
    """A local Hugging Face model folder, its tensors opened lazily: reading one tensor reads that tensor only. A
    file that is damaged (cut short, or not what its name says) is a UserError naming it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.where = where = f"model.init_from={path}"
        if not (self.path / "config.json").is_file():
            raise UserError(f"{where} is not a Hugging Face model folder (no config.json there): give the folder that "
                            "save_pretrained wrote")
        if (self.path / INDEX_FILE).is_file():
            weight_map = self.read_json(INDEX_FILE).get("weight_map")
            if not isinstance(weight_map, dict):
                raise UserError(f"{where}: {INDEX_FILE} has no weight_map (tensor name: shard file): copy the whole "
                                "folder again")
            self.files = {name: self.path / file for name, file in weight_map.items()}
        elif (self.path / WEIGHTS_FILE).is_file():
            with self.open(self.path / WEIGHTS_FILE) as weights:
                self.files = dict.fromkeys(weights.keys(), self.path / WEIGHTS_FILE)
        elif any(self.path.glob("*.bin")):
            raise UserError(f"{where} holds pickled .bin weights, which Cohort does not unpickle: convert them once "
                            "with transformers (from_pretrained, then save_pretrained(folder, "
                            "safe_serialization=True))")
        else:
            raise UserError(f"{where} has neither {WEIGHTS_FILE} nor {INDEX_FILE}: give the folder that "
                            "save_pretrained wrote")
        missing = sorted({str(file.name) for file in self.files.values() if not file.is_file()})
        if missing:
            raise UserError(f"{where}: {INDEX_FILE} names shards that are not there ({', '.join(missing)}): copy the "
                            "whole folder")
        self.config: dict[str, Any] = self.read_json("config.json")

    def read_json(self, name: str) -> dict[str, Any]:
        """A JSON object file of the folder; a UserError for one that is not (cut short, or another file)."""
        try:
            content = json.loads((self.path / name).read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise UserError(f"{self.where}: {name} is not valid JSON ({error}): copy it again from where the model "
                            "came from") from error
        if not isinstance(content, dict):
            raise UserError(f"{self.where}: {name} holds a {type(content).__name__}, not the JSON object "
                            "save_pretrained writes: copy it again from where the model came from")
        return content

    @contextmanager
    def open(self, file: Path) -> Iterator[Any]:
        """safetensors' reader of ``file``; a UserError where its header cannot be read (safetensors checks that
        the header's offsets cover the file exactly, so a file cut short is caught here, before any tensor)."""
        try:
            reader = safe_open(file, framework="pt")
        except SafetensorError as error:
            raise UserError(f"{self.where}: {file.name} is damaged or not a safetensors file ({error}): copy it "
                            "again (a download cut short leaves such a file)") from error
        with reader as weights:
            yield weights

    @cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, from the files' headers: each file opened once (a mixture of experts has tens of
        thousands of tensors), no tensor read."""
        shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(self.files.values())):
            with self.open(file) as weights:
                shapes |= {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
        return shapes

    def tensor(self, source: str | tuple[str, ...]) -> torch.Tensor:
        """The tensor named ``source``, or the tensors it names stacked on a new first dimension: read one at a time
        into the stacked tensor, so the folder's tensors are never all in memory beside it."""
        if isinstance(source, str):
            with self.open(self.files[source]) as weights:
                return weights.get_tensor(source)
        by_file: dict[Path, list[tuple[int, str]]] = {}  # each file opened once: its header is parsed on opening
        for index, name in enumerate(source):
            by_file.setdefault(self.files[name], []).append((index, name))
        stacked = torch.empty(0)
        for file, names in by_file.items():
            with self.open(file) as weights:
                for index, name in names:
                    tensor = weights.get_tensor(name)
                    if stacked.numel() == 0:
                        stacked = tensor.new_empty((len(source), *tensor.shape))
                    stacked[index] = tensor
        return stacked


def check_computable(folder: HuggingFaceFolder, model_type: str, family: str,
                     settings: dict[str, tuple[object, object]]) -> None:
    """A UserError unless ``config.json`` is of ``model_type`` and each setting (name: (found, what Cohort's
    ``family`` computes)) is what Cohort computes."""
    where = f"model.init_from={folder.path}"
    if folder.config.get("model_type") != model_type:
        raise UserError(f"{where} holds a {folder.config.get('model_type')!r} model, not a {family}: give a {family} "
                        "folder, or use the family its config.json names")
    differing = [f"{name}={found!r} (Cohort's {family}: {expected!r})" for name, (found, expected) in settings.items()
                 if found != expected]
    if differing:
        raise UserError(f"{where}: its config.json asks for what Cohort's {family} does not compute: "
                        f"{', '.join(differing)}")


def check_config_is(named: Any, imported: Any, model_name: str, folder: HuggingFaceFolder) -> None:
    """A UserError naming every field where the folder's model is not the named size."""
    differing = [f"{field.name} {getattr(imported, field.name)} (model '{model_name}': {getattr(named, field.name)})"
                 for field in fields(named) if field.name not in NOT_COMPARED
                 and getattr(imported, field.name) != getattr(named, field.name)]
    if differing:
        raise UserError(f"model.init_from={folder.path} is not a model '{model_name}': its config.json has "
                        f"{', '.join(differing)}; set model.model_name to the size it is")


@dataclass(frozen=True)
class HuggingFaceAdapter:
    """How a family's network and a Hugging Face folder of the same architecture translate, both ways: the same
    network, so the weights only change names and layout."""

    model_types: tuple[str, ...]  # config.json's model_type: ("gpt2",), ("llama",), ("bert",), ("mixtral", "qwen3_moe")
    network: Callable[[Any], nn.Module]  # the family's network class, built from its config
    # import: config.json -> the network's config (a UserError for what the network does not compute), and
    # Cohort parameter name -> the folder's tensor it is read from and what turns that into Cohort's layout
    config_from: Callable[[HuggingFaceFolder], Any]
    sources: Callable[[HuggingFaceFolder, Any], Callable[[str], Source]]
    # export: the family module -> config.json, and Cohort's weights (the network's state_dict) -> the folder's
    config_json: Callable[[Any], dict[str, Any]]
    weights: Callable[[dict[str, torch.Tensor], Any], dict[str, torch.Tensor]]

    def check_pretrained(self, folder: HuggingFaceFolder, config: Any, model_name: str) -> None:
        """A UserError unless the folder holds exactly the network of ``config`` (the named size): its config.json,
        then its tensors' names and shapes (read from the files' headers: no tensor is loaded)."""
        try:
            imported = self.config_from(folder)
        except (KeyError, TypeError, ValueError) as error:  # a setting missing, or null where a number belongs
            raise UserError(f"model.init_from={folder.path}: its config.json lacks, or has no number for, a setting "
                            f"the model is built from ({type(error).__name__}: {error}): copy it again from where the "
                            "model came from") from error
        check_config_is(config, imported, model_name, folder)
        with torch.device("meta"):
            network = self.network(config)
        source_of = self.sources(folder, config)
        expected = {name: tuple(param.shape) for name, param in network.named_parameters()}
        read = {name: source_of(name) for name in expected}
        used = {tensor for source, _ in read.values() for tensor in tensor_names(source)}
        missing = sorted(tensor for tensor in used if tensor not in folder.files)
        reshaped = []
        for name, (source, to_cohort) in read.items():
            for tensor in tensor_names(source):  # each of a stack checked as if all had its shape: the odd one named
                if tensor in folder.files:
                    stored = folder.shapes[tensor]
                    stack = stored if isinstance(source, str) else (len(source), *stored)
                    if tuple(to_cohort(torch.empty(stack, device="meta")).shape) != expected[name]:
                        reshaped.append(f"{tensor} {stored} (Cohort's {name}: {expected[name]})")
        unused = sorted(name for name in folder.files if name not in used and not name.endswith(NOT_WEIGHTS)
                        and not name.startswith(NOT_THIS_MODEL))
        problems = [f"{kind}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}" for kind, names in
                    (("missing", missing), ("other shapes", reshaped), ("not used", unused)) if names]
        if problems:
            raise UserError(f"model.init_from={folder.path} does not hold the weights its config.json describes "
                            f"({'; '.join(problems)}): give a folder that save_pretrained wrote")

    def weight_reader(self, folder: HuggingFaceFolder, config: Any) -> Callable[[str], torch.Tensor]:
        """Cohort parameter name -> its full tensor from the folder, in Cohort's layout."""
        source_of = self.sources(folder, config)

        def read(name: str) -> torch.Tensor:
            source, to_cohort = source_of(name)
            return to_cohort(folder.tensor(source))

        return read


def tensor_names(source: str | tuple[str, ...]) -> tuple[str, ...]:
    """The folder's tensors a Source reads."""
    return (source,) if isinstance(source, str) else source


def check_weights_fit(state_dict: dict[str, torch.Tensor], config: Any, network: type[nn.Module]) -> None:
    """A UserError unless ``state_dict`` holds exactly the weights of the Cohort ``network`` of ``config``, in their
    shapes."""
    with torch.device("meta"):  # shapes only: nothing is allocated
        expected = {name: tensor.shape for name, tensor in network(config).state_dict().items()}
    found = {name: tensor.shape for name, tensor in state_dict.items()}
    missing, unexpected = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    reshaped = [f"{name} {tuple(found[name])} (expected {tuple(shape)})" for name, shape in expected.items()
                if name in found and found[name] != shape]
    problems = [f"{kind} {names[:3]}" for kind, names in (("missing", missing), ("unexpected", unexpected),
                                                            ("other shapes:", reshaped)) if names]
    if problems:
        raise UserError(f"the weights are not those of a Cohort {network.__name__} of {config.n_layer} layers, width "
                        f"{config.n_embd}, vocabulary {config.vocab_size} ({'; '.join(problems)}): pass a checkpoint "
                        "cohort fit wrote")
