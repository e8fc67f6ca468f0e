"""The DataLoader fork server's first import (``data.worker_context`` preloads it): the heavy imports after it run
with the cyclic GC off, and the server dies with its rank and leaves stop signals to it (see ``common/data.py``)."""

import gc

gc.disable()
import os  # noqa: E402

from . import data  # noqa: E402

data.fork_server_pid = os.getpid()
data.die_with_parent()
data.leave_signals_to_the_rank(block=True)
