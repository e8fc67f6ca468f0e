"""User mistakes, and memory that runs out, are one line on stderr; bugs stay tracebacks."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable


class UserError(Exception):
    """A problem the user can fix (bad path, bad flag, foreign checkpoint, ...)."""


def run_cli(main: Callable[[], object]) -> None:
    """Run ``main``; a UserError or an allocation that fails is ``error: <what> (<hint>)`` and exit code 2."""
    try:
        main()
    except (UserError, MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
        oom = re.search(r"(\w+ out of memory|can't allocate memory)[^\n]{,160}", str(e))  # also a worker's, quoted
        if isinstance(e, RuntimeError) and not oom:
            raise
        hint = "lower the batch, model or image size; the last checkpoint is intact"
        what = e if isinstance(e, UserError) else f"out of memory: {oom[0] if oom else 'a MemoryError'} ({hint})"
        print(f"error: {what}", file=sys.stderr, flush=True)
        sys.exit(2)
