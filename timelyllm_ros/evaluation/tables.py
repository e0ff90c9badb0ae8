"""Plain-text tables for the command lines (``timelyllm`` and ``lrtrace`` print the same way).

:func:`text_table` lays out any header and rows; :func:`metrics_table` and
:func:`metrics_matrix` lay out the benchmark's summary metrics (``bench.run_summary``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

# (summary key, column header, format) of the metrics a run's table shows
SUMMARY_COLUMNS = (('tasks', 'tasks', '{:d}'), ('completed', 'done', '{:d}'),
                   ('completion_rate', 'done %', '{:.0%}'),
                   ('utility_mean', 'utility', '{:.3f}'),
                   ('utility_floored_mean', 'floored', '{:.3f}'), ('utility_max', 'max', '{:.2f}'),
                   ('response_time_mean_s', 'response s', '{:.3f}'),
                   ('waiting_time_mean_s', 'waiting s', '{:.3f}'),
                   ('completion_time_mean_s', 'completion s', '{:.2f}'))


def text_table(header: Sequence[str], body: Sequence[Sequence[str]],
               align: Literal['left', 'right'] = 'right', title: str | None = None) -> str:
    """Columns as wide as their widest cell, two spaces apart; a title line first if given.
    Left-aligned rows lose their trailing spaces."""
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        if align == 'right':
            return '  '.join(c.rjust(w) for c, w in zip(cells, widths, strict=True))
        return '  '.join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    lines = [title] if title is not None else []
    lines += [line(header), *(line(row) for row in body)]
    return '\n'.join(lines)


def format_value(value: object, pattern: str) -> str:
    """A metric in ``pattern``; ``-`` for a missing or NaN one."""
    if value is None or (isinstance(value, float) and value != value):
        return '-'
    return pattern.format(value)


def metrics_table(title: str, rows: Mapping[str, Mapping[str, Any]], label: str) -> str:
    """One row per group (task class, task type, ...), the summary metrics as columns."""
    header = [label, *(h for _, h, _ in SUMMARY_COLUMNS)]
    body = [[name, *(format_value(m.get(k), p) for k, _, p in SUMMARY_COLUMNS)]
            for name, m in rows.items()]
    return text_table(header, body, title=title)


def is_utility(metric: str) -> bool:
    """Whether a summary metric is a utility, shown with the completion rate beside it: a
    utility says nothing about the goals that never got their plan without it."""
    return 'utility' in metric and metric != 'utility_max'


def metrics_matrix(title: str, results: Mapping[str, Mapping[str, Any]], metric: str,
                   sections: Sequence[str] = ('by_type', 'by_class')) -> str:
    """Rows = task types and/or classes, then overall; columns = policies; cells = one metric
    (a utility with the completion rate in brackets, and the maximum utility beside
    ``utility_mean``)."""
    policies = list(results)
    first = next(iter(results.values()))
    groups = [(section, g) for section in sections for g in first[section]] + [
        ('overall', 'overall')]
    with_max = metric == 'utility_mean'
    header = ['', *policies, *(['max'] if with_max else [])]
    body = []
    for section, group in groups:
        blocks = {p: results[p][section] if section == 'overall'
                  else results[p][section].get(group, {}) for p in policies}
        row = [group, *(_cell(blocks[p], metric) for p in policies)]
        if with_max:
            row.append(format_value(blocks[policies[0]].get('utility_max'), '{:.2f}'))
        body.append(row)
    if is_utility(metric):
        title += ' (completion rate)'
    return text_table(header, body, title=title)


def _cell(block: Mapping[str, Any], metric: str) -> str:
    value = format_value(block.get(metric), '{:.3f}')
    if not is_utility(metric):
        return value
    return f"{value} ({format_value(block.get('completion_rate'), '{:.0%}')})"


def summary_tables(summary: Mapping[str, Any]) -> str:
    """A run's summary (``bench.run_summary``): per task class, per task type, overall."""
    return '\n'.join([metrics_table('per task class', summary['by_class'], 'class'),
                      metrics_table('per task type', summary['by_type'], 'type'),
                      metrics_table('overall', {'all': summary['overall']}, '')])
