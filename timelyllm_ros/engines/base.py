"""The inference-engine interface the scheduler drives (one step = one model iteration).

Call order, per scheduler tick: the scheduler asks :meth:`Engine.can_run` /
:meth:`Engine.run_cost_s` for candidates, calls :meth:`Engine.run` for the admitted ones, then
:meth:`Engine.step` once; generations it cuts at a segment boundary are :meth:`Engine.pause`\\ d
(KV cache and token ids kept), finished or cancelled ones :meth:`Engine.release`\\ d.
Engines do not know about time utility, segments or robots.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Generic, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field

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
    grammar: str | None = None                 # GBNF the output must follow (engines with
                                               # the 'grammar' capability)
    end_within: int = 0                        # with a grammar: end at the first point where
                                               # the text is complete once fewer than this
                                               # many tokens remain (never cut mid-statement)
    repetition_penalty: float = 1.0            # >1 discourages tokens the output already
                                               # holds (CTRL-style; 1: plain greedy)
    messages: tuple[tuple[str, str], ...] | None = None   # the prompt as (role, content) chat
                                               # turns, for engines that apply the model's
                                               # chat template (else ``prompt`` is used)
    zero_utility_s: float | None = None        # how long after its arrival the goal's first
                                               # segment stops earning utility (its TUF's
                                               # zero-utility time; None: never)
    stop: str = ''                             # text that ends the generation before it (not
                                               # in its text): the next turn of a few-shot
                                               # transcript, for models without a chat template


KvLocation = Literal['device', 'host', 'none']   # where a real engine holds a context's KV


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one engine iteration produced.

    A generation may produce one token per iteration or several (speculative decoding,
    forced tokens): ``token_ids`` lists them all and ``text`` is their new text, so counts and
    estimates never assume one token per step.
    """

    duration_s: float                                          # time the iteration took (s)
    text: dict[str, str] = field(default_factory=dict)         # request id -> new text
    token_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)  # -> ids produced
    finished: dict[str, FinishReason] = field(default_factory=dict)  # request id -> why it ended
    preempted: tuple[str, ...] = ()                            # lost their KV: must be re-run
    prefill_tokens: int = 0                                    # tokens prefilled this step
    prefix_cached_tokens: int = 0      # prompt tokens of (re)joining generations served from
                                       # kept or cached KV instead of being prefilled
    batch_size: int = 0                                        # generations in the iteration
    iteration_s: float | None = None   # the iteration's own time where ``duration_s`` is the
                                       # time since the previous step (replicas iterating
                                       # side by side); None: ``duration_s``
    failed: dict[str, str] = field(default_factory=dict)   # request id -> why the engine
                                       # gave up on it (a request its server refused): it
                                       # left the batch and will not run again

    @property
    def iteration_time_s(self) -> float:
        """How long the iteration itself took (what a decode speed is measured on)."""
        return self.duration_s if self.iteration_s is None else self.iteration_s

    def produced(self, request_id: str) -> int:
        """Tokens the generation produced in this iteration (one when an engine gives text
        without ids)."""
        ids = self.token_ids.get(request_id)
        if ids is not None:
            return len(ids)
        return 1 if request_id in self.text else 0


