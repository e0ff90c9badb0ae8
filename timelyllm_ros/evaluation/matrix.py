"""The benchmark matrix: workloads × engine regimes × seeds × policies, in one command.

One bench run per (workload, regime, seed) cell (:func:`~timelyllm_ros.evaluation.bench.
run_bench`, its summary.json and tasks.csv under ``OUT/WORKLOAD/REGIME/seedN``); then, per
workload, regime and policy, each figure's mean and spread (sample standard deviation) over
the seeds: urgent and overall utility, signed and with late tasks floored at 0, completion
rate, mean and p95 response time and SLO attainment. ``matrix.json`` holds them with every
seed's value, ``matrix.md`` a table, ``matrix.png`` a figure (a panel per regime and figure, a
group of bars per workload, a bar per policy with its spread). Given a policy to judge,
both also say where it stands against the best of the others in every cell and figure
(:func:`standing`: issue 28's target, read from the matrix).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from timelyllm_ros.core.scheduler import SchedulerConfig
from timelyllm_ros.errors import PolicyError
from timelyllm_ros.evaluation.bench import EngineOptions, regime_engine, run_bench
from timelyllm_ros.evaluation.workloads import resolve_workload

DEFAULT_WORKLOADS = ('wid1', 'wid2', 'wid3', 'authors-drone', 'authors-arm', 'overload-1000')
DEFAULT_SEEDS = (0, 1, 2, 3, 4)
DEFAULT_REGIMES = ('default', 'contended', 'paper')

FIGURES: tuple[tuple[str, str, str], ...] = (
    # (name, summary group, summary key)
    ('urgent utility', 'urgent', 'utility_mean'),
    ('urgent floored', 'urgent', 'utility_floored_mean'),
    ('utility', 'overall', 'utility_mean'),
    ('floored', 'overall', 'utility_floored_mean'),
    ('completion', 'overall', 'completion_rate'),
    ('mean response s', 'overall', 'response_time_mean_s'),
    ('p95 response s', 'overall', 'response_time_p95_s'),
    ('SLO', 'overall', 'slo_attainment'),
)
"""The figures of each cell: the urgent class where a workload has one, else overall."""

LOWER_IS_BETTER = frozenset({'mean response s', 'p95 response s'})

RESPONSE_MARGIN = 0.10
"""How far behind the best other policy a lower-is-better figure (a response time) may be and
still count as level with it: issue 28's "no more than 10 % behind the best on mean response
time"."""

Verdict = Literal['ahead', 'level', 'behind']


def _best_of(figure: str) -> Callable[..., Any]:
    """``min`` for a figure where lower is better (a response time), else ``max``."""
    return min if figure in LOWER_IS_BETTER else max


def _figure(policy_summary: dict[str, Any], group: str, key: str) -> float:
    block = (policy_summary['overall'] if group == 'overall'
             else policy_summary['by_class'].get(group, policy_summary['overall']))
    value = block.get(key)
    return math.nan if value is None else float(value)


def _spread(values: list[float]) -> dict[str, Any]:
    finite = [v for v in values if math.isfinite(v)]
    return {'mean': statistics.fmean(finite) if finite else None,
            'sd': statistics.stdev(finite) if len(finite) > 1 else 0.0 if finite else None,
            'values': [v if math.isfinite(v) else None for v in values]}


def verdict(mean: float, sd: float, best_mean: float, best_sd: float, figure: str,
            response_margin: float = RESPONSE_MARGIN) -> Verdict:
    """A policy's figure against the best other policy's, as issue 28's targets read it:
    ``'ahead'`` at or past the best mean; ``'level'`` within the seeds' spread (the two means
    ± their sample spreads overlap) or, for a response time, within ``response_margin`` of
    the best; ``'behind'`` otherwise."""
    if figure in LOWER_IS_BETTER:
        if mean <= best_mean:
            return 'ahead'
        return 'level' if mean <= best_mean * (1.0 + response_margin) else 'behind'
    if mean >= best_mean:
        return 'ahead'
    return 'level' if mean + sd >= best_mean - best_sd else 'behind'


