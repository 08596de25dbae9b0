"""``cohort consolidate``: turn a sharded checkpoint folder into one file, to share or for ``load_from_checkpoint``.

    cohort consolidate lightning_logs/version_0/checkpoints/last.ckpt            # -> last.consolidated.ckpt
    cohort consolidate lightning_logs/version_0/checkpoints/last.ckpt full.ckpt

Sharded checkpoints (torch.distributed.checkpoint, written by the fsdp, model_parallel and pipeline strategies) are
folders with one file per rank. Every strategy resumes from the folder itself (one process and DDP read it whole,
as this does, without writing the file); one file is for moving a checkpoint elsewhere. Consolidating reads every
shard in this one process, so the whole checkpoint (weights and optimizer state) must fit in its CPU memory; no
process group is needed.
"""

from __future__ import annotations

from pathlib import Path

from app.safety.checkpoint_reading import consolidate
from core.errors import ArgumentParser, UserError, check_writable_folder


def main(argv: list[str]) -> None:
    parser = ArgumentParser(prog="cohort consolidate", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a sharded checkpoint folder (e.g. .../checkpoints/last.ckpt)")
    parser.add_argument("output", type=Path, nargs="?", help="the file to write; default: NAME.consolidated.ckpt beside it")
    args = parser.parse_args(argv)
    folder: Path = args.checkpoint
    output: Path = args.output or folder.with_name(f"{folder.name.removesuffix('.ckpt')}.consolidated.ckpt")
    if output.is_dir():
        raise UserError(f"the output {output} is a folder: name the file to write, e.g. {output / 'full.ckpt'}")
    check_writable_folder(output.parent, "output folder")  # before every shard is read: a file in its path
    checkpoint = consolidate(folder, output)
    parameters = sum(tensor.numel() for tensor in checkpoint["state_dict"].values())
    print(f"wrote {output}: {parameters:,} weights at step {checkpoint.get('global_step', '?')}")
