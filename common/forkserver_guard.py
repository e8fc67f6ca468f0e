"""Imported by the DataLoader fork server only (``common.data.worker_context`` preloads it): the server then dies
with the rank that started it, and its workers with it (see ``common.data.die_with_parent``)."""

from common.data import die_with_parent

die_with_parent()
