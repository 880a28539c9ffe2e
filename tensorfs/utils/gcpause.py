"""Pausing Python's cyclic garbage collector while large headers become objects."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_pausers = 0
_was_enabled = True


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC for the duration; nests, and is safe from several threads.

    Turning a 100k-tensor header into objects allocates millions of containers and none of them
    can be garbage; without the pause the collector's passes over them take most of the time.
    """
    global _pausers, _was_enabled
    with _lock:
        if _pausers == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _pausers += 1
    try:
        yield
    finally:
        with _lock:
            _pausers -= 1
            if _pausers == 0 and _was_enabled:
                gc.enable()
