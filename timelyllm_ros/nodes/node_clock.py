"""A node's ROS clock as a core :class:`~timelyllm_ros.core.clock.Clock` (no rclpy import).

Stamps the nodes publish, and the planner's scheduling times, are then ROS time: system time
by default, the ``/clock`` topic's time under ``use_sim_time``.
"""

from __future__ import annotations

from typing import Any


class NodeClock:
    """Seconds of ``node.get_clock()`` (any object with that method)."""

    def __init__(self, node: Any) -> None:
        self._clock = node.get_clock()

    def now(self) -> float:
        return float(self._clock.now().nanoseconds) * 1e-9

    def elapse(self, duration_s: float) -> None:
        """Real work already took its time: nothing to do."""
