"""The ROS 2 layer: thin rclpy nodes over the core. The only place that imports rclpy.

Modules here other than :mod:`_convert` need a ROS 2 environment (rclpy and this package's
generated interfaces, built by ``colcon build``).
"""