def check_judged(policy: str, policies: Sequence[str]) -> None:
    """Raise :class:`~timelyllm_ros.errors.PolicyError` unless ``policy`` is one of at least
    two ``policies``."""
    if policy not in policies or len(policies) < 2:
        raise PolicyError(f'{policy!r} must be one of at least two policies to stand against '
                         f"the others (policies: {', '.join(policies)})")


def standing(matrix: dict[str, Any], policy: str,
             response_margin: float = RESPONSE_MARGIN) -> dict[str, Any]:
    """Where ``policy`` stands in every cell (workload, regime) and figure of a matrix: its
    :func:`verdict` against the other policy with the best mean there (a figure a policy has
    no value for, e.g. the response time of a policy that completed nothing, is left out).

    A response time is a mean over the goals a policy completed, so it is judged only against
    policies that completed as many goals (a completion rate not behind ``policy``'s beyond
    the seeds' spread): TimeBill's fast responses over the 1–8 % of goals it did not kill are
    not a faster service of the fleet. Where such a policy had the best response time of the
    cell, the entry names it (``'fewer_goals'``: policy, mean, its completion rate and the
    verdict against it), and ``'behind_counting_fewer_goals'`` lists what is behind when
    every policy's response time counts.

    Returns:
        ``{'policy', 'response_margin', 'cells': {workload: {regime: {figure: {'verdict',
        'best', 'best_mean', 'best_sd'[, 'fewer_goals']}}}}, 'behind': ['workload regime
        figure', …], 'behind_counting_fewer_goals': […]}``.

    Raises:
        PolicyError: ``policy`` is not in the matrix, or it is the only policy there.
    """
    check_judged(policy, matrix['policies'])
    others = [p for p in matrix['policies'] if p != policy]
    cells: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    behind: list[str] = []
    behind_counting_fewer: list[str] = []
    for workload, regimes in matrix['cells'].items():
        for regime, policies in regimes.items():
            row = cells.setdefault(workload, {}).setdefault(regime, {})
            for figure, _, _ in FIGURES:
                own = policies[policy][figure]
                rivals = [(p, policies[p][figure]) for p in others
                          if policies[p][figure]['mean'] is not None]
                if own['mean'] is None or not rivals:
                    continue
                every = _judge(own, rivals, figure, response_margin)
                entry = every
                if figure in LOWER_IS_BETTER:
                    served = [(p, s) for p, s in rivals
                              if not _fewer_goals(policies[p], policies[policy])]
                    if len(served) < len(rivals):
                        entry = (_judge(own, served, figure, response_margin) if served else
                                 {'verdict': 'ahead', 'best': None, 'best_mean': None,
                                  'best_sd': None})
                    if entry['best'] != every['best']:
                        entry['fewer_goals'] = {
                            'policy': every['best'], 'mean': every['best_mean'],
                            'completion': policies[every['best']]['completion']['mean'],
                            'verdict': every['verdict']}
                row[figure] = entry
                label = f'{workload} {regime} {figure}'
                if entry['verdict'] == 'behind':
                    behind.append(label)
                if every['verdict'] == 'behind':
                    behind_counting_fewer.append(label)
    return {'policy': policy, 'response_margin': response_margin, 'cells': cells,
            'behind': behind, 'behind_counting_fewer_goals': behind_counting_fewer}


def _judge(own: dict[str, Any], rivals: list[tuple[str, dict[str, Any]]], figure: str,
           response_margin: float) -> dict[str, Any]:
    """The verdict of ``own`` (a figure's spread) against the best of ``rivals``."""
    best, spread = _best_of(figure)(rivals, key=lambda item: item[1]['mean'])
    return {'verdict': verdict(own['mean'], own['sd'] or 0.0, spread['mean'],
                               spread['sd'] or 0.0, figure, response_margin),
            'best': best, 'best_mean': spread['mean'], 'best_sd': spread['sd']}


