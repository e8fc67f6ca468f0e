"""A user's mistake is one line on stderr and exit code 2; a bug stays a traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class UserError(Exception):  # a problem the user can fix: a bad path, flag or checkpoint
    pass


def run_cli(main: Callable[..., Any], *args: Any) -> None:
    """``main(*args)``, then cleanup; a UserError (or what hardening explains) is ``error: <what> (<hint>)``, exit 2."""
    from common.distributed import SEAMS, cleanup_distributed

    try:
        main(*args)
    except Exception as e:
        what = e if isinstance(e, UserError) else SEAMS.explain(e)
        if what is None:
            raise
        print(f"error: {what}", file=sys.stderr, flush=True)
        sys.exit(2)
    finally:
        cleanup_distributed()
