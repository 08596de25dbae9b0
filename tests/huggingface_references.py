"""Hugging Face folders that transformers saved (random weights in Cohort's test sizes, no download) and the logits
transformers computes from them, kept in tests/data/huggingface/ so that import and export are checked against
transformers' own numbers where transformers is not installed. Written once by

    pip install -e '.[hf]' && python -m tests.huggingface_references

and checked against the installed transformers by tests/test_pretrained.py wherever it is installed.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from models.bert.network import BERT_CONFIGS
from models.gpt.network import GPT_CONFIGS
from models.llama.network import LLAMA_CONFIGS
from models.moe.network import MOE_CONFIGS

REFERENCE_DIR = Path(__file__).parent / "data" / "huggingface"
LOGITS_FILE = "reference_logits.safetensors"  # beside the weights: the tokens, and transformers' logits for them
# the folder names, config.json's model_type: Cohort's families LlamaLanguageModel, GPT..., Bert..., and MoE... twice
FAMILIES = ("llama", "gpt2", "bert", "mixtral", "qwen3_moe")


def reference_models(transformers: ModuleType) -> dict[str, Any]:
    """LlamaForCausalLM, GPT2LMHeadModel and BertForMaskedLM of the sizes 'debug' and 'bert-tiny', weights drawn as
    transformers initialises them under seed 0, and MixtralForCausalLM and Qwen3MoeForCausalLM of the MoE sizes
    'debug' and 'debug-qwen3', every weight drawn again (``redrawn``)."""
    torch.manual_seed(0)
    llama, gpt, bert = LLAMA_CONFIGS["debug"], GPT_CONFIGS["debug"], BERT_CONFIGS["bert-tiny"]
    mixtral, qwen3 = MOE_CONFIGS["debug"], MOE_CONFIGS["debug-qwen3"]
    return {
        "llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=llama.vocab_size, hidden_size=llama.n_embd, intermediate_size=llama.intermediate_size,
            num_hidden_layers=llama.n_layer, num_attention_heads=llama.n_head, num_key_value_heads=llama.n_kv_head,
            max_position_embeddings=llama.block_size, rms_norm_eps=llama.norm_eps, rope_theta=llama.rope_base,
            tie_word_embeddings=False)),
        "gpt2": transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=gpt.n_layer, n_head=gpt.n_head, n_embd=gpt.n_embd, n_positions=gpt.block_size,
            vocab_size=gpt.vocab_size, bos_token_id=None, eos_token_id=None)),  # its 50256 is not a byte
        "bert": transformers.BertForMaskedLM(transformers.BertConfig(
            num_hidden_layers=bert.n_layer, num_attention_heads=bert.n_head, hidden_size=bert.n_embd,
            intermediate_size=bert.intermediate_size, max_position_embeddings=bert.max_position_embeddings,
            vocab_size=bert.vocab_size)),
        "mixtral": redrawn(transformers.MixtralForCausalLM(transformers.MixtralConfig(
            vocab_size=mixtral.vocab_size, hidden_size=mixtral.n_embd, num_hidden_layers=mixtral.n_layer,
            num_attention_heads=mixtral.n_head, num_key_value_heads=mixtral.n_kv_head,
            num_local_experts=mixtral.n_expert, num_experts_per_tok=mixtral.top_k,
            intermediate_size=mixtral.expert_size, max_position_embeddings=mixtral.block_size,
            rms_norm_eps=mixtral.norm_eps, rope_theta=mixtral.rope_base,
            router_aux_loss_coef=mixtral.load_balance_coefficient, tie_word_embeddings=False))),
        "qwen3_moe": redrawn(transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            vocab_size=qwen3.vocab_size, hidden_size=qwen3.n_embd, num_hidden_layers=qwen3.n_layer,
            num_attention_heads=qwen3.n_head, num_key_value_heads=qwen3.n_kv_head, head_dim=qwen3.head_dim,
            num_experts=qwen3.n_expert, num_experts_per_tok=qwen3.top_k, moe_intermediate_size=qwen3.expert_size,
            norm_topk_prob=qwen3.normalize_top_k, max_position_embeddings=qwen3.block_size,
            rms_norm_eps=qwen3.norm_eps, rope_theta=qwen3.rope_base,
            router_aux_loss_coef=qwen3.load_balance_coefficient, tie_word_embeddings=False))),
    }


def redrawn(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every weight drawn from N(0, 0.2²): the norms' too, whose initial ones would hide a query norm
    read as the key norm, and routers and experts large enough that a mix-up of experts or of their projections
    moves the logits far beyond float32 rounding (tests/test_pretrained.py checks that it does)."""
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    return model


def reference_tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


def saved_reference(family: str) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """The family's saved folder, and the tokens and the logits transformers computed for them from it."""
    folder = REFERENCE_DIR / family
    saved = load_file(folder / LOGITS_FILE)
    return folder, saved["tokens"], saved["logits"]


def write_references(out: Path) -> None:
    import transformers

    for family, model in reference_models(transformers).items():
        shutil.rmtree(out / family, ignore_errors=True)
        model.eval().save_pretrained(out / family)
        tokens = reference_tokens()
        with torch.no_grad():
            logits = model(input_ids=tokens).logits
        save_file({"tokens": tokens, "logits": logits.contiguous()}, out / family / LOGITS_FILE)
        print(f"wrote {out / family} (transformers {transformers.__version__})")


if __name__ == "__main__":
    write_references(REFERENCE_DIR)
