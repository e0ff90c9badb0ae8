"""What every engine over a real model shares: the base the llama.cpp, transformers and vLLM
engines (and a new one) fill in with their backend.

A real engine keeps each generation as :class:`~timelyllm_ros.engines.kept.KeptTokens` (its
token ids, never re-tokenized text, its detokenizer and grammar state), a running set, its
counters and the iteration times it observed. :class:`RealEngine` implements the interface
on top of a few backend operations, so that an engine file is about batching against its
backend:

* ``_encode(text)``: token ids of a text, without special tokens;
* ``_prompt_ids(request)``: the ids of a request's prompt (chat template, BOS: the model's);
* ``_new_generation(request, prompt_ids, forced, grammar)``: the kept generation, with the
  backend's detokenizer;
* ``_forward_pass(only)``: one model iteration over the running batch, as a
  :class:`ForwardPass` with the next token each advanced generation chose; the shared step
  takes each token (:func:`~timelyllm_ros.engines.kept.take_token`: forced tokens, end of
  text, grammar, text piece, token and context limits) into a :class:`StepResult`;
* ``_fits(generation)``, ``run_cost_s``, ``decode_step_s``: its memory and latency.

Hooks with defaults: ``_is_eos`` (the ids of ``eos_ids``), ``_forced_ids`` (the script under
``force_script``), ``_grammar`` (refused), ``_joined``, ``_paused``, ``_ended``, ``_released``
(what the backend does when a generation joins the batch, is paused, ends in a step or is
released). ``test/test_engine_family.py`` sketches a whole engine in about 50 lines.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

from timelyllm_ros.engines.base import (
    BatchingEngine,
    Capability,
    EngineRequest,
    EngineStats,
    FinishReason,
    StepResult,
)
from timelyllm_ros.engines.constraint import LlguidanceTokenizer, TokenGrammar
from timelyllm_ros.engines.kept import KeptTokens, take_token
from timelyllm_ros.engines.observed import ObservedLatency
from timelyllm_ros.errors import EngineError

G = TypeVar('G', bound=KeptTokens)


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """How many leading ids two sequences share (at most ``limit``)."""
    end = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    common = 0
    while common < end and a[common] == b[common]:
        common += 1
    return common


@dataclass(slots=True)
class ForwardPass:
    """What one backend iteration did, before its tokens are taken into the generations."""

    produced: dict[str, int] = field(default_factory=dict)   # request id -> the token it
                                       # chose next (taken by the shared rule)
    prefill: bool = False              # a prefill iteration (else a decode one)
    prefill_tokens: int = 0            # tokens fed to fill prompts and recomputes
    batch_size: int = 0                # generations in the iteration (stalled ones included)
    preempted: list[str] = field(default_factory=list)  # lost their KV: to be run again
    decoded: bool = True               # a decode iteration that advanced a generation (its
                                       # time is a decode time)
    seconds: float | None = None       # the backend's own time of the iteration (None: the
                                       # whole step is timed)
    # Output a backend took itself (vLLM chooses, ends and hands out tokens in its core):
    text: dict[str, str] = field(default_factory=dict)
    token_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    finished: dict[str, FinishReason] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)      # request id -> why it
                                       # cannot go on (out of the running batch already)


class RealEngine(BatchingEngine[G]):
    """Continuous batching over a real model: the generations, the running set, the step
    that turns a forward pass into a :class:`StepResult`, the counters and stats."""

    capabilities: ClassVar[frozenset[Capability]] = frozenset({'tokenizer'})
    backend_name: ClassVar[str] = 'real'     # in messages: 'the <backend_name> engine ...'

    max_context: int                          # tokens per generation, prompt included
    model_label: str                          # stats' model (a file stem, a repo id)
    hardware: str                             # stats' hardware
    kv_bytes_per_token: int                   # KV bytes of one token, all layers (0: unknown)
    eos_ids: frozenset[int]                   # ids that end a text (see _is_eos)

    def __init__(self, model: str, max_num_seqs: int = 8, lookahead_tokens: int = 16,
                 force_script: bool = False) -> None:
        """The state every real engine starts with (call it first in the constructor).

        Args:
            model: the model as the engine was asked for it.
            max_num_seqs: largest batch.
            lookahead_tokens: KV headroom a generation needs to join the batch.
            force_script: feed the request's ``script`` (tokenized) instead of the argmax.

        Raises:
            EngineError: ``max_num_seqs`` below 1.
        """
        if max_num_seqs < 1:
            raise EngineError('max_num_seqs must be >= 1')
        self.model_name = model
        self.model_label = model
        self.hardware = 'cpu'
        self.kv_bytes_per_token = 0
        self.eos_ids = frozenset()
        self.force_script = force_script
        self.lookahead_tokens = lookahead_tokens
        self._max_num_seqs = max_num_seqs
        self._generations: dict[str, G] = {}
        self._running: dict[str, None] = {}
        self._closed = False
        self._pending_cached = 0     # prompt tokens served from kept/cached KV since last step
        self._overhead_s = 0.0       # time spent outside steps (evictions) since the last one
        self._released_grammar_s = 0.0   # grammar time of released generations
        self.latency = ObservedLatency()
        # run statistics (read by the calibration and overhead tools and the tests)
        self.steps = 0
        self.busy_s = 0.0
        self.model_s = 0.0               # time inside the model's forward passes (0: untimed)
        self.prefill_s = 0.0
        self.prefill_tokens = 0
        self.decode_s = 0.0
        self.decode_steps = 0
        self.resumed_tokens = 0          # kept tokens of resumed generations (not recomputed)
        self.recomputed_tokens = 0       # tokens of resumed generations that were recomputed
        self.prefix_hit_tokens = 0       # prompt tokens served from a cached prompt prefix

    # -- the backend ------------------------------------------------------------------------
    @abstractmethod
    def _encode(self, text: str) -> list[int]:
        """Token ids of a text, without special tokens."""

    @abstractmethod
    def _prompt_ids(self, request: EngineRequest) -> list[int]:
        """The token ids of a request's prompt (its chat turns through the model's template
        where the engine renders them)."""

    @abstractmethod
    def _new_generation(self, request: EngineRequest, prompt_ids: list[int],
                        forced: list[int] | None, grammar: TokenGrammar | None) -> G:
        """The generation the engine keeps for a registered request."""

    @abstractmethod
    def _forward_pass(self, only: Collection[str] | None) -> ForwardPass:
        """One model iteration over the running batch (``only``: the decode mask)."""

    @abstractmethod
    def _fits(self, generation: G) -> bool:
        """Whether KV memory allows a generation that is not running to join the batch now
        (the batch has room)."""

    def _is_eos(self, token: int) -> bool:
        """Whether a token ends the text."""
        return token in self.eos_ids

    def _grammar(self, gbnf: str) -> TokenGrammar | None:
        """The grammar state of a new generation (None: the backend applies it itself).

        Raises:
            EngineError: the engine has no ``'grammar'`` capability, or refuses the grammar.
        """
        raise EngineError(f'the {self.backend_name} engine cannot constrain decoding to a '
                          'grammar')

    def _built_grammar_tokenizer(self) -> LlguidanceTokenizer | None:
        """The llguidance tokenizer the engine compiles plan grammars with, once built (None
        before its first constrained request, or where grammars are compiled otherwise)."""
        return None

    def _joined(self, generation: G) -> None:
        """A generation joins the running batch: by default its kept KV is a resume."""
        if generation.location == 'device' and generation.cached:
            self._count_resume(generation)

    def _paused(self, generation: G) -> None:
        """A generation left the running batch (paused or evicted)."""

    def _ended(self, request_id: str) -> None:
        """A generation ended in a step (it is out of the running batch)."""

    def _released(self, generation: G) -> None:
        """A generation was released: free what the backend holds of it."""

    # -- Engine interface -------------------------------------------------------------------
    def prepare_request(self, request: EngineRequest) -> None:
        """Compile the request's plan grammar into the engine's llguidance cache, the part of
        :meth:`register` that costs milliseconds for each new scene (the goal's thread pays
        it, not the loop). The tokenizer is built by the first constrained request's
        registration, on the loop: reading the vocabulary beside the loop's own use of the
        tokenizer is not safe."""
        if request.grammar is None or self.force_script or not self.supports('grammar'):
            return
        tokenizer = self._built_grammar_tokenizer()
        if tokenizer is None:
            return
        try:
            tokenizer.prepare(request.grammar)
        except EngineError:
            return          # register refuses the grammar, with this reason

    def register(self, request: EngineRequest) -> None:
        self._check_open()
        if request.request_id in self._generations:
            raise EngineError(f'request {request.request_id!r} is already registered')
        prompt_ids = self._prompt_ids(request) or self._encode(' ')
        if len(prompt_ids) >= self.max_context:
            raise EngineError(f'request {request.request_id!r}: prompt of {len(prompt_ids)} '
                              f'tokens does not fit the context of {self.max_context}')
        forced = self._forced_ids(request)
        grammar = (self._grammar(request.grammar)
                   if request.grammar is not None and forced is None else None)
        self._generations[request.request_id] = self._new_generation(
            request, prompt_ids, forced, grammar)

    def can_run(self, request_id: str) -> bool:
        if request_id in self._running:
            return True
        if len(self._running) >= self._max_num_seqs:
            return False
        return self._fits(self._get(request_id))

    def run(self, request_id: str) -> None:
        self._check_open()
        generation = self._get(request_id)
        if request_id in self._running:
            return
        if not self.can_run(request_id):
            raise EngineError(f'request {request_id!r} does not fit in KV memory now')
        self._joined(generation)
        self._running[request_id] = None

    def pause(self, request_id: str) -> None:
        generation = self._get(request_id)
        self._running.pop(request_id, None)
        self._paused(generation)

    def release(self, request_id: str) -> None:
        generation = self._generations.pop(request_id, None)
        self._running.pop(request_id, None)
        if generation is not None:
            self._released_grammar_s += generation.grammar_s
            self._released(generation)

    def step(self, only: Collection[str] | None = None) -> StepResult:
        self.steps += 1
        overhead, self._overhead_s = self._overhead_s, 0.0
        if not self._running:
            return StepResult(duration_s=overhead)
        start = time.perf_counter()
        forward = self._forward_pass(only)
        for request_id, token in forward.produced.items():
            self._take(forward, request_id, token)
        for request_id in forward.finished:
            self._running.pop(request_id, None)
            self._ended(request_id)
        duration = (time.perf_counter() - start if forward.seconds is None
                    else forward.seconds)
        self._record(forward, duration)
        duration += overhead
        self.busy_s += duration
        cached, self._pending_cached = self._pending_cached, 0
        return StepResult(duration_s=duration, text=forward.text, token_ids=forward.token_ids,
                          finished=forward.finished, preempted=tuple(forward.preempted),
                          failed=forward.failed,
                          prefill_tokens=forward.prefill_tokens, prefix_cached_tokens=cached,
                          batch_size=forward.batch_size)

    def stats(self) -> EngineStats:
        """Identity and the counters every real engine keeps; an engine adds its KV capacity
        and its own figures (swaps, preemptions)."""
        return EngineStats(model=self.model_label, hardware=self.hardware, steps=self.steps,
                           busy_s=self.busy_s, kv_bytes_per_token=self.kv_bytes_per_token,
                           grammar_s=self.grammar_s, model_s=self.model_s)

    def context_tokens(self, request_id: str) -> int:
        """Its prompt and output tokens: the KV a segment of it fills."""
        return self._get(request_id).total

    def count_tokens(self, text: str) -> int:
        """Tokens of a text with the model's tokenizer (no special tokens)."""
        return len(self._encode(text))

    def token_ids(self, request_id: str) -> tuple[int, ...]:
        """The output token ids a generation has produced so far (kept across segments)."""
        return tuple(self._get(request_id).output_ids)

    @property
    def grammar_s(self) -> float:
        """Time spent in grammar checks and masks, released generations included."""
        return self._released_grammar_s + sum(g.grammar_s for g in self._generations.values())

    # -- shared parts -----------------------------------------------------------------------
    def _check_open(self) -> None:
        """After :meth:`close` the backend's memory (model, vocabulary) is freed: using it
        would read freed memory."""
        if self._closed:
            raise EngineError(f'the {self.backend_name} engine is closed')

    def _forced_ids(self, request: EngineRequest) -> list[int] | None:
        """The teacher-forced output ids of a request under ``force_script`` (its script
        joined and tokenized); None when it is generated.

        Raises:
            EngineError: ``force_script`` is on and the request has no script.
        """
        if not self.force_script:
            return None
        if request.script is None:
            raise EngineError(f'request {request.request_id!r} has no script to force')
        return self._encode(''.join(request.script))

    def _take(self, forward: ForwardPass, request_id: str, token: int) -> None:
        """Take a produced (or forced) token into its generation and the step's output."""
        generation = self._generations[request_id]
        before = len(generation.output_ids)
        piece, reason = take_token(generation, token, self._is_eos, self.max_context)
        if piece is not None:
            forward.text[request_id] = piece
        if len(generation.output_ids) > before:
            forward.token_ids[request_id] = tuple(generation.output_ids[before:])
        if reason is not None:
            forward.finished[request_id] = reason

    def _record(self, forward: ForwardPass, duration: float) -> None:
        """Count an iteration's time as prefill or decode time, and observe it."""
        if forward.prefill:
            self.prefill_s += duration
            self.prefill_tokens += forward.prefill_tokens
            self.latency.record_prefill(forward.prefill_tokens, duration)
        elif forward.decoded:
            self.decode_s += duration
            self.decode_steps += 1
            self.latency.record_decode(forward.batch_size, duration)

    def _count_resume(self, generation: G) -> None:
        """A generation resumes over its kept KV: its tokens are not recomputed."""
        generation.resumes += 1
        self.resumed_tokens += generation.cached
        self._pending_cached += generation.cached

    def _count_recompute(self, generation: G) -> None:
        """A generation resumes without its KV: the tokens not cached are recomputed."""
        generation.resumes += 1
        self.recomputed_tokens += generation.total - generation.cached

    def _count_prefix_hit(self, tokens: int) -> None:
        """Prompt tokens of a joining generation served from a cached prompt prefix."""
        self.prefix_hit_tokens += tokens
        self._pending_cached += tokens

    def _warm(self, request_ids: Sequence[str], prompt: str, prompt_tokens: int,
              steps: int) -> None:
        """Run these warm-up generations together for ``steps + 1`` iterations, generated
        (never forced), then release them."""
        saved, self.force_script = self.force_script, False
        try:
            for request_id in request_ids:
                self.register(EngineRequest(request_id, prompt, prompt_tokens, steps + 2))
                self.run(request_id)
            for _ in range(steps + 1):
                self.step()
            for request_id in request_ids:
                self.release(request_id)
        finally:
            self.force_script = saved

    def close(self) -> None:
        """Forget every generation; the engine is unusable afterwards (an engine frees its
        backend too). Idempotent."""
        self._closed = True
        self._generations.clear()
        self._running.clear()
