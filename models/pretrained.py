"""Pretrained weights from a local Hugging Face folder: ``config.json`` and ``model.safetensors`` (or shards listed
in ``model.safetensors.index.json``), read as data (safetensors holds tensors only; a pickled ``.bin`` is refused).

A folder is checked before anything is built (``check_folder``): its ``config.json`` must describe the family's
named size exactly, and its tensors must be the network's parameters, by name and shape, with none left over. The
network is then built on the meta device as usual and each rank reads only the tensors of its own parameters,
keeping its own slice (models/parallel/parallelize.py ``load_weights``): no rank ever holds the whole model, under FSDP2,
tensor parallelism or a pipeline.

    family   Hugging Face class      names
    Llama    LlamaForCausalLM        Cohort's = Hugging Face's without ``model.`` (models/llama.py)
    GPT      GPT2LMHeadModel         models/huggingface.py's table, Conv1D weights transposed, qkv head by head
    BERT     BertForMaskedLM         models/huggingface.py's BERT_NAMES; a pretraining checkpoint's pooler and
                                     next-sentence head, which Cohort's masked-LM BERT has not got, are left unread
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from core.errors import UserError
from models.bert import BERT, BertConfig
from models.gpt import GPT, GPTConfig
from models.huggingface import PROJECTIONS, bert_huggingface_name, llama_huggingface_name, qkv_by_head
from models.llama import Llama, LlamaConfig

WEIGHTS_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
# tensors a Hugging Face file may hold that are not weights (rotary tables, GPT-2's causal masks, BERT's position
# ids) or not this model's (BERT's pooler and next-sentence head, from its pretraining)
NOT_WEIGHTS = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias", "embeddings.position_ids")
NOT_THIS_MODEL = ("bert.pooler.", "cls.seq_relationship.")
# where a Cohort parameter is read from: the folder's tensor, and what turns it into Cohort's layout
Source = tuple[str, Callable[[torch.Tensor], torch.Tensor]]


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

    def shape(self, name: str) -> tuple[int, ...]:
        with self.open(self.files[name]) as weights:
            return tuple(weights.get_slice(name).get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        with self.open(self.files[name]) as weights:
            return weights.get_tensor(name)


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


def llama_config_from(folder: HuggingFaceFolder) -> LlamaConfig:
    """The LlamaConfig that ``config.json`` describes; a UserError for what models/llama.py does not compute."""
    config = folder.config
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}  # transformers 5 and 4
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    head_size = config["hidden_size"] // config["num_attention_heads"]
    check_computable(folder, "llama", "Llama", {
        "hidden_act": (config.get("hidden_act", "silu"), "silu"),
        "rope type": (rope_type, rope_type if rope_type in ("default", "llama3") else "default or llama3"),
        "attention_bias": (config.get("attention_bias", False), False),
        "mlp_bias": (config.get("mlp_bias", False), False),
        "head_dim": (config.get("head_dim") or head_size, head_size),
    })
    return LlamaConfig(n_layer=config["num_hidden_layers"], n_head=config["num_attention_heads"],
                       n_kv_head=config.get("num_key_value_heads") or config["num_attention_heads"],
                       n_embd=config["hidden_size"], intermediate_size=config["intermediate_size"],
                       block_size=config["max_position_embeddings"], vocab_size=config["vocab_size"],
                       rope_base=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
                       norm_eps=config.get("rms_norm_eps", 1e-6),
                       tie_word_embeddings=config.get("tie_word_embeddings", False),
                       rope_scaling=(float(rope["factor"]), float(rope["low_freq_factor"]),
                                     float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
                       if rope_type == "llama3" else None)


def gpt_config_from(folder: HuggingFaceFolder) -> GPTConfig:
    """The GPTConfig that a GPT-2 ``config.json`` describes; a UserError for what models/gpt.py does not compute."""
    config = folder.config
    computed = {"activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
                "tie_word_embeddings": True, "n_inner": 4 * config["n_embd"]}
    found = {**config, "n_inner": config.get("n_inner") or 4 * config["n_embd"]}  # None: 4 x n_embd
    check_computable(folder, "gpt2", "GPT", {name: (found.get(name, value), value) for name, value in computed.items()})
    return GPTConfig(n_layer=config["n_layer"], n_head=config["n_head"], n_embd=config["n_embd"],
                     block_size=config["n_positions"], vocab_size=config["vocab_size"])


def bert_config_from(folder: HuggingFaceFolder) -> BertConfig:
    """The BertConfig that a BERT ``config.json`` describes; a UserError for what models/bert.py does not compute."""
    config = folder.config
    check_computable(folder, "bert", "BERT", {
        "hidden_act": (config.get("hidden_act", "gelu"), "gelu"),
        "position_embedding_type": (config.get("position_embedding_type", "absolute"), "absolute"),
        "is_decoder": (config.get("is_decoder", False), False),
        "tie_word_embeddings": (config.get("tie_word_embeddings", True), True),
    })
    return BertConfig(n_layer=config["num_hidden_layers"], n_head=config["num_attention_heads"],
                      n_embd=config["hidden_size"], intermediate_size=config["intermediate_size"],
                      max_position_embeddings=config["max_position_embeddings"], vocab_size=config["vocab_size"],
                      type_vocab_size=config.get("type_vocab_size", 2),
                      layer_norm_eps=config.get("layer_norm_eps", 1e-12))


def check_config_is(named: Any, imported: Any, model_name: str, folder: HuggingFaceFolder) -> None:
    """A UserError naming every field where the folder's model is not the named size."""
    differing = [f"{field.name} {getattr(imported, field.name)} (model '{model_name}': {getattr(named, field.name)})"
                 for field in fields(named) if field.name != "dropout"
                 and getattr(imported, field.name) != getattr(named, field.name)]
    if differing:
        raise UserError(f"model.init_from={folder.path} is not a model '{model_name}': its config.json has "
                        f"{', '.join(differing)}; set model.model_name to the size it is")


