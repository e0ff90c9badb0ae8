"""Calibrated discrete-event simulation of a continuous-batching engine (the embedded default).

Each :meth:`SimulatedEngine.step` is one engine iteration whose duration comes from the
calibration: the model's latency plus the engine's fixed cost per iteration
(:class:`~timelyllm_ros.engines.base.EngineBehaviour`). Without a prefill token budget
(vLLM 0.5), an iteration either prefills the newly admitted generations (stalling the decode
of the others) or decodes one token for every running generation; with one (chunked
prefill, vLLM v1), an iteration decodes every running generation and prefills pending
prompts up to the budget. At most ``max_joins_per_iteration`` generations start their prefill
per iteration. A suspended generation resumes for free (``kept_kv``) or, as a new request
over a prefix cache (``new_request_prefix_cache``, vLLM), with its uncached tail prefilled in
the iteration where it resumes. The text is replayed from the request's ``script``
(token pieces of a recorded trace), followed by EOS; for live goals the simulator chooses that
script itself from its script source (:mod:`timelyllm_ros.engines.scripts`). It has no
vocabulary: the id of a token is its position in the output.

With prefix caching on (as in the authors' vLLM setup), the prompt prefix that is fixed per
robot kind (skills, guidance, examples) is prefilled once and then shared: later requests of
that kind prefill only their task line, and the prefix's KV blocks are counted once. Where the
calibration's engine caches every full block (``prompt_cache: blocks``, vLLM), a goal whose
prompt was prefilled before prefills only what follows its last full block (its KV is still
counted as its own: memory is accounted as without it).

Where the calibration says so (``outputs_one_iteration_late``: vLLM's asynchronous scheduling
with this project's logits processor), a step runs its iteration and hands out the outputs of
the one before, as the real engine does.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import ClassVar

from timelyllm_ros.engines.base import (
    BatchingEngine,
    Capability,
    CostModel,
    EngineBehaviour,
    EngineRequest,
    EngineStats,
    EvictTo,
    FinishReason,
    KvAccounting,
    PlanScript,
    StepResult,
)
from timelyllm_ros.engines.calibration import Calibration, load_calibration
from timelyllm_ros.engines.kv import KvCacheManager
from timelyllm_ros.engines.observed import (
    NEW_REQUEST_DEFAULT_DECODE_S,
    NEW_REQUEST_DEFAULT_TPS,
    ObservedLatency,
    new_request_join_tokens,
)
from timelyllm_ros.engines.scripts import ScriptSource, TraceScripts
from timelyllm_ros.errors import EngineError
from timelyllm_ros.safe_files import EngineInputError


@dataclass(frozen=True, slots=True)
class IterationPlan:
    """The next iteration of a simulated engine, as its state now makes it."""

    duration_s: float
    model_s: float                           # less the engine's fixed costs
    new_tokens: int                          # tokens it prefills
    producing: tuple[str, ...]               # generations that get a token (or end)
    batch_size: int
    prefills: tuple[tuple[str, int], ...]    # (generation, tokens prefilled) of its joiners
    members: frozenset[str] | None           # its decode's members when they changed
    readmitted: tuple[str, ...]              # resumed generations re-admitted in it


@dataclass(slots=True)
class _Generation:
    request: EngineRequest
    emitted: int = 0            # output tokens produced so far (EOS excluded)
    prefill_tokens: int = 0     # tokens to (re)compute before the next token
    swap_in_tokens: int = 0     # tokens to bring back from host memory
    evict_ratio: float = 0.0    # share of the prompt's KV evicted after prefill (TimeBill)
    evicted_tokens: int = 0     # shared-prefix tokens this generation no longer attends to
    started: bool = False       # has run before: a later run() after a pause is a resume
    resuming: bool = False      # resumed as a new request, its re-admission not charged yet
    prefill_context: int = 0    # tokens already in its KV before its pending prefill
    joined_at: int = 0          # order of (re)joining, for the join limit


class SimulatedEngine(BatchingEngine[_Generation]):
    """A latency-model engine; deterministic for a given sequence of calls."""

    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {'evict', 'compress_kv', 'scripted_plans'})
    live_options: ClassVar[Mapping[str, object]] = {'realtime': True}

    @classmethod
    def prepare_options(cls, options: dict[str, object]) -> dict[str, object]:
        """A calibration given by name or path is loaded; a model is refused (the simulator
        has none)."""
        if 'model' in options:
            raise EngineError("engine 'sim' takes no model: it replays recorded plans with the "
                              'latency of a calibration (option calibration=NAME or a YAML path)')
        calibration = options.get('calibration')
        if isinstance(calibration, str):
            options = {**options, 'calibration': load_calibration(calibration)}
        return options

    def __init__(
        self,
        calibration: Calibration | None = None,
        lookahead_tokens: int = 16,
        max_num_seqs: int | None = None,
        fail_at_step: int | None = None,
        prefix_caching: bool = True,
        realtime: bool = False,
        scripts: ScriptSource | None = None,
    ) -> None:
        """Args:
            calibration: latency model; the bundled Llama3-8B / RTX 4090 one by default.
            lookahead_tokens: KV headroom reserved when a generation joins the batch.
            max_num_seqs: batch cap (default: the calibration's).
            fail_at_step: raise :class:`EngineError` at this iteration (failure injection).
            prefix_caching: share the KV of prompt prefixes across requests.
            realtime: sleep for each iteration's duration, so that the simulator can stand in
                for a real engine behind live nodes on a wall clock.
            scripts: where the plans of live goals come from (default: the bundled traces).
        """
        # Checked because 0 would not fail but fall back to the calibration's cap unseen, and
        # a negative lookahead or failure step would make no sense.
        for option, value, low in (('max_num_seqs', max_num_seqs, 1),
                                   ('lookahead_tokens', lookahead_tokens, 0),
                                   ('fail_at_step', fail_at_step, 0)):
            if value is not None and value < low:
                raise EngineInputError("engine 'sim'", f'must be >= {low}, got {value}', option)
        self.calibration = calibration or load_calibration()
        cal = self.calibration
        self.kv = KvCacheManager(
            gpu_blocks=cal.gpu_kv_tokens // cal.block_size,
            host_blocks=cal.host_kv_tokens // cal.block_size,
            block_size=cal.block_size,
        )
        self.lookahead_tokens = lookahead_tokens
        self._max_num_seqs = max_num_seqs or cal.max_num_seqs
        self._fail_at_step = fail_at_step
        self._generations: dict[str, _Generation] = {}
        self._running: dict[str, None] = {}
        self._attended_total: int | None = None   # over the running set; None: recompute
        self.prefix_caching = prefix_caching
        self.realtime = realtime
        self._scripts = scripts
        self._cached_prefixes: set[str] = set()
        self._cached_prompts: set[str] = set()     # prompts whose KV blocks are cached
                                                   # (prompt_cache 'blocks')
        self.prefix_hits = 0
        self.prefix_misses = 0
        self.steps = 0
        self.busy_s = 0.0
        self.model_s = 0.0          # busy time less the engine's fixed cost per iteration
        self.resumes = 0            # runs of a suspended generation whose KV was kept
        self.resume_tokens = 0      # ... tokens they recomputed (new-request resume model)
        self._joins = 0
        self._pending_cached = 0   # prompt tokens of generations joined since the last step
                                   # that were not recomputed (kept, swapped in, cached prefix)
        self._decode_members: frozenset[str] = frozenset()   # who the last decode ran
        self._held: StepResult | None = None   # outputs not handed out yet (outputs one
                                               # iteration late)
        # What a real engine that prices admission from its own iterations would have
        # observed by now (estimates 'observed'); None: admission reads the calibration.
        self._observed = ObservedLatency() if cal.engine.estimates == 'observed' else None

    # -- Engine interface ------------------------------------------------------------------
    def stats(self) -> EngineStats:
        cal = self.calibration
        return EngineStats(model=cal.model, hardware=f'simulated {cal.gpu}', steps=self.steps,
                           busy_s=self.busy_s, kv_capacity_tokens=cal.gpu_kv_tokens,
                           kv_bytes_per_token=cal.kv_bytes_per_token, model_s=self.model_s)

    def behaviour(self) -> EngineBehaviour:
        return self.calibration.engine

    @property
    def kv_block_size(self) -> int:
        return self.calibration.block_size

    def kv_accounting(self) -> KvAccounting:
        return self.kv

    def kv_room_tokens(self) -> int:
        free = (self.kv.gpu_free + self.kv.host_free) * self.kv.block_size
        return max(free - self.kv.dropped_tokens, 0)

    def context_tokens(self, request_id: str) -> int:
        return self.kv.tokens(request_id)

    def new_context_tokens(self, request: EngineRequest) -> int:
        """The KV tokens a request's context would fill here before it generates."""
        return request.prompt_tokens - self._shared_tokens(request)

    def reset_prefix_cache(self) -> None:
        self._attended_total = None
        self._cached_prefixes.clear()
        self._cached_prompts.clear()

    def cost_model(self) -> CostModel:
        return self.calibration

    def scripted_plan(self, robot_kind: str, task: str, task_class: str) -> PlanScript:
        if self._scripts is None:
            self._scripts = TraceScripts()
        return self._scripts.plan_for(robot_kind, task, task_class)

    def register(self, request: EngineRequest) -> None:
        if request.request_id in self._generations:
            raise EngineError(f'request {request.request_id!r} is already registered')
        if not 0 <= request.prefix_tokens <= request.prompt_tokens:
            raise EngineError(f'request {request.request_id!r}: prefix_tokens must be within '
                              f'[0, prompt_tokens]')
        self._generations[request.request_id] = _Generation(request)
        self.kv.add(request.request_id, self.new_context_tokens(request))

    def can_run(self, request_id: str) -> bool:
        if request_id in self._running:
            return True
        if len(self._running) >= self._max_num_seqs:
            return False
        return self.kv.can_place(request_id, self.lookahead_tokens)

    def _shared_tokens(self, request: EngineRequest) -> int:
        return request.prefix_tokens if self.prefix_caching and request.prefix_id else 0

    def _prefill_tokens(self, request_id: str) -> int:
        """Tokens to compute to (re)build a dropped context: all but a cached prefix."""
        request = self._generations[request_id].request
        tokens = self.kv.tokens(request_id)
        if self._shared_tokens(request) and request.prefix_id not in self._cached_prefixes:
            tokens += request.prefix_tokens
        return tokens

    def run_cost_s(self, request_id: str) -> float:
        if self._observed is not None and request_id not in self._running:
            generation = self._generations[request_id]
            tokens = new_request_join_tokens(generation.request.prompt_tokens + generation.emitted,
                                             generation.emitted > 0, self.calibration.block_size)
            return self._observed.prefill_s(tokens, default_tps=NEW_REQUEST_DEFAULT_TPS)
        location = self.kv.location(request_id)
        tokens = self.kv.tokens(request_id)
        cal = self.calibration
        if location == 'host':
            return cal.swap_in_s(tokens)
        if request_id in self._running:
            return 0.0
        if location != 'none' and cal.engine.resume == 'kept_kv':
            return 0.0              # its KV is on the GPU, kept: nothing to compute to join
        new, context = self._join_prefill(request_id, location == 'none')
        if not new:
            return 0.0
        resume = cal.resume_overhead_s if location != 'none' else 0.0
        return cal.prefill_s(new) + cal.context_prefill_s(new, context) + resume

    def _join_prefill(self, request_id: str, dropped: bool) -> tuple[int, int]:
        """(tokens to prefill, tokens already in the KV before them) if the generation joined
        the batch now: its whole context but a cached prompt prefix when its KV was dropped
        (or never built); else, kept, nothing, or a new-request resume's uncached tail."""
        generation = self._generations[request_id]
        if dropped:
            request = generation.request
            hit = request.prefix_id in self._cached_prefixes
            new = self._prefill_tokens(request_id)
            context = self._shared_tokens(request) if hit else 0
            if request.prompt in self._cached_prompts:    # the block cache holds its prompt
                cached = max(context, self.calibration.cached_block_tokens(request.prompt_tokens))
                new, context = new + context - cached, cached
            return new, context
        if not generation.started:
            return 0, 0
        context = self._attended_tokens(request_id)
        tail = self.calibration.resume_tail_tokens(context)
        return tail, context - tail

    def run(self, request_id: str) -> None:
        generation = self._get(request_id)
        if request_id in self._running:
            return
        if not self.can_run(request_id):
            raise EngineError(f'request {request_id!r} does not fit in KV memory now')
        before = self.kv.place(request_id, self.lookahead_tokens)
        tokens = self.kv.tokens(request_id)
        request = generation.request
        shared = self._shared_tokens(request)
        if before == 'none':
            generation.prefill_tokens, generation.prefill_context = self._join_prefill(
                request_id, dropped=True)
            if shared:
                hit = request.prefix_id in self._cached_prefixes
                self.prefix_hits += hit
                self.prefix_misses += not hit
                self._cached_prefixes.add(request.prefix_id)  # type: ignore[arg-type]
            self._pending_cached += generation.prefill_context
            if self.prefix_caching and self.calibration.engine.prompt_cache == 'blocks':
                self._cached_prompts.add(request.prompt)
        else:
            if before == 'host':
                generation.swap_in_tokens = tokens
                self._pending_cached += tokens + shared
            else:
                tail, generation.prefill_context = self._join_prefill(request_id, dropped=False)
                generation.prefill_tokens = tail
                generation.resuming = tail > 0
                self.resumes += generation.started
                self.resume_tokens += tail
                self._pending_cached += tokens + shared - tail
        generation.started = True
        self._joins += 1
        generation.joined_at = self._joins
        self._running[request_id] = None
        if self._attended_total is not None:    # a join changes no other context
            self._attended_total += self._attended_tokens(request_id)

    def pause(self, request_id: str) -> None:
        self._get(request_id)
        self._leave(request_id)
        self._take_back(request_id)
        self.kv.pause(request_id)

    def release(self, request_id: str) -> None:
        self._leave(request_id)
        self._take_back(request_id)
        self._generations.pop(request_id, None)
        self.kv.remove(request_id)

    def _leave(self, request_id: str) -> None:
        """Take a generation out of the running batch (if there), less its attended tokens
        in the batch's total (the decode-step model reads it at every admission test;
        summing the batch again after every change cost a tenth of each decision)."""
        if request_id in self._running:
            if self._attended_total is not None:
                self._attended_total -= self._attended_tokens(request_id)
            del self._running[request_id]

    def decode_step_s(self, batch_size: int) -> float:
        if self._observed is not None:
            return self._observed.nearest_decode_s(batch_size, NEW_REQUEST_DEFAULT_DECODE_S)
        return self._model_decode_step_s(batch_size)

    def _model_decode_step_s(self, batch_size: int) -> float:
        """A decode iteration of ``batch_size`` generations of the running ones' mean context,
        by the calibration."""
        if not self._running:
            context = batch_size * self.calibration.decode_ms.reference_context_tokens
        else:
            # asked many times per decision (every admission test): kept up to date by every
            # call that changes the batch or a running context (a join, a cut, an end, each
            # iteration's tokens); summed again only after a reset
            if self._attended_total is None:
                self._attended_total = sum(self._attended_tokens(r) for r in self._running)
            context = int(batch_size * (self._attended_total / len(self._running)))
        return self.calibration.decode_s(batch_size, context)

    def _attended_tokens(self, request_id: str) -> int:
        """Context a decode step reads for this generation: its own KV plus the shared prompt
        prefix (stored once, read by every sequence), less what compression evicted."""
        generation = self._generations[request_id]
        return (self.kv.tokens(request_id) + self._shared_tokens(generation.request)
                - generation.evicted_tokens)

    def evict(self, request_id: str, to: EvictTo) -> None:
        self._get(request_id)
        self._leave(request_id)
        self._take_back(request_id)
        if to == 'host' and self.kv.swap_out(request_id):
            return
        self.kv.drop(request_id)

    def compress_kv(self, request_id: str, evict_ratio: float) -> None:
        if not 0.0 <= evict_ratio < 1.0:
            raise EngineError(f'evict ratio must be in [0, 1), got {evict_ratio}')
        self._get(request_id).evict_ratio = evict_ratio

    def step(self, only: Collection[str] | None = None) -> StepResult:
        result = self._step(only)
        if self._observed is not None:     # what a real engine records of its step
            if result.prefill_tokens:
                self._observed.record_prefill(result.prefill_tokens, result.duration_s)
            elif result.text:
                self._observed.record_decode(result.batch_size, result.duration_s)
        return result

    def _step(self, only: Collection[str] | None) -> StepResult:
        self.steps += 1
        if self._fail_at_step is not None and self.steps == self._fail_at_step:
            raise EngineError(f'simulated engine failure at iteration {self.steps}')
        late = self.calibration.engine.outputs_one_iteration_late
        if not self._running:
            if late and self._held is not None:
                flush = self._flush_s()
                self.busy_s += flush
                return self._hand_out(flush)
            return StepResult(duration_s=0.0)
        plan = self.next_iteration(only)
        generations = self._generations
        for r, chunk in plan.prefills:
            generations[r].swap_in_tokens = 0
            if chunk:
                self._prefilled(r, chunk)
        if plan.members is not None:
            self._decode_members = plan.members
        for r in plan.readmitted:
            generations[r].resuming = False
        self.model_s += plan.model_s
        duration = plan.duration_s
        producing = plan.producing
        text: dict[str, str] = {}
        token_ids: dict[str, tuple[int, ...]] = {}
        finished: dict[str, FinishReason] = {}
        preempted: list[str] = []
        grown = 0                   # running generations whose KV took one more token
        for request_id in producing:
            generation = self._generations[request_id]
            request = generation.request
            script = request.script or ()
            if generation.emitted >= len(script):
                finished[request_id] = 'eos'
                continue
            if not self.kv.grow(request_id):
                preempted.append(request_id)
                continue
            grown += request_id in self._running
            text[request_id] = script[generation.emitted]
            token_ids[request_id] = (generation.emitted,)
            generation.emitted += 1
            if generation.emitted >= request.max_tokens:
                finished[request_id] = 'length'
        if self._attended_total is not None:
            self._attended_total += grown
        for request_id in preempted:
            # Out of KV blocks even after evicting paused contexts: recompute later (vLLM).
            self._leave(request_id)
            self.kv.drop(request_id)
        for request_id in finished:
            self._leave(request_id)
        self.busy_s += duration
        if self.realtime:
            time.sleep(duration)
        cached, self._pending_cached = self._pending_cached, 0
        result = StepResult(
            duration_s=duration, text=text, token_ids=token_ids, finished=finished,
            preempted=tuple(preempted),
            prefill_tokens=plan.new_tokens, prefix_cached_tokens=cached,
            batch_size=plan.batch_size,
        )
        if not late:
            return result
        handed = self._hand_out(duration)
        self._held = result
        return handed

    def _hand_out(self, duration_s: float) -> StepResult:
        """The outputs held from the iteration before, with the time of the step now."""
        held, self._held = self._held, None
        if held is None:
            return StepResult(duration_s=duration_s)
        return dataclasses.replace(held, duration_s=duration_s)

    def _flush_s(self) -> float:
        """A step that only hands the held outputs out: vLLM schedules a generation that
        ended on EOS once more before it sees the EOS, so that costs a decode of them."""
        assert self._held is not None
        ended = sum(reason == 'eos' for reason in self._held.finished.values())
        return self._model_decode_step_s(ended) if ended else 0.0

    def _take_back(self, request_id: str) -> None:
        """A generation cut, evicted or released before its held output was handed out:
        the token computed past what the scheduler saw is thrown away (vLLM drops the late
        output of an aborted request)."""
        held = self._held
        if held is None:
            return
        tokens = len(held.token_ids.pop(request_id, ()))
        held.text.pop(request_id, None)
        held.finished.pop(request_id, None)
        generation = self._generations.get(request_id)
        if tokens and generation is not None:
            generation.emitted -= tokens
            self.kv.shrink(request_id, tokens)

    def next_iteration(self, only: Collection[str] | None = None) -> IterationPlan:
        """What the next :meth:`step` would run and how long it would take, from the engine's
        state now; nothing changes (the simulated replicas time an iteration at its start)."""
        cal = self.calibration
        generations = self._generations
        if not self._running:
            return IterationPlan(0.0, 0.0, 0, (), 0, (), None, ())
        pending = sorted((r for r in self._running
                          if generations[r].prefill_tokens or generations[r].swap_in_tokens),
                         key=lambda r: generations[r].joined_at)
        joins = cal.engine.max_joins_per_iteration
        prefilling = pending[:joins] if joins else pending
        if cal.engine.prefill_token_budget is None:
            duration, new_tokens, producing, batch_size, prefills = (
                self._whole_prefill_or_decode(prefilling, only))
        else:
            duration, new_tokens, producing, batch_size, prefills = self._chunked(
                prefilling, set(pending), only, cal.engine.prefill_token_budget)
        model_s = duration
        members = None
        if not new_tokens and producing:
            change, members = self._batch_change_s(producing)
            duration += change
        readmitted = tuple(r for r in prefilling if generations[r].resuming)
        duration += cal.iteration_overhead_s + len(readmitted) * cal.resume_overhead_s
        return IterationPlan(duration, model_s, new_tokens, tuple(producing), batch_size,
                             tuple(prefills), members, readmitted)

    def _batch_change_s(self, producing: list[str]) -> tuple[float, frozenset[str] | None]:
        """What a decode costs beyond the model when its members changed since the last one:
        each member's KV restacked to the batch's longest context; and the new members
        (None: unchanged)."""
        members = frozenset(producing)
        if members == self._decode_members:
            return 0.0, None
        widest = max(self._attended_tokens(r) for r in producing)
        return (self.calibration.engine.batch_change_ms_per_token * len(producing) * widest
                / 1000.0), members

    def _whole_prefill_or_decode(self, prefilling: list[str], only: Collection[str] | None
                                 ) -> tuple[float, int, list[str], int, list[tuple[str, int]]]:
        """vLLM 0.5: prefill the joining generations whole (the others' decode stalls), or
        decode every running one. Returns (duration, prefilled tokens, producing, batch, the
        prefills to apply as (generation, tokens))."""
        cal = self.calibration
        generations = self._generations
        if prefilling:
            new_tokens = sum(generations[r].prefill_tokens for r in prefilling)
            swapped = sum(generations[r].swap_in_tokens for r in prefilling)
            duration = (cal.prefill_s(new_tokens) + cal.swap_in_s(swapped)
                        + sum(self._context_cost_s(r, generations[r].prefill_tokens)
                              for r in prefilling))
            producing = [r for r in prefilling if generations[r].prefill_tokens]
            prefills = [(r, generations[r].prefill_tokens) for r in prefilling]
            return duration, new_tokens, producing, len(self._running), prefills  # stalled too
        ready = [r for r in self._running if not generations[r].prefill_tokens]
        producing = [r for r in ready if only is None or r in only] or ready
        context = sum(self._attended_tokens(r) for r in producing)
        return cal.decode_s(len(producing), context), 0, producing, len(producing), []

    def _chunked(self, prefilling: list[str], pending: set[str], only: Collection[str] | None,
                 budget: int) -> tuple[float, int, list[str], int, list[tuple[str, int]]]:
        """Chunked prefill (vLLM v1): decode every ready generation and spend the rest of the
        token budget on pending prefills, oldest first; a generation whose prefill completes
        produces its first token in the same iteration."""
        cal = self.calibration
        generations = self._generations
        ready = [r for r in self._running if r not in pending]
        decoding = [r for r in ready if only is None or r in only] or ready
        left = max(0, budget - len(decoding))
        new_tokens = 0
        swapped = 0
        context_s = 0.0
        completed: list[str] = []
        prefills: list[tuple[str, int]] = []
        for r in prefilling:
            generation = generations[r]
            swapped += generation.swap_in_tokens
            chunk = min(left, generation.prefill_tokens)
            left -= chunk
            new_tokens += chunk
            context_s += self._context_cost_s(r, chunk)
            prefills.append((r, chunk))
            if chunk >= generation.prefill_tokens:
                completed.append(r)
        context = sum(self._attended_tokens(r) for r in decoding)
        duration = (cal.decode_s(len(decoding), context) + cal.prefill_s(new_tokens)
                    + cal.swap_in_s(swapped) + context_s)
        producing = decoding + completed
        return duration, new_tokens, producing, len(producing), prefills

    def _context_cost_s(self, request_id: str, tokens: int) -> float:
        """Extra cost of prefilling ``tokens`` of a generation over what its KV holds."""
        return self.calibration.context_prefill_s(
            tokens, self._generations[request_id].prefill_context)

    def _prefilled(self, request_id: str, tokens: int) -> None:
        """``tokens`` of a generation's pending prefill were computed."""
        generation = self._generations[request_id]
        generation.prefill_context += tokens
        if generation.prefill_tokens and tokens >= generation.prefill_tokens \
                and generation.evict_ratio:
            self._compress(request_id, generation)
        generation.prefill_tokens = max(0, generation.prefill_tokens - tokens)

    def _compress(self, request_id: str, generation: _Generation) -> None:
        """Evict a share of the prompt's attention context once it is prefilled; the
        generation's own KV blocks shrink with it (a shared prefix's blocks stay, shared)."""
        request = generation.request
        evicted = int(generation.evict_ratio * request.prompt_tokens)
        own = min(evicted, request.prompt_tokens - self._shared_tokens(request))
        before = self._attended_tokens(request_id)
        self.kv.shrink(request_id, own)
        generation.evicted_tokens = evicted - own   # the rest lies in the shared prefix
        if self._attended_total is not None and request_id in self._running:
            self._attended_total += self._attended_tokens(request_id) - before
