"""The one exception type for mistakes a user can fix (bad config, data, checkpoint or environment).

The CLI prints it as a single line, without a traceback; everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input. The message says what was wrong and what to do instead."""