def gpt2_source(name: str, config: GPTConfig, prefix: str) -> Source:
    """The GPT-2 tensor a Cohort GPT parameter is read from, and what turns it into Cohort's layout. ``prefix`` is
    "transformer." in GPT2LMHeadModel's files, "" in GPT2Model's (the original gpt2 release's)."""
    if name == "lm_head.weight":  # tied to wte: GPT-2 files leave it out
        return f"{prefix}wte.weight", lambda tensor: tensor
    if not name.startswith("blocks."):
        return f"{prefix}{name}", lambda tensor: tensor
    _, index, rest = name.split(".", 2)
    module, kind = rest.rsplit(".", 1)
    source = f"{prefix}h.{index}.{PROJECTIONS.get(module, module)}.{kind}"
    if module not in PROJECTIONS:
        return source, lambda tensor: tensor

    def to_cohort(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.t() if kind == "weight" else tensor  # Conv1D stores (in, out)
        return qkv_by_head(tensor, config.n_head) if module == "attn.qkv" else tensor

    return source, to_cohort


def bert_source(name: str, files: dict[str, Path]) -> Source:
    """The BertForMaskedLM tensor a Cohort BERT parameter is read from (models/huggingface.py's names), or a
    LayerNorm's gamma and beta where older files name its weight and bias so."""
    source = bert_huggingface_name(name)
    kind = name.rsplit(".", 1)[1]
    older = source.removesuffix(kind) + {"weight": "gamma", "bias": "beta"}[kind]
    if "LayerNorm" in source and source not in files and older in files:
        source = older
    return source, lambda tensor: tensor


def sources(folder: HuggingFaceFolder, config: LlamaConfig | GPTConfig | BertConfig) -> Callable[[str], Source]:
    """Cohort parameter name -> the folder's tensor it is read from, and what turns that into Cohort's layout."""
    if isinstance(config, BertConfig):
        return lambda name: bert_source(name, folder.files)
    if isinstance(config, LlamaConfig):
        return lambda name: (llama_huggingface_name(name, config), lambda tensor: tensor)
    prefix = "transformer." if "transformer.wte.weight" in folder.files else ""
    return lambda name: gpt2_source(name, config, prefix)


def check_pretrained(folder: HuggingFaceFolder, config: LlamaConfig | GPTConfig | BertConfig, model_name: str) -> None:
    """A UserError unless the folder holds exactly the network of ``config`` (the named size): its config.json,
    then its tensors' names and shapes (read from the files' headers: no tensor is loaded)."""
    if isinstance(config, BertConfig):
        config_from, network_class = bert_config_from, BERT
    elif isinstance(config, LlamaConfig):
        config_from, network_class = llama_config_from, Llama
    else:
        config_from, network_class = gpt_config_from, GPT
    try:
        imported = config_from(folder)
    except (KeyError, TypeError, ValueError) as error:  # a setting missing, or null where a number belongs
        raise UserError(f"model.init_from={folder.path}: its config.json lacks, or has no number for, a setting the "
                        f"model is built from ({type(error).__name__}: {error}): copy it again from where the model "
                        "came from") from error
    check_config_is(config, imported, model_name, folder)
    with torch.device("meta"):
        network = network_class(config)
    source_of = sources(folder, config)
    expected = {name: tuple(param.shape) for name, param in network.named_parameters()}
    read = {name: source_of(name) for name in expected}
    missing = sorted(source for source, _ in read.values() if source not in folder.files)
    reshaped = []
    for name, (source, to_cohort) in read.items():
        if source in folder.files:
            stored = folder.shape(source)
            if tuple(to_cohort(torch.empty(stored, device="meta")).shape) != expected[name]:
                reshaped.append(f"{source} {stored} (Cohort's {name}: {expected[name]})")
    used = {source for source, _ in read.values()}
    unused = sorted(name for name in folder.files if name not in used and not name.endswith(NOT_WEIGHTS)
                    and not name.startswith(NOT_THIS_MODEL))
    problems = [f"{kind}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}" for kind, names in
                (("missing", missing), ("other shapes", reshaped), ("not used", unused)) if names]
    if problems:
        raise UserError(f"model.init_from={folder.path} does not hold the weights its config.json describes "
                        f"({'; '.join(problems)}): give a folder that save_pretrained wrote")


def weight_reader(folder: HuggingFaceFolder,
                  config: LlamaConfig | GPTConfig | BertConfig) -> Callable[[str], torch.Tensor]:
    """Cohort parameter name -> its full tensor from the folder, in Cohort's layout."""
    source_of = sources(folder, config)

    def read(name: str) -> torch.Tensor:
        source, to_cohort = source_of(name)
        return to_cohort(folder.tensor(source))

    return read