def _fewer_goals(other: dict[str, Any], judged: dict[str, Any]) -> bool:
    """Whether ``other`` completed fewer goals than ``judged`` beyond the seeds' spread."""
    theirs, mine = other['completion'], judged['completion']
    if theirs['mean'] is None or mine['mean'] is None:
        return False
    return verdict(theirs['mean'], theirs['sd'] or 0.0, mine['mean'], mine['sd'] or 0.0,
                   'completion') == 'behind'


def run_matrix(out: Path, policies: Sequence[str],
               workloads: Sequence[str] = DEFAULT_WORKLOADS,
               regimes: Sequence[str] = DEFAULT_REGIMES,
               seeds: Sequence[int] = DEFAULT_SEEDS, robot_jitter: float = 0.1,
               config: SchedulerConfig | None = None, engine: EngineOptions | None = None,
               progress: Callable[[str], None] | None = None,
               judged: str | None = None) -> dict[str, Any]:
    """Run every cell and write matrix.json, matrix.md and matrix.png into ``out``.

    ``robot_jitter`` (default 0.1) makes the seeds differ on the authors' workloads too,
    whose arrivals and skill times are recorded. ``judged``: a policy whose
    :func:`standing` against the others the matrix adds (``'standing'``, and a table).

    Raises:
        PolicyError: ``judged`` is not one of at least two ``policies`` (before any run).
    """
    if judged is not None:
        check_judged(judged, policies)          # before the runs, not after
    engine = engine or EngineOptions()
    engines = {regime: regime_engine(regime, engine) for regime in regimes}   # checked first
    cells: dict[str, dict[str, dict[str, dict[str, dict[str, Any]]]]] = {}
    for workload in workloads:
        for regime in regimes:
            per_seed: list[dict[str, Any]] = []
            for seed in seeds:
                if progress:
                    progress(f'{workload} {regime} seed {seed}')
                name, tasks = resolve_workload(workload, seed=seed)
                summary = run_bench(name, tasks, policies, out / workload / regime / f'seed{seed}',
                                    seed=seed, config=config, engine=engines[regime],
                                    robot_jitter=robot_jitter, regime=regime, figures=False)
                per_seed.append(summary['policies'])
            cells.setdefault(workload, {})[regime] = {
                policy: {figure: _spread([_figure(s[policy], group, key) for s in per_seed])
                         for figure, group, key in FIGURES}
                for policy in policies}
    matrix = {'workloads': list(workloads), 'regimes': list(regimes), 'seeds': list(seeds),
              'policies': list(policies), 'robot_jitter': robot_jitter,
              'engine': engine.describe(), 'cells': cells}
    if judged is not None:
        matrix['standing'] = standing(matrix, judged)
    out.mkdir(parents=True, exist_ok=True)
    (out / 'matrix.json').write_text(json.dumps(matrix, indent=1) + '\n')
    (out / 'matrix.md').write_text(matrix_table(matrix))
    matrix_figure(out / 'matrix.png', matrix)
    return matrix


def _cell(spread: dict[str, Any], pattern: str) -> str:
    if spread['mean'] is None:
        return '-'
    return f"{pattern.format(spread['mean'])} ± {pattern.format(spread['sd'])}"


def matrix_table(matrix: dict[str, Any]) -> str:
    """A Markdown table: a row per workload, regime and policy; a column per figure (mean ±
    spread over the seeds); the best mean of each figure in a cell group in bold."""
    patterns = {'completion': '{:.2f}', 'SLO': '{:.2f}'}
    names = [f for f, _, _ in FIGURES]
    lines = [f"seeds {matrix['seeds']}, robot jitter {matrix['robot_jitter']}", '',
             '| workload | regime | policy | ' + ' | '.join(names) + ' |',
             '|---|---|---|' + '---|' * len(names)]
    for workload, regimes in matrix['cells'].items():
        for regime, policies in regimes.items():
            best = {}
            for figure in names:
                means = [p[figure]['mean'] for p in policies.values()
                         if p[figure]['mean'] is not None]
                if means:
                    best[figure] = _best_of(figure)(means)
            for policy, figures in policies.items():
                cells = []
                for figure in names:
                    text = _cell(figures[figure], patterns.get(figure, '{:.3f}'))
                    if figures[figure]['mean'] is not None and figures[figure]['mean'] == best.get(
                            figure):
                        text = f'**{text}**'
                    cells.append(text)
                lines.append(f'| {workload} | {regime} | {policy} | ' + ' | '.join(cells) + ' |')
    if 'standing' in matrix:
        lines += ['', *standing_table(matrix['standing'])]
    return '\n'.join(lines) + '\n'


