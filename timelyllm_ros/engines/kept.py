"""What a real engine keeps of one generation between segments, and how it takes a token.

The three real engines (llama.cpp, transformers, vLLM) differ in how they batch against their
backend; what they keep per generation is the same and lives here: the token ids (never
re-tokenized text), the teacher-forced ids of ``force_script``, the incremental detokenizer and
the grammar state. :func:`take_token` is the one rule for a produced token: a forced token
replaces it, end of text ends the generation, the grammar advances, the text piece is decoded,
the request's stop text ends it (text that may begin the stop text is held back until it is
told apart), and the token limit or the context ends it with ``length``.
"""

from __future__ import annotations

import codecs
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from timelyllm_ros.engines.base import EngineRequest, FinishReason, KvLocation
from timelyllm_ros.engines.constraint import Row, TokenGrammar, host_row


class Detokenizer(ABC):
    """Turns a generation's output ids into text incrementally (never a partial character)."""

    @abstractmethod
    def text(self, ids: Sequence[int], new: int) -> str:
        """The text of the ``new`` last ids of ``ids`` (the whole token sequence so far);
        characters still incomplete are held back until a later token completes them."""


class PieceDetokenizer(Detokenizer):
    """Token bytes through an incremental UTF-8 decoder (llama.cpp gives each token's bytes)."""

    def __init__(self, piece: Callable[[int], bytes]) -> None:
        self._piece = piece
        self._decoder = codecs.getincrementaldecoder('utf-8')(errors='replace')

    def text(self, ids: Sequence[int], new: int) -> str:
        return ''.join(self._decoder.decode(self._piece(token)) for token in ids[-new:])


class WindowDetokenizer(Detokenizer):
    """Decodes a short window of ids before and after the new ones and keeps the difference
    (tokenizers whose pieces depend on their neighbours: SentencePiece spaces, byte fallback)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], prompt_tokens: int) -> None:
        self._decode = decode
        self.prefix_offset = max(0, prompt_tokens - 5)
        self.read_offset = prompt_tokens

    def text(self, ids: Sequence[int], new: int) -> str:
        before = self._decode(ids[self.prefix_offset:self.read_offset])
        after = self._decode(ids[self.prefix_offset:])
        if len(after) > len(before) and not after.endswith('\ufffd'):
            self.prefix_offset = self.read_offset
            self.read_offset = len(ids)
            return after[len(before):]
        return ''


@dataclass(slots=True)
class KeptTokens:
    """One generation as a real engine keeps it: its token ids and how many leading ones have
    KV, wherever that KV is, its detokenizer and its grammar state."""

    request: EngineRequest
    prompt_ids: list[int]
    forced: list[int] | None = None          # teacher-forced output ids (force_script)
    output_ids: list[int] = field(default_factory=list)
    cached: int = 0                          # leading tokens of ids() whose KV exists
    location: KvLocation = 'none'
    resumes: int = 0
    detokenizer: Detokenizer | None = None
    grammar: TokenGrammar | None = None      # the plan grammar's state after output_ids
    grammar_s: float = 0.0                   # time spent in the grammar (checks, masks)
    held: str = ''                           # decoded text that may begin the stop text

    def ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def total(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def pending(self) -> int:
        """Tokens to feed before the next token can be produced."""
        return self.total - self.cached


def chat_prompt_ids(tokenizer: Any, messages: Sequence[tuple[str, str]]) -> list[int]:
    """Chat turns rendered with a Hugging Face tokenizer's chat template, ready for the answer
    (the transformers and vLLM engines)."""
    ids = tokenizer.apply_chat_template(
        [{'role': role, 'content': content} for role, content in messages],
        add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, 'keys'):
        ids = ids['input_ids']
    return [int(token) for token in ids]


def choose_token(generation: KeptTokens, argmax: int, logits: Row, eos: int) -> int:
    """The greedy next token of a generation.

    The row's argmax, unless the request asks for more: a ``repetition_penalty`` lowers the
    logits of the tokens its output already holds (CTRL's rule: positive logits divided,
    negative ones multiplied), a grammar keeps the choice inside it, and once fewer than
    ``end_within`` tokens remain, end of text is chosen as soon as the grammar allows it (a
    plan that ends early rather than one cut inside a statement at the token limit).

    ``logits``: the row on the host, a call giving it, or the row where the model left it (a
    torch tensor, on the GPU say): the penalty then moves only the seen tokens' logits there,
    and the row comes to the host only if the grammar refuses the argmax. The row may be
    changed in place.
    """
    request = generation.request
    if request.repetition_penalty != 1.0 and generation.output_ids:
        row = logits() if callable(logits) else logits
        penalize(row, generation.output_ids, request.repetition_penalty)
        logits, argmax = row, int(row.argmax())
    grammar = generation.grammar
    if grammar is None:
        return argmax
    started = time.perf_counter()
    try:
        choice = unmasked_choice(generation, argmax, eos)
        return choice if choice is not None else grammar.best(host_row(logits))
    finally:
        generation.grammar_s += time.perf_counter() - started


def unmasked_choice(generation: KeptTokens, argmax: int, eos: int) -> int | None:
    """:func:`choose_token`'s choice when it needs no mask (after the penalty): end of text
    once fewer than ``end_within`` tokens remain and the grammar allows it, else the argmax
    when there is no grammar or it allows the argmax. None when the grammar refuses the
    argmax: the choice is then the best allowed token of the row (one token checked instead
    of the whole vocabulary masked, for the same choice)."""
    grammar = generation.grammar
    if grammar is None:
        return argmax
    if ends_here(generation, eos):
        return eos
    return argmax if grammar.allows(argmax) else None


def ends_here(generation: KeptTokens, eos: int) -> bool:
    """Whether a constrained generation ends now whatever its logits say: fewer than
    ``end_within`` tokens remain and its grammar allows end of text (the plan is complete)."""
    request = generation.request
    return generation.grammar is not None and (
        request.max_tokens - len(generation.output_ids) <= request.end_within
        and generation.grammar.allows(eos))


def penalize(row: Any, output_ids: Sequence[int], penalty: float) -> None:
    """CTRL's repetition penalty in place on one row of logits (see :func:`penalize_rows`)."""
    penalize_rows(row[None], [0], [output_ids], [penalty])


