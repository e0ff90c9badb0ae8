"""Helpers of the ROS tests: a planner driven to active, nodes started and killed as processes,
and waiting for a condition."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from typing import TypeVar

Planner = TypeVar('Planner')   # a PlannerNode (or a subclass)


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL a process started with ``start_new_session`` and its children (``ros2 run``
    and the node it runs), as a crash would."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=10)


def activated(planner: Planner) -> Planner:
    """A planner (a ``PlannerNode``) driven to active, as the launch file does."""
    from rclpy.lifecycle import TransitionCallbackReturn  # imported by ROS tests only

    assert planner.trigger_configure() == TransitionCallbackReturn.SUCCESS
    assert planner.trigger_activate() == TransitionCallbackReturn.SUCCESS
    return planner


def until(condition: Callable[[], object], timeout_s: float, what: object) -> None:
    """Wait for ``condition``; fail the test naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f'timed out waiting for {what}'
        time.sleep(0.05)
