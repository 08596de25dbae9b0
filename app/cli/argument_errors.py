"""What jsonargparse refuses, in one line: the key, the value, the nearest valid key for a typo, what to do.

jsonargparse reports a typo as the whole usage (a hundred lines) and a value that no type of a union accepts as a
nested report of every type it tried; the CLI's parser (app/cli/lightning_cli.py) raises the line made here as a
UserError instead, for every key: the trainer's, the top-level ones, the model's and the data's.
"""

from __future__ import annotations

import importlib
import re
from difflib import get_close_matches
from pathlib import Path

from jsonargparse import ArgumentParser

# an unknown key: on the command line (argparse), in a config file (jsonargparse), or inside a class's arguments
UNKNOWN_ON_COMMAND_LINE = re.compile(r"unrecognized arguments: --?([^\s=]+)")
UNKNOWN_IN_CONFIG = re.compile(r"Subcommand '[^']+' does not accept option '([^']+)'")
UNKNOWN_IN_CLASS = re.compile(r"(?:Group '([^']+)' does not accept option|Option) '([^']+)'(?: is not accepted)?")
# a class_path that was imported, and what its class refused ("Problem with given class_path 'C':\n  reason")
CLASS_PROBLEM = re.compile(r"Problem with given class_path '([^']+)':\s*(.*?)\s*(?:\n\s*- |\n\s*Given value|$)",
                           re.DOTALL)
# what jsonargparse says of a class_path that names no class it can import
UNIMPORTABLE = re.compile(r"has no attribute|No module named|not accessible or invalid")
# a subclass's argument given while the key names no class (a strategy given by name): NestedArg(key=..., val=...)
NESTED = re.compile(r"Given value: NestedArg\(key='(.*?)', val='(.*?)'\)")
# the parts of jsonargparse's report on a union that say nothing the user acts on
UNION_NOISE = re.compile(r"Does not validate against any of the Union subtypes|Subtypes: \[.*?\]\n|Errors:|"
                         r"Given value type: .*|- Expected a <class 'NoneType'>|Expected a path but .*")


def one_line(parser: ArgumentParser, message: str, error: Exception | None) -> str:
    """The line for what ``parser`` (the subcommand's, or the root's) refused, as jsonargparse worded it."""
    parser = getattr(error, "subcommand_parser", None) or parser  # a config file's key is checked by the root
    help_hint = f"{parser.prog.replace(' [options]', '')} --help lists every option"
    missing_file = re.match(r'Parser key "config": File does not exist: \'(.*)\'', message)
    if missing_file:
        return missing_config_file(Path(missing_file[1]))
    unknown = UNKNOWN_ON_COMMAND_LINE.match(message) or UNKNOWN_IN_CONFIG.match(message)
    if unknown:
        return f"unknown option {unknown[1]}{nearest(unknown[1], keys_of(parser))}: {help_hint}"
    if message.startswith("Problems parsing config"):
        return f"a config file is not valid YAML: {' '.join(message.split(':', 1)[1].split())}"
    key = re.match(r'Parser key "([^"]+)":', message)
    if key is None:  # argparse's own, already one line ("argument --trainer.max_steps: expected one argument")
        return f"{' '.join(message.split())} ({help_hint})"
    problem = CLASS_PROBLEM.search(message)
    if problem:
        return class_refusal(key[1], problem[1], " ".join(problem[2].split()), help_hint)
    nested = NESTED.search(message)
    if nested:
        return (f"{key[1]}.{nested[1]}={nested[2]} cannot be set: {key[1]} names no class with arguments (set "
                f"{key[1]}.class_path, or use a preset from configs/trainer/)")
    given = re.search(r"Given value: (.*)", message)
    reasons = [" ".join(line.split()).removeprefix("- ") for line in UNION_NOISE.sub("", message).splitlines()[1:]
               if line.strip() and not line.strip().startswith("Given value:")]
    refused = f"{key[1]}={given[1]} is refused:" if given else f"{key[1]}:"
    return f"{refused} {'; '.join(reasons)} ({help_hint} and its type)"


def class_refusal(key: str, class_path: str, reason: str, help_hint: str) -> str:
    """The line for the class that ``key`` names refusing its arguments (``reason``, jsonargparse's): an unknown
    one, with the nearest of the class's own; a class that cannot be imported; a value of the wrong type."""
    unknown = UNKNOWN_IN_CLASS.search(reason) or UNKNOWN_ON_COMMAND_LINE.search(reason)
    if unknown:
        name = ".".join(part for part in unknown.groups() if part)
        hint = nearest(name, keys_of_class(class_path), prefix=f"{key}.")
        return f"unknown option {key}.{name}{hint} ({key} is {class_path}): {help_hint}"
    if UNIMPORTABLE.search(reason):
        return (f"{key}: the class_path {class_path!r} cannot be imported ({reason}): give a class that can be "
                "imported, such as those in configs/")
    reason = re.sub(r'Parser key "([^"]+)":', rf"{key}.\1:", reason)  # the class's own key, within ``key``
    reason = reason if reason.startswith(f"{key}.") else f"{key}: {reason}"
    return f"{reason} ({key} is {class_path}; {help_hint.replace('lists every option', 'lists its fields')})"


def missing_config_file(path: Path) -> str:
    """The line for ``-c PATH`` that names no file, with the file of the nearest name in its folder."""
    folder = path.parent
    if not folder.is_dir():
        return f"the config file {path} (-c) does not exist: neither does its folder {folder}"
    names = [file.name for file in folder.iterdir() if file.suffix in (".yaml", ".yml")]
    match = get_close_matches(path.name, names, n=1)
    hint = f" (did you mean {folder / match[0]}?)" if match else f" (configs are under {Path('configs')}/)"
    return f"the config file {path} (-c) does not exist{hint}"


def nearest(key: str, known: list[str], prefix: str = "") -> str:
    """" (did you mean KEY?)" for the valid key nearest ``key``, or "" where none is near; an unknown first part
    (``modell.dropout``) is matched on its own and the rest kept."""
    match = get_close_matches(key, known, n=1)
    if not match and "." in key:
        head, rest = key.split(".", 1)
        heads = get_close_matches(head, sorted({name.split(".")[0] for name in known}), n=1)
        match = [f"{heads[0]}.{rest}"] if heads else []
    return f" (did you mean {prefix}{match[0]}?)" if match else ""


def keys_of(parser: ArgumentParser) -> list[str]:
    """Every key ``parser`` accepts, dotted (``trainer.max_steps``), its options' help actions left out."""
    keys = (key.replace(".init_args.", ".") for key in parser.get_defaults().keys())  # --model.dropout works
    return [key for key in keys if not key.endswith("help")]


def keys_of_class(class_path: str) -> list[str]:
    """The keys of a class's arguments, as jsonargparse reads them (``optimizer.learning_rate``)."""
    module, name = class_path.rsplit(".", 1)
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(getattr(importlib.import_module(module), name), fail_untyped=False)
    return keys_of(parser)
