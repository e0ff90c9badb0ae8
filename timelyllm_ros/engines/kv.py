"""KV-cache memory accounting in blocks: GPU pool, host swap pool, eviction of paused contexts.

Mirrors vLLM's block manager closely enough for scheduling: a context occupies
``ceil(tokens / block_size)`` blocks; paused contexts stay on the GPU until space is needed,
are then swapped to host memory (cheap to bring back) and, when host memory is full too,
dropped (the generation must re-prefill its prompt and generated tokens on resume).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

Location = Literal['none', 'gpu', 'host']


@dataclass(slots=True)
class _Context:
    tokens: int
    location: Location = 'none'
    dropped: bool = False       # its KV was built, then freed: it must be prefilled again


class KvCacheManager:
    """Owns GPU and host KV blocks of every generation."""

    def __init__(self, gpu_blocks: int, host_blocks: int, block_size: int) -> None:
        if gpu_blocks <= 0 or block_size <= 0 or host_blocks < 0:
            raise ValueError('KV capacity and block size must be positive')
        self.gpu_blocks = gpu_blocks
        self.host_blocks = host_blocks
        self.block_size = block_size
        self._contexts: dict[str, _Context] = {}
        self._paused_on_gpu: OrderedDict[str, None] = OrderedDict()  # least recently paused first
        self._paused_blocks = 0     # blocks they hold: asked at every admission test
        self._gpu_used = 0
        self._host_used = 0
        self.swaps_out = 0
        self.drops = 0
        self._dropped_tokens = 0    # tokens of the dropped contexts (asked at every decision)

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def add(self, request_id: str, tokens: int) -> None:
        self._contexts[request_id] = _Context(tokens)

    def location(self, request_id: str) -> Location:
        return self._contexts[request_id].location

    def tokens(self, request_id: str) -> int:
        return self._contexts[request_id].tokens

    @property
    def gpu_free(self) -> int:
        return self.gpu_blocks - self._gpu_used

    @property
    def host_free(self) -> int:
        return self.host_blocks - self._host_used

    @property
    def dropped_tokens(self) -> int:
        """Tokens of the contexts whose KV was dropped and must be rebuilt to run again."""
        return self._dropped_tokens

    def _evictable(self) -> int:
        return self._paused_blocks

    def _unpause(self, request_id: str, context: _Context) -> None:
        if self._paused_on_gpu.pop(request_id, 0) is None:     # it was there
            self._paused_blocks -= self.blocks(context.tokens)

    def can_place(self, request_id: str, lookahead_tokens: int) -> bool:
        """Whether the context plus ``lookahead_tokens`` fits on the GPU (evicting paused ones)."""
        context = self._contexts[request_id]
        needed = self.blocks(context.tokens + lookahead_tokens)
        if context.location == 'gpu':
            needed -= self.blocks(context.tokens)
            own_evictable = self.blocks(context.tokens) if request_id in self._paused_on_gpu else 0
        else:
            own_evictable = 0
        return needed <= self.gpu_free + self._evictable() - own_evictable

    def place(self, request_id: str, lookahead_tokens: int) -> Location:
        """Bring a context onto the GPU for running; return where it was before."""
        context = self._contexts[request_id]
        before = context.location
        self._undrop(context)
        self._unpause(request_id, context)
        needed = self.blocks(context.tokens + lookahead_tokens)
        if before == 'gpu':
            needed -= self.blocks(context.tokens)
        self._make_room(needed)
        if before == 'host':
            self._host_used -= self.blocks(context.tokens)
        if before != 'gpu':
            self._gpu_used += self.blocks(context.tokens)
        context.location = 'gpu'
        return before

    def grow(self, request_id: str, new_tokens: int = 1) -> bool:
        """Account for generated tokens; False when the GPU is out of blocks."""
        context = self._contexts[request_id]
        extra = self.blocks(context.tokens + new_tokens) - self.blocks(context.tokens)
        if extra > self.gpu_free:
            self._make_room(extra)
        if extra > self.gpu_free:
            return False
        self._gpu_used += extra
        if request_id in self._paused_on_gpu:
            self._paused_blocks += extra
        context.tokens += new_tokens
        return True

    def pause(self, request_id: str) -> None:
        if (self._contexts[request_id].location == 'gpu'
                and request_id not in self._paused_on_gpu):
            self._paused_on_gpu[request_id] = None
            self._paused_blocks += self.blocks(self._contexts[request_id].tokens)

    def swap_out(self, request_id: str) -> bool:
        """Move a context from the GPU to host memory; False if host memory is full."""
        context = self._contexts[request_id]
        if context.location != 'gpu':
            return context.location == 'host'
        size = self.blocks(context.tokens)
        if self._host_used + size > self.host_blocks:
            return False
        self._free(request_id, context)
        self._host_used += size
        context.location = 'host'
        self.swaps_out += 1
        return True

    def shrink(self, request_id: str, tokens: int) -> None:
        """Forget ``tokens`` of a context (KV compression), freeing the blocks they filled."""
        context = self._contexts[request_id]
        tokens = min(max(tokens, 0), context.tokens)
        freed = self.blocks(context.tokens) - self.blocks(context.tokens - tokens)
        if context.location == 'gpu':
            self._gpu_used -= freed
        elif context.location == 'host':
            self._host_used -= freed
        if request_id in self._paused_on_gpu:
            self._paused_blocks -= freed
        if context.dropped:
            self._dropped_tokens -= tokens
        context.tokens -= tokens

    def drop(self, request_id: str) -> None:
        """Free a context's memory but remember its length (it will be re-prefilled)."""
        context = self._contexts[request_id]
        self._free(request_id, context)
        if context.location != 'none':
            self._mark_dropped(context)
        context.location = 'none'

    def remove(self, request_id: str) -> None:
        context = self._contexts.pop(request_id, None)
        if context is not None:
            self._free(request_id, context)
            self._undrop(context)

    def _free(self, request_id: str, context: _Context) -> None:
        self._unpause(request_id, context)
        if context.location == 'gpu':
            self._gpu_used -= self.blocks(context.tokens)
        elif context.location == 'host':
            self._host_used -= self.blocks(context.tokens)

    def _mark_dropped(self, context: _Context) -> None:
        context.dropped = True
        self._dropped_tokens += context.tokens

    def _undrop(self, context: _Context) -> None:
        if context.dropped:
            context.dropped = False
            self._dropped_tokens -= context.tokens

    def _make_room(self, needed: int) -> None:
        while needed > self.gpu_free and self._paused_on_gpu:
            victim, _ = self._paused_on_gpu.popitem(last=False)
            context = self._contexts[victim]
            size = self.blocks(context.tokens)
            self._paused_blocks -= size
            self._gpu_used -= size
            if self._host_used + size <= self.host_blocks:
                self._host_used += size
                context.location = 'host'
                self.swaps_out += 1
            else:
                context.location = 'none'
                self._mark_dropped(context)
                self.drops += 1
        assert 0 <= self._gpu_used <= self.gpu_blocks + needed
