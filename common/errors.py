"""A user's mistake is one line on stderr and exit code 2; a bug stays a traceback."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Any


class UserError(Exception):  # a problem the user can fix: a bad path, flag or checkpoint
    pass


def run_cli(main: Callable[..., Any], *args: Any) -> None:
    """``main(*args)``, then cleanup; a UserError, or memory that runs out, is ``error: <what> (<hint>)``, exit 2."""
    from common.distributed import cleanup_distributed

    try:
        main(*args)
    except (UserError, MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
        oom = re.search(r"(\w+ out of memory|can't allocate memory)[^\n]{,160}", str(e))  # a worker's too, quoted
        if isinstance(e, RuntimeError) and not oom:
            raise
        hint = "lower the batch, model or image size; the last checkpoint is intact"
        what = e if isinstance(e, UserError) else f"out of memory: {oom[0] if oom else 'a MemoryError'} ({hint})"
        print(f"error: {what}", file=sys.stderr, flush=True)
        sys.exit(2)
    finally:
        cleanup_distributed()
