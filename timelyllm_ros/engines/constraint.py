"""Grammar-constrained token choice, shared by the real engines.

Each constrained generation owns a :class:`TokenGrammar`: the state of its plan grammar after
the tokens it produced (:mod:`timelyllm_ros.language.grammar`). It lives with the generation's
kept token ids, so a generation suspended at a segment boundary resumes exactly where its grammar
was, inside an open ``{...}`` too; an engine that must rebuild it (vLLM resubmits a request per
segment) replays the kept ids into a fresh one with :meth:`TokenGrammar.replay`.

Greedy decoding needs the full mask only when the model's own choice breaks the grammar: the
engines check the argmax first (one token, :func:`~timelyllm_ros.engines.kept.unmasked_choice`)
and mask the whole vocabulary only when that token is refused, which picks the same token as
masking first (the argmax of the allowed tokens), at a fraction of the cost. Where reading the
argmax would stall an accelerator (vLLM on a GPU), the masks of a whole batch are computed at
once instead (:func:`packed_masks`) and applied on the device.

Two grammar states: llama.cpp's own grammar sampler (in :mod:`.llamacpp`) and
:class:`LlguidanceGrammar`, an llguidance matcher over any tokenizer (the transformers engine
and vLLM's logits processor).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from timelyllm_ros.errors import EngineError
from timelyllm_ros.recently_used import recently_used

GRAMMAR_INSTALL_HINT = 'pip install llguidance (grammar-constrained decoding)'


class TokenGrammar(ABC):
    """Which tokens one generation may produce next under its grammar."""

    @abstractmethod
    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next."""

    @abstractmethod
    def restrict(self, logits: np.ndarray[Any, Any]) -> None:
        """Set the logits of every token that may not come next to ``-inf`` (in place)."""

    def best(self, logits: np.ndarray[Any, Any]) -> int:
        """The allowed token with the highest logit (the row may be masked in place).

        Raises:
            EngineError: the grammar allows no token here.
        """
        self.restrict(logits)
        choice = int(logits.argmax())
        if not np.isfinite(logits[choice]):
            raise EngineError('the grammar allows no token here')
        return choice

    @abstractmethod
    def accept(self, token: int) -> None:
        """Advance the grammar past a produced token.

        Raises:
            EngineError: the grammar refuses the token.
        """

    def replay(self, tokens: Sequence[int]) -> None:
        """Advance past tokens already produced (a rebuilt grammar state)."""
        for token in tokens:
            self.accept(token)


Row = Any
"""A row of logits: a float numpy array on the host, a call giving one (called only when
needed), or a tensor where the model left it (torch; copied to the host only when needed)."""


def host_row(logits: Row) -> np.ndarray[Any, Any]:
    """The row as a writable float32 numpy array on the host."""
    if isinstance(logits, np.ndarray):
        return logits
    if callable(logits):
        return logits()  # type: ignore[no-any-return]
    return np.array(logits.float().cpu().numpy(), dtype=np.float32)


def _import_llguidance() -> Any:
    try:
        import llguidance
    except ImportError as err:
        raise EngineError(f'grammar-constrained decoding needs llguidance ({err}); '
                          f'{GRAMMAR_INSTALL_HINT}') from None
    return llguidance


MATCHERS_KEPT = 256
"""Compiled grammars an llguidance tokenizer keeps (as the plan grammars' own cache)."""


