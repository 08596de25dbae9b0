"""``cohort export``: write a checkpoint's GPT or Llama as a Hugging Face folder (config.json, model.safetensors).

    cohort export lightning_logs/version_0/checkpoints/last.ckpt --out my-gpt
    python -c "from transformers import GPT2LMHeadModel; GPT2LMHeadModel.from_pretrained('my-gpt')"
    python -c "from transformers import LlamaForCausalLM; LlamaForCausalLM.from_pretrained('my-llama')"

The checkpoint is a file or a sharded folder (read in this one process, as ``cohort consolidate`` reads it). The
folder holds GPT-2's or LlamaForCausalLM's own parameter names and layout (models/huggingface.py), so transformers
computes the same logits as Cohort. No tokenizer is written: Cohort's checkpoints do not say which one the data was
prepared with.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from app.safety.checkpoints import load_checkpoint, remove_path, replace_path
from core.errors import UserError
from models.gpt import GPTConfig, gpt_config
from models.huggingface import (
    huggingface_gpt2_config, huggingface_gpt2_state_dict, huggingface_llama_config, huggingface_llama_state_dict,
)
from models.language_model import GPTLanguageModel
from models.llama import LlamaConfig, llama_config
from models.llama_language_model import LlamaLanguageModel
from models.module import class_path_of

BYTE_VOCABULARY = 256  # models trained on bytes (cohort prepare without --tokenizer): token id = byte value


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="cohort export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a .ckpt file or sharded checkpoint folder written by cohort fit")
    parser.add_argument("--out", type=Path, required=True, metavar="FOLDER",
                        help="the folder to write; it must not exist or be empty")
    args = parser.parse_args(argv)
    out: Path = args.out
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise UserError(f"--out {out} already exists and is not an empty folder: remove it or name another folder")
    checkpoint = load_checkpoint(args.checkpoint)
    config = model_config(checkpoint, args.checkpoint)
    prefix = "model."  # the families hold their network as self.model
    weights = {name.removeprefix(prefix): tensor for name, tensor in checkpoint["state_dict"].items()
               if name.startswith(prefix)}
    if isinstance(config, LlamaConfig):
        write_folder(out, huggingface_llama_state_dict(weights, config), huggingface_llama_config(config))
        kind, loader = "Llama", "LlamaForCausalLM"
    else:
        write_folder(out, huggingface_gpt2_state_dict(weights, config), huggingface_gpt2_config(config))
        kind, loader = "GPT-2", "GPT2LMHeadModel"
    print(f"wrote {out}: {kind} with {config.n_layer} layers x {config.n_head} heads, width {config.n_embd}, context "
          f"{config.block_size}, vocabulary {config.vocab_size}, at step {checkpoint.get('global_step', '?')}; load it "
          f"with transformers.{loader}.from_pretrained('{out}')")
    if config.vocab_size == BYTE_VOCABULARY:
        print("no tokenizer was written: this model reads UTF-8 bytes (token id = byte value, "
              "list(text.encode())), which no Hugging Face tokenizer encodes as is")
    else:
        print(f"no tokenizer was written: copy the tokenizer.json its data was prepared with into {out}")


def model_config(checkpoint: dict[str, Any], path: Path) -> GPTConfig | LlamaConfig:
    """The network's shape, from the hyperparameters its family saved in the checkpoint."""
    saved = checkpoint.get("hyper_parameters", {})
    family = checkpoint.get("cohort_model_class", class_path_of(GPTLanguageModel))  # older checkpoints: GPTs only
    exported = (class_path_of(GPTLanguageModel), class_path_of(LlamaLanguageModel))
    if family not in exported:
        raise UserError(f"{path} holds a {family.rsplit('.', 1)[-1]}, and cohort export writes GPT and Llama "
                        "folders only: pass a checkpoint of a GPT or Llama run")
    if "model_name" not in saved:
        raise UserError(f"{path} is not a checkpoint of a Cohort GPT or Llama (no model_name among its "
                        "hyperparameters): pass one cohort fit wrote, e.g. "
                        "lightning_logs/version_0/checkpoints/last.ckpt")
    if family == class_path_of(LlamaLanguageModel):
        return llama_config(saved["model_name"], vocab_size=saved.get("vocab_size"))
    return gpt_config(saved["model_name"], vocab_size=saved.get("vocab_size"), dropout=saved.get("dropout"))


def write_folder(out: Path, weights: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """``out`` with config.json and model.safetensors, written beside it as ``NAME.partial`` and then renamed into
    place, so that an export that fails or is killed midway never leaves a half-written ``out``."""
    partial = out.with_name(f"{out.name}.partial")
    remove_path(partial)  # left by an export that was killed
    partial.mkdir(parents=True)
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(weights, partial / "model.safetensors", metadata={"format": "pt"})  # transformers checks "format"
    # safetensors writes its file readable by its owner only, whatever the umask: give it config.json's permissions
    shutil.copymode(partial / "config.json", partial / "model.safetensors")
    replace_path(partial, out)
