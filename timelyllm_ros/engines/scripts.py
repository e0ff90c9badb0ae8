"""Where the simulated engine's plans come from: recorded plans of the bundled trace set.

The simulator does not generate text. For a live goal it replays the recorded plan of the
trace whose task line matches the goal, else one of a trace of the same robot kind and class
(chosen by a hash of the task, so the same task always gets the same plan), else any trace
of that robot kind.
"""

from __future__ import annotations

import zlib
from typing import Protocol

from timelyllm_ros.engines.base import PlanScript
from timelyllm_ros.errors import GoalError
from timelyllm_ros.language.traces import TraceSet, approx_tokenize, load_trace_set


class ScriptSource(Protocol):
    """Chooses the recorded plan a scripted engine replays for a goal."""

    def plan_for(self, robot_kind: str, task: str, task_class: str) -> PlanScript:
        """Raises GoalError when there is no plan for the robot kind."""
        ...


class TraceScripts:
    """Plans from a trace set (the bundled one unless given)."""

    def __init__(self, traces: TraceSet | None = None) -> None:
        self._traces = traces

    def plan_for(self, robot_kind: str, task: str, task_class: str) -> PlanScript:
        """The recorded plan for a goal.

        Raises:
            GoalError: the trace set has no plan for this robot kind.
        """
        if self._traces is None:
            self._traces = load_trace_set()
        traces = self._traces.traces
        exact = [t for t in traces if t.robot == robot_kind and t.task == task]
        candidates = exact or [t for t in traces if t.robot == robot_kind
                               and t.task_class == task_class] or [
            t for t in traces if t.robot == robot_kind]
        if not candidates:
            raise GoalError(f'the simulated engine has no recorded plan for robot kind '
                            f'{robot_kind!r} (record traces with lrtrace first)')
        trace = candidates[zlib.crc32(task.encode()) % len(candidates)]
        task_tokens = min(len(approx_tokenize(task)) + 4, trace.prompt_tokens)
        return PlanScript(trace.task_type, trace.task_class, trace.pieces, trace.prompt_tokens,
                          task_tokens)
