"""Look into an LRTrace bag: tasks, segments and skill timings as rows; a timeline figure.

Rows are plain dicts (float seconds on the recorder's clock) for :func:`format_table`, CSV or
JSON. :func:`plot_timeline` draws one lane per task in the style of the paper's Fig. 6: for
each segment the span from when it could start being generated (the request's arrival, or the
previous cut) to its cut, and its execution on the robot.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lrtrace import format as fmt
from lrtrace.reader import TraceBag, read_bag
from timelyllm_ros.evaluation.tables import text_table

__all__ = ['format_table', 'plot_timeline', 'segment_rows', 'skill_rows', 'task_rows']

Row = dict[str, Any]


def _bag(bag: str | Path | TraceBag) -> TraceBag:
    return bag if isinstance(bag, TraceBag) else read_bag(bag)


def task_rows(bag: str | Path | TraceBag) -> list[Row]:
    """One row per recorded task."""
    rows = []
    for task in _bag(bag).tasks:
        arrival = fmt.stamp_seconds(task.arrival_stamp)
        starts = [fmt.stamp_seconds(s) for s in task.start_stamps]
        ends = [fmt.stamp_seconds(s) for s in task.end_stamps]
        rows.append({
            'task': task.task_id, 'robot': task.robot_id, 'type': task.task_type,
            'class': task.task_class, 'status': task.status, 'arrival_s': arrival,
            'segments': len(task.cut_tokens), 'tokens': len(task.token_pieces),
            'response_s': starts[0] - arrival if starts else math.nan,
            'completion_s': ends[-1] - arrival if ends else math.nan,
            'plan': task.text,
        })
    return rows


def segment_rows(bag: str | Path | TraceBag) -> list[Row]:
    """One row per segment of every task (cut point, generation and execution times)."""
    rows = []
    for task in _bag(bag).tasks:
        previous = 0
        for k, cut in enumerate(task.cut_tokens):
            start = fmt.stamp_seconds(task.start_stamps[k])
            end = fmt.stamp_seconds(task.end_stamps[k])
            rows.append({
                'task': task.task_id, 'segment': k, 'tokens': int(cut) - previous,
                'cut_s': fmt.stamp_seconds(task.cut_stamps[k]), 'start_s': start,
                'end_s': end, 'exec_s': end - start,
                'estimate_s': float(task.estimated_execution_s[k]),
                'text': task.segment_texts[k],
            })
            previous = int(cut)
    return rows


def skill_rows(bag: str | Path | TraceBag) -> list[Row]:
    """One row per recorded skill execution."""
    rows = []
    for record in _bag(bag).skills:
        start = fmt.stamp_seconds(record.start_stamp)
        end = fmt.stamp_seconds(record.end_stamp)
        rows.append({
            'task': record.goal_id, 'robot': record.robot_id, 'segment': record.segment_index,
            'skill': record.skill, 'call': record.call, 'start_s': start, 'end_s': end,
            'seconds': end - start, 'success': record.success, 'error': record.error,
        })
    return rows


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return '-' if math.isnan(value) else f'{value:.3f}'
    text = str(value)
    return text if len(text) <= 40 else text[:37] + '...'


def format_table(rows: Sequence[Row], columns: Sequence[str] | None = None) -> str:
    """A plain-text table of rows (columns: the first row's keys unless given)."""
    if not rows:
        return '(no rows)'
    columns = list(columns) if columns is not None else list(rows[0])
    body = [[_cell(row.get(c, '')) for c in columns] for row in rows]
    return text_table(columns, body, align='left')


def plot_timeline(bag: str | Path | TraceBag, out_png: str | Path,
                  tasks: Sequence[str] | None = None) -> Path:
    """Draw the per-task timeline (paper Fig. 6) to a PNG file.

    Args:
        bag: the bag (path or read).
        out_png: the PNG file to write.
        tasks: task ids to draw (default: every task, at most the first 40).

    Returns:
        The PNG path.
    """
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    records = sorted(_bag(bag).tasks, key=lambda t: fmt.stamp_ns(t.arrival_stamp) or 0)
    if tasks is not None:
        wanted = set(tasks)
        records = [t for t in records if t.task_id in wanted]
    else:
        records = records[:40]
    fig, ax = plt.subplots(figsize=(10, max(2.0, 0.35 * len(records) + 1.2)))
    colors = plt.get_cmap('tab10')
    for lane, task in enumerate(records):
        arrival = fmt.stamp_seconds(task.arrival_stamp)
        previous = arrival
        ax.plot([arrival], [lane], marker='|', color='black', markersize=10)
        for k in range(len(task.cut_tokens)):
            cut = fmt.stamp_seconds(task.cut_stamps[k])
            start = fmt.stamp_seconds(task.start_stamps[k])
            end = fmt.stamp_seconds(task.end_stamps[k])
            color = colors(k % 10)
            if not math.isnan(cut):
                ax.broken_barh([(previous, max(cut - previous, 1e-3))], (lane - 0.35, 0.25),
                               facecolors=color, alpha=0.45)
                previous = cut
            if not (math.isnan(start) or math.isnan(end)):
                ax.broken_barh([(start, max(end - start, 1e-3))], (lane - 0.05, 0.4),
                               facecolors=color, edgecolor='black', linewidth=0.4)
    ax.set_yticks(range(len(records)))
    ax.set_yticklabels([f'{t.task_id} {t.task_type}' for t in records], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel('time (s)')
    ax.set_title('LRTrace timeline: thin = until the segment is cut (queued + generating), '
                 'thick = executed', fontsize=9)
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