def penalize_rows(logits: Any, rows: Sequence[int], output_ids: Sequence[Sequence[int]],
                  penalties: Sequence[float], distinct: bool = False) -> None:
    """CTRL's repetition penalty in place on rows of a batch's logits (a numpy array, or a
    torch tensor on its device: one gather and one scatter for all the rows): in row
    ``rows[i]``, the logits of the tokens in ``output_ids[i]``, positive ones divided by
    ``penalties[i]``, the others multiplied. ``distinct``: each row's ids are given once
    each already (a caller that keeps them so spares the sort)."""
    seen = [np.asarray(ids, dtype=np.int64) if distinct
            else np.unique(np.asarray(ids, dtype=np.int64)) for ids in output_ids]
    counts = [len(tokens) for tokens in seen]
    at = np.stack([np.repeat(np.asarray(rows, dtype=np.int64), counts),
                   np.concatenate(seen) if seen else np.empty(0, dtype=np.int64)])
    factor = np.repeat(np.asarray(penalties, dtype=np.float64), counts)
    if isinstance(logits, np.ndarray):
        index: Any = (at[0], at[1])
        factors: Any = factor.astype(logits.dtype)
        where: Any = np.where
    else:
        import torch

        on_device = to_device(at, logits.device)      # one copy for both index rows
        index = (on_device[0], on_device[1])
        factors = to_device(factor, logits.device).to(logits.dtype)
        where = torch.where
    values = logits[index]
    # no boolean indexing: on a GPU it would wait for the device to count the positives
    logits[index] = where(values > 0, values / factors, values * factors)


def to_device(array: np.ndarray[Any, Any], device: Any) -> Any:
    """A host array as a torch tensor on ``device``, copied without waiting for the device:
    from pinned memory, asynchronously (a copy from ordinary memory would wait until the
    device's queue is done, the forward pass that is still running included)."""
    import torch

    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if torch.device(device).type != 'cuda':
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def take_token(generation: KeptTokens, token: int, is_eos: Callable[[int], bool],
               max_context: int) -> tuple[str | None, FinishReason | None]:
    """Take one produced token into a generation.

    Args:
        generation: The generation.
        token: The token the engine chose (ignored when the generation is teacher-forced).
        is_eos: Whether a token ends the text.
        max_context: Tokens a generation may hold, prompt included.

    Returns:
        The token's new text (``None`` when nothing was appended; '' while text is held back
        as a possible start of the stop text) and why the generation ended (``None`` while it
        goes on).

    Raises:
        EngineError: the grammar refuses the token (the engine chose outside its mask).
    """
    if generation.forced is not None:
        index = len(generation.output_ids)
        if index >= len(generation.forced):
            return _release_held(generation), 'eos'
        token = generation.forced[index]
    elif is_eos(token):
        return _release_held(generation), 'eos'
    elif generation.grammar is not None:
        started = time.perf_counter()
        generation.grammar.accept(token)
        generation.grammar_s += time.perf_counter() - started
    generation.output_ids.append(token)
    piece = (generation.detokenizer.text(generation.ids(), 1)
             if generation.detokenizer is not None else '')
    stop = generation.request.stop
    if stop and generation.forced is None:
        text = generation.held + piece
        at = text.find(stop)
        if at >= 0:                          # the model began the next turn: the answer ended
            generation.held = ''
            return text[:at], 'eos'
        keep = next((n for n in range(min(len(stop) - 1, len(text)), 0, -1)
                     if stop.startswith(text[-n:])), 0)
        generation.held = text[len(text) - keep:]
        piece = text[:len(text) - keep]
    if (len(generation.output_ids) >= generation.request.max_tokens
            or generation.total >= max_context):
        return piece + (_release_held(generation) or ''), 'length'
    return piece, None


def _release_held(generation: KeptTokens) -> str | None:
    """The text held back at the end of a generation (it did not begin the stop text)."""
    held, generation.held = generation.held, ''
    return held or None
