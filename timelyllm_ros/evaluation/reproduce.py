"""The paper's evaluation regenerated on the simulator: figures, tables and claims side by side.

:func:`reproduce` runs, on one calibration (the paper's setup by default,
``llama3-8b-fp16_rtx4090_vllm054``), the experiments behind Fig. 5 (WID1/WID2 utility,
response and waiting per task type), Fig. 7 (fixed batch sizes 1–16 on WID2), Fig. 8 (segmented
FCFS / EDF / TimelyLLM), Fig. 9 (WID3, robot arms), Fig. 10 (story chatbot, sentence and
paragraph segments), Table 4 (segmentation overhead per trace, each run from a cold prompt
cache as the paper's separate runs; on the simulator, and on a real engine when one is given)
and Table 5 (scheduling overhead with 1–8 queued). Each experiment writes its bench output
(summary.json, tasks.csv, figures) under its own folder.

Every claim goes to ``summary.json`` and ``claims.md`` with the paper's value, ours, the gap,
the tolerance it is judged by and whether it holds within it (``holds``), beside whether its
direction holds (``direction_ok``): a direction alone hides level gaps. The tolerances: ±10
points on a share of the maximum utility or a reduction in percent (what the paper's bars
can be read to, and a testbed we simulate rather than run); ±20 points on one policy's utility
as a share of another's, ±50 on a gain of about 200 %; ±2 sequences on Fig. 7's peak for
TimelyLLM and ±4 for vLLM (one swept size either side) and ±0.15 on a utility level; ±2 points
per trace in Table 4 (the paper's values span 2.6–5.6 %); ±1× on Table 5's growth. No claim is
checked against a figure fitted to it: Table 4 runs with the calibration's resume cost at 0
when its provenance says it was fitted to Table 4 (:func:`table4_calibration`), and Table 5
compares growth with the queue, not milliseconds from other hardware.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from timelyllm_ros.core.scheduler import SchedulerConfig
from timelyllm_ros.engines.base import Engine
from timelyllm_ros.engines.calibration import Calibration, load_calibration
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
SWEEP_SIZES = (1, 2, 4, 6, 8, 12, 16)
DESK_CLEAN = 'T10'                  # Fig. 9's best case, the 'Desk Clean' task (trace 10)
TABLE4_KEYS = ('overhead_ms', 'overhead_pct', 'whole_ms', 'segmented_ms', 'resumes')

Claim = dict[str, Any]

TABLE4_FITTED = 'fitted to Table 4'
"""How a calibration's provenance marks a figure fitted to the paper's Table 4: Table 4 is then
measured with that figure at 0, so that it is never checked against itself."""


def _level(paper: float, ours: float, tolerance: float, unit: str, direction_ok: bool,
           basis: str) -> Claim:
    """A claim about a level: it holds when ``ours`` is within ``tolerance`` of ``paper``."""
    gap = ours - paper
    return {'paper': paper, 'ours': round(ours, 3), 'gap': round(gap, 3),
            'tolerance': f'±{tolerance:g} {unit}'.rstrip(), 'holds': abs(gap) <= tolerance,
            'direction_ok': bool(direction_ok), 'basis': basis}


def _fact(paper: object, ours: object, holds: bool, basis: str) -> Claim:
    """A claim about an order or a yes/no fact: it holds when it holds."""
    return {'paper': paper, 'ours': ours, 'gap': None, 'tolerance': 'must hold',
            'holds': bool(holds), 'direction_ok': bool(holds), 'basis': basis}


def _pct_of_max(summary: Mapping[str, Any], policy: str, task_class: str) -> float:
    row = summary['policies'][policy]['by_class'][task_class]
    return 100.0 * float(row['utility_mean']) / float(row['utility_max'])


def table4_calibration(name: str) -> Calibration:
    """The calibration Table 4 is measured on: ``name`` with every engine figure its
    provenance marks as fitted to Table 4 set to 0 (not modelled)."""
    calibration = load_calibration(name)
    fitted = {key.removeprefix('engine.'): 0.0 for key, text in calibration.provenance.items()
              if key.startswith('engine.') and text.startswith(TABLE4_FITTED)}
    if not fitted:
        return calibration
    return calibration.model_copy(update={'engine': calibration.engine.model_copy(
        update=fitted)})


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
        return segmentation_overhead(SimulatedEngine(table4_calibration(calibration)),
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
    """The paper's claims against what the experiments measured: each with the paper's value,
    ours, the gap, the tolerance it is judged by, whether it holds within it, and whether at
    least its direction holds."""
    wid1, wid2 = results['fig5_wid1'], results['fig5_wid2']
    claims: dict[str, Claim] = {}
    urgent = {p: _pct_of_max(wid1, p, 'urgent') for p in ('vllm', 'timelyllm')}
    fixed = _pct_of_max(results['fig5_wid1_fixed'], 'timelyllm', 'urgent')
    for policy, paper in (('timelyllm', 81.5), ('vllm', 59.5)):
        claims[f'fig5_wid1_urgent_utility_pct_of_max_{policy}'] = _level(
            paper, urgent[policy], 10.0, 'points', urgent['timelyllm'] > urgent['vllm'],
            f'Fig. 5(a), WID1, urgent tasks, latency-guided admission as in the paper (with '
            f"the artifact's fixed batch TimelyLLM keeps {fixed:.1f} %)")
    urgent2 = {p: wid2['policies'][p]['by_class']['urgent'] for p in ('vllm', 'timelyllm')}
    floored = {p: float(row['utility_floored_mean']) for p, row in urgent2.items()}
    gain = 100.0 * (floored['timelyllm'] / floored['vllm'] - 1.0) if floored['vllm'] > 0 else None
    claims['fig5_wid2_urgent_utility_gain_pct'] = {
        **_level(191.0, gain if gain is not None else math.nan, 50.0, 'points',
                 floored['timelyllm'] > floored['vllm'],
                 'Fig. 5(d), WID2 (high workload), urgent utility of TimelyLLM over vLLM, late '
                 "tasks at 0 (a relative gain needs a positive base; signed: vLLM "
                 f"{urgent2['vllm']['utility_mean']:.3f}, TimelyLLM "
                 f"{urgent2['timelyllm']['utility_mean']:.3f})"),
        **({} if gain is not None else {'ours': None, 'gap': None, 'holds': False})}
    sweep = results['fig7_wid2']['batch_sweep']
    curves = {p: {int(k): v for k, v in sweep[p].items()} for p in ('timelyllm', 'vllm')}
    peaks = {p: max(c, key=lambda size, c=c: c[size]) for p, c in curves.items()}  # type: ignore[misc]
    for policy, paper_peak, tolerance, paper_level in (('timelyllm', 6, 2, 1.21),
                                                       ('vllm', 12, 4, 0.74)):
        claims[f'fig7_{policy}_peak_batch'] = _level(
            paper_peak, peaks[policy], tolerance, 'sequences', True,
            f'Fig. 7, WID2, fixed batch sizes {list(SWEEP_SIZES)}: where {policy} peaks')
        claims[f'fig7_{policy}_peak_utility'] = _level(
            paper_level, curves[policy][peaks[policy]], 0.15, '', True,
            f"Fig. 7: the mean utility at {policy}'s peak")
    timely, vllm = curves['timelyllm'], curves['vllm']
    above = all(timely[s] >= vllm[s] for s in timely)
    claims['fig7_timelyllm_above_vllm_at_every_batch'] = _fact(
        True, above, above, 'Fig. 7: at every swept batch size')
    fig8 = {p: results['fig8_wid1']['policies'][p]['by_class']['urgent']['utility_mean']
            for p in ('seg-fcfs', 'seg-edf', 'timelyllm')}
    for rival, paper in (('seg-edf', 142.0), ('seg-fcfs', 183.0)):
        ratio = 100.0 * fig8['timelyllm'] / fig8[rival] if fig8[rival] > 0 else math.inf
        claims[f'fig8_urgent_utility_timelyllm_pct_of_{rival}'] = _level(
            paper, ratio, 20.0, 'points', fig8['timelyllm'] > fig8[rival],
            f"Fig. 8, WID1: urgent utility of TimelyLLM as a share of {rival}'s")
    by_type = {p: results['fig9_wid3']['policies'][p]['by_type']
               for p in ('vllm', 'vllm-stream', 'timelyllm')}
    desk = {p: rows[DESK_CLEAN] for p, rows in by_type.items()}
    waiting = 100.0 * (1.0 - desk['timelyllm']['waiting_time_mean_s']
                       / desk['vllm']['waiting_time_mean_s'])
    claims['fig9_desk_clean_waiting_reduction_pct'] = _level(
        84.0, waiting, 10.0, 'points', waiting > 0,
        "Fig. 9, WID3, the 'Desk Clean' task (trace 10), the paper's best case")
    utility_gain = desk['timelyllm']['utility_mean'] - desk['vllm']['utility_mean']
    claims['fig9_desk_clean_utility_gain'] = _level(
        1.97, utility_gain, 0.3, '', utility_gain > 0,
        "Fig. 9: the 'Desk Clean' task's utility, TimelyLLM less vLLM")
    arm = {p: results['fig9_wid3']['policies'][p]['by_class']['arm']['utility_mean']
           for p in by_type}
    claims['fig9_wid3_utility_vllm_below_stream_below_timelyllm'] = _fact(
        True, {p: round(v, 3) for p, v in arm.items()},
        arm['vllm'] <= arm['vllm-stream'] <= arm['timelyllm'],
        'Fig. 9: mean arm utility, vLLM <= vLLM-stream <= TimelyLLM')
    story = {name: results[experiment]['policies'][policy]['overall']
             for name, experiment, policy in (('vllm', 'fig10_sentence', 'vllm'),
                                              ('timelyllm_para', 'fig10_paragraph', 'timelyllm'),
                                              ('timelyllm_sen', 'fig10_sentence', 'timelyllm'))}
    utility = {name: row['utility_mean'] for name, row in story.items()}
    ordered = utility['timelyllm_sen'] > utility['timelyllm_para'] > utility['vllm']
    claims['fig10_story_utility_sentence_over_paragraph_over_vllm'] = _fact(
        'TimelyLLM-Sen > TimelyLLM-Para > vLLM', {n: round(v, 3) for n, v in utility.items()},
        ordered, 'Fig. 10: mean story utility (the paper sums 21.57 more over its '
                 'WritingPrompts requests: a level not comparable with three stories)')
    delay = {name: row['response_time_mean_s'] for name, row in story.items()}
    claims['fig10_story_delay_sentence_below_paragraph_below_vllm'] = _fact(
        'TimelyLLM-Sen < TimelyLLM-Para < vLLM', {n: round(v, 3) for n, v in delay.items()},
        delay['timelyllm_sen'] < delay['timelyllm_para'] < delay['vllm'],
        'Fig. 10: mean response time of the stories')
    reduction = 100.0 * (1.0 - delay['timelyllm_sen'] / delay['vllm'])
    claims['fig10_sentence_delay_reduction_pct'] = _level(
        96.0, reduction, 10.0, 'points', reduction > 0,
        "Fig. 10: TimelyLLM-Sen response time below vLLM's (the paper: up to 96 % on Phi-3)")
    for experiment, suffix in (('table4', ''), ('table4_real', '_real_engine')):
        if experiment not in results:
            continue
        pct = {int(t): float(r['overhead_pct']) for t, r in results[experiment].items()}
        gaps = {t: round(pct[t] - PAPER_TABLE4_PCT[t], 2) for t in pct}
        claims[f'table4_segmentation_overhead_pct{suffix}'] = {
            'paper': PAPER_TABLE4_PCT, 'ours': {t: round(v, 2) for t, v in pct.items()},
            'gap': gaps, 'tolerance': '±2 points per trace',
            'holds': all(abs(g) <= 2.0 for g in gaps.values()),
            'direction_ok': max(pct.values()) < 6.0,
            'correlation': _correlation([PAPER_TABLE4_PCT[t] for t in pct], list(pct.values())),
            'basis': ('Table 4, cold prompt cache, ' + (
                'on the real engine' if suffix else
                'on the calibration with its resume cost at 0: that figure was fitted to this '
                'table, so it is not used to check it'))}
    table5 = results['table5']
    growth = table5[8] / table5[1] if table5[1] > 0 else math.inf
    claims['table5_decision_growth_1_to_8_queued'] = _level(
        PAPER_TABLE5_MS[8] / PAPER_TABLE5_MS[1], growth, 1.0, 'x', growth >= 1.0,
        'Table 5: the cost of a scheduling decision at 8 queued over 1 (the paper: 0.58 -> '
        f'2.03 ms on its hardware; ours {table5[1]:.3f} -> {table5[8]:.3f} ms, the real '
        'decide() that admits, here: absolute times across machines are not compared)')
    return claims


def _correlation(paper: list[float], ours: list[float]) -> float | None:
    """Pearson r of our per-trace figures with the paper's (None when either is flat)."""
    if len(paper) < 2 or statistics.pstdev(paper) == 0 or statistics.pstdev(ours) == 0:
        return None
    return round(statistics.correlation(paper, ours), 3)


def _claims_table(claims: Mapping[str, Claim]) -> str:
    lines = ['| claim | paper | ours | gap | tolerance | holds | direction |',
             '|---|---|---|---|---|---|---|']
    for name, claim in claims.items():
        lines.append(f"| {name} | {json.dumps(claim['paper'])} | {json.dumps(claim['ours'])} "
                     f"| {json.dumps(claim['gap'])} | {claim['tolerance']} "
                     f"| {'yes' if claim['holds'] else 'NO'} "
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