Capability = Literal['evict', 'compress_kv', 'grammar', 'scripted_plans', 'tokenizer']
"""Optional operations; an engine lists the ones it has in :attr:`Engine.capabilities`.

* ``evict`` -- :meth:`Engine.evict` moves a paused context's KV to host memory or drops it;
* ``compress_kv`` -- :meth:`Engine.compress_kv` (TimeBill's α, SnapKV-style);
* ``grammar`` -- the engine constrains decoding to a request's ``grammar`` (GBNF), keeping
  the grammar state across suspend and resume;
* ``scripted_plans`` -- the engine replays recorded plans (:meth:`Engine.scripted_plan`)
  instead of generating text: the simulator;
* ``tokenizer`` -- the engine runs a model's tokenizer: :meth:`Engine.count_tokens` counts a
  text's tokens and :meth:`Engine.token_ids` gives a generation's output ids.
"""


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What an engine reports about itself: identity, capacity and counters since it began."""

    model: str                      # model label (file stem, repo id, calibration's model)
    hardware: str                   # where it runs ('cpu', a GPU name, 'simulated <GPU>')
    steps: int = 0                  # iterations run
    busy_s: float = 0.0             # time spent in iterations (s; simulated for the simulator)
    kv_capacity_tokens: int = 0     # KV cache size in tokens (0: unknown)
    kv_bytes_per_token: int = 0     # KV bytes of one token, all layers (0: unknown)
    swap_bytes: int = 0             # KV bytes restored from host memory so far
    swap_s: float = 0.0             # time those restores took (s)
    grammar_s: float = 0.0          # time spent in grammar checks and masks (s)
    model_s: float = 0.0            # time in the model's forward passes (s; 0: not timed
                                    # apart from the rest of an iteration)
    preemptions: int = 0            # generations the engine itself preempted (vLLM: by
                                    # recomputation, re-run inside the engine)


@dataclass(frozen=True, slots=True)
class PlanScript:
    """A recorded plan an engine with ``scripted_plans`` replays for a goal."""

    task_type: str                  # the trace's id, e.g. 'T3'
    task_class: str
    pieces: tuple[str, ...]         # token pieces of the recorded plan
    prompt_tokens: int
    task_tokens: int                # of which the task line (the rest is a cacheable prefix)


class KvAccounting(Protocol):
    """Block-level KV accounting an engine may expose (read-only to its readers)."""

    @property
    def block_size(self) -> int: ...

    @property
    def gpu_free(self) -> int:
        """Free device blocks."""
        ...

    @property
    def host_free(self) -> int:
        """Free host (swap) blocks."""
        ...

    def blocks(self, tokens: int) -> int:
        """Blocks that ``tokens`` tokens occupy."""
        ...

    def tokens(self, request_id: str) -> int:
        """Tokens of a context (KeyError when unknown)."""
        ...

    def location(self, request_id: str) -> str:
        """Where a context's KV is: ``'gpu'``, ``'host'`` or ``'none'`` (KeyError when
        unknown)."""
        ...


class CostModel(Protocol):
    """An engine's own latency model, for policies that price work before it runs."""

    @property
    def decode_ms_per_context_token(self) -> float:
        """Decode-step time per attended context token (ms)."""
        ...

    def prefill_s(self, tokens: int) -> float:
        """One prefill iteration over ``tokens`` new tokens (s)."""
        ...

    def swap_in_s(self, tokens: int) -> float:
        """Restoring ``tokens`` tokens of KV from host memory (s)."""
        ...


ResumeModel = Literal['kept_kv', 'new_request_prefix_cache']
PromptCache = Literal['prefix', 'blocks']
Estimates = Literal['model', 'observed']


