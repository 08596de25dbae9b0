"""``python -m app ...`` is the ``cohort`` command: the Lightning subcommands (app/cli/lightning_cli.py) and Cohort's
own, one line each in app/cli/commands.py (``cohort --help`` prints them).

    cohort prepare my_texts/ --out data/my_corpus                           # text -> train.bin, val.bin
    cohort fit -c configs/quickstart.yaml                                   # 1 CPU process, embedded corpus
    cohort fit -c configs/quickstart.yaml -c configs/trainer/ddp_cpu.yaml   # the same run on 2 processes
    cohort fit -c configs/quickstart.yaml --ckpt_path last                  # resume the newest run
    cohort predict -c configs/quickstart.yaml --ckpt_path last              # generate text from it
    torchrun --nproc_per_node=2 -m app comm                                 # collective bandwidth (app/tools/comm.py)
    torchrun --nproc_per_node=2 -m app doctor -c ...                        # pre-flight checks (app/tools/doctor.py)
    cohort plan -c configs/quickstart.yaml --devices 2                      # layouts ranked (app/tools/plan.py)
    cohort consolidate lightning_logs/version_0/checkpoints/last.ckpt       # sharded folder -> one file
    cohort export lightning_logs/version_0/checkpoints/last.ckpt --out hf    # -> a Hugging Face GPT-2 folder
"""

from __future__ import annotations

import sys
import warnings

from app.cli.commands import COMMANDS, help_text


def main(args: list[str] | None = None) -> None:
    """``cohort ARGS``: the command overview, one of Cohort's own commands, or a Lightning subcommand."""
    argv = sys.argv[1:] if args is None else args
    command = argv[0] if argv else "--help"
    if command in ("-h", "--help"):
        print(help_text())
        return
    if command not in COMMANDS and not command.startswith("-"):  # options before a subcommand are LightningCLI's
        sys.exit(f"cohort: error: unknown command {command!r}: use one of {', '.join(COMMANDS)} "
                 "(cohort --help says what each does)")
    # imported only here, so that the overview and the error above come without loading torch and Lightning
    from app.cli.lightning_cli import run_cli, run_reporting_errors
    from app.tools import comm, consolidate, doctor, export, plan
    from datamodules import prepare

    if command == "comm":
        return run_reporting_errors(comm.main, argv[1:])
    if command == "doctor":
        return run_reporting_errors(doctor.main, argv[1:])
    if command == "plan":
        return run_reporting_errors(plan.main, argv[1:])
    if command == "consolidate":
        return run_reporting_errors(consolidate.main, argv[1:])
    if command == "export":
        return run_reporting_errors(export.main, argv[1:])
    if command == "prepare":
        return run_reporting_errors(prepare.main, argv[1:])
    # noise from Lightning's own use of a torch API that torch deprecated; nothing a user can act on
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    run_reporting_errors(run_cli, args)


if __name__ == "__main__":
    main()
