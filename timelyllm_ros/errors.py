"""Error types of timelyllm_ros: one base class, one subclass per concern."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class TimelyError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(TimelyError, ValueError):
    """A run-wide parameter is out of range (batch cap, timeouts, latencies, ...)."""


class ProfileError(TimelyError):
    """A robot profile file is missing, malformed or inconsistent."""


class GoalError(TimelyError):
    """A plan request is invalid (empty task, unknown robot kind, duplicate id, ...)."""


class TufError(GoalError):
    """A time-utility function has invalid parameters."""


class SegmentationError(TimelyError):
    """Generated text could not be segmented (e.g. no executable skill at all)."""


class PolicyError(TimelyError):
    """An unknown or misconfigured scheduling policy."""


class EngineError(TimelyError):
    """An inference engine failed or was misconfigured (calibration, capacity)."""


class WorkloadError(TimelyError):
    """A workload or trace set is malformed or refers to unknown traces or robots."""


class TraceFormatError(TimelyError):
    """An LRTrace file does not follow the expected format."""


class RobotError(TimelyError):
    """A robot backend refused or failed to execute a skill."""


def describe_error(err: BaseException, limit: int | None = 300) -> str:
    """An exception as a reason: the message of our own errors, else type and message, cut
    to ``limit`` characters (None: whole)."""
    message = str(err).strip()
    if isinstance(err, TimelyError) and message:
        text = message
    else:
        text = f'{type(err).__name__}: {message}' if message else type(err).__name__
    return text if limit is None or len(text) <= limit else text[:limit - 3] + '...'


def run_command(command: Callable[[Any], int], args: Any) -> int:
    """Run a CLI command; a TimelyError is printed as ``ERROR: …`` and gives exit status 1."""
    try:
        return int(command(args))
    except TimelyError as err:
        print(f'ERROR: {err}', file=sys.stderr)
        return 1
