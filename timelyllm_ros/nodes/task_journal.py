"""A controller's task journal: its robot's tasks outlive the controller's process.

A controller holds its robot's active task and the tasks waiting for the robot in memory; a
killed controller (``kill -9``, a crash, a power cut of its computer) would lose them with no
result. The journal is a small JSON file the controller rewrites (atomically) on every
change of its queue, and reads when it starts again:

* tasks that were waiting are taken up again, in their order, if they are recent enough
  (``resume_within_s``); older ones end ``failed`` with the reason, so a robot restarted the
  next day does not fly yesterday's tasks;
* the active task whose goal the planner had accepted is ended by the planner (the restarted
  controller reports that it lost the goal, :data:`LOST_GOAL_PREFIX`): the planner fails the
  goal and publishes its ``PlanResult`` and ``TaskRecord`` in the controller's place;
* an active task whose goal was never accepted goes first in the queue again.

No rclpy import: the controller node uses it, tests use it directly.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from timelyllm_ros.errors import GoalError
from timelyllm_ros.nodes.convert import TaskRequest, task_from_msg

LOST_GOAL_PREFIX = 'uuid:'
"""``goal_id`` of a ``SegmentDone`` that names a goal by its action goal UUID (hex) rather
than by the planner's task id: a restarted controller reporting a goal it lost with its
process. The planner fails such a goal and reports its result in the controller's place."""

FORMAT = 1
"""Version of the journal's layout; a journal of another version is set aside, not read."""


@dataclass(frozen=True, slots=True)
class KeptTask:
    """A task a controller holds: what arrived on its ``task`` topic, when (wall-clock
    seconds, so that a restarted process can tell its age), and the hex UUID of its plan goal
    once the planner accepted it (the active task only)."""

    request: TaskRequest
    arrived_s: float
    goal_uuid: str = ''


@dataclass(frozen=True, slots=True)
class JournalState:
    """The robot's tasks when the journal was last written."""

    active: KeptTask | None = None
    waiting: tuple[KeptTask, ...] = field(default_factory=tuple)
    lost: tuple[KeptTask, ...] = field(default_factory=tuple)   # goals to report to a planner

    @property
    def empty(self) -> bool:
        return self.active is None and not self.waiting and not self.lost


class JournalError(Exception):
    """A journal that cannot be read (it is set aside and named in the message)."""


def default_state_dir() -> Path:
    """``$ROS_HOME/timelyllm`` (``~/.ros/timelyllm`` when ``ROS_HOME`` is unset), beside ROS's
    own logs."""
    return Path(os.environ.get('ROS_HOME') or Path.home() / '.ros') / 'timelyllm'


def journal_path(state_dir: str | Path, node_name: str) -> Path:
    """The journal of the node with fully qualified name ``node_name``
    (``/fleet_a/drone_0/controller`` -> ``<state_dir>/tasks/fleet_a/drone_0/controller.json``):
    one file per controller, the same across its restarts."""
    parts = [part for part in node_name.split('/') if part]
    if not parts:
        raise ValueError(f'not a node name: {node_name!r}')
    return Path(state_dir, 'tasks', *parts[:-1], parts[-1] + '.json')


class TaskJournal:
    """Reads and rewrites one controller's journal file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def save(self, state: JournalState) -> None:
        """Replace the journal with ``state`` (write aside, then rename: a kill mid-write
        leaves the previous journal whole). Removes the file when there is nothing to keep."""
        if state.empty:
            self.path.unlink(missing_ok=True)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {'format': FORMAT,
                'active': None if state.active is None else _to_json(state.active),
                'waiting': [_to_json(task) for task in state.waiting],
                'lost': [_to_json(task) for task in state.lost]}
        partial = self.path.with_name(self.path.name + '.partial')
        partial.write_text(json.dumps(data), encoding='utf-8')
        os.replace(partial, self.path)

    def load(self) -> JournalState:
        """The journal's tasks (empty when there is no journal).

        Raises:
            JournalError: the file is unreadable, not this layout, or holds an invalid task;
                it is renamed to ``<name>.unreadable`` so the next start begins empty.
        """
        try:
            raw = self.path.read_text(encoding='utf-8')
        except FileNotFoundError:
            return JournalState()
        except OSError as err:
            raise self._set_aside(f'cannot read it: {err.strerror}') from None
        try:
            data = json.loads(raw)
            if not isinstance(data, dict) or data.get('format') != FORMAT:
                raise ValueError(f'not a format-{FORMAT} task journal')
            active = data['active']
            return JournalState(
                active=None if active is None else _task(active),
                waiting=tuple(_task(item) for item in data['waiting']),
                lost=tuple(_task(item) for item in data.get('lost', ())))
        except (ValueError, KeyError, TypeError) as err:
            raise self._set_aside(str(err) or type(err).__name__) from None

    def _set_aside(self, reason: str) -> JournalError:
        aside = self.path.with_name(self.path.name + '.unreadable')
        try:
            os.replace(self.path, aside)
        except OSError:
            aside = self.path
        return JournalError(f'task journal {self.path}: {reason} (kept as {aside})')


def _to_json(kept: KeptTask) -> dict[str, object]:
    request = kept.request
    tuf = request.tuf
    return {'task': request.task, 'task_id': request.task_id, 'urgency': request.urgency,
            'tuf': None if tuf is None else [tuf.ert_s, tuf.alpha, tuf.beta],
            'arrived_s': kept.arrived_s, 'goal_uuid': kept.goal_uuid}


def _task(data: object) -> KeptTask:
    """A journal entry, read through the same gate as a ``Task`` message."""
    if not isinstance(data, dict):
        raise ValueError('a task is not a mapping')
    tuf = data.get('tuf')
    ert_s, alpha, beta = (float(v) for v in tuf) if tuf is not None else (0.0, 0.0, 0.0)
    message = SimpleNamespace(
        task=data['task'], task_id=data.get('task_id', ''), urgency=data.get('urgency', ''),
        has_tuf=tuf is not None, tuf=SimpleNamespace(ert_s=ert_s, alpha=alpha, beta=beta))
    try:
        request = task_from_msg(message)
    except GoalError as err:
        raise ValueError(str(err)) from None
    return KeptTask(request, arrived_s=float(data['arrived_s']),
                    goal_uuid=str(data.get('goal_uuid', '')))
