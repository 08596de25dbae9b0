"""The one exception type for mistakes a user can fix (bad config, data, checkpoint or environment).

The CLI prints it as a single line, without a traceback; everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input. The message says what was wrong and what to do instead."""


def check_ranges(section: str, rules: dict[str, tuple[bool, str]], values: dict[str, object]) -> None:
    """A UserError naming the first setting whose rule does not hold: ``rules`` maps a name to (holds, what it
    must be), ``values`` holds the values as given."""
    for name, (holds, requirement) in rules.items():
        if not holds:
            raise UserError(f"{section}.{name}={values[name]!r} must be {requirement}: change it in the config or on "
                            "the command line")
