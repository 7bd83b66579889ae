"""What torchrun starts on each worker (``python -m nmt_cli.worker ARGS``): the `nmt train` command
with the same arguments, ended without the interpreter's shutdown."""

from __future__ import annotations

import os
import sys

from nmt_cli.cli import app


def main() -> None:
    try:
        app(["train", *sys.argv[1:]], prog_name="nmt")
        status = 0
    except SystemExit as e:
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)  # what the interpreter would have printed
        status = e.code if isinstance(e.code, int) else int(e.code is not None)
    # A worker ends without the interpreter's shutdown: gloo's threads may still hold a finished
    # collective whose tensors point to Python objects, and releasing them while the interpreter
    # shuts down can abort the process ("terminate called without an active exception"; see pytorch
    # pull request 179291). Everything this worker wrote is closed by now; only its output streams
    # remain to flush.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
