"""Spinning a node until shutdown, the way every executable of this package does."""

from __future__ import annotations

import rclpy
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
from rclpy.node import Node


def spin_until_shutdown(node: Node, num_threads: int | None = None) -> None:
    """Spin ``node`` on a MultiThreadedExecutor, then destroy it and shut rclpy down."""
    try:
        rclpy.spin(node, executor=MultiThreadedExecutor(num_threads=num_threads))
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        node.destroy_node()
        rclpy.try_shutdown()
