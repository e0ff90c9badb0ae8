"""The inference-engine interface the scheduler drives (one step = one model iteration).

Call order, per scheduler tick: the scheduler asks :meth:`Engine.can_run` /
:meth:`Engine.run_cost_s` for candidates, calls :meth:`Engine.run` for the admitted ones, then
:meth:`Engine.step` once; generations it cuts at a segment boundary are :meth:`Engine.pause`\\ d
(KV cache and token ids kept), finished or cancelled ones :meth:`Engine.release`\\ d.
Engines do not know about time utility, segments or robots.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from timelyllm_ros.errors import EngineError

FinishReason = Literal['eos', 'length']
EvictTo = Literal['host', 'none']   # KV swapped to host memory, or dropped (recompute on resume)


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One generation as the engine sees it."""

    request_id: str
    prompt: str                                # full prompt text (real engines tokenize it)
    prompt_tokens: int                         # prompt length in tokens
    max_tokens: int                            # generation token limit
    script: tuple[str, ...] | None = None      # simulated engines emit these pieces, then EOS
    prefix_id: str | None = None               # name of the prompt prefix shared by a robot kind
    prefix_tokens: int = 0                     # its length: cacheable across requests


KvLocation = Literal['device', 'host', 'none']   # where a real engine holds a context's KV


@dataclass(slots=True)
class KeptTokens:
    """What a real engine keeps of one generation between segments: its token ids (never
    re-tokenized text) and how many leading ones have KV, wherever that KV is."""

    request: EngineRequest
    prompt_ids: list[int]
    forced: list[int] | None = None          # teacher-forced output ids (force_script)
    output_ids: list[int] = field(default_factory=list)
    cached: int = 0                          # leading tokens of ids() whose KV exists
    location: KvLocation = 'none'
    resumes: int = 0

    def ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def total(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def pending(self) -> int:
        """Tokens to feed before the next token can be produced."""
        return self.total - self.cached


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one engine iteration produced."""

    duration_s: float                                          # time the iteration took (s)
    tokens: dict[str, str] = field(default_factory=dict)       # request id -> new text piece
    finished: dict[str, FinishReason] = field(default_factory=dict)  # request id -> why it ended
    preempted: tuple[str, ...] = ()                            # lost their KV: must be re-run
    prefill_tokens: int = 0                                    # tokens prefilled this step
    prefix_cached_tokens: int = 0      # prompt tokens of (re)joining generations served from
                                       # kept or cached KV instead of being prefilled
    batch_size: int = 0                                        # generations in the iteration


class Engine(ABC):
    """A continuous-batching engine that can pause a generation and resume it later."""

    @abstractmethod
    def register(self, request: EngineRequest) -> None:
        """Make a request known (no memory is used until :meth:`run`)."""

    @abstractmethod
    def can_run(self, request_id: str) -> bool:
        """Whether KV memory allows adding this generation to the running batch now."""

    @abstractmethod
    def run_cost_s(self, request_id: str) -> float:
        """Extra time the next iteration takes if this generation joins (prefill, swap-in)."""

    @abstractmethod
    def run(self, request_id: str) -> None:
        """Add a registered or paused generation to the running batch."""

    @abstractmethod
    def pause(self, request_id: str) -> None:
        """Take a generation out of the batch, keeping its token ids and (if possible) KV."""

    @abstractmethod
    def release(self, request_id: str) -> None:
        """Forget a generation and free all its memory."""

    @abstractmethod
    def step(self, only: Collection[str] | None = None) -> StepResult:
        """Run one iteration over the running batch.

        ``only`` restricts a decode iteration to these running generations (a decode mask);
        the other running ones stay resident and idle. Newly joined generations are prefilled
        whatever the mask.
        """

    # -- optional capabilities: rival policies use them where the engine has them ----------
    supports_kv_compression: ClassVar[bool] = False

    def evict(self, request_id: str, to: EvictTo) -> None:
        """Take a generation out of the batch and move its KV to host memory (``'host'``) or
        drop it (``'none'``: rebuilt from the kept token ids when it runs again).

        Raises:
            EngineError: the engine cannot evict.
        """
        raise EngineError(f'{type(self).__name__} cannot evict KV caches')

    def compress_kv(self, request_id: str, evict_ratio: float) -> None:
        """Evict a fraction of the prompt's KV after prefill (TimeBill's α; SnapKV-style).

        Raises:
            EngineError: the engine has no KV compression (``supports_kv_compression``).
        """
        raise EngineError(f'{type(self).__name__} cannot compress KV caches')

    @abstractmethod
    def decode_step_s(self, batch_size: int) -> float:
        """Estimated time of one decode iteration with ``batch_size`` generations."""

    @property
    @abstractmethod
    def running(self) -> tuple[str, ...]:
        """Ids of the generations in the running batch."""

    @property
    @abstractmethod
    def max_num_seqs(self) -> int:
        """Largest batch the engine accepts."""
