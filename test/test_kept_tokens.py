"""How a real engine takes a token (engines/kept.py): the stop text of a few-shot transcript."""

from __future__ import annotations

import pytest

from timelyllm_ros.engines.base import EngineRequest
from timelyllm_ros.engines.kept import KeptTokens, PieceDetokenizer, take_token
from timelyllm_ros.language.profiles import NEXT_TASK

EOS = 0
PIECES = {1: b"s('cat')", 2: b'\n', 3: b'\n', 4: b'Task', 5: b':', 6: b' more', 7: b'T', 8: b'ea'}


def _generation(stop: str, max_tokens: int = 50) -> KeptTokens:
    request = EngineRequest(request_id='r', prompt='p', prompt_tokens=1, max_tokens=max_tokens,
                            stop=stop)
    return KeptTokens(request, [9], detokenizer=PieceDetokenizer(PIECES.__getitem__))


def _run(generation: KeptTokens, tokens: list[int]) -> tuple[str, list[object]]:
    text, reasons = '', []
    for token in tokens:
        piece, reason = take_token(generation, token, lambda t: t == EOS, 1000)
        text += piece or ''
        reasons.append(reason)
        if reason:
            break
    return text, reasons


def test_a_model_that_starts_the_next_task_has_ended_its_answer() -> None:
    """Issue 27: Gemma 3 270M has no chat template and, without the grammar, went on with the
    transcript's next 'Task:' to the token limit."""
    generation = _generation(NEXT_TASK)
    text, reasons = _run(generation, [1, 2, 3, 4, 5, 6])
    assert text == "s('cat')\n" and reasons[-1] == 'eos' and len(reasons) == 5
    assert generation.output_ids == [1, 2, 3, 4, 5]      # the ids stay what the model wrote


@pytest.mark.parametrize('tokens, text, reason', [
    ([1, 2, 7, 8, EOS], "s('cat')\nTea", 'eos'),       # held '\nT' told apart, then released
    ([1, 2, EOS], "s('cat')\n", 'eos'),                 # held text is released at the end
    ([1, 2, 4], "s('cat')\nTask", 'length'),            # and at the token limit
])
def test_text_held_as_a_possible_stop_is_released(tokens, text, reason) -> None:
    generation = _generation(NEXT_TASK, max_tokens=3 if reason == 'length' else 50)
    got, reasons = _run(generation, tokens)
    assert (got, reasons[-1]) == (text, reason)


def test_without_a_stop_text_every_piece_goes_out_as_it_comes() -> None:
    generation = _generation('')
    pieces = [take_token(generation, t, lambda t: t == EOS, 1000)[0] for t in (1, 2, 3, 4)]
    assert pieces == ["s('cat')", '\n', '\n', 'Task']
