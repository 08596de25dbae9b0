"""``cohort consolidate``: turn a sharded checkpoint folder into one file that any strategy loads.

    cohort consolidate lightning_logs/version_0/checkpoints/last.ckpt            # -> last.consolidated.ckpt
    cohort consolidate lightning_logs/version_0/checkpoints/last.ckpt full.ckpt
    cohort validate -c configs/quickstart.yaml --ckpt_path full.ckpt             # one process, no sharding

Sharded checkpoints (torch.distributed.checkpoint, written by the fsdp and model_parallel strategies) are folders
with one file per rank. Consolidating reads every shard in this one process, so the whole checkpoint (weights
and optimizer state) must fit in its CPU memory; no process group is needed.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.load import _load_distributed_checkpoint

from app.checkpoints import META_FILE, is_sharded_checkpoint, read_checkpoint
from core.errors import UserError


def consolidate(folder: Path, output: Path) -> dict[str, Any]:
    """Write the sharded checkpoint ``folder`` as the single file ``output``; returns the checkpoint."""
    if not is_sharded_checkpoint(folder):
        raise UserError(f"{folder} is not a sharded checkpoint folder (it needs .metadata and {META_FILE}): pass the "
                        "folder the fsdp or model_parallel strategy wrote, e.g. lightning_logs/version_0/checkpoints/last.ckpt")
    if output.exists():
        raise UserError(f"{output} already exists: remove it or name another output file")
    read_checkpoint(folder / META_FILE)  # refuses a meta.pt whose pickle asks for code, before Lightning reads it
    checkpoint = _load_distributed_checkpoint(folder)  # shards and meta.pt, as full tensors
    # ModelParallelStrategy saves the weights as "state_dict", FSDPStrategy as "model"; the optimizers as
    # optimizer_0, optimizer_1, ... where a single-file checkpoint has the list "optimizer_states"
    if "model" in checkpoint:
        checkpoint["state_dict"] = checkpoint.pop("model")
    optimizer_keys = sorted((key for key in checkpoint if re.fullmatch(r"optimizer_\d+", key)), key=lambda k: int(k[10:]))
    if optimizer_keys:
        checkpoint["optimizer_states"] = [checkpoint.pop(key) for key in optimizer_keys]
    partial = output.with_name(f"{output.name}.partial")
    torch.save(checkpoint, partial)
    partial.replace(output)
    return checkpoint


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="cohort consolidate", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a sharded checkpoint folder (e.g. .../checkpoints/last.ckpt)")
    parser.add_argument("output", type=Path, nargs="?", help="the file to write; default: NAME.consolidated.ckpt beside it")
    args = parser.parse_args(argv)
    folder: Path = args.checkpoint
    output: Path = args.output or folder.with_name(f"{folder.name.removesuffix('.ckpt')}.consolidated.ckpt")
    checkpoint = consolidate(folder, output)
    parameters = sum(tensor.numel() for tensor in checkpoint["state_dict"].values())
    print(f"wrote {output}: {parameters:,} weights at step {checkpoint.get('global_step', '?')}")