class EngineBehaviour(BaseModel):
    """How the serving engine runs iterations, beyond the model's own latency.

    ``resume`` says what continuing a suspended generation costs:

    * ``kept_kv`` -- the engine keeps the generation's tokens and KV cache (llama.cpp, the
      transformers engine): it rejoins the batch at no extra cost;
    * ``new_request_prefix_cache`` -- the generation comes back as a new request over its
      prompt and output so far (vLLM); prefix caching finds its full KV blocks, and the
      uncached tail (the tokens after the last full block, at least one token: the engine
      needs logits) is prefilled in the iteration where it resumes, stalling the batch.

    It is the ``engine`` section of a calibration (schema 2), and what a real engine declares
    of itself (:meth:`Engine.behaviour`; the fixed cost is measured, not declared).
    """

    model_config = ConfigDict(extra='forbid', frozen=True)

    iteration_overhead_ms: float = Field(default=0.0, ge=0)   # fixed host cost of every iteration
    prefill_token_budget: int | None = Field(default=None, gt=0)  # tokens per iteration (chunked
                                                          # prefill); None: whole prefills
    max_joins_per_iteration: int | None = Field(default=None, gt=0)  # requests starting per
                                                             # iteration; None: all admitted
    resume: ResumeModel = 'kept_kv'
    prompt_cache: PromptCache = 'prefix'  # what prefix caching shares between prompts: the
                                        # prefix fixed per robot kind (llama.cpp's kept
                                        # prefixes), or every full KV block computed before
                                        # (vLLM: a goal repeating an earlier prompt prefills
                                        # only what follows its last full block)
    resume_overhead_ms: float = Field(default=0.0, ge=0)  # host cost of re-admitting one
                                        # resumed generation as a new request (re-tokenizing,
                                        # hashing its blocks, scheduling), in its iteration
    batch_change_ms_per_token: float = Field(default=0.0, ge=0)  # host cost of a decode whose
                                        # members changed since the last decode, per KV token
                                        # of its batch (the transformers engine restacks them
                                        # into one padded cache)
    outputs_one_iteration_late: bool = False  # a step runs an iteration to its end and hands
                                        # out the one before it (vLLM's asynchronous scheduling
                                        # with a logits processor that waits for the iteration
                                        # it launches): every output reaches the scheduler an
                                        # iteration after it was computed, and a generation
                                        # cut there has computed one token more, thrown away
    estimates: Estimates = 'model'      # how the engine prices admission (run_cost_s,
                                        # decode_step_s): from its latency model, or as the
                                        # vLLM engines do, from what it observed of its own
                                        # iterations (a new request at its whole context, a
                                        # resume at its last partial block, over the observed
                                        # prefill throughput; a decode step at the nearest
                                        # observed batch size): a simulator replaying a real
                                        # engine's run prices as it did


