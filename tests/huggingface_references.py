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

REFERENCE_DIR = Path(__file__).parent / "data" / "huggingface"
LOGITS_FILE = "reference_logits.safetensors"  # beside the weights: the tokens, and transformers' logits for them
FAMILIES = ("llama", "gpt2", "bert")  # the folder names; Cohort's families LlamaLanguageModel, GPT..., Bert...


def reference_models(transformers: ModuleType) -> dict[str, Any]:
    """LlamaForCausalLM, GPT2LMHeadModel and BertForMaskedLM of the sizes 'debug' and 'bert-tiny', weights drawn as
    transformers initialises them under seed 0."""
    torch.manual_seed(0)
    llama, gpt, bert = LLAMA_CONFIGS["debug"], GPT_CONFIGS["debug"], BERT_CONFIGS["bert-tiny"]
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
    }


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
