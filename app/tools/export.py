"""``cohort export``: write a checkpoint's GPT, Llama, MoE or BERT as a Hugging Face folder (config.json,
model.safetensors).

    cohort export lightning_logs/version_0/checkpoints/last.ckpt --out my-gpt
    python -c "from transformers import GPT2LMHeadModel; GPT2LMHeadModel.from_pretrained('my-gpt')"
    python -c "from transformers import LlamaForCausalLM; LlamaForCausalLM.from_pretrained('my-llama')"
    python -c "from transformers import BertForMaskedLM; BertForMaskedLM.from_pretrained('my-bert')"
    python -c "from transformers import MixtralForCausalLM; MixtralForCausalLM.from_pretrained('my-moe')"

The checkpoint is a file or a sharded folder (read in this one process, as ``cohort consolidate`` reads it). The
folder holds GPT-2's, LlamaForCausalLM's, BertForMaskedLM's, MixtralForCausalLM's or (an MoE with qk_norm)
Qwen3MoeForCausalLM's own parameter names and layout (models/<family>/huggingface.py), so transformers computes the
same logits as Cohort. No tokenizer is written: Cohort's checkpoints do not say which one the data was prepared with.
"""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from app.safety.atomic_paths import remove_path, replace_path
from app.safety.checkpoint_reading import load_checkpoint
from core.errors import ArgumentParser, UserError, check_writable_folder
from core.tokens import BYTE_BERT_VOCAB_SIZE, BYTE_SPECIAL_TOKENS, BYTE_VOCAB_SIZE
from models.registry import DEFAULT_FAMILY, EXPORTED, family_of, labels


def main(argv: list[str]) -> None:
    parser = ArgumentParser(prog="cohort export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a .ckpt file or sharded checkpoint folder written by cohort fit")
    parser.add_argument("--out", type=Path, required=True, metavar="FOLDER",
                        help="the folder to write; it must not exist or be empty")
    args = parser.parse_args(argv)
    out: Path = args.out
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise UserError(f"--out {out} already exists and is not an empty folder: remove it or name another folder")
    check_writable_folder(out, "--out folder")  # before the checkpoint is read: a file in its path, no permission
    checkpoint = load_checkpoint(args.checkpoint)
    weights, huggingface_config, config = huggingface_model(checkpoint, args.checkpoint)
    write_folder(out, weights, huggingface_config)
    loader = huggingface_config["architectures"][0]
    print(f"wrote {out}: {loader} with {config.n_layer} layers x {config.n_head} heads, width {config.n_embd}, "
          f"vocabulary {config.vocab_size}, at step {checkpoint.get('global_step', '?')}; load it with "
          f"transformers.{loader}.from_pretrained('{out}')")
    if config.vocab_size in (BYTE_VOCAB_SIZE, BYTE_BERT_VOCAB_SIZE):
        special = (f"; [MASK], [CLS], [SEP] and [PAD] are ids {', '.join(map(str, BYTE_SPECIAL_TOKENS.ids))}"
                   if config.vocab_size == BYTE_BERT_VOCAB_SIZE else "")
        print("no tokenizer was written: this model reads UTF-8 bytes (token id = byte value, "
              f"list(text.encode())), which no Hugging Face tokenizer encodes as is{special}")
    else:
        print(f"no tokenizer was written: copy the tokenizer.json its data was prepared with into {out}")


def huggingface_model(checkpoint: dict[str, Any], path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], Any]:
    """The checkpoint's network as a transformers model's weights and config.json, and as Cohort's config. Its
    shape is what the family makes of the hyperparameters it saved (the family is built, its network is not: the
    weights are the checkpoint's)."""
    saved = checkpoint.get("hyper_parameters", {})
    class_path = checkpoint.get("cohort_model_class", DEFAULT_FAMILY.class_path)  # unrecorded: the default's
    family = family_of(class_path)  # also by a path it had before it moved
    if family not in EXPORTED:
        raise UserError(f"{path} holds a model of the family {class_path.rsplit('.', 1)[-1]}, and cohort export "
                        f"writes {labels(EXPORTED, 'and')} folders only: pass a checkpoint of a "
                        f"{labels(EXPORTED, 'or')} run")
    if "model_name" not in saved:
        raise UserError(f"{path} is not a checkpoint of a Cohort {labels(EXPORTED, 'or')} (no model_name among its "
                        "hyperparameters): pass one cohort fit wrote, e.g. "
                        "lightning_logs/version_0/checkpoints/last.ckpt")
    family_class = family.module_class
    arguments = inspect.signature(family_class).parameters  # the saved hyperparameters hold the CLI's _class_path too
    model = family_class(**{key: value for key, value in saved.items() if key in arguments and key != "init_from"})
    prefix = "model."  # the families hold their network as self.model
    weights = {name.removeprefix(prefix): tensor for name, tensor in checkpoint["state_dict"].items()
               if name.startswith(prefix)}
    adapter = family.huggingface
    return adapter.weights(weights, model.config), adapter.config_json(model), model.config


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
