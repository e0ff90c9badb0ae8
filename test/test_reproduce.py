"""`timelyllm reproduce`: every experiment of the paper's evaluation on the paper's setup,
with the claims side by side (deterministic on the simulator, apart from Table 5's timings)."""

from __future__ import annotations

import json

from timelyllm_ros.cli import main

FIGURES = ('fig5_wid1', 'fig5_wid1_fixed', 'fig5_wid2', 'fig7_wid2', 'fig8_wid1',
           'fig9_wid3', 'fig10_sentence', 'fig10_paragraph')


def test_reproduce_writes_every_figure_table_and_claim(tmp_path, capsys) -> None:
    out = tmp_path / 'repro'
    assert main(['reproduce', '--out', str(out), '--quiet']) == 0
    printed = capsys.readouterr().out
    assert '| claim | paper | ours | direction ok |' in printed
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['calibration'] == 'llama3-8b-fp16_rtx4090_vllm054'
    claims = summary['claims']
    assert len(claims) == 11
    for claim in claims.values():
        assert set(claim) == {'paper', 'ours', 'direction_ok'}
    for name in FIGURES:
        assert (out / name / 'summary.json').exists(), name
    assert (out / 'fig7_wid2' / 'fig7_batch_sweep.png').exists()
    assert (out / 'table4_overhead_pct.png').exists() and (out / 'claims.md').exists()
    # the simulator's claims are deterministic on the paper's setup
    assert claims['fig7_timelyllm_peak_batch']['ours'] == 6
    assert claims['fig5_wid1_urgent_utility_pct_of_max']['direction_ok']
    assert claims['fig8_urgent_utility_timelyllm_over_edf_over_fcfs']['direction_ok']
    assert set(summary['table4']) == {'sim'}
    assert set(summary['table4']['sim']) == {str(t) for t in range(1, 9)}
    # Table 4 from cold prompt caches: every run holds its prompt's prefill, as the paper's
    assert all(row['whole_ms'] > 250 for row in summary['table4']['sim'].values())
    assert claims['table4_segmentation_overhead_pct_below_6']['direction_ok']
    assert claims['fig10_story_utility_sentence_over_paragraph_over_vllm']['direction_ok']
