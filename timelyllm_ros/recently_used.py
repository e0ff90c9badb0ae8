"""Bounded caches of computed values that goals' threads and the planner loop share.

The plan grammars, their converted shapes and their compiled matchers are each kept for the
last few hundred scenes; goals' threads fill them (``Scheduler.prepare``) while the loop
reads them, so each step on a cache must leave it whole for the other threads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TypeVar

K = TypeVar('K', bound=Hashable)
V = TypeVar('V')


def recently_used(cache: OrderedDict[K, V], key: K, make: Callable[[], V], kept: int,
                  fresh: Callable[[V], bool] = lambda _: True) -> V:
    """``cache[key]``, made by ``make()`` where absent (or not ``fresh``), and the newest entry
    after; at most ``kept`` entries, the least recently used dropped. Every step is one dict
    operation (the entry is taken out and put back last, not read then moved), so threads
    sharing the cache never meet it half changed; two that race make one value twice at
    worst. What ``make`` raises leaves the key out."""
    value = cache.pop(key, None)
    if value is None or not fresh(value):
        value = make()
    cache[key] = value
    while len(cache) > kept:
        cache.popitem(last=False)
    return value
