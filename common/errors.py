"""User mistakes are one line on stderr; bugs stay tracebacks."""

from __future__ import annotations

import sys
from collections.abc import Callable


class UserError(Exception):
    """A problem the user can fix (bad path, bad flag, foreign checkpoint, ...)."""


def run_cli(main: Callable[[], object]) -> None:
    """Run ``main`` and turn a UserError into ``error: <what> (<hint>)`` and exit code 2."""
    try:
        main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
