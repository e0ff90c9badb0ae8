"""What the scheduler tells its driver: the one stream of dispatches, closes and ends.

Every change a robot or a goal's owner must hear of is an event the scheduler buffers, in the
order it happened, whatever caused it (a tick, a cancel, a robot's report, an overdue
deadline, the service giving up). A driver (the simulation, the live service) drains the
buffer (:meth:`~timelyllm_ros.core.scheduler.Scheduler.drain_events`, or the events of
:meth:`~timelyllm_ros.core.scheduler.Scheduler.tick`) and acts on each event; nothing ends a goal
any other way.
"""

from __future__ import annotations

from dataclasses import dataclass

from timelyllm_ros.core.request import Generation, Segment


@dataclass(frozen=True, slots=True)
class Dispatch:
    """A segment to send to its robot now."""

    task_id: str
    robot_id: str
    segment: Segment


@dataclass(frozen=True, slots=True)
class Closed:
    """The plan ended after its last segment had already been sent: tell the robot that no
    segment follows (a closing marker, see :func:`timelyllm_ros.live.service.closing_segment`)."""

    generation: Generation


@dataclass(frozen=True, slots=True)
class Generated:
    """The generation is complete (status GENERATED): all its segments are out; the goal ends
    once its robot reports them, or now for a goal that does not wait for execution."""

    generation: Generation


@dataclass(frozen=True, slots=True)
class Ended:
    """The goal reached a terminal status (finished, failed, cancelled, killed)."""

    generation: Generation


SchedulerEvent = Dispatch | Closed | Generated | Ended