class Engine(ABC):
    """A continuous-batching engine that can pause a generation and resume it later.

    Optional operations are declared in :attr:`capabilities` and raise :class:`EngineError`
    where absent. An engine holds a model and memory: :meth:`close` frees them (engines are
    context managers).
    """

    capabilities: ClassVar[frozenset[Capability]] = frozenset()
    lookahead_tokens: int = 0       # KV headroom a generation needs to join the batch
    live_options: ClassVar[Mapping[str, object]] = {}
    """Defaults of the options not given when the engine serves live goals on a wall clock
    (the live service's; the simulator sleeps through its iterations)."""

    @classmethod
    def prepare_options(cls, options: dict[str, object]) -> dict[str, object]:
        """The engine's own reading of its options, before :func:`~timelyllm_ros.engines.
        create_engine` checks them against its constructor (e.g. a name that stands for a
        file it loads). By default they are taken as given.

        Raises:
            EngineError: an option the engine refuses as given.
        """
        return options

    @abstractmethod
    def register(self, request: EngineRequest) -> None:
        """Make a request known (no memory is used until :meth:`run`)."""

    def prepare_request(self, request: EngineRequest) -> None:
        """Do ahead what registering ``request`` will compute, so that :meth:`register` on
        the scheduler's loop finds it done (a real engine compiles the plan grammar). Called
        from a goal's own thread while the loop drives the engine: it must be safe beside any
        other call, changes nothing the engine runs, and raises nothing (a request it cannot
        prepare is left for :meth:`register` to refuse). By default nothing is prepared."""
        return

    @abstractmethod
    def can_run(self, request_id: str) -> bool:
        """Whether KV memory allows adding this generation to the running batch now."""

    def fits_when_idle(self, request_id: str) -> bool:
        """Whether the generation could run with nothing else in the engine: a goal is ended
        as too large only when this is false (default: :meth:`can_run`, asked when nothing
        runs)."""
        return self.can_run(request_id)

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

    @abstractmethod
    def decode_step_s(self, batch_size: int) -> float:
        """Estimated time of one decode iteration with ``batch_size`` generations."""

    @property
    @abstractmethod
    def running(self) -> tuple[str, ...]:
        """Ids of the generations in the running batch."""

    @property
    def num_running(self) -> int:
        """How many generations are in the running batch (asked per replica at every
        placement: engines that keep a batch answer without copying it)."""
        return len(self.running)

    @property
    @abstractmethod
    def max_num_seqs(self) -> int:
        """Largest batch the engine accepts."""

    @abstractmethod
    def stats(self) -> EngineStats:
        """Identity, capacity and counters (cheap; safe to call between iterations)."""

    def behaviour(self) -> EngineBehaviour:
        """How this engine runs iterations (a calibration's ``engine`` section): by default
        it keeps a suspended generation's KV, prefills whole prompts and lets every admitted
        request join at once. Its fixed cost per iteration is measured, not declared."""
        return EngineBehaviour()

    @property
    def kv_block_size(self) -> int:
        """Tokens per KV block: the granularity of memory and of prefix-cache hits."""
        return 16

    @property
    def cost_edges(self) -> tuple[int, ...]:
        """Tokens per iteration past which the engine's cost jumps (vLLM on CUDA: the largest
        iteration it runs as a captured CUDA graph; above it the iteration runs eagerly), so
        that a calibration measures both sides; none by default."""
        return ()

    def reset_prefix_cache(self) -> None:
        """Forget the prompt prefixes kept for later requests, so that the next request
        prefills its whole prompt: a cold start, as when each run is its own process (the
        paper's Table 4 protocol). Generations still registered keep their own KV
        (default: no prefix cache, nothing to forget)."""
        return

    # -- life cycle -------------------------------------------------------------------------
    def warmup(self) -> None:
        """Run the first-call allocations now, so that they stay out of measured runs."""
        return

    def close(self) -> None:
        """Free the model and its memory; the engine is unusable afterwards. Idempotent."""
        return

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- optional capabilities --------------------------------------------------------------
    def supports(self, capability: Capability) -> bool:
        """Whether the engine has an optional operation (see :data:`Capability`)."""
        return capability in self.capabilities

    def evict(self, request_id: str, to: EvictTo) -> None:
        """Take a generation out of the batch and move its KV to host memory (``'host'``) or
        drop it (``'none'``: rebuilt from the kept token ids when it runs again).

        Raises:
            EngineError: the engine cannot evict (no ``'evict'`` capability).
        """
        raise EngineError(f'{type(self).__name__} cannot evict KV caches')

    def compress_kv(self, request_id: str, evict_ratio: float) -> None:
        """Evict a fraction of the prompt's KV after prefill (TimeBill's α; SnapKV-style).

        Raises:
            EngineError: the engine has no KV compression (no ``'compress_kv'`` capability).
        """
        raise EngineError(f'{type(self).__name__} cannot compress KV caches')

    def count_tokens(self, text: str) -> int:
        """Tokens of a text with the model's tokenizer (no special tokens).

        Raises:
            EngineError: the engine has no tokenizer (no ``'tokenizer'`` capability).
        """
        raise EngineError(f'{type(self).__name__} has no tokenizer to count tokens with')

    def token_ids(self, request_id: str) -> tuple[int, ...]:
        """The output token ids a generation has produced so far (kept across segments).

        Raises:
            EngineError: the engine has no tokenizer (no ``'tokenizer'`` capability), or the
                request is unknown.
        """
        raise EngineError(f'{type(self).__name__} keeps no token ids')

    def scripted_plan(self, robot_kind: str, task: str, task_class: str) -> PlanScript | None:
        """The recorded plan a ``scripted_plans`` engine will replay for a goal (None for an
        engine that generates its text).

        Raises:
            GoalError: the engine has no recorded plan for this robot kind.
        """
        return None

    # -- what policies may read -------------------------------------------------------------
    def kv_accounting(self) -> KvAccounting | None:
        """The engine's block-level KV accounting, if it exposes one."""
        return None

    def cost_model(self) -> CostModel | None:
        """The engine's latency model, if it has one (the simulator's calibration)."""
        return None

    def kv_room_tokens(self) -> int | None:
        """KV tokens new contexts can fill before the engine must drop a kept one (free
        device blocks plus free host swap blocks) and leave room for the contexts it already
        dropped to be rebuilt (their generations resume first); None: the engine does not
        tell."""
        return None

    def context_tokens(self, request_id: str) -> int | None:
        """KV tokens the generation's context fills when it runs (what a shared prompt
        prefix does not cover, plus what it generated; None: the engine does not tell)."""
        return None

    def cohort(self, request_id: str) -> Engine | None:
        """The engine whose iterations this generation would join, where that is not this
        one: a replica of a pool (None: this engine; its whole batch is one cohort)."""
        return None

    def place_elsewhere(self, request_id: str) -> bool:
        """The scheduler could not admit this generation where it would run (its replica's
        latency test or memory said no): a pool with another replica it has not tried since
        its last iteration places it there (True); one engine has no other (False)."""
        return False

    def replica_states(self) -> tuple[ReplicaState, ...]:
        """Each replica of a pool, for observability (none: the engine is one replica)."""
        return ()


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """One replica of an engine pool, as the pool sees it."""

    name: str                          # its URL, or its index in a simulated pool
    up: bool = True
    running: int = 0                   # generations in its batch
    kv_cache_usage: float = 0.0        # share of its KV cache in use (0-1)
    failures: int = 0                  # consecutive failures (0 once it answers again)
    last_error: str = ''