class LlguidanceTokenizer:
    """An llguidance view of a tokenizer, built once per engine (it walks the vocabulary)."""

    def __init__(self, handle: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.handle = handle
        self.vocab_size = vocab_size
        self.eos_ids = frozenset(eos_ids)
        # matchers at their start by grammar text, the last MATCHERS_KEPT (a grounded grammar
        # per scene: a long-running planner meets new ones all the time)
        self._compiled: OrderedDict[str, Any] = OrderedDict()

    @classmethod
    def from_hf(cls, tokenizer: Any, eos_ids: Sequence[int]) -> LlguidanceTokenizer:
        """From a Hugging Face (fast) tokenizer."""
        _import_llguidance()
        import llguidance.hf

        try:
            handle = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer),
                                                  eos_token=list(eos_ids) or None)
        except Exception as err:   # noqa: BLE001 -- llguidance raises many kinds
            raise EngineError(f'llguidance cannot read the tokenizer: {err}') from None
        return cls(handle, len(tokenizer), eos_ids)

    @classmethod
    def from_pieces(cls, pieces: Sequence[bytes], eos_id: int, bos_id: int | None,
                    encode: Callable[[bytes], list[int]]) -> LlguidanceTokenizer:
        """From a tokenizer given as its token bytes (a byte-level tokenizer)."""
        llguidance = _import_llguidance()

        class _Pieces:
            eos_token_id = eos_id
            bos_token_id = bos_id
            tokens = list(pieces)
            special_token_ids = [eos_id] + ([bos_id] if bos_id is not None else [])

            def __call__(self, data: bytes) -> list[int]:
                return encode(data)

        wrapper = llguidance.TokenizerWrapper(_Pieces())
        return cls(llguidance.LLTokenizer(wrapper), len(pieces), [eos_id])

    def grammar(self, gbnf: str) -> LlguidanceGrammar:
        """A fresh grammar state at the start of a GBNF grammar.

        Raises:
            EngineError: the grammar does not compile.
        """
        return LlguidanceGrammar(self._pristine(gbnf).deep_copy(), self.vocab_size,
                                 self.eos_ids)

    def prepare(self, gbnf: str) -> None:
        """Compile a grammar into the cache, so that :meth:`grammar` finds it (from any
        thread: a goal's own, beside the loop's calls).

        Raises:
            EngineError: the grammar does not compile.
        """
        self._pristine(gbnf)

    def _pristine(self, gbnf: str) -> Any:
        """The compiled matcher of a grammar at its start, from the cache (shared by goals'
        threads and the loop) or compiled now.

        Compiling costs milliseconds (a grounded arm grammar of seven objects: 7 ms, its Lark
        text from the shape's conversion); a copy of the matcher costs microseconds, so goals
        of one scene share one compile.
        """
        return recently_used(self._compiled, gbnf, lambda: self._compile(gbnf), MATCHERS_KEPT)

    def _compile(self, gbnf: str) -> Any:
        llguidance = _import_llguidance()
        try:
            matcher = llguidance.LLMatcher(
                self.handle, llguidance.LLMatcher.grammar_from_lark(gbnf_lark(gbnf)))
        except ValueError as err:
            raise EngineError(f'the grammar does not compile: {err}') from None
        if matcher.is_error():
            raise EngineError(f'the grammar does not compile: {matcher.get_error()}')
        return matcher


def gbnf_lark(gbnf: str) -> str:
    """The GBNF grammar in llguidance's Lark dialect, as llguidance's converter writes it.

    The converter is pure Python and cost most of a grounded plan grammar's compile (a
    seven-object arm grammar: 16 ms of 25 on this project's 2-core machine), paid for every
    goal on the scheduler's loop, since goals of different scenes have different grammars.
    But grounded grammars of one robot kind and object count differ only in their literals
    (the object names), and the converter copies a literal's text as it is: so the grammar
    is converted once per shape (every plain literal replaced by a numbered placeholder,
    :data:`LARK_SHAPES_KEPT` shapes kept) and its literals written back into the Lark text.
    A literal with an escape the converter rewrites (``\\x``, ``\\u``, ``\\U``) or refuses
    stays part of the shape, so the result is the converter's in every case (tested).

    Raises:
        ValueError: the converter cannot read the grammar.
    """
    from llguidance.gbnf_to_lark import is_lark_syntax

    if is_lark_syntax(gbnf) or _MARK_OPEN in gbnf:
        return _converted(gbnf)
    literals: list[str] = []

    def placeholder(piece: re.Match[str]) -> str:
        text = piece.group(0)
        if not _PLAIN_LITERAL.fullmatch(text):
            return text                 # a class, a comment, or a literal kept in the shape
        literals.append(text)
        return f'"{_MARK_OPEN}{len(literals) - 1}{_MARK_CLOSE}"'

    shape = _GBNF_PIECE.sub(placeholder, gbnf)
    template = recently_used(_LARK_SHAPES, shape, lambda: _converted(shape), LARK_SHAPES_KEPT)
    lark, written = _MARK.subn(lambda mark: literals[int(mark.group(1))], template)
    if written != len(literals):        # never seen: the converter dropped or repeated one
        return _converted(gbnf)
    return lark


