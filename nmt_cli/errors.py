"""The one exception type a user can cause.

Every mistake a user can make (a bad path, mismatched line counts, an unknown option, a corrupt
file) raises :class:`NmtError` with a message that names the file and says what to do. The CLI
prints the message without a traceback and exits with status 2; anything else is a bug.
"""


class NmtError(Exception):
    """A problem with the user's input or environment, with the fix in the message."""
