"""`timelyllm reproduce`: every experiment of the paper's evaluation on the paper's setup,
with the claims side by side (deterministic on the simulator, apart from Table 5's timings)."""

from __future__ import annotations

import json

import pytest

from timelyllm_ros.cli import main

FIGURES = ('fig5_wid1', 'fig5_wid1_fixed', 'fig5_wid2', 'fig7_wid2', 'fig8_wid1',
           'fig9_wid3', 'fig10_sentence', 'fig10_paragraph')


def test_reproduce_writes_every_figure_table_and_claim(tmp_path, capsys) -> None:
    out = tmp_path / 'repro'
    assert main(['reproduce', '--out', str(out), '--quiet']) == 0
    printed = capsys.readouterr().out
    assert '| claim | paper | ours | gap | tolerance | holds | direction |' in printed
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['calibration'] == 'llama3-8b-fp16_rtx4090_vllm054'
    claims = summary['claims']
    assert len(claims) == 18
    for claim in claims.values():
        assert {'paper', 'ours', 'gap', 'tolerance', 'holds', 'direction_ok',
                'basis'} <= set(claim)
        assert claim['tolerance']
    for name in FIGURES:
        assert (out / name / 'summary.json').exists(), name
    assert (out / 'fig7_wid2' / 'fig7_batch_sweep.png').exists()
    assert (out / 'table4_overhead_pct.png').exists() and (out / 'claims.md').exists()
    # the simulator's claims are deterministic on the paper's setup
    assert claims['fig7_timelyllm_peak_batch']['ours'] == 6
    assert claims['fig7_timelyllm_peak_batch']['holds']
    assert claims['fig5_wid1_urgent_utility_pct_of_max_timelyllm']['direction_ok']
    # issue 26: a level gap shows although the direction holds (97 % of the maximum against
    # the paper's 81.5 %, with the paper's latency-guided admission)
    fig5 = claims['fig5_wid1_urgent_utility_pct_of_max_timelyllm']
    assert fig5['gap'] == pytest.approx(fig5['ours'] - 81.5, abs=1e-3) and not fig5['holds']
    sweep = json.loads((out / 'fig7_wid2' / 'summary.json').read_text())['batch_sweep']
    assert set(sweep['vllm']) == {'1', '2', '4', '6', '8', '12', '16'}
    assert claims['fig8_urgent_utility_timelyllm_pct_of_seg-edf']['direction_ok']
    assert claims['fig8_urgent_utility_timelyllm_pct_of_seg-fcfs']['direction_ok']
    assert set(summary['table4']) == {'sim'}
    assert set(summary['table4']['sim']) == {str(t) for t in range(1, 9)}
    # Table 4 from cold prompt caches: every run holds its prompt's prefill, as the paper's
    assert all(row['whole_ms'] > 250 for row in summary['table4']['sim'].values())
    table4 = claims['table4_segmentation_overhead_pct']
    assert table4['direction_ok'] and 'resume cost at 0' in table4['basis']
    assert claims['fig10_story_utility_sentence_over_paragraph_over_vllm']['direction_ok']


def test_table4_is_not_checked_against_the_figure_fitted_to_it() -> None:
    """Issue 26: the paper calibration's 6.8 ms resume cost was fitted to Table 4; Table 4 is
    measured with it at 0, every other figure as it is."""
    from timelyllm_ros.engines.calibration import load_calibration
    from timelyllm_ros.evaluation.reproduce import table4_calibration

    paper = load_calibration('llama3-8b-fp16_rtx4090_vllm054')
    assert paper.engine.resume_overhead_ms == pytest.approx(6.8)
    measured = table4_calibration('llama3-8b-fp16_rtx4090_vllm054')
    assert measured.engine.resume_overhead_ms == 0.0
    assert measured.model_copy(update={'engine': paper.engine}) == paper
    cpu = 'smollm2-135m-q4_1_cpu-llamacpp'
    assert table4_calibration(cpu) == load_calibration(cpu)
