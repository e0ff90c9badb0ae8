"""The paper's evaluation regenerated on the simulator: figures, tables and claims side by side.

:func:`reproduce` runs, on one calibration (the paper's setup by default,
``llama3-8b-fp16_rtx4090_vllm054``), the experiments behind Fig. 5 (WID1/WID2 utility,
response and waiting per task type), Fig. 7 (fixed batch sizes on WID2), Fig. 8 (segmented
FCFS / EDF / TimelyLLM), Fig. 9 (WID3, robot arms), Fig. 10 (story chatbot, sentence and
paragraph segments), Table 4 (segmentation overhead per trace, each run from a cold prompt
cache as the paper's separate runs; on the simulator with its modelled resume cost, and on a
real engine when one is given) and Table 5 (scheduling overhead with 1–8 queued).
Each experiment writes its bench output (summary.json, tasks.csv, figures) under its own
folder; every claim of the paper it checks goes to ``summary.json`` as ``{"paper": x, "ours":
y, "direction_ok": bool}`` and to ``claims.md`` as a table.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from timelyllm_ros.core.scheduler import SchedulerConfig
from timelyllm_ros.engines.base import Engine
from timelyllm_ros.engines.calibration import load_calibration
from timelyllm_ros.engines.sim import SimulatedEngine
from timelyllm_ros.evaluation.bench import (
    PAPER_CALIBRATION,
    EngineOptions,
    run_bench,
    scheduling_overhead,
)
from timelyllm_ros.evaluation.plots import grouped_bars
from timelyllm_ros.evaluation.seg_overhead import segmentation_overhead
from timelyllm_ros.evaluation.workloads import resolve_workload

PAPER_TABLE4_MS = {1: 13.7, 2: 24.1, 3: 19.9, 4: 19.9, 5: 16.0, 6: 13.1, 7: 14.4, 8: 14.8}
PAPER_TABLE4_PCT = {1: 3.0, 2: 2.6, 3: 5.6, 4: 2.8, 5: 3.2, 6: 3.7, 7: 4.1, 8: 4.2}
PAPER_TABLE5_MS = {1: 0.58, 2: 0.83, 4: 1.25, 6: 1.58, 8: 2.03}
SWEEP_SIZES = (1, 2, 4, 6, 8)
TABLE4_KEYS = ('overhead_ms', 'overhead_pct', 'whole_ms', 'segmented_ms', 'resumes')

Claim = dict[str, Any]


def _claim(paper: object, ours: object, direction_ok: bool) -> Claim:
    return {'paper': paper, 'ours': ours, 'direction_ok': bool(direction_ok)}


def _pct_of_max(summary: Mapping[str, Any], policy: str, task_class: str) -> float:
    row = summary['policies'][policy]['by_class'][task_class]
    return 100.0 * float(row['utility_mean']) / float(row['utility_max'])


def _experiments(out: Path, calibration: str, seed: int,
                 real_engine: Callable[[], Engine] | None
                 ) -> list[tuple[str, Callable[[], Any]]]:
    engine = EngineOptions(calibration=calibration)

    def bench(name: str, workload: str, policies: tuple[str, ...],
              config: SchedulerConfig | None = None,
              sizes: tuple[int, ...] = ()) -> Callable[[], Any]:
        def run() -> Any:
            label, tasks = resolve_workload(workload, seed=seed)
            return run_bench(label, tasks, policies, out / name, seed=seed, config=config,
                             engine=engine, batch_sizes=sizes)
        return run

    def table4() -> Any:
        return segmentation_overhead(SimulatedEngine(load_calibration(calibration)),
                                     list(PAPER_TABLE4_MS), prompt_cache='cold')

    def table4_real() -> Any:
        assert real_engine is not None
        with real_engine() as measured:
            return segmentation_overhead(measured, list(PAPER_TABLE4_MS), repeats=3,
                                         prompt_cache='cold')

    def table5() -> Any:
        return {q: scheduling_overhead(q).decision_ms for q in PAPER_TABLE5_MS}

    fixed = SchedulerConfig(batch_mode='fixed')
    experiments = [
        ('fig5_wid1', bench('fig5_wid1', 'wid1', ('vllm', 'vllm-stream', 'timelyllm'))),
        ('fig5_wid1_fixed', bench('fig5_wid1_fixed', 'wid1', ('timelyllm',), fixed)),
        ('fig5_wid2', bench('fig5_wid2', 'wid2', ('vllm', 'timelyllm'))),
        ('fig7_wid2', bench('fig7_wid2', 'wid2', ('vllm', 'timelyllm'), sizes=SWEEP_SIZES)),
        ('fig8_wid1', bench('fig8_wid1', 'wid1', ('seg-fcfs', 'seg-edf', 'timelyllm'))),
        ('fig9_wid3', bench('fig9_wid3', 'wid3', ('vllm', 'vllm-stream', 'timelyllm'))),
        ('fig10_sentence', bench('fig10_sentence', 'story', ('vllm', 'timelyllm'))),
        ('fig10_paragraph', bench('fig10_paragraph', 'story-para', ('timelyllm',))),
        ('table4', table4),
        ('table5', table5),
    ]
    if real_engine is not None:
        experiments.append(('table4_real', table4_real))
    return experiments


def claims_of(results: Mapping[str, Any]) -> dict[str, Claim]:
    """The paper's claims against what the experiments measured."""
    wid1, wid2 = results['fig5_wid1'], results['fig5_wid2']
    claims: dict[str, Claim] = {}
    ours = {p: round(_pct_of_max(wid1, p, 'urgent'), 1) for p in ('vllm', 'timelyllm')}
    ours['timelyllm_fixed_batch'] = round(
        _pct_of_max(results['fig5_wid1_fixed'], 'timelyllm', 'urgent'), 1)
    claims['fig5_wid1_urgent_utility_pct_of_max'] = _claim(
        {'vllm': 59.5, 'timelyllm': 81.5}, ours, ours['timelyllm'] > ours['vllm'])
    urgent2 = {p: wid2['policies'][p]['by_class']['urgent']['utility_mean']
               for p in ('vllm', 'timelyllm')}
    claims['fig5_wid2_urgent_utility_gain'] = _claim(
        '+191 % over vLLM (high workload)', {p: round(v, 3) for p, v in urgent2.items()},
        urgent2['timelyllm'] > urgent2['vllm'])
    sweep = results['fig7_wid2']['batch_sweep']
    timely = {int(k): v for k, v in sweep['timelyllm'].items()}
    vllm = {int(k): v for k, v in sweep['vllm'].items()}
    peak = max(timely, key=lambda size: timely[size])
    claims['fig7_timelyllm_peak_batch'] = _claim(6, peak, 4 <= peak <= 8)
    claims['fig7_timelyllm_above_vllm_at_every_batch'] = _claim(
        True, all(timely[s] >= vllm[s] for s in timely), all(timely[s] >= vllm[s]
                                                              for s in timely))
    fig8 = {p: results['fig8_wid1']['policies'][p]['by_class']['urgent']['utility_mean']
            for p in ('seg-fcfs', 'seg-edf', 'timelyllm')}
    claims['fig8_urgent_utility_timelyllm_over_edf_over_fcfs'] = _claim(
        'TimelyLLM 142 % of EDF, 183 % of FCFS', {p: round(v, 3) for p, v in fig8.items()},
        fig8['timelyllm'] > fig8['seg-edf'] > fig8['seg-fcfs'])
    arm = {p: results['fig9_wid3']['policies'][p]['by_class']['arm']
           for p in ('vllm', 'vllm-stream', 'timelyllm')}
    waiting = 100.0 * (1.0 - arm['timelyllm']['waiting_time_mean_s']
                       / arm['vllm']['waiting_time_mean_s'])
    claims['fig9_wid3_waiting_reduction_pct'] = _claim(84, round(waiting, 1), waiting > 0)
    utilities = {p: arm[p]['utility_mean'] for p in arm}
    claims['fig9_wid3_utility_vllm_below_stream_below_timelyllm'] = _claim(
        True, {p: round(v, 3) for p, v in utilities.items()},
        utilities['vllm'] <= utilities['vllm-stream'] <= utilities['timelyllm'])
    story = {name: results[experiment]['policies'][policy]['overall']
             for name, experiment, policy in (('vllm', 'fig10_sentence', 'vllm'),
                                              ('timelyllm_para', 'fig10_paragraph', 'timelyllm'),
                                              ('timelyllm_sen', 'fig10_sentence', 'timelyllm'))}
    utility = {name: row['utility_mean'] for name, row in story.items()}
    claims['fig10_story_utility_sentence_over_paragraph_over_vllm'] = _claim(
        'TimelyLLM-Sen > TimelyLLM-Para > vLLM', {n: round(v, 3) for n, v in utility.items()},
        utility['timelyllm_sen'] > utility['timelyllm_para'] > utility['vllm'])
    delay = {name: row['response_time_mean_s'] for name, row in story.items()}
    claims['fig10_story_delay_sentence_below_paragraph_below_vllm'] = _claim(
        'TimelyLLM-Sen < TimelyLLM-Para < vLLM (up to 96 % less than vLLM)',
        {n: round(v, 3) for n, v in delay.items()},
        delay['timelyllm_sen'] < delay['timelyllm_para'] < delay['vllm'])
    for experiment, suffix in (('table4', ''), ('table4_real', '_real_engine')):
        if experiment not in results:
            continue
        pct = {int(t): round(float(r['overhead_pct']), 2)
               for t, r in results[experiment].items()}
        claims[f'table4_segmentation_overhead_pct_below_6{suffix}'] = _claim(
            PAPER_TABLE4_PCT, pct, max(pct.values()) < 6.0)
    table5 = {q: round(ms, 3) for q, ms in results['table5'].items()}
    claims['table5_scheduling_overhead_ms_at_8_queued'] = _claim(
        PAPER_TABLE5_MS[8], table5[8], table5[8] <= PAPER_TABLE5_MS[8])
    return claims


