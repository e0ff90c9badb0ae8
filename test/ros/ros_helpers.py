"""Helpers of the ROS tests that start and kill nodes as processes."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL a process started with ``start_new_session`` and its children (``ros2 run``
    and the node it runs), as a crash would."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=10)


def until(condition: Callable[[], object], timeout_s: float, what: object) -> None:
    """Wait for ``condition``; fail the test naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f'timed out waiting for {what}'
        time.sleep(0.05)
