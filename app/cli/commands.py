"""The ``cohort`` subcommands, one line each. ``cohort --help`` prints them, app/__main__.py dispatches on them and
the Lightning subcommands' own ``--help`` (app/cli/lightning_cli.py) repeats them, so the three cannot disagree. Imports
nothing: ``cohort --help`` answers without loading torch."""

from __future__ import annotations

# no family named here (models/registry.py names them; `cohort fit --help` lists them): this text loads no torch
DESCRIPTION = ("Cohort trains language models and image classifiers with PyTorch Lightning, on one CPU or on many\n"
               "GPUs and nodes with the same config, and resumes runs exactly.")

# LightningCLI's (app/cli/lightning_cli.py); the others are Cohort's
LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")

COMMANDS: dict[str, str] = {
    "fit": "train a model (-c configs/quickstart.yaml); --ckpt_path last resumes the newest run",
    "validate": "the validation metrics (loss; perplexity or accuracy) of a checkpoint (--ckpt_path)",
    "test": "the test loss and perplexity of a GPT checkpoint (--ckpt_path)",
    "predict": "continue prompts with a GPT checkpoint (--ckpt_path, --data.prompts)",
    "prepare": "turn text files or folders into train.bin and val.bin (bytes or any tokenizer.json) for fit",
    "doctor": "pre-flight checks and the memory estimate, run with the launcher and config of the job they precede",
    "plan": ("the layouts to run a recipe on a cluster, ranked by predicted step time and memory (--calibrate "
             "measures what the model does not count, --try K runs the best)"),
    "comm": "collective bandwidth (all-reduce, all-gather, reduce-scatter) of the launched processes",
    "consolidate": "turn a sharded checkpoint folder into one file, to share or for load_from_checkpoint",
    "export": "write a GPT, Llama, MoE or BERT checkpoint as a Hugging Face folder (--out) that transformers loads",
}


def help_text() -> str:
    """What ``cohort``, ``cohort -h`` and ``cohort --help`` print."""
    width = max(map(len, COMMANDS)) + 2
    table = "\n".join(f"  {name:<{width}}{summary}" for name, summary in COMMANDS.items())
    return (f"usage: cohort COMMAND [ARGS]  (python -m app COMMAND [ARGS] is the same)\n\n{DESCRIPTION}\n\n"
            f"commands:\n{table}\n\n"
            "cohort COMMAND --help lists a command's arguments; start with: cohort fit -c configs/quickstart.yaml")


def describe(command: str) -> str:
    """The description at the top of ``cohort COMMAND --help``."""
    return f"cohort {command}: {COMMANDS[command]}. {DESCRIPTION}"
