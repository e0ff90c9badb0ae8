"""An rclpy action client whose requests cannot lose their responses.

rclpy's ``ActionClient`` (Jazzy) sends a goal, cancel or result request and only then records
the request's sequence number; the executor thread that takes the response looks that number
up. When the request is sent from another thread than the one handling the client (a
``MultiThreadedExecutor``, a task callback, a test thread) and the response is fast, the lookup
comes first: rclpy logs ``Ignoring unexpected goal response`` and the caller's future never
completes. That is how goals sent in bursts went unanswered. :class:`SafeActionClient` holds
one lock while it sends and records a request and while it handles responses, so the two
never interleave.

The services and the feedback topic of the PlanTask action get queues sized for a fleet's
bursts (:func:`action_qos`, on both ends): with rclpy's default depth of 10, requests and
responses beyond ten in flight were dropped by the middleware.

Feedback callbacks run under that lock: they must be plain functions that return promptly (a
coroutine feedback callback would hold it across its awaits).
"""

from __future__ import annotations

import threading
from typing import Any

from rclpy.action import ActionClient
from rclpy.qos import QoSProfile, ReliabilityPolicy

PLAN_ACTION = 'plan'
"""The name of the planner's PlanTask action in its fleet's namespace."""

ACTION_QUEUE_DEPTH = 4096
"""Requests, responses and feedback messages of the action queued per endpoint: more than the
goals a fleet sends at once (a burst beyond it would be dropped by the middleware)."""


def reliable(depth: int) -> QoSProfile:
    """Reliable, volatile, keep-last ``depth``: what the fleet's segments, reports and
    results use (nothing may be lost; depth sized to the fleet's bursts)."""
    return QoSProfile(depth=depth, reliability=ReliabilityPolicy.RELIABLE)


def action_qos() -> dict[str, QoSProfile]:
    """QoS keyword arguments for an ``ActionServer`` or ``ActionClient`` of the fleet."""
    profile = reliable(ACTION_QUEUE_DEPTH)
    return {'goal_service_qos_profile': profile, 'result_service_qos_profile': profile,
            'cancel_service_qos_profile': profile, 'feedback_sub_qos_profile': profile}


class SafeActionClient(ActionClient):  # type: ignore[misc]  # rclpy is untyped here
    """``ActionClient`` with request bookkeeping and response handling serialized."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**action_qos(), **kwargs})
        self._requests_lock = threading.RLock()

    def send_goal_async(self, *args: Any, **kwargs: Any) -> Any:
        with self._requests_lock:
            return super().send_goal_async(*args, **kwargs)

    def _cancel_goal_async(self, *args: Any, **kwargs: Any) -> Any:
        with self._requests_lock:
            return super()._cancel_goal_async(*args, **kwargs)

    def _get_result_async(self, *args: Any, **kwargs: Any) -> Any:
        with self._requests_lock:
            return super()._get_result_async(*args, **kwargs)

    async def execute(self, taken_data: Any) -> None:
        with self._requests_lock:
            await super().execute(taken_data)
