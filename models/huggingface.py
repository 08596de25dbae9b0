"""Cohort's networks as Hugging Face's: the same networks, so the weights only change names and layout.

Llama (models/llama.py) is LlamaForCausalLM: the same names without ``model.`` (the head has none), the same
rotate-half RoPE, nothing to transpose; a tied head is stored once, as the embedding.

GPT (models/gpt.py) is GPT-2:

    Cohort (models/gpt.py)           Hugging Face (GPT2LMHeadModel)
    wte, wpe, ln_f                   transformer.wte, transformer.wpe, transformer.ln_f
    blocks.i.ln_1, ln_2              transformer.h.i.ln_1, ln_2
    blocks.i.attn.qkv                transformer.h.i.attn.c_attn    [q of all heads | k | v], not head by head
    blocks.i.attn.proj               transformer.h.i.attn.c_proj
    blocks.i.mlp.fc, mlp.proj        transformer.h.i.mlp.c_fc, mlp.c_proj
    lm_head (tied to wte)            lm_head, tied to wte by tie_word_embeddings: not stored

GPT-2's projections are ``Conv1D`` modules, whose weight is stored transposed: (in_features, out_features).

BERT (models/bert.py) is BertForMaskedLM, module by module as BERT_NAMES lists; the decoder's bias is stored as
``cls.predictions.bias`` and its weight, tied to the token embedding, not at all.

Pure tensor code; writing the files and reading the checkpoint are app/tools/export.py's.
"""

from __future__ import annotations

from typing import Any

import torch

from core.errors import UserError
from core.tokens import SpecialTokens
from models.bert import BERT, BertConfig
from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig

# Cohort's Linear layers inside a block, by their GPT-2 Conv1D names
PROJECTIONS = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
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


def llama_huggingface_name(name: str, config: LlamaConfig) -> str:
    """The LlamaForCausalLM tensor that holds Cohort Llama parameter ``name`` (a tied head: the embedding)."""
    if name == "lm_head.weight":
        return "model.embed_tokens.weight" if config.tie_word_embeddings else name
    return f"model.{name}"


def huggingface_llama_config(config: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` with which ``LlamaForCausalLM`` computes what Cohort's Llama of ``config`` computes."""
    return {
        "model_type": "llama",
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
        "rope_theta": config.rope_base,  # transformers 4's keys; 5 reads them too and writes rope_parameters
        "rope_scaling": llama3_rope_scaling(config),
        "rope_parameters": {"rope_theta": config.rope_base,
                            **(llama3_rope_scaling(config) or {"rope_type": "default"})},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": None,  # as for GPT-2 below: Cohort's data claims no special tokens
        "eos_token_id": None,
    }


def llama3_rope_scaling(config: LlamaConfig) -> dict[str, Any] | None:
    if config.rope_scaling is None:
        return None
    factor, low_freq_factor, high_freq_factor, trained_context = config.rope_scaling
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor, "original_max_position_embeddings": trained_context}


def huggingface_llama_state_dict(state_dict: dict[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Cohort Llama weights (``Llama.state_dict()`` names) as LlamaForCausalLM's, each contiguous; a tied head once.
    A UserError if they are not a Llama of ``config``."""
    check_weights_fit(state_dict, config)
    return {llama_huggingface_name(name, config): tensor.detach().contiguous() for name, tensor in state_dict.items()
            if not (name == "lm_head.weight" and config.tie_word_embeddings)}


def huggingface_gpt2_config(config: GPTConfig) -> dict[str, Any]:
    """The ``config.json`` with which ``GPT2LMHeadModel`` computes what Cohort's GPT of ``config`` computes."""
    check_is_gpt2(config)
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_embd": config.n_embd,
        "n_inner": 4 * config.n_embd,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,  # what configs before transformers 4 read
        "vocab_size": config.vocab_size,
        "activation_function": "gelu_new",  # GELU's tanh approximation, as models/gpt.py's MLP uses
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
    check_weights_fit(state_dict, config)
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
        "model_type": "bert",
        "architectures": ["BertForMaskedLM"],
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "hidden_size": config.n_embd,
        "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "type_vocab_size": config.type_vocab_size,
        "hidden_act": "gelu",  # the exact (erf) GELU, as models/bert.py's
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
    check_weights_fit(state_dict, config)
    return {bert_huggingface_name(name): tensor.detach().contiguous() for name, tensor in state_dict.items()
            if name != TIED_BERT_DECODER}


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


def check_weights_fit(state_dict: dict[str, torch.Tensor], config: GPTConfig | LlamaConfig | BertConfig) -> None:
    """A UserError unless ``state_dict`` holds exactly the weights of a Cohort GPT, Llama or BERT of ``config``, in
    their shapes."""
    family, network_class = {LlamaConfig: ("Llama", Llama), GPTConfig: ("GPT", GPT), BertConfig: ("BERT", BERT)}[
        type(config)]
    with torch.device("meta"):  # shapes only: nothing is allocated
        expected = {name: tensor.shape for name, tensor in network_class(config).state_dict().items()}
    found = {name: tensor.shape for name, tensor in state_dict.items()}
    missing, unexpected = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    reshaped = [f"{name} {tuple(found[name])} (expected {tuple(shape)})" for name, shape in expected.items()
                if name in found and found[name] != shape]
    problems = [f"{kind} {names[:3]}" for kind, names in (("missing", missing), ("unexpected", unexpected),
                                                            ("other shapes:", reshaped)) if names]
    if problems:
        raise UserError(f"the weights are not those of a Cohort {family} of {config.n_layer} layers, width "
                        f"{config.n_embd}, vocabulary {config.vocab_size} ({'; '.join(problems)}): pass a checkpoint "
                        "cohort fit wrote")
