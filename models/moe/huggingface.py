"""Cohort's mixture of experts (models/moe/network.py) as Hugging Face's MixtralForCausalLM or Qwen3MoeForCausalLM,
both ways. All but the MoE layers are Llama's (models/llama/huggingface.py: the same names after ``model.``, nothing
transposed); in an MoE layer the router is the folder's ``gate`` and each stacked expert parameter is n_expert tensors
of the folder, one per expert, as the Hub's folders hold them and transformers 4 and 5 both save them (5 fuses gate
and up into one gate_up_proj in memory, converting on loading and back on saving):

    Cohort, layers.N.mlp.             Mixtral, model.layers.N.block_sparse_moe.   Qwen3-MoE, model.layers.N.mlp.
    router.weight (E, C)              gate.weight                                 gate.weight
    experts.gate_proj (E, W, C)       experts.M.w1.weight (W, C) for M < E        experts.M.gate_proj.weight
    experts.up_proj (E, W, C)         experts.M.w3.weight                         experts.M.up_proj.weight
    experts.down_proj (E, C, W)       experts.M.w2.weight (C, W)                  experts.M.down_proj.weight

Which of the two a network is follows from its shape, so nothing needs choosing: Qwen3-MoE normalises each query and
key head (qk_norm) and Mixtral never does, so a size with qk_norm is written as Qwen3-MoE, the others as Mixtral. A
folder is read as its config.json's model_type says and must then be the named size, as for every family (a Mixtral
folder given to a qk_norm size is refused naming qk_norm). Neither has a shared expert; Mixtral always renormalises
the chosen experts' probabilities (Qwen3-MoE where norm_topk_prob); both route in float32 by softmax, then top-k, as
Cohort does. Dropping by ``capacity_factor`` is Cohort's: transformers routes every token, so an exported model
computes there what Cohort computes with capacity_factor null. The balance loss's weight is written as
router_aux_loss_coef and, like a folder's, is not compared on import (the run's own setting trains).

Pure tensor code; writing the files and reading the checkpoint are app/tools/export.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from core.errors import UserError
from models.interchange import HuggingFaceAdapter, HuggingFaceFolder, Source, check_computable, check_weights_fit
from models.llama.huggingface import ROPE_TYPES, llama_huggingface_name, rope_from, rope_json
from models.moe.network import MoE, MoEConfig


@dataclass(frozen=True)
class MoEFormat:
    """What tells a Mixtral folder from a Qwen3-MoE one."""

    model_type: str  # config.json's
    architecture: str  # the transformers class that loads it
    label: str  # what messages call it
    moe_module: str  # the name of a block's MoE layer
    expert_tensors: dict[str, str]  # Cohort's stacked expert parameter -> the name of one expert's tensor
    # config.json's number of routed experts, the first written (Qwen3-MoE's num_experts, which transformers 5 saves as
    # num_local_experts and 4 reads only as num_experts), any of them read
    n_expert_keys: tuple[str, ...]
    expert_size_key: str  # config.json's width of one expert
    defaults: dict[str, float]  # transformers' values for what a config.json may leave out


MIXTRAL = MoEFormat("mixtral", "MixtralForCausalLM", "Mixtral", "block_sparse_moe",
                    {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}, ("num_local_experts",),
                    "intermediate_size", {"rope_theta": 1e6, "rms_norm_eps": 1e-5})
QWEN3_MOE = MoEFormat("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3-MoE", "mlp",
                      {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"},
                      ("num_experts", "num_local_experts"), "moe_intermediate_size",
                      {"rope_theta": 1e4, "rms_norm_eps": 1e-6})
FORMATS = {format.model_type: format for format in (MIXTRAL, QWEN3_MOE)}


def moe_format(config: MoEConfig) -> MoEFormat:
    """The format that holds a network of ``config``: Qwen3-MoE's with qk_norm, Mixtral's without; a UserError for
    what neither computes."""
    format = QWEN3_MOE if config.qk_norm else MIXTRAL
    unsupported = [what for what, present in (
        (f"a shared expert (shared_expert_size={config.shared_expert_size})", config.shared_expert_size > 0),
        ("the chosen experts' probabilities left unnormalised (normalize_top_k false)",
         format is MIXTRAL and not config.normalize_top_k)) if present]
    if unsupported:
        raise UserError(f"this MoE has {' and '.join(unsupported)}, which {format.architecture} does not compute: "
                        "Hugging Face folders hold the sizes of Mixtral's or Qwen3-MoE's shape")
    return format


def moe_huggingface_name(name: str, config: MoEConfig) -> str | tuple[str, ...]:
    """The folder's tensor that holds Cohort parameter ``name``, or for a stacked expert parameter its n_expert
    tensors in expert order."""
    layer, is_moe, part = name.partition(".mlp.")
    if not is_moe:
        return llama_huggingface_name(name, config)  # type: ignore[arg-type]  # reads tie_word_embeddings only
    format = moe_format(config)
    moe = f"model.{layer}.{format.moe_module}"
    if part == "router.weight":
        return f"{moe}.gate.weight"
    tensor = format.expert_tensors[part.removeprefix("experts.")]
    return tuple(f"{moe}.experts.{expert}.{tensor}.weight" for expert in range(config.n_expert))


def huggingface_moe_config(config: MoEConfig) -> dict[str, Any]:
    """The ``config.json`` with which MixtralForCausalLM or Qwen3MoeForCausalLM computes what Cohort's MoE of
    ``config`` computes."""
    format = moe_format(config)
    settings = {
        "model_type": format.model_type,
        "architectures": [format.architecture],
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "hidden_size": config.n_embd,
        "head_dim": config.head_size,
        format.n_expert_keys[0]: config.n_expert,
        "num_experts_per_tok": config.top_k,
        format.expert_size_key: config.expert_size,
        "max_position_embeddings": config.block_size,
        "vocab_size": config.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        **rope_json(config.rope_base, config.rope_scaling),
        "sliding_window": None,
        "router_aux_loss_coef": config.load_balance_coefficient,
        "output_router_logits": False,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": None,  # Cohort's data claims no special tokens
        "eos_token_id": None,
    }
    if format is MIXTRAL:
        return settings | {"router_jitter_noise": 0.0}
    # every layer routed (no dense MLP layers, so no intermediate_size), attention without biases
    return settings | {"norm_topk_prob": config.normalize_top_k, "use_sliding_window": False,
                       "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False}


def huggingface_moe_state_dict(state_dict: dict[str, torch.Tensor], config: MoEConfig) -> dict[str, torch.Tensor]:
    """Cohort MoE weights (``MoE.state_dict()`` names) as the folder's: each stacked expert parameter split into its
    experts' tensors (copies: safetensors refuses tensors that share memory), a tied head once. A UserError if they
    are not an MoE of ``config``, or not one a Hugging Face folder holds."""
    check_weights_fit(state_dict, config, MoE)
    moe_format(config)
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        target = moe_huggingface_name(name, config)
        if isinstance(target, str):
            weights[target] = tensor.detach().contiguous()
        else:
            weights |= {expert_name: expert.detach().clone() for expert_name, expert in zip(target, tensor)}
    return weights


def moe_config_from(folder: HuggingFaceFolder) -> MoEConfig:
    """The MoEConfig that a Mixtral's or Qwen3-MoE's ``config.json`` describes; a UserError for another model, or
    for what models/moe/network.py does not compute."""
    config = folder.config
    format = FORMATS.get(config.get("model_type"))
    if format is None:
        raise UserError(f"model.init_from={folder.path} holds a {config.get('model_type')!r} model, not a Mixtral or "
                        "Qwen3-MoE: give a folder of one of them, or use the family its config.json names")
    rope_type, rope_base, rope_scaling = rope_from(config, format.defaults["rope_theta"])
    head_size = config["hidden_size"] // config["num_attention_heads"]
    window = config.get("sliding_window")
    if format is QWEN3_MOE and not config.get("use_sliding_window", False):
        window = None  # Qwen3-MoE's folders keep a sliding_window that use_sliding_window false turns off
    settings: dict[str, tuple[object, object]] = {
        "hidden_act": (config.get("hidden_act", "silu"), "silu"),
        "rope type": (rope_type, rope_type if rope_type in ROPE_TYPES else "default or llama3"),
        "sliding_window": (window, None),
    }
    if format is QWEN3_MOE:
        settings |= {"attention_bias": (config.get("attention_bias", False), False),
                     "decoder_sparse_step": (config.get("decoder_sparse_step", 1), 1),  # 1 and none MLP-only: all
                     "mlp_only_layers": (config.get("mlp_only_layers") or [], [])}  # layers MoE
    check_computable(folder, format.model_type, format.label, settings)
    head_dim = config.get("head_dim") or head_size
    n_expert_key = next((key for key in format.n_expert_keys if key in config), format.n_expert_keys[0])
    return MoEConfig(n_layer=config["num_hidden_layers"], n_head=config["num_attention_heads"],
                     n_kv_head=config.get("num_key_value_heads") or config["num_attention_heads"],
                     n_embd=config["hidden_size"], n_expert=config[n_expert_key],
                     top_k=config["num_experts_per_tok"], expert_size=config[format.expert_size_key],
                     normalize_top_k=config.get("norm_topk_prob", False) if format is QWEN3_MOE else True,
                     load_balance_coefficient=config.get("router_aux_loss_coef", 0.001),
                     head_dim=None if head_dim == head_size else head_dim,  # as the named sizes say it
                     qk_norm=format is QWEN3_MOE, block_size=config["max_position_embeddings"],
                     vocab_size=config["vocab_size"], rope_base=rope_base,
                     norm_eps=config.get("rms_norm_eps", format.defaults["rms_norm_eps"]),
                     tie_word_embeddings=config.get("tie_word_embeddings", False), rope_scaling=rope_scaling)


def moe_sources(folder: HuggingFaceFolder, config: MoEConfig) -> Callable[[str], Source]:
    """Cohort MoE parameter name -> the folder's tensor, or its experts' tensors stacked, as they are stored."""
    return lambda name: (moe_huggingface_name(name, config), lambda tensor: tensor)


MOE_HUGGING_FACE = HuggingFaceAdapter(
    model_types=tuple(FORMATS), network=MoE, config_from=moe_config_from, sources=moe_sources,
    config_json=lambda family: huggingface_moe_config(family.config), weights=huggingface_moe_state_dict)
