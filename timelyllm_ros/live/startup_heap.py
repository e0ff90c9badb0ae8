"""The start-up heap kept out of the garbage collector's scans while a planner serves.

A full collection of Python's cyclic garbage collector scans every object it tracks, and a
real engine's start-up leaves hundreds of thousands of them (the transformers engine:
412,000, mostly PyTorch's and transformers' modules; a full collection of that heap took
208 ms on this project's machines), all of them alive until the process ends. The planner's
loop stops for the length of each collection: longer than an urgent goal's ERT. vLLM freezes
its own start-up objects for the same reason (``gc.freeze()``); while a planner serves, this
module keeps what was alive when it started frozen, so that a collection scans what serving
made (goals in flight, their segments), and unfreezes it once no planner serves, so that a
closed engine's objects can be collected (some sit in reference cycles).
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_serving = 0        # planners holding the start-up heap frozen


def hold() -> None:
    """A planner starts serving: collect, then freeze what is alive (the first to start
    freezes the engine and libraries; a later one freezes what was made since)."""
    global _serving
    with _lock:
        _serving += 1
        gc.collect()
        gc.freeze()


def release() -> None:
    """A planner stopped serving: once none serves, the frozen objects are tracked again
    (collected when they are garbage)."""
    global _serving
    with _lock:
        if _serving <= 0:
            return
        _serving -= 1
        if _serving == 0:
            gc.unfreeze()


def serving() -> int:
    """How many planners hold the start-up heap frozen."""
    return _serving
