"""Spinning a node until shutdown, the way every executable of this package does."""

from __future__ import annotations

import rclpy
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
from rclpy.node import Node
from rclpy.task import Future


def spin_until_shutdown(node: Node, num_threads: int | None = None,
                        until: Future | None = None) -> None:
    """Spin ``node`` on a MultiThreadedExecutor (until shutdown, or until ``until`` is done),
    then destroy it and shut rclpy down."""
    executor = MultiThreadedExecutor(num_threads=num_threads)
    try:
        if until is None:
            rclpy.spin(node, executor=executor)
        else:
            rclpy.spin_until_future_complete(node, until, executor=executor)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    except RuntimeError:
        # SIGINT's handler shuts the context down from another thread; if that happens while
        # the executor builds its wait set, rclpy raises RCLError "failed to initialize wait
        # set: the given context is not valid" (ros2/rclpy#398) instead of returning.
        if node.context.ok():
            raise
    finally:
        node.destroy_node()
        rclpy.try_shutdown()
