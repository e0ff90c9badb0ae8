"""Figures in the style of the paper's evaluation (Fig. 5, 7, 8, 9), written as PNG files."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from timelyllm_ros.evaluation.tables import is_utility  # noqa: E402

Summary = Mapping[str, Mapping[str, float | int]]   # group -> metric -> value

METRIC_LABELS = {
    'utility_mean': 'time utility',
    'utility_floored_mean': 'time utility, late tasks at 0',
    'response_time_mean_s': 'response time (s)',
    'waiting_time_mean_s': 'robot waiting time (s)',
    'completion_time_mean_s': 'task completion time (s)',
    'slo_attainment': 'SLO attainment (share of tasks)',
    'completion_rate': 'completion rate',
    'response_time_p95_s': 'response time p95 (s)',
    'response_time_p99_s': 'response time p99 (s)',
    'completion_time_p99_s': 'completion time p99 (s)',
}


def grouped_bars(path: Path, by_policy: Mapping[str, Summary], metric: str, title: str,
                 show_max: bool = False) -> Path:
    """One bar per policy for each group (task type or class) — Fig. 5 / 8 / 9 style; a
    utility's bars carry their completion rate."""
    policies = list(by_policy)
    groups = sorted({g for summary in by_policy.values() for g in summary},
                    key=lambda g: (len(g), g))
    width = 0.8 / max(len(policies), 1)
    x = np.arange(len(groups))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(groups) + 2), 3.6))
    for i, policy in enumerate(policies):
        blocks = [by_policy[policy].get(g, {}) for g in groups]
        bars = ax.bar(x + (i - (len(policies) - 1) / 2) * width,
                      [b.get(metric, np.nan) for b in blocks], width, label=policy)
        if is_utility(metric):
            ax.bar_label(bars, labels=[_percent(b.get('completion_rate')) for b in blocks],
                         fontsize=5, rotation=90, padding=2)
    if show_max:
        first = next(iter(by_policy.values()))
        maxima = [first.get(g, {}).get('utility_max', np.nan) for g in groups]
        ax.scatter(x, maxima, marker='_', s=900, color='black', label='max', zorder=3)
    ax.set_xticks(x, groups)
    ax.set_ylabel(METRIC_LABELS.get(metric, metric))
    ax.set_title(title)
    ax.axhline(0, color='grey', linewidth=0.6)
    # Below the axes, so that it never hides a bar.
    ax.legend(fontsize=7, ncols=min(len(policies) + show_max, 4), loc='upper center',
              bbox_to_anchor=(0.5, -0.12), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches='tight')
    plt.close(fig)
    return path


def _percent(value: float | int | None) -> str:
    return '' if value is None or value != value else f'{value:.0%}'


def batch_sweep(path: Path, sweep: Mapping[str, Mapping[int, float]], title: str,
                completion: Mapping[str, Mapping[int, float]] | None = None) -> Path:
    """Overall utility against a fixed maximum batch size, one line per policy — Fig. 7;
    each point labelled with its completion rate when given."""
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for policy, points in sweep.items():
        sizes = sorted(points)
        ax.plot(sizes, [points[s] for s in sizes], marker='o', label=policy)
        rates = completion.get(policy, {}) if completion is not None else {}
        for size in sizes if rates else ():
            ax.annotate(_percent(rates.get(size)), (size, points[size]),
                        fontsize=5, textcoords='offset points', xytext=(0, 4), ha='center')
    ax.set_xlabel('maximum batch size')
    ax.set_ylabel('mean time utility')
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches='tight')
    plt.close(fig)
    return path


def metric_figures(out: Path, workload: str, by_class: Mapping[str, Summary],
                   metrics: Sequence[str]) -> list[Path]:
    """One figure per metric: a bar per policy for each task class and overall."""
    return [grouped_bars(out / f'metric_{metric}.png', by_class, metric,
                         f'{workload}: {METRIC_LABELS.get(metric, metric)}',
                         show_max=metric == 'utility_mean')
            for metric in metrics]


def paper_figures(out: Path, workload: str, by_type: Mapping[str, Summary],
                  classes: Sequence[str]) -> list[Path]:
    """All per-task-type figures of one bench run."""
    written = [
        grouped_bars(out / 'fig5_utility.png', by_type, 'utility_mean',
                     f'{workload}: time utility per task type', show_max=True),
        grouped_bars(out / 'fig5_response.png', by_type, 'response_time_mean_s',
                     f'{workload}: response time per task type'),
        grouped_bars(out / 'fig5_waiting.png', by_type, 'waiting_time_mean_s',
                     f'{workload}: robot waiting time per task type'),
    ]
    fig8 = {p: by_type[p] for p in ('seg-fcfs', 'seg-edf', 'timelyllm') if p in by_type}
    if len(fig8) > 1:
        written.append(grouped_bars(out / 'fig8_policies.png', fig8, 'utility_mean',
                                    f'{workload}: FCFS vs EDF vs TimelyLLM', show_max=True))
    if 'arm' in classes:
        for metric, name in (('utility_mean', 'utility'), ('waiting_time_mean_s', 'waiting')):
            written.append(grouped_bars(out / f'fig9_arm_{name}.png', by_type, metric,
                                        f'{workload}: robot arm {name} per task',
                                        show_max=metric == 'utility_mean'))
    return written
