"""The one exception type a user can cause.

Every mistake a user can make (a bad path, mismatched line counts, an unknown option, a corrupt
file) raises :class:`NmtError` with a message that names the file and says what to do. The CLI
prints the message without a traceback and exits with status 2; anything else is a bug.
"""

from __future__ import annotations

import errno
import reprlib


class NmtError(Exception):
    """A problem with the user's input or environment, with the fix in the message."""


_FIXES = {
    errno.ENOENT: "check the path",
    errno.EACCES: "check its permissions",
    errno.EPERM: "check its permissions",
    errno.EISDIR: "it is a folder: give a file",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.EEXIST: "a file is in the way: give a folder that is not a file",
    errno.ENOSPC: "the disk is full: free some space or write elsewhere",
    errno.EDQUOT: "the disk quota is used up: free some space or write elsewhere",
    errno.EROFS: "the filesystem is read-only: write elsewhere",
    errno.ENAMETOOLONG: "use a shorter path",
}


def from_os_error(e: OSError) -> NmtError:
    """An operating-system error on a path the user gave (unreadable, a folder where a file belongs,
    a full disk, ...) as a user error naming the path. For what no stage turned into its own message."""
    path = e.filename2 if e.filename2 is not None else e.filename  # a rename's target, not its temporary file
    reason = e.strerror or type(e).__name__
    fix = _FIXES.get(e.errno, "check the path and that it can be read or written")
    return NmtError(f"{path}: {reason}; {fix}" if path is not None else f"{reason}; {fix}")


SHOWN_CHARS = 300
_SHOWN = reprlib.Repr()  # attributes, not keywords: those came in Python 3.12
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxtuple, _SHOWN.maxdict, _SHOWN.maxset = 2, 4, 4, 4, 4
_SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 120, 120, 60


def shown(value: object) -> str:
    """`repr(value)` cut to a few hundred characters at most: how an error quotes what the user gave.
    A value can be huge (a YAML alias nested nine deep names a billion strings in a few lines; a
    line of a corrupt file can be megabytes), and printing it whole would take the machine down."""
    text = _SHOWN.repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS - 5]}[...]"
