"""One writer at a time for the generated test assets (tiny checkpoints, tiny probe, o200k vocab).

Parallel test workers (pytest-xdist) and two demos started together may ask for the same folder at
once; each generator replaces its output with `os.replace`, so an unlocked second writer could swap
a folder out from under a server that is loading it. An advisory `flock` on a sibling lock file
serialises them; the second caller then finds the output current and returns at once.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager


@contextmanager
def exclusive(lock_path: str):
    """Hold an exclusive lock on `lock_path` (created if missing). Where it cannot be created
    (a read-only cache folder: nothing will be written there either) run unlocked."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(lock_path)) or ".", exist_ok=True)
        handle = open(lock_path, "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
