"""Cohort's GPT (models/gpt/network.py) as Hugging Face's GPT-2 (GPT2LMHeadModel), both ways:

    Cohort (models/gpt/network.py)   Hugging Face (GPT2LMHeadModel)
    wte, wpe, ln_f                   transformer.wte, transformer.wpe, transformer.ln_f
    blocks.i.ln_1, ln_2              transformer.h.i.ln_1, ln_2
    blocks.i.attn.qkv                transformer.h.i.attn.c_attn    [q of all heads | k | v], not head by head
    blocks.i.attn.proj               transformer.h.i.attn.c_proj
    blocks.i.mlp.fc, mlp.proj        transformer.h.i.mlp.c_fc, mlp.c_proj
    lm_head (tied to wte)            lm_head, tied to wte by tie_word_embeddings: not stored

GPT-2's projections are ``Conv1D`` modules, whose weight is stored transposed: (in_features, out_features). The
original gpt2 release's files are GPT2Model's, the same names without ``transformer.``.

Pure tensor code; writing the files and reading the checkpoint are app/tools/export.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from core.errors import UserError
from models.gpt.network import GPT, GPTConfig
from models.interchange import HuggingFaceAdapter, HuggingFaceFolder, Source, check_computable, check_weights_fit

MODEL_TYPE = "gpt2"
# Cohort's Linear layers inside a block, by their GPT-2 Conv1D names
PROJECTIONS = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}


def huggingface_gpt2_config(config: GPTConfig) -> dict[str, Any]:
    """The ``config.json`` with which ``GPT2LMHeadModel`` computes what Cohort's GPT of ``config`` computes."""
    check_is_gpt2(config)
    return {
        "model_type": MODEL_TYPE,
        "architectures": ["GPT2LMHeadModel"],
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_embd": config.n_embd,
        "n_inner": 4 * config.n_embd,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,  # what configs before transformers 4 read
        "vocab_size": config.vocab_size,
        "activation_function": "gelu_new",  # GELU's tanh approximation, as models/gpt/network.py's MLP uses
        "layer_norm_epsilon": 1e-5,  # nn.LayerNorm's default
        "scale_attn_weights": True,  # scores / sqrt(head size), as scaled_dot_product_attention does
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        # Cohort drops out exactly where GPT-2 does (embeddings, attention weights, both residual branches)
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "resid_pdrop": config.dropout,
        "tie_word_embeddings": True,
        # Cohort's data has no special tokens (documents are joined by a newline), so none is claimed here;
        # GPT-2's default (50256) would name a token that means nothing to this model, or none at all
        "bos_token_id": None,
        "eos_token_id": None,
    }


def huggingface_gpt2_state_dict(state_dict: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Cohort GPT weights (``GPT.state_dict()`` names) as GPT2LMHeadModel's, each contiguous (as safetensors wants
    them); the tied head is left out, as ``save_pretrained`` leaves it out. A UserError if they are not a GPT of
    ``config``."""
    check_is_gpt2(config)
    check_weights_fit(state_dict, config, GPT)
    converted = {f"transformer.{name}": state_dict[name] for name in ("wte.weight", "wpe.weight", "ln_f.weight",
                                                                     "ln_f.bias")}
    for i in range(config.n_layer):
        cohort, hf = f"blocks.{i}.", f"transformer.h.{i}."
        for norm in ("ln_1", "ln_2"):
            converted[f"{hf}{norm}.weight"] = state_dict[f"{cohort}{norm}.weight"]
            converted[f"{hf}{norm}.bias"] = state_dict[f"{cohort}{norm}.bias"]
        for name, hf_name in PROJECTIONS.items():
            weight, bias = state_dict[f"{cohort}{name}.weight"], state_dict[f"{cohort}{name}.bias"]  # (out, in), (out,)
            if name == "attn.qkv":
                weight, bias = qkv_by_kind(weight, config.n_head), qkv_by_kind(bias, config.n_head)
            converted[f"{hf}{hf_name}.weight"] = weight.t()  # Conv1D: (in, out)
            converted[f"{hf}{hf_name}.bias"] = bias
    return {name: tensor.detach().contiguous() for name, tensor in converted.items()}


def qkv_by_kind(qkv: torch.Tensor, n_head: int) -> torch.Tensor:
    """The fused qkv projection's output rows (its weight's dim 0, or its bias) reordered from Cohort's head by head
    layout, (q, k, v) within each head, to GPT-2's: q of every head, then k, then v."""
    per_head = qkv.view(n_head, 3, -1, *qkv.shape[1:])  # (nh, 3, hs, ...)
    return per_head.transpose(0, 1).reshape(qkv.shape)  # (3, nh, hs, ...) flattened back


def qkv_by_head(qkv: torch.Tensor, n_head: int) -> torch.Tensor:
    """``qkv_by_kind`` undone: GPT-2's rows (q of every head, then k, then v) in Cohort's head by head layout."""
    per_kind = qkv.view(3, n_head, -1, *qkv.shape[1:])  # (3, nh, hs, ...)
    return per_kind.transpose(0, 1).reshape(qkv.shape)  # (nh, 3, hs, ...) flattened back


def check_is_gpt2(config: GPTConfig) -> None:
    if not config.bias:
        raise UserError("the model has no biases (bias=False), and GPT-2 has biases in every Linear and LayerNorm: "
                        "only a model with bias=True exports as GPT-2")


def gpt_config_from(folder: HuggingFaceFolder) -> GPTConfig:
    """The GPTConfig that a GPT-2 ``config.json`` describes; a UserError for what models/gpt/network.py does not
    compute."""
    config = folder.config
    computed = {"activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
                "tie_word_embeddings": True, "n_inner": 4 * config["n_embd"]}
    found = {**config, "n_inner": config.get("n_inner") or 4 * config["n_embd"]}  # None: 4 x n_embd
    check_computable(folder, MODEL_TYPE, "GPT",
                     {name: (found.get(name, value), value) for name, value in computed.items()})
    return GPTConfig(n_layer=config["n_layer"], n_head=config["n_head"], n_embd=config["n_embd"],
                     block_size=config["n_positions"], vocab_size=config["vocab_size"])


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


def gpt2_sources(folder: HuggingFaceFolder, config: GPTConfig) -> Callable[[str], Source]:
    """Cohort GPT parameter name -> the folder's GPT-2 tensor it is read from, and what turns that into Cohort's
    layout."""
    prefix = "transformer." if "transformer.wte.weight" in folder.files else ""
    return lambda name: gpt2_source(name, config, prefix)


GPT_HUGGING_FACE = HuggingFaceAdapter(
    model_types=(MODEL_TYPE,), network=GPT, config_from=gpt_config_from, sources=gpt2_sources,
    config_json=lambda family: huggingface_gpt2_config(family.config), weights=huggingface_gpt2_state_dict)