def _converted(gbnf: str) -> str:
    """llguidance's conversion, its errors as ``llguidance.grammar_from`` gives them."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(gbnf)
    except Exception as err:   # noqa: BLE001 -- the converter raises several kinds
        raise ValueError(f'Failed to convert the grammar from GBNF to Lark: {err}') from None


LARK_SHAPES_KEPT = 64
"""Converted grammar shapes kept (:func:`gbnf_lark`): one per robot kind and object count."""

_LARK_SHAPES: OrderedDict[str, str] = OrderedDict()
# GBNF's literals, character classes and comments, in the converter's reading (a quote in a
# class or a comment is no literal); a plain literal holds only the escapes kept as written
_GBNF_PIECE = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|#[^\r\n]*')
_PLAIN_LITERAL = re.compile(r'"(?:[^"\\]|\\["\\\[\]nrt])*"')
_MARK_OPEN, _MARK_CLOSE = '\ue000', '\ue001'       # private-use characters (a grammar that
                                                    # holds one is converted whole)
_MARK = re.compile(f'"{_MARK_OPEN}(\\d+){_MARK_CLOSE}"')


class LlguidanceGrammar(TokenGrammar):
    """An llguidance matcher: the grammar state of one generation."""

    def __init__(self, matcher: Any, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids

    def allows(self, token: int) -> bool:
        if not 0 <= token < self.vocab_size:
            # a padded vocabulary's id (models round their output layer up): llguidance would
            # take it as an error and stop matching
            return False
        if token in self.eos_ids:
            # validate_tokens refuses EOS where it is the only way on; the grammar is complete.
            return bool(self.matcher.is_accepting())
        return bool(self.matcher.validate_tokens([token]) == 1)

    def packed_mask(self) -> np.ndarray[Any, Any]:
        """The tokens that may come next as int32 words, bit ``i`` of word ``j`` for token
        ``32 j + i`` (llguidance's layout, which ``llguidance.torch`` applies on a device).
        The end-of-text bit is set where :meth:`allows` allows it (the grammar is complete);
        a matcher that failed allows end of text alone (:meth:`accept` never leaves one so)."""
        return np.frombuffer(self.matcher.compute_bitmask(), dtype=np.int32)

    def restrict(self, logits: np.ndarray[Any, Any]) -> None:
        bits = np.unpackbits(self.packed_mask().view(np.uint8), bitorder='little')
        allowed = np.zeros(len(logits), dtype=bool)
        count = min(len(bits), len(logits), self.vocab_size)
        allowed[:count] = bits[:count].astype(bool)
        logits[~allowed] = -np.inf

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise EngineError(f'the grammar refused token {token}: {self.matcher.get_error()}')


def packed_masks(grammars: Sequence[TokenGrammar],
                 threads: int | None = None) -> np.ndarray[Any, Any]:
    """The packed masks (:meth:`LlguidanceGrammar.packed_mask`) of a batch's grammars over one
    vocabulary, a row each, computed in one call by llguidance's thread pool (``threads``, by
    default :data:`MASK_THREADS`), outside the GIL. A mask costs tens of microseconds in a
    state met for the first time (41 µs on average on the H200 machine's CPU, with the
    planner's grounded grammar), a few when the state is met again.

    Raises:
        EngineError: a grammar allows no token.
    """
    _import_llguidance()           # the install hint where it is missing
    from llguidance.numpy import fill_next_token_bitmask_par

    if not grammars:
        return np.zeros((0, 0), dtype=np.int32)
    matchers = [(cast(LlguidanceGrammar, grammar).matcher, row)
                for row, grammar in enumerate(grammars)]
    words = -(-cast(LlguidanceGrammar, grammars[0]).vocab_size // 32)   # llguidance's width
    masks: np.ndarray[Any, Any] = np.zeros((len(grammars), words), dtype=np.int32)
    fill_next_token_bitmask_par(_executor(threads or MASK_THREADS), matchers, masks)
    if not masks.any(axis=1).all():
        raise EngineError('the grammar allows no token here')
    return masks


MASK_THREADS = 1
"""Threads of llguidance's pool that compute a batch's masks. One: the pool's single call
already does the rows without Python between them (H200, 32 plan rows: the processor's host
time per step 2.06 ms against 3.14-3.53 ms for the rows' masks one after the other, the step
5.94 ms against raw vLLM's 5.32-5.33 in earlier runs). Eight threads were measured only before
the processor stopped copying each plan's ids every step (a step of 6.47-7.06 ms against 7.74-8.75
one after the other); deep copies of one grammar share its lexer, so rows of one scene do not
run in parallel anyway (measured here, 2 cores: no gain)."""

_EXECUTORS: dict[int, Any] = {}


def _executor(threads: int) -> Any:
    """llguidance's thread pool of ``threads`` threads (one per size, made on first use)."""
    executor = _EXECUTORS.get(threads)
    if executor is None:
        executor = _EXECUTORS[threads] = _import_llguidance().LLExecutor(threads)
    return executor