def _claims_table(claims: Mapping[str, Claim]) -> str:
    lines = ['| claim | paper | ours | direction ok |', '|---|---|---|---|']
    for name, claim in claims.items():
        lines.append(f"| {name} | {json.dumps(claim['paper'])} | {json.dumps(claim['ours'])} "
                     f"| {'yes' if claim['direction_ok'] else 'NO'} |")
    return '\n'.join(lines) + '\n'


def reproduce(out: Path, calibration: str = PAPER_CALIBRATION, seed: int = 0,
              progress: Callable[[str, int], None] | None = None,
              real_engine: Callable[[], Engine] | None = None) -> dict[str, Any]:
    """Run every experiment into ``out``; write summary.json, claims.md and the tables'
    figures; return the summary (``{"calibration", "claims": {NAME: claim}}``).

    ``progress`` is called before each experiment with its name and how many there are;
    ``real_engine`` makes the engine on which Table 4 is measured again (closed after)."""
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    experiments = _experiments(out, calibration, seed, real_engine)
    for name, run in experiments:
        if progress:
            progress(name, len(experiments))
        results[name] = run()
    claims = claims_of(results)
    table4 = {label: {str(t): {k: r[k] for k in TABLE4_KEYS} for t, r in results[name].items()}
              for label, name in (('sim', 'table4'), ('real_engine', 'table4_real'))
              if name in results}
    grouped_bars(out / 'table4_overhead_pct.png', {
        'paper': {str(t): {'overhead_pct': v} for t, v in PAPER_TABLE4_PCT.items()},
        **{f'ours ({label})': rows for label, rows in table4.items()}},
        'overhead_pct', 'Table 4: segmentation overhead per trace (%)')
    grouped_bars(out / 'table5_scheduling_ms.png', {
        'paper': {str(q): {'ms': v} for q, v in PAPER_TABLE5_MS.items()},
        'ours': {str(q): {'ms': v} for q, v in results['table5'].items()}},
        'ms', 'Table 5: scheduling overhead (ms) by queued tasks')
    summary = {'calibration': calibration, 'seed': seed, 'claims': claims,
               'table4': table4,
               'table5_ms': {str(q): v for q, v in results['table5'].items()}}
    (out / 'summary.json').write_text(json.dumps(summary, indent=2) + '\n')
    (out / 'claims.md').write_text(_claims_table(claims))
    return summary