def standing_table(judged: dict[str, Any]) -> list[str]:
    """The lines of a Markdown table of a :func:`standing`: a row per workload and regime, a
    column per figure (``ahead``, ``level · BEST``, or ``behind · BEST's mean``)."""
    names = [f for f, _, _ in FIGURES]
    total = sum(len(figures) for regimes in judged['cells'].values()
                for figures in regimes.values())
    counting = judged.get('behind_counting_fewer_goals', judged['behind'])
    lines = [f"Where {judged['policy']} stands against the best other policy of each cell: "
             f"behind in {len(judged['behind'])} of {total} figures (level: within the seeds' "
             f"spread; response times within {judged['response_margin']:.0%} of the best of "
             f"the policies that completed as many goals; {len(counting)} counting the "
             f"response times of policies that completed fewer)", '',
             '| workload | regime | ' + ' | '.join(names) + ' |',
             '|---|---|' + '---|' * len(names)]
    for workload, regimes in judged['cells'].items():
        for regime, figures in regimes.items():
            cells = []
            for figure in names:
                entry = figures.get(figure)
                if entry is None:
                    cells.append('-')
                    continue
                if entry['verdict'] == 'ahead':
                    text = 'ahead'
                elif entry['verdict'] == 'level':
                    text = f"level · {entry['best']}"
                else:
                    text = f"**behind** · {entry['best']} {entry['best_mean']:.3f}"
                fewer = entry.get('fewer_goals')
                if fewer is not None:
                    text += (f" ({fewer['policy']} {fewer['mean']:.3f} over "
                             f"{fewer['completion']:.0%} of goals)")
                cells.append(text)
            lines.append(f'| {workload} | {regime} | ' + ' | '.join(cells) + ' |')
    return lines


def matrix_figure(path: Path, matrix: dict[str, Any],
                  figures: Sequence[str] = ('urgent utility', 'urgent floored', 'completion',
                                            'p95 response s', 'SLO')) -> Path:
    """A panel per (figure, regime): a group per workload, a bar per policy, spread as error
    bars."""
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    import numpy as np

    workloads, regimes, policies = matrix['workloads'], matrix['regimes'], matrix['policies']
    fig, axes = plt.subplots(len(figures), len(regimes), squeeze=False,
                             figsize=(4.8 * len(regimes), 2.6 * len(figures)))
    width = 0.8 / max(len(policies), 1)
    x = np.arange(len(workloads))
    for row, figure in enumerate(figures):
        for col, regime in enumerate(regimes):
            ax = axes[row][col]
            for i, policy in enumerate(policies):
                spreads = [matrix['cells'][w][regime][policy][figure] for w in workloads]
                means = [s['mean'] if s['mean'] is not None else np.nan for s in spreads]
                errors = [s['sd'] if s['sd'] is not None else 0.0 for s in spreads]
                ax.bar(x + (i - (len(policies) - 1) / 2) * width, means, width, yerr=errors,
                       label=policy, capsize=1.5, error_kw={'linewidth': 0.6})
            ax.set_xticks(x, workloads, fontsize=6)
            ax.axhline(0, color='grey', linewidth=0.5)
            ax.set_title(f'{figure} · {regime}', fontsize=8)
            ax.tick_params(axis='y', labelsize=6)
    axes[0][0].legend(fontsize=5, ncols=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
