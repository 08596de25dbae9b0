"""Cohort's Llama (models/llama/network.py) as Hugging Face's LlamaForCausalLM, both ways: the same names without
``model.`` (the head has none), the same rotate-half RoPE, nothing to transpose; a tied head is stored once, as the
embedding.

Pure tensor code; writing the files and reading the checkpoint are app/tools/export.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from models.interchange import HuggingFaceAdapter, HuggingFaceFolder, Source, check_computable, check_weights_fit
from models.llama.network import Llama, LlamaConfig

MODEL_TYPE = "llama"
ROPE_TYPES = ("default", "llama3")  # the RoPE Cohort computes (models/llama/network.py rotary_tables)


def llama_huggingface_name(name: str, config: LlamaConfig) -> str:
    """The LlamaForCausalLM tensor that holds Cohort Llama parameter ``name`` (a tied head: the embedding)."""
    if name == "lm_head.weight":
        return "model.embed_tokens.weight" if config.tie_word_embeddings else name
    return f"model.{name}"


def huggingface_llama_config(config: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` with which ``LlamaForCausalLM`` computes what Cohort's Llama of ``config`` computes."""
    return {
        "model_type": MODEL_TYPE,
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "hidden_size": config.n_embd,
        "head_dim": config.head_size,
        "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.block_size,
        "vocab_size": config.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        **rope_json(config.rope_base, config.rope_scaling),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": None,  # as for GPT-2 below: Cohort's data claims no special tokens
        "eos_token_id": None,
    }


def rope_json(rope_base: float, rope_scaling: tuple[float, float, float, int] | None) -> dict[str, Any]:
    """config.json's RoPE settings: transformers 4's keys (rope_theta, rope_scaling), which 5 reads too, and the
    rope_parameters that 5 writes."""
    scaling = None
    if rope_scaling is not None:
        factor, low_freq_factor, high_freq_factor, trained_context = rope_scaling
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low_freq_factor,
                   "high_freq_factor": high_freq_factor, "original_max_position_embeddings": trained_context}
    return {"rope_theta": rope_base, "rope_scaling": scaling,
            "rope_parameters": {"rope_theta": rope_base, **(scaling or {"rope_type": "default"})}}


def rope_from(config: dict[str, Any], default_base: float = 10000.0
              ) -> tuple[str, float, tuple[float, float, float, int] | None]:
    """config.json's RoPE, as transformers 5 (rope_parameters) or 4 (rope_theta, rope_scaling) writes it: its type
    (Cohort computes "default" and "llama3"), its base, and Llama 3's scaling where that is the type."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = ((float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                int(rope["original_max_position_embeddings"])) if rope_type == "llama3" else None)
    return rope_type, float(rope.get("rope_theta", config.get("rope_theta", default_base))), scaling


def huggingface_llama_state_dict(state_dict: dict[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Cohort Llama weights (``Llama.state_dict()`` names) as LlamaForCausalLM's, each contiguous; a tied head once.
    A UserError if they are not a Llama of ``config``."""
    check_weights_fit(state_dict, config, Llama)
    return {llama_huggingface_name(name, config): tensor.detach().contiguous() for name, tensor in state_dict.items()
            if not (name == "lm_head.weight" and config.tie_word_embeddings)}


def llama_config_from(folder: HuggingFaceFolder) -> LlamaConfig:
    """The LlamaConfig that ``config.json`` describes; a UserError for what models/llama/network.py does not
    compute."""
    config = folder.config
    rope_type, rope_base, rope_scaling = rope_from(config)
    head_size = config["hidden_size"] // config["num_attention_heads"]
    check_computable(folder, MODEL_TYPE, "Llama", {
        "hidden_act": (config.get("hidden_act", "silu"), "silu"),
        "rope type": (rope_type, rope_type if rope_type in ROPE_TYPES else "default or llama3"),
        "attention_bias": (config.get("attention_bias", False), False),
        "mlp_bias": (config.get("mlp_bias", False), False),
        "head_dim": (config.get("head_dim") or head_size, head_size),
    })
    return LlamaConfig(n_layer=config["num_hidden_layers"], n_head=config["num_attention_heads"],
                       n_kv_head=config.get("num_key_value_heads") or config["num_attention_heads"],
                       n_embd=config["hidden_size"], intermediate_size=config["intermediate_size"],
                       block_size=config["max_position_embeddings"], vocab_size=config["vocab_size"],
                       rope_base=rope_base, norm_eps=config.get("rms_norm_eps", 1e-6),
                       tie_word_embeddings=config.get("tie_word_embeddings", False), rope_scaling=rope_scaling)


def llama_sources(folder: HuggingFaceFolder, config: LlamaConfig) -> Callable[[str], Source]:
    """Cohort Llama parameter name -> the folder's tensor it is read from, as it is stored."""
    return lambda name: (llama_huggingface_name(name, config), lambda tensor: tensor)


LLAMA_HUGGING_FACE = HuggingFaceAdapter(
    model_types=(MODEL_TYPE,), network=Llama, config_from=llama_config_from, sources=llama_sources,
    config_json=lambda family: huggingface_llama_config(family.config), weights=huggingface_llama_state_dict)