G = TypeVar('G')


class BatchingEngine(Engine, Generic[G]):
    """An engine that keeps the generations it knows (``G``: what it keeps of one), its
    running batch (ids in join order) and its batch cap: the simulator and the real engines
    alike."""

    _generations: dict[str, G]
    _running: dict[str, None]
    _max_num_seqs: int

    @property
    def running(self) -> tuple[str, ...]:
        """Ids of the generations in the running batch."""
        return tuple(self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def max_num_seqs(self) -> int:
        """Largest batch the engine accepts."""
        return self._max_num_seqs

    def _get(self, request_id: str) -> G:
        try:
            return self._generations[request_id]
        except KeyError:
            raise EngineError(f'unknown request {request_id!r}') from None


class EngineView:
    """The engine as a policy sees it: what it can tell, none of what it can do.

    The scheduler hands policies this view instead of the engine, so that a policy can price
    and plan admissions but never run, pause or evict a generation itself.
    """

    __slots__ = ('_engine', 'kv', 'costs', 'lookahead_tokens')

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.kv: KvAccounting | None = engine.kv_accounting()
        self.costs: CostModel | None = engine.cost_model()
        self.lookahead_tokens: int = engine.lookahead_tokens

    def __eq__(self, other: object) -> bool:
        """Views of one engine are equal (a pool's replica is asked for anew each time)."""
        return isinstance(other, EngineView) and other._engine == self._engine

    def __hash__(self) -> int:
        return hash(self._engine)

    def can_run(self, request_id: str) -> bool:
        """Whether KV memory allows adding this generation to the running batch now."""
        return self._engine.can_run(request_id)

    def run_cost_s(self, request_id: str) -> float:
        """Extra time the next iteration takes if this generation joins."""
        return self._engine.run_cost_s(request_id)

    def decode_step_s(self, batch_size: int) -> float:
        """Estimated time of one decode iteration with ``batch_size`` generations."""
        return self._engine.decode_step_s(batch_size)

    def kv_room_tokens(self) -> int | None:
        """KV tokens new contexts can fill before a kept one is dropped
        (:meth:`Engine.kv_room_tokens`)."""
        return self._engine.kv_room_tokens()

    def context_tokens(self, request_id: str) -> int | None:
        """KV tokens this generation's context fills (:meth:`Engine.context_tokens`)."""
        return self._engine.context_tokens(request_id)

    def cohort(self, request_id: str) -> EngineView | None:
        """The view of the replica this generation would run on (:meth:`Engine.cohort`)."""
        replica = self._engine.cohort(request_id)
        return EngineView(replica) if replica is not None else None

    def supports(self, capability: Capability) -> bool:
        return self._engine.supports(capability)

    @property
    def running(self) -> tuple[str, ...]:
        return self._engine.running

    @property
    def max_num_seqs(self) -> int:
        return self._engine.max_num_seqs
