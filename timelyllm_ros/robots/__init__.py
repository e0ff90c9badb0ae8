"""Robot backends; vendor clients (djitellopy, neuromeka) are imported only when used."""

from timelyllm_ros.robots.base import Execution, SegmentExecutor
from timelyllm_ros.robots.sim import SimulatedRobot

__all__ = ['Execution', 'SegmentExecutor', 'SimulatedRobot']
