"""Cohort's BERT (models/bert/network.py) as Hugging Face's BertForMaskedLM, both ways: module by module as
BERT_NAMES lists; the decoder's bias is stored as ``cls.predictions.bias`` and its weight, tied to the token embedding,
not at all. A pretraining checkpoint's pooler and next-sentence head, which Cohort's masked-LM BERT has not got, are
left unread.

Pure tensor code; writing the files and reading the checkpoint are app/tools/export.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from core.tokens import SpecialTokens
from models.bert.network import BERT, BertConfig
from models.interchange import HuggingFaceAdapter, HuggingFaceFolder, Source, check_computable, check_weights_fit

MODEL_TYPE = "bert"
# Cohort BERT module -> BertForMaskedLM module; {i} is a block's index
BERT_NAMES = {
    "token_embedding": "bert.embeddings.word_embeddings", "position_embedding": "bert.embeddings.position_embeddings",
    "token_type_embedding": "bert.embeddings.token_type_embeddings", "ln_embedding": "bert.embeddings.LayerNorm",
    "blocks.{i}.attn.query": "bert.encoder.layer.{i}.attention.self.query",
    "blocks.{i}.attn.key": "bert.encoder.layer.{i}.attention.self.key",
    "blocks.{i}.attn.value": "bert.encoder.layer.{i}.attention.self.value",
    "blocks.{i}.attn.proj": "bert.encoder.layer.{i}.attention.output.dense",
    "blocks.{i}.ln_1": "bert.encoder.layer.{i}.attention.output.LayerNorm",
    "blocks.{i}.mlp.fc": "bert.encoder.layer.{i}.intermediate.dense",
    "blocks.{i}.mlp.proj": "bert.encoder.layer.{i}.output.dense",
    "blocks.{i}.ln_2": "bert.encoder.layer.{i}.output.LayerNorm",
    "head.dense": "cls.predictions.transform.dense", "head.ln": "cls.predictions.transform.LayerNorm",
    "head.decoder": "cls.predictions.decoder",
}
TIED_BERT_DECODER = "head.decoder.weight"  # the token embedding's weight, by a second name


def bert_huggingface_name(name: str) -> str:
    """The BertForMaskedLM tensor that holds Cohort BERT parameter ``name``."""
    if name == "head.decoder.bias":
        return "cls.predictions.bias"
    module, kind = name.rsplit(".", 1)
    index = module.split(".")[1] if module.startswith("blocks.") else ""
    return f"{BERT_NAMES[module.replace(f'blocks.{index}.', 'blocks.{i}.', 1)].format(i=index)}.{kind}"


def huggingface_bert_config(config: BertConfig, special_tokens: SpecialTokens) -> dict[str, Any]:
    """The ``config.json`` with which ``BertForMaskedLM`` computes what Cohort's BERT of ``config`` computes."""
    return {
        "model_type": MODEL_TYPE,
        "architectures": ["BertForMaskedLM"],
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "hidden_size": config.n_embd,
        "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "type_vocab_size": config.type_vocab_size,
        "hidden_act": "gelu",  # the exact (erf) GELU, as models/bert/network.py's
        "layer_norm_eps": config.layer_norm_eps,
        "hidden_dropout_prob": config.dropout,
        "attention_probs_dropout_prob": config.dropout,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": True,
        "pad_token_id": special_tokens.pad,  # the run's [PAD], whose embedding BertEmbeddings keeps out of training
    }


def huggingface_bert_state_dict(state_dict: dict[str, torch.Tensor], config: BertConfig) -> dict[str, torch.Tensor]:
    """Cohort BERT weights (``BERT.state_dict()`` names) as BertForMaskedLM's, each contiguous; the decoder's tied
    weight left out, as ``save_pretrained`` leaves it out. A UserError if they are not a BERT of ``config``."""
    check_weights_fit(state_dict, config, BERT)
    return {bert_huggingface_name(name): tensor.detach().contiguous() for name, tensor in state_dict.items()
            if name != TIED_BERT_DECODER}


def bert_config_from(folder: HuggingFaceFolder) -> BertConfig:
    """The BertConfig that a BERT ``config.json`` describes; a UserError for what models/bert/network.py does not
    compute."""
    config = folder.config
    check_computable(folder, MODEL_TYPE, "BERT", {
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


def bert_source(name: str, files: dict[str, Path]) -> Source:
    """The BertForMaskedLM tensor a Cohort BERT parameter is read from (BERT_NAMES), or a
    LayerNorm's gamma and beta where older files name its weight and bias so."""
    source = bert_huggingface_name(name)
    kind = name.rsplit(".", 1)[1]
    older = source.removesuffix(kind) + {"weight": "gamma", "bias": "beta"}[kind]
    if "LayerNorm" in source and source not in files and older in files:
        source = older
    return source, lambda tensor: tensor


def bert_sources(folder: HuggingFaceFolder, config: BertConfig) -> Callable[[str], Source]:
    """Cohort BERT parameter name -> the folder's tensor it is read from, as it is stored."""
    return lambda name: bert_source(name, folder.files)


BERT_HUGGING_FACE = HuggingFaceAdapter(
    model_types=(MODEL_TYPE,), network=BERT, config_from=bert_config_from, sources=bert_sources,
    config_json=lambda family: huggingface_bert_config(family.config, family.special_tokens),
    weights=huggingface_bert_state_dict)
