"""``vllm serve`` replicas behind the engine interface: the planner drives a pool of GPU
servers instead of owning one GPU (issue 30).

One streamed ``/v1/completions`` request per segment, as the in-process vLLM engine submits
one vLLM request per segment. The prompt is always token ids: the request's prompt, rendered
here with the model's tokenizer (a local copy of the servers' model folder), then the kept
output ids. A step hands out at most one new token per generation (an iteration's worth), so
the scheduler's segmenter sees the boundary token alone and pauses right after it; a pause
closes the stream, vLLM aborts the request when its client goes, and tokens that had already
arrived past the boundary are dropped (counted in ``trimmed_tokens``), never kept. A resume is
a new request over the kept ids: the replica's prefix cache holds their KV blocks.

Decoding is the in-process engine's, to the token: the servers load this package's logits
processor (``--logits-processors`` :data:`SERVER_PROCESSOR`) and each request carries, in
``vllm_xargs``, what the processor needs: the grammar (GBNF), the ids kept before the segment
(the grammar state is rebuilt by replaying them, so a plan resumed inside an open ``{…}`` goes
on inside it), the repetition penalty and the early end; or the ids to force
(``force_script``). A server started without the processor is found at start-up (a probe
request is not forced) and refused with the command that starts one. Built with
``grammar=False`` (and no ``force_script``) the servers need nothing of this package: vLLM
chooses the greedy token itself and plans are checked after generation.

The pool. Each generation is placed on one replica when it first runs and stays there for
its life (its KV is there); a new one goes where :func:`~timelyllm_ros.engines.replicas.
replica_rank` puts it (room first, then a replica that already served its robot kind's prompt
prefix, then the fewest running). Admission asks that replica: its batch below
``max_num_seqs`` and the generation's KV blocks free in the replica's own KV usage (its
``/metrics``, polled every ``metrics_s``, plus the blocks of those admitted since). A replica
that fails (connection refused or reset, an HTTP 5xx, a stream cut before the segment ended)
or stalls (no token for ``stall_s`` while it has generations running) is marked down: its
running generations are handed back as preempted (the scheduler queues them again, and they
re-prefill their kept ids on another replica), paused ones lose their home and move when they
resume, and the replica is probed again after ``retry_s``, doubling up to ``retry_max_s``.
A request the server refuses (an HTTP 4xx) ends that generation only
(``StepResult.failed``). :meth:`VllmServerEngine.replica_states` reports each replica (the
service's state and the planner's ``scheduler_state`` carry it).

The HTTP client is httpx's asynchronous one on an event loop in a thread of its own: streams
arrive while the scheduler decides.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from timelyllm_ros.engines.base import (
    Engine,
    EngineBehaviour,
    EngineRequest,
    EngineStats,
    ReplicaState,
    StepResult,
)
from timelyllm_ros.engines.constraint import TokenGrammar
from timelyllm_ros.engines.kept import KeptTokens
from timelyllm_ros.engines.observed import NEW_REQUEST_DEFAULT_TPS, new_request_join_tokens
from timelyllm_ros.engines.real import ForwardPass
from timelyllm_ros.engines.replicas import replica_rank
from timelyllm_ros.engines.vllm_engine import DECODING_KEY, FORCED_KEY, SegmentRequestEngine
from timelyllm_ros.errors import EngineError, describe_error

logger = logging.getLogger(__name__)

SERVER_PROCESSOR = 'timelyllm_ros.engines.vllm_engine:ForcedTokensLogitsProcessor'
"""What ``vllm serve --logits-processors`` loads for plan decoding (this package installed in
the server's environment)."""

SERVER_INSTALL_HINT = ('start each server with --logits-processors ' + SERVER_PROCESSOR +
                       ' (timelyllm_ros installed beside vLLM), or build the engine with '
                       'grammar=false')


@dataclass(slots=True)
class _Segment:
    """One streamed completion request: what has arrived of it and how it ended."""

    replica: int
    ids: deque[int] = field(default_factory=deque)   # arrived, not handed out yet
    finish: str | None = None               # the server's finish reason (the stream ended)
    error: str | None = None                # why the request failed
    fault: bool = False                     # ... through the replica (else it was refused)
    prompt_tokens: int = 0
    resume: bool = False                    # a resumed generation's segment on its home
    cached: int = 0                         # prompt tokens the replica's prefix cache served:
    measured: bool = False                  # ... read from its counters, else estimated
    alone: bool = False                     # the only request in flight on its replica
    last: float = field(default_factory=time.monotonic)     # when something last arrived
    future: concurrent.futures.Future[None] | None = None
    joined: bool = True                     # its prompt's figures are still to be counted

    @property
    def ready(self) -> bool:
        return bool(self.ids) or self.finish is not None or self.error is not None


@dataclass(slots=True)
class _Generation(KeptTokens):
    seq: int = 0                            # registration order (the request's priority)
    home: int | None = None                 # the replica holding its KV
    segment: _Segment | None = None         # the live request
    segments: int = 0


@dataclass(slots=True)
class Replica:
    """One server of the pool, as the engine sees it."""

    url: str
    up: bool = True
    failures: int = 0                       # consecutive; sets the retry backoff
    retry_at: float = 0.0                   # monotonic time of the next probe when down
    last_error: str = ''
    kv_usage: float = 0.0                   # vLLM's KV cache usage (0-1), from /metrics
    num_blocks: int = 0                     # its KV blocks (0: unknown, admission by batch)
    block_size: int = 16
    prefix_hits: float = 0.0                # vLLM's prefix-cache counters (tokens)
    prefix_queries: float = 0.0
    prefixes: set[str] = field(default_factory=set)   # prompt prefixes it has served
    running: set[str] = field(default_factory=set)
    admitted: set[str] = field(default_factory=set)   # joined since its last /metrics
    probing: bool = False


class VllmServerEngine(SegmentRequestEngine[_Generation]):
    """A pool of ``vllm serve`` endpoints: one request per segment, streamed."""

    backend_name: ClassVar[str] = 'vllm-server'

    def __init__(
        self,
        model: str,
        endpoints: str | Sequence[str] = 'http://127.0.0.1:8000',
        max_num_seqs: int = 8,
        max_model_len: int | None = None,
        force_script: bool = False,
        grammar: bool = True,
        use_priority: bool = True,
        chat_template: bool = True,
        lookahead_tokens: int = 16,
        served_model: str | None = None,
        connect_timeout_s: float = 5.0,
        stall_s: float = 30.0,
        retry_s: float = 1.0,
        retry_max_s: float = 30.0,
        metrics_s: float = 0.25,
        measure_cache: bool = False,
    ) -> None:
        """Args:
            model: a local Hugging Face model folder: the servers' model (its tokenizer
                renders prompts and reads outputs here).
            endpoints: the servers' base URLs: comma-separated, a list, or a YAML file
                that lists them (``endpoints: [http://gpu1:8000, ...]`` or the bare list).
            max_num_seqs: batch cap per replica (the servers' ``--max-num-seqs``).
            max_model_len: context per generation (None: the servers' own).
            force_script: feed the request's ``script`` tokens (the servers' processor).
            grammar: decode plans through the servers' processor (see the module docstring).
            use_priority: send each generation's registration order as its ``priority``
                (servers started with ``--scheduling-policy priority``).
            chat_template: render chat turns with the tokenizer's chat template.
            lookahead_tokens: KV headroom a generation needs to join.
            served_model: the model name the servers serve (None: what ``/v1/models`` says).
            connect_timeout_s: to connect to a server, and for a probe's answer.
            stall_s: a replica whose running generations got nothing for this long is down.
            retry_s: first wait before a failed replica is probed again (doubling).
            retry_max_s: longest wait between probes.
            metrics_s: how often each replica's ``/metrics`` (KV usage) is read.
            measure_cache: read a replica's prefix-cache counters before a request that is
                alone on it and at its first token: the prompt tokens its cache served,
                measured (vLLM reports them only at a stream's end, which a cut segment never
                reaches); else estimated as the kept ids' full blocks. Two ``/metrics`` reads
                per such request: for seg-overhead and the tests.

        Raises:
            EngineError: no endpoint, httpx missing, the tokenizer cannot be read, no server
                answers, the servers serve different models, or they lack the processor.
        """
        super().__init__(model, max_num_seqs, lookahead_tokens, force_script)
        urls = [u.rstrip('/') for u in endpoint_urls(endpoints) if u]
        if not urls:
            raise EngineError('the vllm-server engine needs at least one endpoint')
        if len(set(urls)) != len(urls):
            raise EngineError(f'an endpoint is listed twice: {", ".join(urls)}')
        try:
            import httpx
        except ImportError:
            raise EngineError("the vllm-server engine needs httpx: pip install -e '.[server]'"
                              ) from None
        self._httpx = httpx
        self.tokenizer = _load_tokenizer(model)
        eos = self.tokenizer.eos_token_id
        self.eos_id = int(eos) if eos is not None else None
        self.eos_ids = frozenset() if self.eos_id is None else frozenset({self.eos_id})
        self.replicas = [Replica(url) for url in urls]
        self.per_replica_seqs = max_num_seqs
        self._max_num_seqs = max_num_seqs * len(urls)
        self.in_engine_decoding = grammar
        if grammar:
            self._grammar_tokenizer()    # the vocabulary read now, not at the first plan goal
        self.use_priority = use_priority
        self.chat_template = chat_template
        self.connect_timeout_s = connect_timeout_s
        self.stall_s = stall_s
        self.retry_s = retry_s
        self.retry_max_s = retry_max_s
        self.metrics_s = metrics_s
        self.measure_cache = measure_cache
        self._arrived = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name='vllm-server-io',
                                        daemon=True)
        self._thread.start()
        self._client: Any = None
        self._avoid: dict[str, set[int]] = {}    # request id -> replicas that refused it
        self._seq = 0
        self._metrics_task: concurrent.futures.Future[None] | None = None
        # statistics of the pool's own (the shared ones are RealEngine's)
        self.resumes = 0
        self.resume_prompt_tokens = 0    # prompt tokens of resumed segments on their home
        self.resume_cached_tokens = 0    # ... of them served from the prefix cache
        self.resume_measured = 0         # resumes whose cached tokens were measured
        self.trimmed_tokens = 0          # arrived past a boundary, dropped
        self.moves = 0                   # generations re-placed after their replica failed
        self.requests = 0
        self._baseline: list[tuple[float, float]] = []
        try:
            self._call(self._open(), timeout=3 * connect_timeout_s + 5)
            self.served_model = served_model or self._served_name()
            self.max_context = self._context_limit(max_model_len)
            self._probe_servers(needs_processor=grammar or force_script)
            self._metrics_task = asyncio.run_coroutine_threadsafe(self._poll_metrics(),
                                                                  self._loop)
            self._call(self._read_all_metrics(), timeout=3 * connect_timeout_s + 5)
            self._baseline = [(r.prefix_hits, r.prefix_queries) for r in self.replicas]
        except BaseException:
            self.close()
            raise
        self.model_label = self.served_model
        self.hardware = f'{len(urls)} vllm server(s)'

    # -- start-up ---------------------------------------------------------------------------
    async def _open(self) -> None:
        httpx = self._httpx
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=self.connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self._models = await asyncio.gather(
            *(self._get_json(r, '/v1/models') for r in self.replicas), return_exceptions=True)
        for replica, answer in zip(self.replicas, self._models, strict=True):
            if isinstance(answer, BaseException):
                self._mark_down(replica, f'not answering: {describe_error(answer)}')

    async def _get_json(self, replica: Replica, path: str) -> Any:
        response = await self._client.get(replica.url + path, timeout=self.connect_timeout_s)
        response.raise_for_status()
        return response.json()

    def _served_name(self) -> str:
        names = {m['id'] for answer in self._models if isinstance(answer, dict)
                 for m in answer.get('data', [])[:1]}
        if not names:
            raise EngineError('no vllm server answers at ' +
                              ', '.join(r.url for r in self.replicas) + ': ' +
                              '; '.join(r.last_error for r in self.replicas))
        if len(names) > 1:
            raise EngineError(f'the servers serve different models: {sorted(names)}')
        return names.pop()  # type: ignore[no-any-return]

    def _context_limit(self, asked: int | None) -> int:
        limits = [int(m['max_model_len']) for answer in self._models
                  if isinstance(answer, dict) for m in answer.get('data', [])[:1]
                  if m.get('max_model_len')]
        served = min(limits) if limits else None
        if asked is not None and served is not None and asked > served:
            raise EngineError(f'max_model_len={asked} is more than the servers take '
                              f'({served})')
        return asked or served or 4096

    def _probe_servers(self, needs_processor: bool) -> None:
        """One one-token request to every live server, with a priority where the engine sends
        them; where plans need this package's processor, forcing a token the model would not
        choose (a server without the processor answers with its own choice).

        Raises:
            EngineError: a server refuses the request's form, or lacks the processor.
        """
        probe = self._encode(' zebra')[-1:]
        xargs = {FORCED_KEY: probe} if needs_processor else None
        for replica in self.replicas:
            if not replica.up:
                continue
            body = self._body(self._encode('The'), max_tokens=1, priority=1, xargs=xargs)
            body['stream'] = False
            try:
                answer = self._call(self._post_json(replica, body),
                                    timeout=60 + self.connect_timeout_s)
            except EngineError as err:      # the server answered, and refused
                hint = (' (start it with --scheduling-policy priority, or build the engine '
                        'with use_priority=false)' if 'priority' in str(err) else '')
                raise EngineError(f'the vllm server at {replica.url} refused a probe: '
                                  f'{err}{hint}') from None
            except Exception as err:  # noqa: BLE001 - a server that fails the probe is down
                self._mark_down(replica, f'probe failed: {describe_error(err)}')
                continue
            ids = (answer.get('choices') or [{}])[0].get('token_ids') or []
            if needs_processor and list(ids) != probe:
                raise EngineError(f'the vllm server at {replica.url} does not decode plans '
                                  f'with this package (probe answered {ids}, forced {probe}): '
                                  f'{SERVER_INSTALL_HINT}')
        if not any(r.up for r in self.replicas):
            raise EngineError('no vllm server answers a probe: ' +
                              '; '.join(f'{r.url}: {r.last_error}' for r in self.replicas))

    async def _post_json(self, replica: Replica, body: dict[str, Any]) -> Any:
        response = await self._client.post(replica.url + '/v1/completions', json=body)
        if response.status_code != 200:
            raise EngineError(f'HTTP {response.status_code}: {response.text[:300]}')
        return response.json()

    # -- the backend ------------------------------------------------------------------------
    def _new_generation(self, request: EngineRequest, prompt_ids: list[int],
                        forced: list[int] | None, grammar: TokenGrammar | None) -> _Generation:
        generation = _Generation(request, prompt_ids, forced, seq=self._seq,
                                 detokenizer=self._detokenizer(len(prompt_ids)))
        self._seq += 1
        return generation

    # -- placement and admission ------------------------------------------------------------
    def placement(self, request_id: str) -> int | None:
        """The replica a generation runs on: its home, else where it would go now (None: no
        replica is up)."""
        generation = self._get(request_id)
        if generation.home is not None:
            return generation.home
        self._probe_due()
        prefix = generation.request.prefix_id
        avoid = self._avoid.get(request_id, ())
        live = [i for i, r in enumerate(self.replicas) if r.up and i not in avoid]
        if not live:
            return None

        def rank(index: int) -> tuple[bool, float, int, bool, int, int]:
            replica = self.replicas[index]
            return replica_rank(index, free=self.per_replica_seqs - len(replica.running),
                                cached=prefix is not None and prefix in replica.prefixes,
                                running=len(replica.running))

        return min(live, key=rank)

    def cohort(self, request_id: str) -> Engine | None:
        """The replica the generation runs or would run on, as the latency-guided test weighs
        it (its batch, its step), so that admission protects that replica's iterations only
        (None: no replica is up)."""
        index = self.placement(request_id)
        return None if index is None else _ReplicaCohort(self, index)

    def place_elsewhere(self, request_id: str) -> bool:
        """A generation without a home goes to its next best live replica until the next
        step, if one is left."""
        generation = self._get(request_id)
        if generation.home is not None:
            return False
        current = self.placement(request_id)
        avoid = self._avoid.setdefault(request_id, set())
        if current is not None:
            avoid.add(current)
        return self.placement(request_id) is not None

    def _fits(self, generation: _Generation) -> bool:
        """Room on its replica: a batch slot, and its KV blocks beside what the replica last
        reported in use plus the blocks of those admitted since."""
        index = self.placement(generation.request.request_id)
        if index is None:
            return False
        replica = self.replicas[index]
        if len(replica.running) >= self.per_replica_seqs:
            return False
        if not replica.num_blocks:
            return True
        used = replica.kv_usage * replica.num_blocks
        used += sum(self._blocks(self._generations[r], replica) for r in replica.admitted
                    if r in self._generations)
        return used + self._blocks(generation, replica) <= replica.num_blocks

    def fits_when_idle(self, request_id: str) -> bool:
        index = self.placement(request_id)
        replica = self.replicas[index if index is not None else 0]
        generation = self._get(request_id)
        return (not replica.num_blocks or self._blocks(generation, replica)
                <= replica.num_blocks) and generation.total < self.max_context

    def _blocks(self, generation: _Generation, replica: Replica) -> int:
        return -(-(generation.total + self.lookahead_tokens) // replica.block_size)

    def run_cost_s(self, request_id: str) -> float:
        generation = self._get(request_id)
        home = generation.home           # a resume on its replica: its last block is prefilled
        tokens = generation.total if home is None else new_request_join_tokens(
            generation.total, bool(generation.output_ids), self.replicas[home].block_size)
        return self.latency.prefill_s(tokens, default_tps=NEW_REQUEST_DEFAULT_TPS)

    def _joined(self, generation: _Generation) -> None:
        index = self.placement(generation.request.request_id)
        assert index is not None          # _fits placed it
        replica = self.replicas[index]
        generation.home = index
        replica.running.add(generation.request.request_id)
        replica.admitted.add(generation.request.request_id)
        if generation.request.prefix_id is not None:
            replica.prefixes.add(generation.request.prefix_id)

    def _paused(self, generation: _Generation) -> None:
        self._close(generation)
        self._leave(generation)

    def _released(self, generation: _Generation) -> None:
        self._paused(generation)

    def _leave(self, generation: _Generation) -> None:
        if generation.home is not None:
            replica = self.replicas[generation.home]
            replica.running.discard(generation.request.request_id)
            replica.admitted.discard(generation.request.request_id)

    def decode_step_s(self, batch_size: int) -> float:
        """A step of a replica holding an even share of the batch (the replicas iterate side
        by side)."""
        up = max(1, sum(r.up for r in self.replicas))
        return super().decode_step_s(max(1, math.ceil(batch_size / up)))

    # -- the step ---------------------------------------------------------------------------
    def _forward_pass(self, only: Collection[str] | None) -> ForwardPass:
        """Submit the joining generations' segment requests (closing the masked-out ones'),
        wait until one of the running generations has news or ``stall_s`` passes, then hand
        out one token per generation, the ends, and the failures."""
        self._probe_due()
        self._avoid.clear()
        active = [r for r in self._running if only is None or r in only] or list(self._running)
        forward = ForwardPass(batch_size=len(active))
        for request_id in list(self._running):
            generation = self._generations[request_id]
            if request_id not in active:
                self._close(generation)          # masked out: idle, its blocks stay cached
            elif generation.segment is None:
                self._submit(generation)
        live = [self._generations[r] for r in active]
        deadline = time.monotonic() + self.stall_s
        with self._arrived:
            while not any(g.segment is None or g.segment.ready for g in live):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._arrived.wait(left)
        now = time.monotonic()
        for generation in live:
            segment = generation.segment
            if segment is None:
                continue
            request_id = generation.request.request_id
            with self._arrived:
                token = segment.ids.popleft() if segment.ids else None
                drained = not segment.ids
            if segment.joined and (token is not None or segment.finish is not None):
                segment.joined = False
                self._count_join(forward, segment)
            if token is not None:
                self._hand_out(forward, generation, token)
            if request_id in forward.finished:
                continue
            if drained and segment.finish is not None:
                self._finish(forward, generation, segment.finish)
            elif drained and segment.error is not None:
                self._fail(forward, generation, segment)
            elif token is None and now - segment.last >= self.stall_s:
                segment.error, segment.fault = (f'stalled: nothing for {self.stall_s:g} s'), True
                self._fail(forward, generation, segment)
        forward.prefill = bool(forward.prefill_tokens) and not forward.text
        forward.decoded = bool(forward.text)
        return forward

    def _count_join(self, forward: ForwardPass, segment: _Segment) -> None:
        """A segment's first output: its prompt's prefilled and cached tokens."""
        forward.prefill_tokens += segment.prompt_tokens - segment.cached
        self._pending_cached += segment.cached
        if segment.resume:
            self.resume_prompt_tokens += segment.prompt_tokens
            self.resume_cached_tokens += segment.cached
            self.resume_measured += segment.measured

    def _hand_out(self, forward: ForwardPass, generation: _Generation, token: int) -> None:
        request_id = generation.request.request_id
        if self._is_eos(token):
            self._finish(forward, generation, 'stop')
            return
        generation.output_ids.append(token)
        assert generation.detokenizer is not None
        forward.text[request_id] = generation.detokenizer.text(generation.ids(), 1)
        forward.token_ids[request_id] = (token,)
        if (len(generation.output_ids) >= generation.request.max_tokens
                or generation.total >= self.max_context):
            self._finish(forward, generation, 'length')

    def _finish(self, forward: ForwardPass, generation: _Generation, reason: str) -> None:
        request_id = generation.request.request_id
        length = reason == 'length' or len(generation.output_ids) >= generation.request.max_tokens
        forward.finished[request_id] = 'length' if length else 'eos'
        self._close(generation)
        self._leave(generation)

    def _fail(self, forward: ForwardPass, generation: _Generation, segment: _Segment) -> None:
        """A request that failed: through its replica (the generation moves: preempted), or
        refused by the server (the generation ends: failed)."""
        request_id = generation.request.request_id
        self._close(generation)
        self._leave(generation)
        self._running.pop(request_id, None)
        if not segment.fault:
            forward.failed[request_id] = f'the vllm server refused it: {segment.error}'
            return
        self._mark_down(self.replicas[segment.replica], segment.error or 'failed')
        self._orphan(segment.replica)
        forward.preempted.append(request_id)

    def _orphan(self, index: int) -> None:
        """A replica is down: every generation whose KV was there has no home any more."""
        for generation in self._generations.values():
            if generation.home == index:
                generation.home = None
                generation.location = 'none'
                if generation.output_ids:
                    self.moves += 1

    # -- requests ---------------------------------------------------------------------------
    def _body(self, prompt: list[int], max_tokens: int, priority: int,
              xargs: dict[str, Any] | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            'model': getattr(self, 'served_model', None) or self.model_name,
            'prompt': prompt, 'max_tokens': max(1, max_tokens), 'temperature': 0.0,
            'stream': True, 'return_token_ids': True}
        if self.use_priority and priority:
            body['priority'] = priority
        if xargs:
            body['vllm_xargs'] = xargs
        return body

    def _submit(self, generation: _Generation) -> None:
        request = generation.request
        index = generation.home
        assert index is not None
        remaining, forced, decoding = self.segment_decoding(generation)
        xargs: dict[str, Any] | None = None
        if forced is not None:
            xargs = {FORCED_KEY: forced}
        elif decoding is not None:     # vllm_xargs take text and numbers: the dict as JSON
            xargs = {DECODING_KEY: json.dumps(decoding)}
        prompt = generation.ids()
        segment = _Segment(index, prompt_tokens=len(prompt), alone=self.measure_cache and not any(
            g.segment is not None and g.segment.replica == index
            for g in self._generations.values()))
        # estimated, unless measured (measure_cache): nothing cached first, or after its home
        # failed; on a resume, the kept ids' full blocks
        if generation.segments and generation.location == 'none':
            self._count_recompute(generation)
        elif generation.segments:
            self.resumes += 1
            block = self.replicas[index].block_size
            segment.resume = True
            segment.cached = len(prompt) - (len(prompt) % block or block)
        generation.segments += 1
        generation.location = 'device'
        self.requests += 1
        body = self._body(prompt, remaining, generation.seq, xargs)
        body['request_id'] = f'{request.request_id}#{generation.segments}-{self.requests}'
        generation.segment = segment
        segment.future = asyncio.run_coroutine_threadsafe(
            self._stream(self.replicas[index], segment, body), self._loop)

    async def _stream(self, replica: Replica, segment: _Segment, body: dict[str, Any]) -> None:
        """Read one segment's stream into its segment (on the event loop's thread)."""
        httpx = self._httpx
        before = await self._prefix_counters(replica) if segment.alone else None
        try:
            async with self._client.stream('POST', replica.url + '/v1/completions',
                                           json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode('utf-8', 'replace')[:300]
                    self._arrive(segment, error=f'HTTP {response.status_code}: {text}',
                                 fault=response.status_code >= 500)
                    return
                async for line in response.aiter_lines():
                    if not line.startswith('data:'):
                        continue
                    data = line[5:].strip()
                    if data == '[DONE]':
                        break
                    if before is not None:       # the first chunk: the request was served
                        await self._measure(replica, segment, before)
                        before = None
                    self._read_chunk(segment, json.loads(data))
                    if segment.error is not None:
                        return
            if segment.finish is None:
                self._arrive(segment, error='the stream ended before the segment did',
                             fault=True)
        except asyncio.CancelledError:
            raise                                   # a cut: the stream is closed
        except (httpx.HTTPError, OSError, ValueError) as err:
            self._arrive(segment, error=describe_error(err), fault=True)

    async def _measure(self, replica: Replica, segment: _Segment,
                       before: tuple[float, float]) -> None:
        """The prompt tokens the replica's prefix cache served a request alone on it: the
        counters' growth since it was sent (read again for up to 0.2 s: vLLM may publish
        them a moment after the first token)."""
        for _ in range(10):
            after = await self._prefix_counters(replica)
            if after is not None and after[1] - before[1] >= segment.prompt_tokens:
                if after[1] - before[1] == segment.prompt_tokens:
                    segment.cached, segment.measured = int(after[0] - before[0]), True
                return
            await asyncio.sleep(0.02)

    async def _prefix_counters(self, replica: Replica) -> tuple[float, float] | None:
        """A replica's prefix-cache (hits, queries) in tokens now (None: not readable)."""
        figures = await self._fetch_metrics(replica)
        if figures is None or not {'prefix_cache_hits', 'prefix_cache_queries'} <= set(figures):
            return None
        return figures['prefix_cache_hits'], figures['prefix_cache_queries']

    async def _fetch_metrics(self, replica: Replica) -> dict[str, float] | None:
        """The figures of a replica's ``/metrics`` (:func:`server_metrics`; None: not
        readable now)."""
        try:
            response = await self._client.get(replica.url + '/metrics',
                                              timeout=self.connect_timeout_s)
            response.raise_for_status()
            return server_metrics(response.text)
        except (self._httpx.HTTPError, OSError, ValueError) as err:
            logger.debug('metrics of %s: %s', replica.url, describe_error(err))
            return None

    def _read_chunk(self, segment: _Segment, chunk: dict[str, Any]) -> None:
        if 'error' in chunk:
            error = chunk['error']
            message = error.get('message', error) if isinstance(error, dict) else error
            self._arrive(segment, error=f'server error: {message}', fault=True)
            return
        for choice in chunk.get('choices') or []:
            ids = [int(t) for t in choice.get('token_ids') or []]
            self._arrive(segment, ids=ids, finish=choice.get('finish_reason'))

    def _arrive(self, segment: _Segment, ids: Sequence[int] = (), finish: str | None = None,
                error: str | None = None, fault: bool = False) -> None:
        with self._arrived:
            segment.ids.extend(ids)
            segment.last = time.monotonic()
            if finish is not None:
                segment.finish = finish
            if error is not None and segment.error is None:
                segment.error, segment.fault = error, fault
            self._arrived.notify_all()

    def _close(self, generation: _Generation) -> None:
        """End a generation's live request: closing its stream makes vLLM abort it; what had
        arrived and was not handed out is dropped."""
        segment, generation.segment = generation.segment, None
        if segment is None:
            return
        if segment.future is not None and not segment.future.done():
            segment.future.cancel()
        with self._arrived:
            self.trimmed_tokens += len(segment.ids)
            segment.ids.clear()

    # -- replica health ---------------------------------------------------------------------
    def _mark_down(self, replica: Replica, why: str) -> None:
        if replica.up:
            logger.warning('vllm server %s is down: %s', replica.url, why)
        replica.up = False
        self._back_off(replica, why)
        replica.running.clear()
        replica.admitted.clear()
        replica.prefixes.clear()

    def _probe_due(self) -> None:
        """Probe the down replicas whose wait is over (in the background)."""
        now = time.monotonic()
        for replica in self.replicas:
            if not replica.up and not replica.probing and now >= replica.retry_at:
                replica.probing = True
                asyncio.run_coroutine_threadsafe(self._probe(replica), self._loop)

    async def _probe(self, replica: Replica) -> None:
        try:
            response = await self._client.get(replica.url + '/health',
                                              timeout=self.connect_timeout_s)
            healthy = response.status_code == 200
            why = f'health check: HTTP {response.status_code}'
        except (self._httpx.HTTPError, OSError) as err:
            healthy, why = False, describe_error(err)
        if healthy:
            await self._read_metrics(replica)
            logger.warning('vllm server %s is back', replica.url)
            replica.up, replica.failures, replica.last_error = True, 0, ''
        else:
            self._back_off(replica, why)
        replica.probing = False

    def _back_off(self, replica: Replica, why: str) -> None:
        """One more failure: the next probe waits ``retry_s``, doubled per failure in a row,
        at most ``retry_max_s``."""
        replica.failures += 1
        replica.last_error = why
        replica.retry_at = time.monotonic() + min(
            self.retry_max_s, self.retry_s * 2 ** (replica.failures - 1))

    async def _poll_metrics(self) -> None:
        while True:
            await asyncio.sleep(self.metrics_s)
            await self._read_all_metrics()

    async def _read_all_metrics(self) -> None:
        await asyncio.gather(*(self._read_metrics(r) for r in self.replicas if r.up),
                             return_exceptions=True)

    async def _read_metrics(self, replica: Replica) -> None:
        """vLLM's KV usage, KV capacity and prefix-cache counters from ``/metrics``."""
        figures = await self._fetch_metrics(replica)
        if figures is None:
            return
        replica.kv_usage = figures.get('kv_cache_usage', replica.kv_usage)
        replica.num_blocks = int(figures.get('num_gpu_blocks', replica.num_blocks))
        replica.block_size = int(figures.get('block_size', replica.block_size))
        replica.prefix_hits = figures.get('prefix_cache_hits', replica.prefix_hits)
        replica.prefix_queries = figures.get('prefix_cache_queries', replica.prefix_queries)
        # rebound, not cleared: the scheduler's thread may be summing the old set right now
        replica.admitted = set()

    # -- extras -----------------------------------------------------------------------------
    def replica_states(self) -> tuple[ReplicaState, ...]:
        """Each server: URL, up, running, KV usage, consecutive failures, last error."""
        return tuple(ReplicaState(r.url, r.up, len(r.running), round(r.kv_usage, 4),
                                  r.failures, r.last_error) for r in self.replicas)

    @property
    def resume_stats(self) -> dict[str, float]:
        """Resumes on their home replica and the share of their prompt tokens its prefix cache
        served (``prefix_reuse``; measured for ``resumes_measured`` of them, the others
        estimated: see ``measure_cache``), tokens dropped past boundaries, generations moved
        off a failed replica, and the servers' own prefix-cache hit rate over every prompt
        since this engine started."""
        self._call(self._read_all_metrics(), timeout=3 * self.connect_timeout_s + 5)
        hits = sum(r.prefix_hits - b[0] for r, b in zip(self.replicas, self._baseline,
                                                        strict=False))
        queries = sum(r.prefix_queries - b[1] for r, b in zip(self.replicas, self._baseline,
                                                              strict=False))
        reuse = (self.resume_cached_tokens / self.resume_prompt_tokens
                 if self.resume_prompt_tokens else 0.0)
        return {'resumes': self.resumes, 'resumes_measured': self.resume_measured,
                'resume_prompt_tokens': self.resume_prompt_tokens,
                'resume_cached_tokens': self.resume_cached_tokens, 'prefix_reuse': reuse,
                'trimmed_tokens': self.trimmed_tokens, 'moves': self.moves,
                'server_prefix_hit_rate': hits / queries if queries else 0.0}

    def behaviour(self) -> EngineBehaviour:
        return EngineBehaviour(resume='new_request_prefix_cache', prompt_cache='blocks',
                               estimates='observed')

    @property
    def kv_block_size(self) -> int:
        return self.replicas[0].block_size

    def stats(self) -> EngineStats:
        return replace(super().stats(), kv_capacity_tokens=sum(
            r.num_blocks * r.block_size for r in self.replicas))

    def close(self) -> None:
        """Close every stream and the client, stop the event loop. Idempotent."""
        if self._closed:
            return
        try:
            for generation in list(self._generations.values()):
                self._close(generation)
            if self._metrics_task is not None:
                self._metrics_task.cancel()
            if self._client is not None and self._loop.is_running():
                self._call(self._client.aclose(), timeout=5)
        finally:
            super().close()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    def _call(self, coroutine: Any, timeout: float) -> Any:
        """Run a coroutine on the event loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)


class _ReplicaCohort(Engine):
    """One replica of a vllm-server pool as admission sees it: its running generations, its
    batch cap, a step at its own batch; questions about a generation go to the pool. It runs
    nothing."""

    def __init__(self, pool: VllmServerEngine, index: int) -> None:
        self._pool = pool
        self._index = index
        self.lookahead_tokens = pool.lookahead_tokens

    def __eq__(self, other: object) -> bool:
        """The same replica of the same pool (asked for anew at every question)."""
        return (isinstance(other, _ReplicaCohort) and other._pool is self._pool
                and other._index == self._index)

    def __hash__(self) -> int:
        return hash((id(self._pool), self._index))

    def _refuse(self) -> EngineError:
        return EngineError('a replica of the pool is asked, never driven: use the pool')

    def register(self, request: EngineRequest) -> None:
        raise self._refuse()

    def run(self, request_id: str) -> None:
        raise self._refuse()

    def pause(self, request_id: str) -> None:
        raise self._refuse()

    def release(self, request_id: str) -> None:
        raise self._refuse()

    def step(self, only: Collection[str] | None = None) -> StepResult:
        raise self._refuse()

    def can_run(self, request_id: str) -> bool:
        return self._pool.can_run(request_id)

    def run_cost_s(self, request_id: str) -> float:
        return self._pool.run_cost_s(request_id)

    def decode_step_s(self, batch_size: int) -> float:
        return SegmentRequestEngine.decode_step_s(self._pool, batch_size)

    @property
    def running(self) -> tuple[str, ...]:
        return tuple(r for r in self._pool.running
                     if self._pool._generations[r].home == self._index)

    @property
    def max_num_seqs(self) -> int:
        return self._pool.per_replica_seqs

    def stats(self) -> EngineStats:
        return self._pool.stats()


def endpoint_urls(endpoints: str | Sequence[str]) -> list[str]:
    """The endpoints' URLs from a list, a comma-separated text, or a YAML file naming them.

    Raises:
        EngineError: a YAML file that cannot be read or does not list URLs.
    """
    if not isinstance(endpoints, str):
        return [str(url).strip() for url in endpoints]
    text = endpoints.strip()
    if text.endswith(('.yaml', '.yml')):
        from timelyllm_ros.safe_files import EngineInputError, load_yaml

        try:
            data = load_yaml(text, EngineInputError)
        except OSError as err:
            raise EngineError(f'cannot read the endpoints file {text!r}: {err}') from None
        listed = data.get('endpoints') if isinstance(data, dict) else data
        if not isinstance(listed, list) or not all(isinstance(u, str) for u in listed):
            raise EngineError(f'{text}: expected a list of URLs (or endpoints: [...])')
        return [url.strip() for url in listed]
    return [url.strip() for url in text.split(',')]


def server_metrics(text: str) -> dict[str, float]:
    """The figures this engine reads from a vLLM server's Prometheus text (``/metrics``):
    ``kv_cache_usage`` (0-1), ``num_gpu_blocks`` and ``block_size`` (from
    ``vllm:cache_config_info``), ``prefix_cache_hits`` and ``prefix_cache_queries`` (tokens),
    summed over the server's engines.

    Raises:
        ValueError: the text is not Prometheus' exposition format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    figures: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name == 'vllm:kv_cache_usage_perc':
                figures['kv_cache_usage'] = figures.get('kv_cache_usage', 0.0) + sample.value
            elif name in ('vllm:prefix_cache_hits_total', 'vllm:prefix_cache_queries_total'):
                key = name[5:-6]
                figures[key] = figures.get(key, 0.0) + sample.value
            elif name == 'vllm:cache_config_info':
                for label, key in (('num_gpu_blocks', 'num_gpu_blocks'),
                                   ('block_size', 'block_size')):
                    value = sample.labels.get(label)
                    if value is not None and value not in ('', 'None'):
                        figures[key] = float(value)
    return figures


def _load_tokenizer(model: str) -> Any:
    if not os.path.isdir(model):
        raise EngineError(f'vllm-server engine: {model!r} is not a local model folder (the '
                          "servers' model: its tokenizer renders prompts here)")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise EngineError("the vllm-server engine reads the model's tokenizer with "
                          "transformers: pip install -e '.[server]'") from None
    try:
        return AutoTokenizer.from_pretrained(model)
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds
        raise EngineError(f'cannot read the tokenizer of {model!r}: {err}') from None

