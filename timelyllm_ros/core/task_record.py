"""What an LRTrace task record holds about one task, as plain values.

One mapping serves both writers of ``TaskRecord`` messages: the bag recorder (rosbags
classes) and the live planner (rclpy classes), which only differ in how they build stamps,
numeric arrays and the nested TUF.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from timelyllm_ros.core.request import Generation

UNSET_STAMP_SEC = -(2**31)
"""``sec`` of a stamp that never happened (a segment the robot never ran)."""

STAMP_FIELDS = ('arrival_stamp', 'done_stamp')
"""Fields holding one time (float seconds on the recording clock)."""

STAMP_LIST_FIELDS = ('cut_stamps', 'dispatch_stamps', 'start_stamps', 'end_stamps')
"""Fields holding one time per segment."""


def task_record_fields(generation: Generation, pieces: Sequence[str] | None = None,
                       task_id: str | None = None) -> dict[str, Any]:
    """The fields of a task's ``TaskRecord``: times as float seconds (NaN: never happened),
    sequences as lists, ``tuf`` as a mapping of its three values.

    Args:
        generation: the scheduler's record of the task (normally in a terminal state).
        pieces: the generated token pieces; by default the first ``generation.tokens``
            pieces of the request's script (what the simulated engine emitted), else the
            output of each iteration as the scheduler received it.
        task_id: the id to record (default: the scheduler's task id).
    """
    spec = generation.spec
    if pieces is None:
        pieces = (spec.script[:generation.tokens] if spec.script is not None
                  else generation.pieces)
    pieces = [str(p) for p in pieces]
    segments = generation.segments
    cuts: list[int] = []
    total = 0
    for segment in segments:
        total += segment.tokens
        cuts.append(total)
    return {
        'robot_id': spec.robot_id, 'task_id': task_id or spec.task_id,
        'profile': spec.profile, 'task_class': spec.task_class, 'task_type': spec.task_type,
        'task': spec.task,
        'tuf': {'ert_s': spec.tuf.ert_s, 'alpha': spec.tuf.alpha, 'beta': spec.tuf.beta},
        'arrival_stamp': spec.arrival_time, 'prompt_tokens': spec.prompt_tokens,
        'task_tokens': spec.task_tokens,
        'text': ''.join(pieces) if pieces else ''.join(s.text for s in segments),
        'token_pieces': pieces, 'cut_tokens': cuts,
        'cut_stamps': [s.cut_time for s in segments],
        'dispatch_stamps': [s.dispatch_time for s in segments],
        'start_stamps': [s.start_time for s in segments],
        'end_stamps': [s.end_time for s in segments],
        'estimated_execution_s': [s.estimated_exec_s for s in segments],
        'segment_texts': [s.text for s in segments],
        'segment_success': [s.success for s in segments],
        'segment_errors': [s.error for s in segments],
        'status': generation.status.name, 'finish_reason': generation.finish_reason,
        'error': generation.error, 'suspensions': generation.suspensions,
        'preemptions': generation.preemptions, 'done_stamp': generation.done_time,
    }
