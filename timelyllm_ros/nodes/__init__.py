"""The ROS 2 layer: thin rclpy nodes over the core (LRTrace's own are in :mod:`lrtrace.nodes`).

Modules here other than :mod:`convert` need a ROS 2 environment (rclpy and this package's
generated interfaces, built by ``colcon build``).
"""
