"""Imported by the DataLoader fork server only, first (``common.data.worker_context`` preloads it): the server
imports the heavy modules after it with Python's cyclic GC off (each worker freezes what it inherits and turns the
collector on, in ``init_worker``), dies with the rank that started it, and its workers with it (see
``common.data.die_with_parent``), and ignores the signals that its rank handles (``leave_signals_to_the_rank``)."""

import gc

gc.disable()
import os  # noqa: E402

from . import data  # noqa: E402

data.fork_server_pid = os.getpid()
data.die_with_parent()
data.leave_signals_to_the_rank(block=True)
